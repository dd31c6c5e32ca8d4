"""Every selector under one budget: invariants, oracles' optimality, and the engine against fresh selection."""

from __future__ import annotations

import pytest
import torch
from conftest import BLOCK_SELECTORS, SELECTORS, prompt, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attention import Oracle, greedy_loop

from sparsedecode import SparseConfig, SparseDecodeError, compare, select_support, sparse_decoding
from sparsedecode.layout import BlockLayout
from sparsedecode.selectors import group_attention, quest_scores

STATELESS = ("mean-pooled", "quest", "oracle-blocks", "oracle-tokens", "streaming")


@st.composite
def problems(draw):
    kv_heads, group, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([4, 8]))
    window, block, b = draw(st.integers(1, 10)), draw(st.integers(1, 6)), draw(st.integers(0, 4))
    n = draw(st.integers(2 + window + (b + 1) * block, 140))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return torch.randn(kv_heads * group, d, generator=g) * 2, torch.randn(kv_heads, n, d, generator=g), window, block, b


def captured(queries, keys, kept, window):
    """True attention mass on the kept distant positions: per KV head summed over its group's query heads for a
    support per KV head, per query head for a support per query head (``len(kept)`` tells which)."""
    probs = group_attention(queries, keys, keys.shape[-1] ** -0.5)
    if len(kept) == queries.shape[0] and len(kept) != keys.shape[0]:
        probs = torch.softmax(queries_logits(queries, keys), dim=-1)
    n = keys.shape[1]
    return [float(probs[h, p[(p >= 1) & (p < n - window)]].sum()) for h, p in enumerate(kept)]


