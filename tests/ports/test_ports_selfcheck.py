"""The ports of the official selection rules (tests/ports/README.md) checked on hand-made cases, and compared with
today's ``select_support``: equal with one query head per KV head, different under GQA (issue #39)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsedecode import select_support

from .common import positions_to_mask
from .h2o_official import h2o_decode, h2o_step_supports
from .quest_official import quest_eval_supports, quest_kernel_supports, quest_on_our_layout
from .sparq_official import sparq_head_scores, sparq_official_supports
from .streaming_official import streaming_supports
from .twilight_official import (
    min_max_quantise,
    top_p_kernel_mask,
    twilight_estimated_probs,
    twilight_quest_candidates,
    twilight_supports,
)


def _case(seed: int, heads: int, kv_heads: int, n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(heads, d, generator=generator), torch.randn(kv_heads, n, d, generator=generator)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort().values, b.sort().values)


# ---------------------------------------------------------------------------------------------------------- Quest
@pytest.mark.parametrize(("n", "page", "budget"), [(100, 16, 64), (257, 16, 1024), (300, 8, 40), (64, 16, 16)])
def test_quest_eval_is_the_min_max_bound_per_page_at_one_head_per_group(n, page, budget):
    queries, keys = _case(n, 3, 3, n, 16)
    pages = -(-n // page)
    count = min(max(3, min(n, budget) // page), pages)
    for h, got in enumerate(quest_eval_supports(queries, keys, page_size=page, token_budget=budget)):
        q, bounds = queries[h], []
        for j in range(pages):
            tokens = keys[h, j * page : min((j + 1) * page, n)]
            low, high = tokens.min(dim=0).values, tokens.max(dim=0).values
            bounds.append(float(torch.maximum(q * low, q * high).sum()))
        best = sorted(range(pages), key=lambda j: -bounds[j])[:count]
        expected = torch.cat([torch.arange(j * page, min((j + 1) * page, n)) for j in sorted(best)])
        assert torch.equal(got, expected)


def test_quest_eval_keeps_three_pages_at_least_drops_a_page_below_the_budget_and_forces_nothing():
    queries, keys = _case(1, 2, 2, 100, 16)
    assert all(len(s) < 100 for s in quest_eval_supports(queries, keys, token_budget=1024))  # 6 of 7 pages
    assert all(len(s) == 48 for s in quest_eval_supports(queries, keys[:, :96], token_budget=16))  # 3 pages
    queries = torch.ones(1, 16)
    keys = torch.randn(1, 100, 16)
    keys[0, 0], keys[0, 96:] = -10.0, -10.0  # position 0's page and the current token's page bound low
    keys[0, 1:16] = -10.0
    support = quest_eval_supports(queries, keys, token_budget=64)[0]
    assert 0 not in support and 99 not in support and len(support) == 64


def test_quest_kernels_always_read_the_last_page_within_a_budget_counting_it():
    queries, keys = _case(2, 2, 2, 200, 16)
    for support in quest_kernel_supports(queries, keys, page_size=16, token_budget=64):
        assert len(support) == 3 * 16 + 8 and torch.equal(support[-8:], torch.arange(192, 200))
    assert all(len(s) == 200 for s in quest_kernel_supports(queries, keys, token_budget=16 * 13))
    with pytest.raises(ValueError, match="multi-head"):
        quest_kernel_supports(*_case(2, 4, 2, 200, 16))


def test_quest_pages_are_chosen_per_query_head_under_gqa():
    queries, keys = _case(3, 6, 2, 497, 32)
    queries[1] = -queries[0]
    supports = quest_eval_supports(queries, keys, token_budget=128)
    assert not _same(supports[0], supports[1])
    for h in range(6):  # each query head alone against its KV head (repeat_kv: head h reads KV head h // 3)
        alone = quest_eval_supports(queries[h : h + 1], keys[h // 3 : h // 3 + 1], token_budget=128)[0]
        assert torch.equal(supports[h], alone)
    ours = quest_on_our_layout(queries, keys, support=1 + 64 + 4 * 16, window=64, block_size=16)
    assert all(s[0] == 0 and torch.equal(s[-64:], torch.arange(433, 497)) and len(s) == 129 for s in ours)


# ---------------------------------------------------------------------------------------------------------- SparQ
@pytest.mark.parametrize("group", [1, 3])
def test_sparq_with_every_channel_is_exact_top_k_of_the_group_summed_logits(group):
    queries, keys = _case(4, 2 * group, 2, 300, 32)
    k, local_k = 40, 9
    supports = sparq_official_supports(queries, keys, k=k, local_k=local_k, rank=32)
    for kv in range(2):
        logits = (keys[kv] @ queries[kv * group : (kv + 1) * group].T).sum(dim=1)
        local = torch.arange(300 - 1 - local_k, 300)
        logits[local] = float("inf")
        expected = logits.topk(k + 1).indices.sort().values
        assert all(torch.equal(supports[h], expected) for h in range(kv * group, (kv + 1) * group))


def test_sparq_scores_use_the_group_channels_and_each_head_s_coverage():
    queries, keys = _case(5, 6, 2, 50, 8)
    rank, scores = 3, sparq_head_scores(queries, keys, 3)
    for kv in range(2):
        group = queries[kv * 3 : (kv + 1) * 3]
        channels = sorted(range(8), key=lambda i: -float(group[:, i].abs().sum()))[:rank]
        for g in range(3):
            q = group[g]
            coverage = float(q[channels].abs().sum() / q.abs().sum())
            expected = keys[kv][:, channels] @ q[channels] / (8 * coverage) ** 0.5
            torch.testing.assert_close(scores[kv * 3 + g], expected)


def test_sparq_keeps_k_plus_one_positions_with_the_local_ones():
    queries, keys = _case(6, 4, 2, 120, 16)
    for keep_first in (False, True):
        for support in sparq_official_supports(queries, keys, k=30, local_k=7, rank=4, keep_first=keep_first):
            assert len(support) == 31 and torch.equal(support[-8:], torch.arange(112, 120))
            assert (0 in support) or not keep_first
    assert all(len(s) == 20 for s in sparq_official_supports(queries, keys[:, :20], k=30, local_k=7, rank=4))


# ------------------------------------------------------------------------------------------------------- Twilight
def test_top_p_keeps_the_fewest_positions_reaching_p_when_position_0_leads():
    assert torch.equal(
        top_p_kernel_mask(torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04]), 0.85), torch.tensor([1, 1, 1, 0, 0]).bool()
    )
    generator = torch.Generator().manual_seed(7)
    for _ in range(20):
        probs = torch.softmax(torch.randn(400, generator=generator) * 3, dim=0)
        probs[0] = probs.max() * 2
        probs /= probs.sum()
        for p in (0.5, 0.85, 0.95):
            ordered = probs.sort(descending=True)
            count = int((ordered.values.cumsum(0) < p).sum()) + 1
            fewest = torch.zeros(400, dtype=torch.bool)
            fewest[ordered.indices[:count]] = True
            kept = top_p_kernel_mask(probs, p)
            assert bool((kept >= fewest).all())  # a superset of the fewest reaching p...
            extra = probs[kept & ~fewest]  # ...plus at most values within the kernel's 1e-5 of the cut
            assert extra.numel() == 0 or float(probs[fewest].min() - extra.min()) <= 1e-5


def test_top_p_threshold_never_exceeds_position_0_s_probability():
    assert top_p_kernel_mask(torch.tensor([0.04, 0.5, 0.3, 0.1, 0.06]), 0.85).all()  # every position >= p0 is kept
    assert torch.equal(
        top_p_kernel_mask(torch.tensor([0.0, 0.5, 0.3, 0.1, 0.1]), 0.85), torch.tensor([0, 1, 1, 1, 1]).bool()
    )


def test_min_max_quantiser_has_sixteen_levels_per_token():
    keys = torch.randn(2, 30, 64)
    quantised = min_max_quantise(keys, 4)
    step = (keys.amax(-1, keepdim=True) - keys.amin(-1, keepdim=True)) / 15
    assert bool(((quantised - keys).abs() <= step / 2 + 1e-6).all())
    assert all(len(row.unique()) <= 16 for row in quantised.flatten(0, 1))
    torch.testing.assert_close(quantised.amin(-1), keys.amin(-1))


def test_twilight_prunes_quest_candidates_per_query_head():
    queries, keys = _case(8, 4, 2, 608, 32)
    candidates = twilight_quest_candidates(queries, keys, chunk_size=16, token_budget=200)
    assert candidates.sum(-1).tolist() == [208] * 4  # ceil(200 / 16) = 13 pages per query head
    supports = twilight_supports(queries, keys, candidates=candidates)
    probs = twilight_estimated_probs(queries, keys, candidates)
    for h, support in enumerate(supports):
        assert bool(candidates[h, support].all()) and float(probs[h, support].sum()) >= 0.85
        assert (0 in support) == bool(candidates[h, 0])
    assert all(c.all() for c in twilight_quest_candidates(queries, keys[:, :100], token_budget=8192))
    without_sink = candidates.clone()
    without_sink[:, :16] = False  # position 0 not a candidate: the threshold is 0 and nothing is pruned
    pruned = twilight_supports(queries, keys, candidates=without_sink)
    assert all(torch.equal(s, row.nonzero().flatten()) for s, row in zip(pruned, without_sink))


# -------------------------------------------------------------------------------------------- H2O, StreamingLLM
def test_h2o_eviction_is_the_step_rule_on_the_scores_it_accumulated():
    generator = torch.Generator().manual_seed(9)
    queries = torch.randn(3, 70, 16, generator=generator)
    keys = torch.randn(3, 70, 16, generator=generator)
    supports, seen = h2o_decode(queries[:, :40], queries[:, 40:], keys, hh_size=8, recent_size=12)
    for step, (support, scores) in enumerate(zip(supports, seen)):
        assert all(len(s) == 8 + 12 + 1 and s[-1] == 40 + step for s in support)
        rule = h2o_step_supports(scores, hh_size=8, recent_size=12)
        assert all(torch.equal(a, b) for a, b in zip(support, rule))
    with pytest.raises(ValueError, match="multi-head"):
        h2o_decode(queries[:2, :40], queries[:2, 40:], keys[:1], hh_size=8, recent_size=12)


def test_streaming_reads_the_sinks_and_the_recent_window():
    assert torch.equal(streaming_supports(10, 1, start_size=4, recent_size=5)[0], torch.arange(10))
    got = streaming_supports(30, 2, start_size=4, recent_size=5)
    assert all(torch.equal(s, torch.tensor([0, 1, 2, 3, 24, 25, 26, 27, 28, 29])) for s in got)


# --------------------------------------------------------------------------- today's selectors against the ports
CASES = [  # (seed, N, d, S, W, B)
    (10, 100, 32, 97, 16, 16),
    (11, 400, 64, 97, 32, 8),
    (12, 777, 128, 193, 64, 16),
    (13, 1500, 64, 385, 64, 32),
    (14, 2100, 32, 193, 16, 16),
    (15, 333, 64, 129, 64, 16),
    (16, 1024, 128, 769, 64, 16),
    (17, 4000, 64, 385, 64, 16),
]


def _ports_at_g1(method: str, queries, keys, support: int, window: int, block: int, history):
    if method == "quest":
        return quest_on_our_layout(queries, keys, support=support, window=window, block_size=block)
    if method.startswith("sparq"):
        rank = int(method.partition("=")[2] or 8)
        return sparq_official_supports(queries, keys, k=support - 1, local_k=window - 1, rank=rank, keep_first=True)
    if method == "h2o":
        return h2o_step_supports(history, hh_size=support - window, recent_size=window - 1)
    if method == "streaming":
        return streaming_supports(keys.shape[1], queries.shape[0], start_size=1, recent_size=support - 2)
    return streaming_supports(keys.shape[1], queries.shape[0], start_size=4, recent_size=support - 5)


@pytest.mark.parametrize("method", ["quest", "sparq", "sparq:rank=16", "h2o", "streaming", "sink-streaming"])
def test_select_support_agrees_with_the_ports_at_one_query_head_per_kv_head(method):
    mismatches = heads = 0
    for seed, n, d, support, window, block in CASES:
        queries, keys = _case(seed, 3, 3, n, d)
        history = torch.rand(3, n, generator=torch.Generator().manual_seed(seed))
        history[:, 0] = n  # an attention sink: position 0 is among H2O's heavy hitters
        ours = select_support(
            queries, keys, support=support, window=window, block_size=block, method=method, history=history
        )
        ported = _ports_at_g1(method, queries, keys, support, window, block, history)
        mismatches += sum(not _same(a, b) for a, b in zip(ours, ported))
        heads += 3
    assert mismatches == 0, f"{method}: {mismatches} of {heads} heads select otherwise than the official rule"


def _supports_under_gqa(method: str, queries, keys, support: int, window: int, block: int, rank: int = 8):
    """Ours and the port's, paired per query head (Quest) or per KV head (SparQ's group rule)."""
    group = queries.shape[0] // keys.shape[0]
    spec = f"sparq:rank={rank}" if method == "sparq" else method
    ours = select_support(queries, keys, support=support, window=window, block_size=block, method=spec)
    if method.startswith("quest"):  # the official Quest picks pages per query head
        ported = quest_on_our_layout(queries, keys, support=support, window=window, block_size=block)
        if method == "quest":
            assert len(ours) == len(ported) == queries.shape[0]  # a support per query head
            return list(zip(ours, ported))
        return [(ours[h // group], ported[h]) for h in range(queries.shape[0])]
    ported = sparq_official_supports(queries, keys, k=support - 1, local_k=window - 1, rank=rank, keep_first=True)
    return [(ours[kv], ported[kv * group]) for kv in range(keys.shape[0])]


@settings(max_examples=30, deadline=None)
@given(
    method=st.sampled_from(["quest", "sparq"]),
    group=st.sampled_from([1, 2, 3, 4, 7]),
    kv_heads=st.integers(1, 3),
    d=st.sampled_from([32, 64, 128]),
    n=st.integers(100, 4000),
    shape=st.sampled_from([(97, 64, 16), (193, 64, 16), (385, 64, 32), (129, 32, 8), (769, 128, 16)]),
    rank=st.integers(1, 32),
    seed=st.integers(0, 2**16),
)
def test_quest_and_sparq_select_what_the_official_code_selects_under_gqa(
    method, group, kv_heads, d, n, shape, rank, seed
):
    """The defaults are the official rules (issue #39): Quest per query head, SparQ's group rule, at every GQA
    ratio our models have and others, head sizes 32-128, N 100-4000."""
    support, window, block = shape
    queries, keys = _case(seed, kv_heads * group, kv_heads, n, d)
    pairs = _supports_under_gqa(method, queries, keys, support, window, block, rank=min(rank, d))
    assert all(_same(a, b) for a, b in pairs), f"{method}: {sum(not _same(a, b) for a, b in pairs)} differ"


@pytest.mark.parametrize("method", ["quest:grouping=mean-query", "sparq:grouping=mean-query"])
def test_the_group_mean_variants_differ_from_the_official_rules_under_gqa(method):
    """The variants this project ran before (one support per KV head from the group-mean query), kept under their
    own names so that earlier rows reproduce, are not the official methods once a KV head has several query heads."""
    compared = mismatches = 0
    for (seed, n, d, support, window, block), group in zip(CASES, [2, 3, 4, 7, 2, 3, 4, 7]):
        queries, keys = _case(seed, 2 * group, 2, n, d)
        group_rule = method.replace(":grouping=mean-query", "") if method.startswith("sparq") else method
        if group_rule == "sparq":
            ours = select_support(queries, keys, support=support, window=window, block_size=block, method=method)
            ported = sparq_official_supports(queries, keys, k=support - 1, local_k=window - 1, rank=8, keep_first=True)
            pairs = [(ours[kv], ported[kv * group]) for kv in range(2)]
        else:
            pairs = _supports_under_gqa(method, queries, keys, support, window, block)
        compared += len(pairs)
        mismatches += sum(not _same(a, b) for a, b in pairs)
    assert mismatches > 0, f"{method}: {mismatches} of {compared} supports differ"


@settings(max_examples=25, deadline=None)
@given(
    group=st.sampled_from([1, 2, 3, 4, 7]),
    kv_heads=st.integers(1, 3),
    d=st.sampled_from([32, 64, 128]),
    extra=st.integers(1, 3500),
    shape=st.sampled_from([(97, 64, 16), (193, 64, 16), (385, 64, 32), (129, 32, 8), (769, 128, 16)]),
    temperature=st.sampled_from([1.0, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_twilight_keeps_what_the_official_pruning_keeps_of_quests_candidates(
    group, kv_heads, d, extra, shape, temperature, seed
):
    """Twilight over Quest's per-query-head candidates on our layout, pruned by the official top-p (the kernel's
    bisection): the same positions per query head, the anchor and the window read besides (our layout's; Twilight
    may prune them). A context the support covers is dense for every selector, so the comparison starts past it."""
    support, window, block = shape
    queries, keys = _case(seed, kv_heads * group, kv_heads, support + extra, d)
    queries = queries * temperature
    n = keys.shape[1]
    ours = select_support(queries, keys, support=support, window=window, block_size=block, method="twilight")
    candidates = quest_on_our_layout(queries, keys, support=support, window=window, block_size=block)
    ported = twilight_supports(queries, keys, candidates=candidates, p=0.85)
    assert len(ours) == queries.shape[0]
    probs = twilight_estimated_probs(queries, keys, positions_to_mask(candidates, n))
    for head, (mine, theirs) in enumerate(zip(ours, ported)):
        expected = {*theirs.tolist(), 0, *range(n - window, n)}
        assert sorted(set(mine.tolist())) == mine.tolist()
        # the kernel stops its bisection once the values around the cut are within 1e-5 (absolute): a position that
        # close to the cut is kept or not by float32 rounding of the sums (the official code's own behaviour too)
        for position in set(mine.tolist()) ^ expected:
            assert abs(float(probs[head, position]) - _cut(probs[head])) <= 2e-5, (head, position)


def _cut(row: torch.Tensor) -> float:
    """The port's threshold: the largest probability it drops (0 if none)."""
    dropped = row[(row > 0) & ~top_p_kernel_mask(row, 0.85)]
    return float(dropped.max()) if dropped.numel() else 0.0
