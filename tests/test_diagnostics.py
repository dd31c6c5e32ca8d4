"""Omitted-mass audit and the downstream margin certificate."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import prompt, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsedecode import SparseConfig, compare, dense_reference, sparse_decoding
from sparsedecode.layout import BlockLayout, support_positions
from sparsedecode.protocol.diagnostics import (
    MassAudit,
    audit_step,
    load_audit,
    margin_certificate,
    save_audit,
    selection_quality,
    summarize_audit,
    summarize_certificate,
)
from sparsedecode.selectors import token_index
from sparsedecode.session import StepView


def audited_run(arch, support=97, context=300, tokens=30):
    model = tiny_model(arch)
    ids = prompt(context)
    return compare(model, None, ids, SparseConfig(support=support, audit=True), tokens=tokens)


def test_audit_identity_bound_and_ranges(arch):
    result = audited_run(arch)
    arrays = result.audit_arrays
    assert arrays["omitted_mass"].shape == (29, 2, 4)  # steps x layers x query heads
    # the identity holds exactly in float64; the residual (relative to |o_dense|) is the float32 output's round-off:
    # conftest.attention_tolerance, about 1e-6 of values below 1 on the tiny models
    assert result.identity_residual_max <= 1e-5
    assert result.bound_violations == 0
    # the same round-off, now relative to the largest value norm (at least 1), as the library's own check allows
    assert np.all(arrays["error_norm"] <= arrays["bound"] + 1e-5 * np.maximum(arrays["max_value_norm"], 1)[..., None])
    # masses and ratios are float64 sums of at most 340 softmax weights: off by at most 340 * 2**-53 = 4e-14
    for name in ("selector_recall", "captured_mass_ratio", "omitted_mass", "mass_anchor", "mass_window"):
        assert np.all((arrays[name] >= -1e-12) & (arrays[name] <= 1 + 1e-12)), name
    total = arrays["mass_anchor"] + arrays["mass_window"] + arrays["mass_blocks"] + arrays["omitted_mass"]
    assert np.allclose(total, 1.0, atol=1e-9)  # four such float64 sums: far below 1e-9
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
    # float64 sums of 150 weights at most 1 (round-off 150 * 2**-53 = 2e-14); the output is float32 softmax attention
    # over 150 positions, so the identity's residual is its round-off, ~1e-6 relative (conftest.attention_tolerance)
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
    summary = summarize_audit(loaded)
    assert summary["bound_violations"] == 0
    # the same float64 arrays averaged again (in another order): approx's default 1e-6 relative is far above that
    assert summary["captured_mass_ratio_mean"] == pytest.approx(result.captured_mass_ratio_mean)
    assert summary["selector_recall_per_head_best_mean"] == pytest.approx(result.selector_recall_per_head_best_mean)


def test_an_audit_saved_before_the_group_reference_reads_as_per_head(tmp_path):
    arrays = audited_run("llama", tokens=6).audit_arrays
    old = {k: v for k, v in arrays.items() if not k.endswith("_per_head_best")}
    old["selector_recall"] = arrays["selector_recall_per_head_best"]  # what the old audit stored under this name
    old["captured_mass_ratio"] = arrays["captured_mass_ratio_per_head_best"]
    save_audit(tmp_path / "old.npz", old)
    loaded = load_audit(tmp_path / "old.npz")
    assert "selector_recall" not in loaded and "captured_mass_ratio" not in loaded
    assert np.array_equal(loaded["selector_recall_per_head_best"], arrays["selector_recall_per_head_best"])
    summary = summarize_audit(loaded)
    assert summary["selector_recall_mean"] is None and summary["captured_mass_ratio_mean"] is None
    assert summary["captured_mass_ratio_per_head_best_mean"] == pytest.approx(  # one float64 mean, reordered
        arrays["captured_mass_ratio_per_head_best"].mean()
    )
    assert summary["layers"][0]["selector_recall_mean"] is None


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
    assert summary["margin_at_divergence"] == pytest.approx(0.1)  # 2.0 - 1.9 in float32: off by ~1e-7 relative
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


def test_the_audit_matches_layers_by_step_when_they_turn_sparse_apart():
    """Per-layer supports: layer 1 (S = 193) is dense while the context fits it, layer 0 (S = 97) sparse throughout.
    A row of the arrays is one decode step for every layer (NaN where a layer was dense), so each layer's figures
    cover all its own sparse steps and no step is paired with another."""
    model = tiny_model("llama")
    audit = MassAudit()
    with sparse_decoding(model, SparseConfig(support=97, layer_supports={1: 193})) as session, torch.no_grad():
        session.observers.append(audit)
        model.generate(prompt(150), max_new_tokens=60, do_sample=False)
    assert len(audit.records[0]) == 59 and 0 < len(audit.records[1]) < 59
    arrays = audit.arrays()
    assert arrays["omitted_mass"].shape == (59, 2, 4)
    sparse_1 = ~np.isnan(arrays["omitted_mass"][:, 1, 0])
    assert not np.isnan(arrays["omitted_mass"][:, 0]).any() and sparse_1.sum() == len(audit.records[1])
    assert sparse_1[-len(audit.records[1]) :].all()  # the last steps, where the context outgrew 193
    for layer in (0, 1):
        own = np.stack([record["omitted_mass"].numpy() for record in audit.records[layer]])
        np.testing.assert_array_equal(
            arrays["omitted_mass"][:, layer][~np.isnan(arrays["omitted_mass"][:, layer, 0])], own
        )
    summary = summarize_audit(arrays)
    assert summary["audited_steps"] == 59
    assert [layer["audited_steps"] for layer in summary["layers"]] == [59, len(audit.records[1])]
    assert summary["layers"][0]["omitted_mass_mean"] == pytest.approx(
        float(np.mean([r["omitted_mass"].numpy() for r in audit.records[0]]))
    )
    assert summary["bound_violations"] == 0 and np.isfinite(summary["omitted_mass_mean"])


@pytest.mark.parametrize("selector", ["oracle-blocks", "oracle-tokens"])
@pytest.mark.parametrize("support", [97, 161])
def test_oracles_reach_the_group_best_at_every_step(arch, selector, support):
    model = tiny_model(arch)
    assert model.config.num_attention_heads // model.config.num_key_value_heads > 1  # GQA: heads share a set
    cfg = SparseConfig(support=support, selector=selector, audit=True)
    arrays = compare(model, None, prompt(300), cfg, tokens=16).audit_arrays
    assert arrays["selector_recall"].size > 0
    assert np.all(arrays["selector_recall"] == 1.0)
    assert np.allclose(arrays["captured_mass_ratio"], 1.0, rtol=0, atol=1e-12)  # float64 ratio of equal sums
    # against each query head's own best, the oracle falls short: that is why it is no longer the headline figure
    assert arrays["selector_recall_per_head_best"].min() < 1
    assert arrays["captured_mass_ratio_per_head_best"].min() < 1 - 1e-6


def test_group_figures_bound_a_practical_selector(arch):
    cfg = SparseConfig(support=129, selector="mean-pooled", audit=True)
    result = compare(tiny_model(arch), None, prompt(300), cfg, tokens=16)
    arrays = result.audit_arrays
    for name in ("selector_recall", "captured_mass_ratio", "selector_recall_per_head_best"):
        assert np.all((arrays[name] >= 0) & (arrays[name] <= 1 + 1e-12)), name
    assert np.all(arrays["captured_mass_ratio_per_head_best"] <= 1 + 1e-12)
    assert arrays["captured_mass_ratio"].min() < 1  # the test means something: mean-pooled misses somewhere
    # group figures are one value per KV-head group, repeated for its query heads (4 query heads, 2 KV heads)
    assert np.array_equal(arrays["selector_recall"][..., 0::2], arrays["selector_recall"][..., 1::2])
    assert result.to_dict()["captured_mass_ratio_per_head_best_mean"] == pytest.approx(  # one float64 mean
        arrays["captured_mass_ratio_per_head_best"].mean()
    )


def test_selection_quality_on_a_hand_built_group():
    # one KV head, two query heads, four distant blocks, budget 2
    mass = torch.tensor([[[0.5, 0.3, 0.0, 0.1], [0.0, 0.3, 0.4, 0.1]]], dtype=torch.float64)
    # group sums 0.5, 0.6, 0.4, 0.2: the group best is {0, 1} (1.1);
    # head 0's own best is {0, 1} (0.8), head 1's {1, 2} (0.7); float64 sums and ratios of four terms: approx's
    # default 1e-6 relative is far above their round-off
    stats = selection_quality(mass, torch.tensor([[False, True, True, False]]), 2)
    assert stats["selector_recall"].tolist() == [[0.5, 0.5]]
    assert stats["captured_mass_ratio"][0].tolist() == pytest.approx([1.0 / 1.1, 1.0 / 1.1])  # (0.3 + 0.7) / 1.1
    assert stats["selector_recall_per_head_best"].tolist() == [[0.5, 1.0]]
    assert stats["captured_mass_ratio_per_head_best"][0].tolist() == pytest.approx([0.3 / 0.8, 1.0])

    oracle = selection_quality(mass, torch.tensor([[True, True, False, False]]), 2)
    assert oracle["selector_recall"].tolist() == [[1.0, 1.0]]
    assert oracle["captured_mass_ratio"].tolist() == [[1.0, 1.0]]
    assert oracle["selector_recall_per_head_best"].tolist() == [[1.0, 0.5]]
    assert oracle["captured_mass_ratio_per_head_best"][0].tolist() == pytest.approx([1.0, 0.3 / 0.7])

    # a tie at the cut goes to the lowest index, as oracle-blocks breaks it: same mass, but not the best set
    tied = torch.tensor([[[0.2, 0.2, 0.2]]], dtype=torch.float64)
    stats = selection_quality(tied, torch.tensor([[False, False, True]]), 1)
    assert stats["selector_recall"].tolist() == [[0.0]] and stats["captured_mass_ratio"].tolist() == [[1.0]]


def _brute_force(probs: np.ndarray, units: list[list[int]], chosen: set[int], budget: int) -> dict[str, np.ndarray]:
    """float64 loops over every ``budget``-subset of units: the four figures of one KV head ``(G,)``."""
    group = probs.shape[0]
    mass = np.array([[sum(probs[h, p] for p in unit) for unit in units] for h in range(group)])

    def best(weights):
        return max(itertools.combinations(range(len(units)), budget), key=lambda s: sum(weights[u] for u in s))

    group_best = best(mass.sum(0))
    chosen_mass = np.array([sum(mass[h, u] for u in chosen) for h in range(group)])
    out = {
        "selector_recall": np.full(group, len(chosen & set(group_best)) / budget),
        "captured_mass_ratio": np.full(
            group, chosen_mass.sum() / sum(mass[h, u] for h in range(group) for u in group_best)
        ),
        "selector_recall_per_head_best": np.zeros(group),
        "captured_mass_ratio_per_head_best": np.zeros(group),
    }
    for h in range(group):
        own = best(mass[h])
        out["selector_recall_per_head_best"][h] = len(chosen & set(own)) / budget
        out["captured_mass_ratio_per_head_best"][h] = chosen_mass[h] / sum(mass[h, u] for u in own)
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 2),
    st.integers(24, 44),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_audit_step_matches_a_brute_force_loop(group, kv_heads, n, token_level, seed):
    g = torch.Generator().manual_seed(seed)
    window, block, d = 8, 4, 8
    layout = BlockLayout(n=n, window=window, block_size=block)
    keys, values = torch.randn(kv_heads, n, d, generator=g) * 2, torch.randn(kv_heads, n, d, generator=g)
    query = torch.randn(kv_heads * group, d, generator=g) * 2
    scale = d**-0.5
    if token_level:
        budget = 3
        distant = torch.stack([torch.randperm(layout.distant_end - 1, generator=g)[:budget] for _ in range(kv_heads)])
        index, blocks = token_index(distant.sort(-1).values + 1, layout), None
        valid = torch.ones_like(index, dtype=torch.bool)
        units = [[p] for p in range(1, layout.distant_end)]
    else:
        budget = 3
        blocks = torch.stack([torch.randperm(layout.n_blocks, generator=g)[:budget] for _ in range(kv_heads)])
        index, valid = support_positions(blocks, layout)
        units = [
            list(range(1 + j * block, min(1 + (j + 1) * block, layout.distant_end))) for j in range(layout.n_blocks)
        ]
    output = torch.zeros(kv_heads * group, d)  # the selector figures do not read the output
    stats = audit_step(StepView(0, 1, query, keys, values, index, valid, output, scale, layout, blocks))
    for h in range(kv_heads):
        q = query.double().view(kv_heads, group, d)[h].numpy()
        logits = q @ keys[h].double().numpy().T * scale
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        if token_level:
            chosen = {int(p) - 1 for p in index[h, 1 : 1 + budget]}
        else:
            chosen = {int(j) for j in blocks[h]}
        expected = _brute_force(probs, units, chosen, budget)
        for name, value in expected.items():
            got = stats[name].view(kv_heads, group)[h].numpy()
            assert np.allclose(got, value, rtol=1e-9, atol=1e-12), name  # float64 both ways: round-off ~1e-14


def test_blocks_an_adaptive_budget_dropped_are_not_counted_as_chosen():
    """block-top-p keeps ``b`` blocks in its selection but reads only those its budget keeps (the rest are masked out
    of the support): recall and captured/best judge the blocks read, as ``mass_blocks`` and ``omitted_mass`` do."""
    from sparsedecode.selectors.select import BlockChoice, support_of

    g = torch.Generator().manual_seed(3)
    n, window, block, d = 60, 8, 4, 8
    layout = BlockLayout(n=n, window=window, block_size=block)
    keys, values = torch.randn(1, n, d, generator=g) * 2, torch.randn(1, n, d, generator=g)
    query = torch.randn(2, d, generator=g) * 2
    probs = torch.softmax(query.double() @ keys[0].double().T * d**-0.5, dim=-1)  # (G, n)
    units = [list(range(1 + j * block, min(1 + (j + 1) * block, layout.distant_end))) for j in range(layout.n_blocks)]
    mass = torch.stack([probs[:, u].sum(-1) for u in units], dim=-1)  # (G, U)
    best = mass.sum(0).argsort(descending=True)[:3].sort().values  # the group's best three blocks
    blocks = best.unsqueeze(0)
    budget_mask = torch.tensor([[True, False, True]])  # the budget drops the middle one: 2 of the 3 blocks read
    index, valid = support_of(BlockChoice(blocks, budget_mask), layout)
    stats = audit_step(StepView(0, 1, query, keys, values, index, valid, torch.zeros(2, d), d**-0.5, layout, blocks))
    read = [int(best[0]), int(best[2])]
    assert stats["selector_recall"].tolist() == pytest.approx([2 / 3, 2 / 3])
    expected = float(mass[:, read].sum() / mass[:, best].sum())
    assert stats["captured_mass_ratio"].tolist() == pytest.approx([expected, expected], rel=1e-12)
    assert stats["mass_blocks"].tolist() == pytest.approx(mass[:, read].sum(-1).tolist(), rel=1e-12)


def test_mass_probe_takes_cache_and_first_together():
    """Found by probing the library's ``mass_probe``: a ``cache`` without ``first`` failed with a TypeError
    traceback, a ``first`` without ``cache`` was silently replaced by the prefill's token, and ``tokens=0`` returned
    one token; each is now a one-line error."""
    from sparsedecode import SparseDecodeError
    from sparsedecode.decoding.loop import prefill
    from sparsedecode.experiments.probes import mass_probe

    model, ids = tiny_model("llama"), prompt(120)
    cfg = SparseConfig(support=33, window=16, block_size=8)
    cache, _ = prefill(model, ids)
    for kwargs, words in [
        (dict(cache=cache), "pass cache and first together"),
        (dict(first=5), "pass cache and first together"),
        (dict(tokens=0), "tokens must be an integer >= 1"),
    ]:
        with pytest.raises(SparseDecodeError, match=f"mass_probe: {words}"):
            mass_probe(model, ids, cfg, **{"tokens": 4, **kwargs})
    assert cache.get_seq_length() == 120, "the cache is untouched"
    assert mass_probe(model, ids, cfg, tokens=3).summary["audited_steps"] == 2
