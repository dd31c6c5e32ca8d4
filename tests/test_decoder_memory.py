"""compiled/memory.py: a CPU decoder's block statistics and static cache on huge pages, one buffer each."""

import pytest
import torch
from conftest import tiny_family, tiny_model

from sparsedecode import SparseConfig
from sparsedecode.compiled.decoder import CompiledDecoder
from sparsedecode.models import arena

CFG = SparseConfig(support=97, window=32, block_size=8)


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_statistics_and_cache_lie_in_one_huge_page_buffer_each():
    model = tiny_model("llama")
    decoder = CompiledDecoder(model, CFG, batch=2, max_len=384, backend="native")
    stats = [state.stats for state in decoder.states.values()]
    keys = [t for layer in decoder.cache.layers for t in (layer.keys, layer.values)]
    assert len(_storages(stats)) == 1 and len(_storages(keys)) == 1
    assert all(t.data_ptr() % arena.ALIGN == 0 for t in stats + keys)
    assert min(t.data_ptr() for t in keys) % arena.PAGE == 0
    assert all(not t.any() for t in stats + keys)  # fresh zeros, as torch's own would be
    assert tuple(keys[0].shape) == (2, model.config.num_key_value_heads, 384, 16) and keys[0].dtype == torch.float32


@pytest.mark.parametrize("backend", ["native", "inductor"])
def test_a_decoder_on_huge_pages_decodes_as_one_without(backend, monkeypatch):
    model = tiny_model("qwen2")
    ids = torch.randint(0, 90, (1, 200), generator=torch.Generator().manual_seed(2))

    def tokens():
        decoder = CompiledDecoder(model, CFG, batch=1, max_len=384, backend=backend)
        with decoder.installed():
            token = decoder.prefill(ids).argmax(-1)
            out = []
            for _ in range(6):
                token = decoder.step(token).argmax(-1)
                out.append(int(token))
        return out, decoder

    placed, decoder = tokens()
    assert len(_storages(s.stats for s in decoder.states.values())) == 1
    monkeypatch.setattr(arena, "ENABLED", False)
    plain, decoder = tokens()
    assert len(_storages(s.stats for s in decoder.states.values())) == len(decoder.states) > 1
    assert placed == plain


def test_other_families_keep_transformers_own_cache():
    decoder = CompiledDecoder(tiny_family("gemma"), None, batch=1, max_len=256, backend="inductor")
    assert not any(getattr(layer, "is_initialized", False) for layer in decoder.cache.layers)
