"""Every selector under one budget: invariants, oracles' optimality, and the engine against fresh selection."""

from __future__ import annotations

import pytest
import torch
from conftest import prompt, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention import Oracle, greedy_loop

from sparsedecode import SparseConfig, compare, select_support, sparse_decoding
from sparsedecode.config import BLOCK_SELECTORS, SELECTORS
from sparsedecode.selectors import BlockLayout, group_attention, quest_scores

STATELESS = ("mean-pooled", "quest", "oracle-blocks", "oracle-tokens", "streaming")


@st.composite
def problems(draw):
    kv_heads, group, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([4, 8]))
    window, block, b = draw(st.integers(0, 10)), draw(st.integers(1, 6)), draw(st.integers(0, 4))
    n = draw(st.integers(2 + window + (b + 1) * block, 140))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return torch.randn(kv_heads * group, d, generator=g) * 2, torch.randn(kv_heads, n, d, generator=g), window, block, b


def captured(queries, keys, kept, window):
    """True attention mass (summed over each group's heads) on the kept distant positions, per KV head."""
    probs = group_attention(queries, keys, keys.shape[-1] ** -0.5)
    n = keys.shape[1]
    return [float(probs[h, p[(p >= 1) & (p < n - window)]].sum()) for h, p in enumerate(kept)]


@settings(max_examples=120, deadline=None)
@given(problems())
def test_quest_score_bounds_every_key_of_its_block(problem):
    queries, keys, window, block, _ = problem
    kv_heads, n, d = keys.shape
    layout = BlockLayout(n=n, window=window, block_size=block)
    means = queries.view(kv_heads, -1, d).mean(1)
    for j in range(layout.n_blocks):
        members = keys[:, 1 + j * block : min(1 + (j + 1) * block, layout.distant_end)]
        score = quest_scores(means, members.amin(1, keepdim=True), members.amax(1, keepdim=True))[:, 0]
        best = torch.einsum("hd,hnd->hn", means, members).amax(-1)
        assert torch.all(score >= best - 1e-5)


@settings(max_examples=120, deadline=None)
@given(problems())
def test_oracles_capture_at_least_as_much_as_any_selector(problem):
    queries, keys, window, block, b = problem
    support = 1 + window + b * block
    mass = {
        method: captured(
            queries,
            keys,
            select_support(queries, keys, support=support, window=window, block_size=block, method=method),
            window,
        )
        for method in SELECTORS
    }
    for method in BLOCK_SELECTORS:
        assert all(o >= m - 1e-5 for o, m in zip(mass["oracle-blocks"], mass[method])), method
    for method in SELECTORS:  # every selector keeps b*B = S - 1 - W distant positions or fewer
        assert all(o >= m - 1e-5 for o, m in zip(mass["oracle-tokens"], mass[method])), method


@settings(max_examples=80, deadline=None)
@given(problems())
def test_streaming_keeps_the_anchor_and_the_last_positions(problem):
    queries, keys, window, block, b = problem
    support = 1 + window + b * block
    n = keys.shape[1]
    for positions in select_support(
        queries, keys, support=support, window=window, block_size=block, method="streaming"
    ):
        assert positions.tolist() == [0, *range(n - support + 1, n)]


def test_random_blocks_are_seeded():
    q, k = torch.randn(4, 8), torch.randn(2, 400, 8)
    a = select_support(q, k, support=97, method="random-blocks", seed=1)
    b = select_support(q, k, support=97, method="random-blocks", seed=1)
    c = select_support(q, k, support=97, method="random-blocks", seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("selector", STATELESS)
def test_engine_matches_fresh_selection_and_float64_attention(selector):
    model = tiny_model("qwen2")
    cfg = SparseConfig(support=97, selector=selector)
    oracle = Oracle(cfg)
    with sparse_decoding(model, cfg) as session:
        session.observers.append(oracle)
        greedy_loop(model, prompt(200), 30)
    assert oracle.steps == 60 and oracle.max_error < 1e-5


@pytest.mark.parametrize("selector", SELECTORS)
def test_every_selector_runs_the_protocol_with_a_clean_audit(selector):
    model = tiny_model("llama")
    result = compare(model, None, prompt(300), SparseConfig(support=97, selector=selector, audit=True), tokens=10)
    assert result.sparse_steps == 9 * 2
    assert result.identity_residual_max <= 1e-5 and result.bound_violations == 0
    assert 0 <= result.captured_mass_ratio_mean <= 1 + 1e-9 and 0 <= result.selector_recall_mean <= 1
    assert 0 <= result.captured_mass_ratio_per_head_best_mean <= 1 + 1e-9
    assert 0 <= result.selector_recall_per_head_best_mean <= 1
    assert result.certificate_violations == 0


def test_h2o_starts_as_oracle_tokens_and_then_uses_its_history():
    model = tiny_model("llama")
    picks = {}
    for selector in ("h2o", "oracle-tokens"):
        record = []
        with sparse_decoding(model, SparseConfig(support=97, selector=selector)) as session:
            session.observers.append(lambda view, record=record: record.append(view.index.clone()))
            greedy_loop(model, prompt(250), 12)
        picks[selector] = record
    assert torch.equal(picks["h2o"][0], picks["oracle-tokens"][0]), "no history at the first step"
    assert any(not torch.equal(a, b) for a, b in zip(picks["h2o"], picks["oracle-tokens"]))
