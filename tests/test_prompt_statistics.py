"""A compiled decoder's prefill (and its resume over a prompt prefilled elsewhere) leaves the prompt's block
statistics computed, so that the first decode step does not compute them: the same numbers, to the bit, as the step
would have made, and the same tokens and logits after it."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from sparsedecode import SparseConfig
from sparsedecode.compiled import decoder as decoder_module
from sparsedecode.compiled.decoder import CompiledDecoder
from sparsedecode.layout import BlockLayout
from sparsedecode.selectors.statistics import BlockStatistics

CFG = dict(support=97, window=32, block_size=8)
LENGTH, STEPS = 203, 6  # 203: the last distant block short of a full one at the first steps


def _ids(batch: int) -> torch.Tensor:
    return torch.randint(0, 90, (batch, LENGTH), generator=torch.Generator().manual_seed(5))


def _expected(decoder: CompiledDecoder, state, n: int) -> tuple[int, list[torch.Tensor]]:
    """n_full at ``n`` and each row's statistics as a fresh BlockStatistics computes them from the cache's keys."""
    n_full = BlockLayout(n=n, window=state.cfg.window, block_size=state.cfg.block_size).n_full
    keys = decoder.cache.layers[state.layer].keys
    rows = []
    for i in range(decoder.batch):
        stats = BlockStatistics(state.cfg.block_size, state.kinds).update_all(keys[i], n_full)
        rows.append(torch.stack([stats[kind].transpose(1, 2) for kind in state.kinds]))  # (kinds, kv, d, n_full)
    return n_full, rows


def _decode(decoder: CompiledDecoder, ids: torch.Tensor) -> list[torch.Tensor]:
    logits = [decoder.prefill(ids, chunk=64)]
    for _ in range(STEPS):
        logits.append(decoder.step(logits[-1].argmax(-1)))
    return logits


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(
    ("selector", "backend"), [("mean-pooled", "aot_eager"), ("quest", "aot_eager"), ("mean-pooled", "native")]
)
def test_a_prefill_leaves_the_prompts_statistics_as_the_step_makes_them(selector, backend, batch, monkeypatch):
    model = tiny_model("llama")
    cfg = SparseConfig(**CFG, selector=selector)
    decoder = CompiledDecoder(model, cfg, batch=batch, max_len=LENGTH + STEPS + 1, backend=backend)
    ids = _ids(batch)
    with decoder.installed():
        decoder.prefill(ids, chunk=64)
        for resumed in (False, True):
            if resumed:
                decoder.resume(LENGTH)
            for state in decoder.states.values():
                n_full, rows = _expected(decoder, state, LENGTH)
                assert n_full > 0 and state.count.tolist() == [n_full] * batch
                for i, row in enumerate(rows):
                    assert torch.equal(state.stats[:, i, :, :, :n_full], row)
        eager = _decode(decoder, ids)
    monkeypatch.setattr(decoder_module, "prompt_statistics", lambda *args: None)  # the step computes them itself
    lazy = CompiledDecoder(model, cfg, batch=batch, max_len=LENGTH + STEPS + 1, backend=backend)
    with lazy.installed():
        assert all(state.count.sum() == 0 for state in lazy.states.values())
        left = _decode(lazy, ids)
    assert all(torch.equal(a, b) for a, b in zip(eager, left))
    assert decoder.tally() == lazy.tally() and decoder.tally()["sparse_steps"] == STEPS * batch * len(decoder.states)