def queries_logits(queries, keys):
    """``(H, N)``: each query head's logits over its KV head's keys."""
    group = queries.shape[0] // keys.shape[0]
    return torch.einsum("hd,hnd->hn", queries, keys.repeat_interleave(group, dim=0)) * keys.shape[-1] ** -0.5


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
            select_support(
                queries,
                keys,
                support=support,
                window=window,
                block_size=block,
                method=method,
                history=keys.sum(-1).abs() if method == "h2o" else None,  # any history: h2o ranks by it
            ),
            window,
        )
        for method in SELECTORS
    }
    own = {}  # each query head's own oracles (its group of one): what a support per query head is bounded by
    group = queries.shape[0] // keys.shape[0]
    for oracle in ("oracle-blocks", "oracle-tokens"):
        own[oracle] = [
            captured(queries[h : h + 1], keys[h // group : h // group + 1], select_support(
                queries[h : h + 1], keys[h // group : h // group + 1], support=support, window=window,
                block_size=block, method=oracle), window)[0]
            for h in range(queries.shape[0])
        ]  # fmt: skip
    for method in SELECTORS:  # every selector keeps b*B = S - 1 - W distant positions or fewer
        per_head = len(mass[method]) != keys.shape[0]
        oracles = ("oracle-tokens",) + (("oracle-blocks",) if method in BLOCK_SELECTORS else ())
        for oracle in oracles:
            bound = own[oracle] if per_head else mass[oracle]
            assert all(o >= m - 1e-5 for o, m in zip(bound, mass[method], strict=True)), (method, oracle)


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


@pytest.mark.parametrize(("method", "sinks"), [("streaming", 1), ("sink-streaming", 4)])
def test_streaming_keeps_the_last_positions_past_float32s_integers(method, sinks):
    """Recency is a position's index: past 2**24 positions float32 rounds neighbouring indices to one value, and the
    tie rule kept an earlier position instead of the newest (found by probing contexts past 2**24); integer scores
    keep exactly the sinks and the last ``S - sinks`` positions."""
    n = 2**24 + 1001
    kept = select_support(torch.ones(1, 2), torch.zeros(1, n, 2), support=97, window=16, block_size=16, method=method)
    assert kept[0].tolist() == [*range(sinks), *range(n - 97 + sinks, n)]


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
    assert oracle.steps == 60 and oracle.max_error_ratio < 1, oracle.max_error  # float32 round-off


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


def _prefill_received(model, ids) -> list[torch.Tensor]:
    """Per layer, the attention each position receives from every prompt query, summed over each KV group (float64),
    from transformers' own eager attention weights: independent of sparsedecode."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(input_ids=ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
    kv_heads = model.config.num_key_value_heads
    return [a[0].double().sum(dim=1).view(kv_heads, -1, ids.shape[1]).sum(dim=1) for a in attentions]


@pytest.mark.parametrize("reuse", [1, 3])
def test_h2o_keeps_the_heavy_hitters_of_earlier_steps_prefill_included(reuse):
    """H2O as published: the distant positions kept at a selection are those of largest attention received from
    every earlier query (the prefill's and each earlier step's, over that step's support), never the current
    query's; the history is rebuilt here independently, in float64."""
    model = tiny_model("llama")
    ids = prompt(250)
    cfg = SparseConfig(support=97, selector="h2o", reuse=reuse)
    history = _prefill_received(model, ids)
    picks, checked = {}, []

    def check(view) -> None:
        expected = history[view.layer]
        n, distant_end, m = view.layout.n, view.layout.distant_end, cfg.distant_positions
        kept = view.index[:, 1 : 1 + m]
        if (view.step - 1) % reuse == 0:  # a selection: the top m of the history over the distant region
            for h in range(kept.shape[0]):
                inside = torch.zeros(n, dtype=torch.bool)
                inside[kept[h]] = True
                weights = expected[h, :n]
                others = weights[1:distant_end][~inside[1:distant_end]]
                assert weights[kept[h]].min() >= others.max() - 1e-4, "kept positions are the heaviest so far"
            checked.append(view.step)
        picks.setdefault(view.layer, []).append(kept.clone())
        # the step's own attention over its support joins the history after its selection
        kv_heads, d = view.keys.shape[0], view.keys.shape[-1]
        q = view.query.double().view(kv_heads, -1, d)
        keys = view.keys.double().gather(1, view.index.unsqueeze(-1).expand(-1, -1, d))
        probs = torch.softmax(torch.bmm(q, keys.transpose(1, 2)) * view.scaling, dim=-1).sum(dim=1)
        grown = torch.zeros(kv_heads, n, dtype=torch.float64)
        grown[:, : expected.shape[1]] = expected[:, :n]
        history[view.layer] = grown.scatter_add_(1, view.index, probs)

    with sparse_decoding(model, cfg) as session:
        session.observers.append(check)
        greedy_loop(model, ids, 12)
    assert len(checked) == 2 * len(range(0, 12, reuse))
    oracle = []
    with sparse_decoding(model, SparseConfig(support=97, selector="oracle-tokens")) as session:
        session.observers.append(lambda view: oracle.append(view.index[:, 1:33].clone()) if view.layer == 0 else None)
        greedy_loop(model, ids, 1)
    assert not torch.equal(picks[0][0], oracle[0]), "step 1 is not the current query's own top attention"


def test_h2o_needs_a_history_outside_a_session():
    q, k = torch.randn(4, 8), torch.randn(2, 300, 8)
    with pytest.raises(SparseDecodeError, match="h2o"):
        select_support(q, k, support=97, method="h2o")
    heavy = torch.zeros(2, 300)
    heavy[:, 10:42] = 1.0
    for positions in select_support(q, k, support=97, method="h2o", history=heavy):
        assert positions.tolist() == [0, *range(10, 42), *range(300 - 64, 300)]


def test_sparq_scores_a_zero_query_head_zero_not_nan():
    """SparQ's scale 1 / sqrt(d * coverage) is 0 / 0 for a query head whose chosen channels are all zero (a zero
    query): that head's approximate logits are 0, as its true ones are, and the selection goes on."""
    keys = torch.randn(2, 200, 8, generator=torch.Generator().manual_seed(0))
    queries = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    queries[1] = 0
    kept = select_support(queries, keys, support=97, window=32, block_size=8, method="sparq")
    assert len(kept) == 2 and all(len(k) == 97 for k in kept)
    from sparsedecode.selectors.methods.sparq import group_sum_scores

    assert torch.isfinite(group_sum_scores(queries, keys, 4)).all()
    queries[0] = 0  # a whole group of zero queries: every position scores 0
    assert torch.equal(group_sum_scores(queries, keys, 4)[0], torch.zeros(200))


@pytest.mark.parametrize("method", ["sparq", "sparq:rank=64", "sparq:grouping=mean-query"])
def test_sparq_ranks_equal_keys_by_the_tie_rule(method):
    """Equal keys (a layer without RoPE repeating a token) score equally, so the lowest distant positions are kept. A
    matrix product scored them: its tiles at the end of ``N`` rounded otherwise, and later positions won the tie."""
    wrong = []
    for trial in range(40):
        kv_heads, group, d = [(1, 1, 16), (2, 3, 31), (1, 7, 64), (3, 1, 128)][trial % 4]
        generator = torch.Generator().manual_seed(trial)
        queries = torch.randn(kv_heads * group, d, generator=generator)
        keys = torch.randn(kv_heads, 1, d, generator=generator).repeat(1, 100 + 7 * trial, 1)
        n = keys.shape[1]
        expected = [*range(0, 97 - 16), *range(n - 16, n)]
        kept = select_support(queries, keys, support=97, window=16, block_size=16, method=method)
        wrong += [trial for positions in kept if positions.tolist() != expected]
    assert not wrong, f"{method}: equal keys not ranked lowest first in trials {sorted(set(wrong))}"
