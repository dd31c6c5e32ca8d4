"""The paired dense/sparse protocol on tiny models."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import prompt, tiny_model

from sparsedecode import SparseConfig, SparseDecodeError, compare, dense_reference
from sparsedecode.protocol.results import FIRST_DIVERGENCE_CONVENTION, first_divergence, upgrade_row


def test_dense_reference_is_greedy_generate(arch):
    model = tiny_model(arch)
    ids = prompt(130)
    reference = dense_reference(model, ids, tokens=24)
    generated = model.generate(ids, max_new_tokens=24, do_sample=False)[0, 130:].tolist()
    assert reference.tokens == generated
    assert reference.cache.get_seq_length() == 130, "cache cropped back to the prompt"
    assert all(x >= 0 for x in reference.nll) and math.isfinite(reference.ppl)


def test_full_support_survives_with_zero_delta(arch):
    model = tiny_model(arch)
    ids = prompt(160)
    result = compare(model, None, ids, SparseConfig(support=1 + 64 + 16 * 8), tokens=32)  # 193 >= 160 + 32
    assert result.survives and result.first_divergence == 32
    assert result.teacher_forced_match == 100.0
    assert result.delta_ppl_percent == pytest.approx(0.0, abs=1e-9)  # no sparse step: the same NLLs, exactly
    assert result.sparse_tokens == result.dense_tokens
    assert result.sparse_steps == 0


def test_small_support_is_measured_consistently(arch):
    model = tiny_model(arch)
    ids = prompt(300)
    reference = dense_reference(model, ids, tokens=40)
    result = compare(model, None, ids, SparseConfig(support=97), tokens=40, reference=reference)
    assert result.sparse_steps == 39 * 2
    assert 0.0 <= result.teacher_forced_match <= 100.0
    # docs/definitions.md, section 3: the step t >= 1 of the first s_t != d_t, T if none (s_0 = d_0 is shared)
    diverged = [t for t, (d, s) in enumerate(zip(result.dense_tokens, result.sparse_tokens)) if d != s]
    assert result.sparse_tokens[0] == result.dense_tokens[0] and result.survives == (not diverged)
    assert result.first_divergence == (diverged[0] if diverged else 40) and diverged, "a run that survives tests less"
    t = result.first_divergence
    assert result.sparse_tokens[:t] == result.dense_tokens[:t] and result.sparse_tokens[t] != result.dense_tokens[t]
    # teacher-forced argmax agrees with free-running tokens until the first divergence, which it reproduces
    assert result.teacher_forced_tokens[:t] == result.sparse_tokens[1 : t + 1]
    assert result.margin_at_divergence == result.margins[t - 1]
    expected = 100 * (math.exp(sum(result.sparse_nll[1:]) / 39) / math.exp(sum(result.dense_nll[1:]) / 39) - 1)
    assert result.delta_ppl_percent == pytest.approx(expected, rel=1e-9)  # the same NLLs: float64 round-off only
    # each layer/KV head read b blocks of B at every one of 39 steps: between b*B and all distant positions
    assert 2 * 16 <= result.mean_unique_distant_positions_per_kv <= 300 + 40 - 64 - 1
    # reusing the dense reference gives the same result as recomputing it
    again = compare(model, None, ids, SparseConfig(support=97), tokens=40)
    assert again.sparse_tokens == result.sparse_tokens and again.sparse_nll == result.sparse_nll
    assert reference.cache.get_seq_length() == 300


def test_bad_tokens_and_mismatched_reference():
    model = tiny_model("llama")
    ids = prompt(100)
    with pytest.raises(SparseDecodeError):
        dense_reference(model, ids, tokens=0)
    reference = dense_reference(model, ids, tokens=8)
    with pytest.raises(SparseDecodeError):
        compare(model, None, prompt(100, seed=9), SparseConfig(), tokens=8, reference=reference)
    with pytest.raises(SparseDecodeError):
        compare(model, None, ids, SparseConfig(), tokens=9, reference=reference)
    with pytest.raises(SparseDecodeError, match="BatchReference"):  # a batch takes a batch's reference
        compare(model, None, torch.cat([ids, ids]), SparseConfig(), tokens=8, reference=reference)
    with pytest.raises(SparseDecodeError):
        compare(model, None, [ids, ids[:, :0]], SparseConfig(), tokens=8)


def test_anchor_and_window_only_support_runs(arch):
    """b = 0 (support = 1 + W) keeps no distant block: the step must still run and read nothing distant."""
    model = tiny_model(arch)
    result = compare(model, None, prompt(200), SparseConfig(support=65), tokens=6)
    assert result.settings["blocks"] == 0 and result.sparse_steps == 5 * 2
    assert result.mean_unique_distant_positions_per_kv == 0


def test_first_divergence_convention_and_the_migration_of_old_rows():
    d = [5, 6, 7, 8]
    assert first_divergence(d, [5, 9, 7, 8]) == 1
    assert first_divergence(d, [5, 6, 7, 9]) == 3, "a divergence at the last step is T - 1, not T"
    assert first_divergence(d, list(d)) == 4
    with pytest.raises(SparseDecodeError):
        first_divergence(d, d[:3])
    # rows of convention 1 (no mark) held the 1-based position counting the shared first token
    old = {"first_divergence": 4, "survives": False, "dense_tokens": d, "sparse_tokens": [5, 6, 7, 9], "x_s": 1.5}
    new = upgrade_row(old)
    assert new == {**old, "first_divergence": 3, "first_divergence_convention": FIRST_DIVERGENCE_CONVENTION}
    assert list(new)[-1] == "first_divergence_convention" and old["first_divergence"] == 4, "a copy, mark last"
    assert upgrade_row(new) is new
    survived = {"first_divergence": 4, "survives": True, "dense_tokens": d, "sparse_tokens": list(d)}
    assert upgrade_row(survived)["first_divergence"] == 4
    for bad in ({**old, "first_divergence": 3}, {**old, "survives": True}, {"first_divergence": 2, "survives": False}):
        with pytest.raises(SparseDecodeError):
            upgrade_row(bad)
    with pytest.raises(SparseDecodeError, match="newer version"):
        upgrade_row({**new, "first_divergence_convention": 3})


def test_an_old_row_whose_token_ids_are_not_lists_is_refused_in_one_line():
    """A row of convention 1 is migrated from its token ids; ids that are not lists (a hand-edited ``null``) are one
    line naming the row's problem, not a TypeError from inside the migration (found by an independent reference)."""
    row = {"first_divergence": 2, "survives": False, "dense_tokens": [5, 6, 7], "sparse_tokens": [5, 9, 7]}
    for name, value in (("dense_tokens", None), ("sparse_tokens", None), ("dense_tokens", 5)):
        with pytest.raises(SparseDecodeError, match="lacks its token ids"):
            upgrade_row({**row, name: value})
