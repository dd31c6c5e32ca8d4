"""models/arena.py: a model's weights gathered into one huge-page buffer keep their values, identities and ties."""

import copy

import pytest
import torch
from conftest import prompt, tiny_model

from sparsedecode.models import arena
from sparsedecode.models.quantized import quantize_linears


def _storage_start(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("tied", [False, True])
def test_gathered_weights_keep_values_ties_and_identities(tied):
    model = tiny_model("llama", tie_word_embeddings=tied)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    ids = prompt(24)
    before = model(ids).logits
    params = dict(model.named_parameters(remove_duplicate=False))
    values = {name: p.detach().clone() for name, p in params.items()}
    moved = arena.gather_weights(model)
    assert moved >= sum(p.numel() * p.element_size() for p in model.parameters())
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[name] is params[name] for name in params)  # the same Parameter objects
    assert all(torch.equal(after[name], values[name]) for name in params)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert torch.equal(model(ids).logits, before)
    starts = [p.data_ptr() for p in model.parameters()]  # module order: one buffer, increasing, cache-line aligned
    assert starts == sorted(starts) and all(s % arena.ALIGN == 0 for s in starts)
    assert starts[-1] - starts[0] < moved
    assert len({_storage_start(p) for p in model.parameters()}) == 1


def test_quantized_layers_buffers_move_and_products_stay():
    model = tiny_model("qwen2")
    quantize_linears(model, "int4")
    ids = prompt(12)
    before = model(ids).logits
    layer = model.model.layers[0].self_attn.q_proj
    arena.gather_weights(model)
    assert torch.equal(model(ids).logits, before)
    assert layer.packed.untyped_storage().data_ptr() == model.lm_head.packed.untyped_storage().data_ptr()
    assert layer.packed.data_ptr() < model.lm_head.packed.data_ptr()  # module order


def test_shared_and_partial_storages_stay_where_they_are():
    module = torch.nn.Module()
    whole = torch.arange(64, dtype=torch.float32)
    module.register_buffer("first", whole[:32])  # two views of one storage: moving one would part them
    module.register_buffer("second", whole[32:])
    child = torch.nn.Module()
    shared = torch.ones(8)
    module.register_buffer("shared", shared)
    child.register_buffer("shared", shared)  # one tensor in two modules: one copy, in both
    module.child = child
    module.strided = torch.nn.Parameter(torch.zeros(4, 4).t(), requires_grad=False)
    arena.gather_weights(module)
    assert module.first.data_ptr() == whole.data_ptr() and module.second.data_ptr() == whole.data_ptr() + 128
    assert module.shared is child.shared and module.shared is not shared and torch.equal(module.shared, shared)
    assert not module.strided.is_contiguous()  # left as it was
    assert arena.gather_weights(torch.nn.Module()) == 0  # nothing to move


def test_gathered_model_copies_and_saves(tmp_path):
    model = tiny_model("llama")
    arena.gather_weights(model)
    twin = copy.deepcopy(model)  # what a second thread is told to use
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(model.parameters(), twin.parameters()))
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters()))


def test_huge_page_buffer_starts_on_a_page_and_is_writable():
    buffer = arena.huge_page_buffer(3 * arena.PAGE + 5)
    assert buffer.data_ptr() % arena.PAGE == 0 and buffer.numel() == 3 * arena.PAGE + 5
    buffer.fill_(7)
    assert int(buffer[-1]) == 7


def test_load_model_gathers_a_cpu_model_unless_switched_off(tiny_model_dir, monkeypatch):
    from sparsedecode.experiments.environment import environment
    from sparsedecode.models.catalog import load_model

    model, _ = load_model(str(tiny_model_dir))
    assert len({_storage_start(p) for p in model.parameters()}) == 1
    assert environment(model)["weights_gathered"] and model.sparsedecode_gathered > 0  # result files record it
    monkeypatch.setattr(arena, "ENABLED", False)
    model, _ = load_model(str(tiny_model_dir))
    assert len({_storage_start(p) for p in model.parameters()}) > 1
    assert not environment(model)["weights_gathered"]


def test_without_memory_for_the_copy_or_a_posix_mapping_the_weights_stay_or_use_torchs_memory(monkeypatch):
    model = tiny_model("llama")
    starts = [p.data_ptr() for p in model.parameters()]

    def no_room(nbytes):
        raise MemoryError

    monkeypatch.setattr(arena, "huge_page_buffer", no_room)
    assert arena.gather_weights(model) == 0 and [p.data_ptr() for p in model.parameters()] == starts
    monkeypatch.undo()
    monkeypatch.delattr(arena.mmap, "MAP_ANONYMOUS")  # as on Windows
    buffer = arena.huge_page_buffer(1000)
    assert buffer.numel() == 1000 and buffer.dtype == torch.uint8 and not buffer.any()  # zeros, as a fresh mapping
