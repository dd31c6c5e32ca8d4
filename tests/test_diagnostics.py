"""Omitted-mass audit and the downstream margin certificate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import prompt, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsedecode import SparseConfig, compare, dense_reference, sparse_decoding
from sparsedecode.attention import StepView
from sparsedecode.diagnostics import (
    MassAudit,
    audit_step,
    load_audit,
    margin_certificate,
    save_audit,
    summarize_audit,
    summarize_certificate,
)
from sparsedecode.selectors import BlockLayout, support_positions


def audited_run(arch, support=97, context=300, tokens=30):
    model = tiny_model(arch)
    ids = prompt(context)
    return compare(model, None, ids, SparseConfig(support=support, audit=True), tokens=tokens)


def test_audit_identity_bound_and_ranges(arch):
    result = audited_run(arch)
    arrays = result.audit_arrays
    assert arrays["omitted_mass"].shape == (29, 2, 4)  # steps x layers x query heads
    assert result.identity_residual_max <= 1e-5
    assert result.bound_violations == 0
    assert np.all(arrays["error_norm"] <= arrays["bound"] + 1e-5 * np.maximum(arrays["max_value_norm"], 1)[..., None])
    for name in ("selector_recall", "captured_mass_ratio", "omitted_mass", "mass_anchor", "mass_window"):
        assert np.all((arrays[name] >= -1e-12) & (arrays[name] <= 1 + 1e-12)), name
    total = arrays["mass_anchor"] + arrays["mass_window"] + arrays["mass_blocks"] + arrays["omitted_mass"]
    assert np.allclose(total, 1.0, atol=1e-9)
    assert 0 < result.omitted_mass_mean < 1
    assert len(result.audit["layers"]) == 2
    assert "audit_arrays" not in result.to_dict()


def test_selecting_every_block_gives_full_recall_and_no_error():
    torch.manual_seed(0)
    n, window, block = 150, 16, 8
    layout = BlockLayout(n=n, window=window, block_size=block)
    keys, values = torch.randn(2, n, 8), torch.randn(2, n, 8)
    query = torch.randn(4, 8)
    blocks = torch.arange(layout.n_blocks).expand(2, -1)
    index, valid = support_positions(blocks, layout)
    scale = 8**-0.5
    probs = torch.softmax(query.view(2, 2, 8) @ keys.transpose(1, 2) * scale, dim=-1)
    output = (probs @ values).reshape(4, 8)
    view = StepView(0, 1, query, keys, values, index, valid, output, scale, layout, blocks)
    stats = audit_step(view)
    assert torch.allclose(stats["selector_recall"], torch.ones(4, dtype=torch.float64))
    assert torch.allclose(stats["captured_mass_ratio"], torch.ones(4, dtype=torch.float64))
    assert float(stats["omitted_mass"].abs().max()) < 1e-12
    assert float(stats["identity_residual"].max()) < 1e-6


def test_audit_arrays_round_trip(tmp_path):
    result = audited_run("llama", tokens=6)
    path = tmp_path / "audit.npz"
    save_audit(path, result.audit_arrays)
    loaded = load_audit(path)
    assert set(loaded) == set(result.audit_arrays)
    assert np.array_equal(loaded["omitted_mass"], result.audit_arrays["omitted_mass"])
    assert summarize_audit(loaded)["bound_violations"] == 0


def test_audit_off_has_no_observer_and_no_audit_fields():
    model = tiny_model("llama")
    result = compare(model, None, prompt(300), SparseConfig(support=97), tokens=8)
    assert result.audit is None and result.identity_residual_max is None
    with sparse_decoding(model, SparseConfig(support=97)) as session:
        assert session.observers == []


def test_certificate_never_violated_on_tiny_model_traces(arch):
    flips = 0
    for seed in range(3):
        model = tiny_model(arch, seed=seed)
        ids = prompt(300, seed=seed)
        reference = dense_reference(model, ids, tokens=40)
        for support in (97, 129):
            result = compare(model, None, ids, SparseConfig(support=support), tokens=40, reference=reference)
            assert result.certificate_violations == 0
            assert result.certificate["uncertified_flips"] == result.flips
            flips += result.flips
            if not result.survives:
                assert result.margin_at_divergence is not None
                step = result.first_divergence - 1
                # the free-running flip happened on the dense prefix: it is a teacher-forced flip as well
                assert result.teacher_forced_tokens[step] != result.dense_tokens[step + 1]
                assert result.margins[step] <= 2 * result.logit_errors[step]
    assert flips > 0, "the tiny models must produce flips for this test to mean anything"


def test_a_built_flip_is_uncertified():
    dense = torch.tensor([[2.0, 1.9, 0.0], [5.0, 1.0, 0.0]])
    sparse = torch.tensor([[1.8, 2.05, 0.0], [4.9, 1.1, 0.0]])  # step 1 flips, step 2 is certified
    cert = margin_certificate(dense, sparse)
    assert cert["flipped"].tolist() == [True, False]
    assert cert["certified"].tolist() == [False, True]
    summary = summarize_certificate(cert, first_divergence=1)  # s_1 != d_1: decode step 1
    assert summary["flips"] == 1 and summary["certificate_violations"] == 0
    assert summary["margin_at_divergence"] == pytest.approx(0.1)
    assert summarize_certificate(cert, first_divergence=2)["margin_at_divergence"] == pytest.approx(4.0)
    assert summarize_certificate(cert, first_divergence=None)["margin_at_divergence"] is None
    assert summary["certified_fraction"] == 0.5


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 40),
    st.floats(1e-4, 10.0),
    st.integers(0, 2**16),
)
def test_certified_steps_never_flip(vocab, scale, seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(8, vocab, generator=g, dtype=torch.float64) * 3
    sparse = dense + torch.randn(8, vocab, generator=g, dtype=torch.float64) * scale
    cert = margin_certificate(dense, sparse)
    assert not np.any(cert["certified"] & cert["flipped"])


def test_warning_regime_flag_follows_teacher_forced_match(arch):
    result = audited_run(arch, tokens=20)
    assert result.warning_regime == (result.teacher_forced_match < 70.0)


def test_mass_audit_collects_per_layer():
    model = tiny_model("qwen2")
    audit = MassAudit()
    with sparse_decoding(model, SparseConfig(support=97)) as session, torch.no_grad():
        session.observers.append(audit)
        model.generate(prompt(200), max_new_tokens=5, do_sample=False)
    assert audit.steps == 4 and sorted(audit.records) == [0, 1]
