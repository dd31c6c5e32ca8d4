"""Selection invariants of the mean-pooled block selector (pure functions, no model)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsedecode import SparseConfig, SparseDecodeError, select_support
from sparsedecode.layout import BlockLayout
from sparsedecode.selectors import block_centroids, group_mean_queries


def brute_force_scores(queries, keys, window, block):
    """Reference: score every distant block by looping, in float64: one list of scores per KV head."""
    kv_heads, n, d = keys.shape
    group = queries.shape[0] // kv_heads
    distant_end = n - window
    scores = []
    for h in range(kv_heads):
        q = queries[h * group : (h + 1) * group].double().mean(0)
        scores.append(
            [
                float(q @ keys[h, start : min(start + block, distant_end)].double().mean(0)) / math.sqrt(d)
                for start in range(1, distant_end, block)
            ]
        )
    return scores


@st.composite
def problems(draw):
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    d = draw(st.sampled_from([4, 8]))
    window = draw(st.integers(1, 12))  # the window holds the current token: SparseConfig refuses 0
    block = draw(st.integers(1, 6))
    b = draw(st.integers(0, 5))
    support = 1 + window + b * block + draw(st.integers(0, block - 1))
    n = draw(st.integers(1, 120))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(kv_heads * group, d, generator=g)
    keys = torch.randn(kv_heads, n, d, generator=g)
    return queries, keys, support, window, block, b


@settings(max_examples=200, deadline=None)
@given(problems())
def test_support_structure(problem):
    queries, keys, support, window, block, b = problem
    kv_heads, n, _ = keys.shape
    kept = select_support(queries, keys, support=support, window=window, block_size=block)
    assert len(kept) == kv_heads
    effective = 1 + window + b * block
    for positions in kept:
        assert positions.dtype == torch.long
        assert torch.equal(positions, torch.unique(positions)), "sorted and unique"
        if n <= effective:
            assert torch.equal(positions, torch.arange(n))
            continue
        distant_end = n - window
        assert int(positions[0]) == 0, "anchor kept"
        assert torch.equal(positions[-window:] if window else positions[:0], torch.arange(distant_end, n))
        distant = positions[(positions >= 1) & (positions < distant_end)]
        blocks = torch.unique((distant - 1) // block)
        assert len(blocks) == b, "exactly b blocks"
        for j in blocks.tolist():  # whole blocks (clipped to the distant region)
            start, stop = 1 + j * block, min(1 + (j + 1) * block, distant_end)
            assert torch.equal(distant[(distant >= start) & (distant < stop)], torch.arange(start, stop))
        assert len(positions) <= effective


@settings(max_examples=150, deadline=None)
@given(problems())
def test_top_blocks_match_brute_force(problem):
    queries, keys, support, window, block, b = problem
    kv_heads, n, _ = keys.shape
    if n <= 1 + window + b * block:
        return
    kept = select_support(queries, keys, support=support, window=window, block_size=block)
    for h, scores in enumerate(brute_force_scores(queries, keys, window, block)):
        distant = kept[h][(kept[h] >= 1) & (kept[h] < n - window)]
        chosen = set(torch.unique((distant - 1) // block).tolist())
        others = [s for j, s in enumerate(scores) if j not in chosen]
        assert len(chosen) == b
        if not chosen or not others:
            continue
        # every kept block scores at least as high as every dropped one (float32 vs float64 slack)
        assert min(scores[j] for j in chosen) >= max(others) - 1e-5


def test_gqa_group_shares_blocks_from_mean_query():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 400, 8, generator=g)
    queries = torch.randn(6, 8, generator=g)
    kept = select_support(queries, keys, support=97, window=64, block_size=16)
    # Replacing a group's queries by their mean (repeated) must not change its selection.
    means = group_mean_queries(queries, 2)
    pooled = means.repeat_interleave(3, dim=0)
    assert all(torch.equal(a, b) for a, b in zip(kept, select_support(pooled, keys, support=97)))


def test_ties_go_to_lowest_block_index():
    keys = torch.ones(1, 1 + 10 * 4 + 8, 2)  # every block has the same centroid
    queries = torch.ones(1, 2)
    kept = select_support(queries, keys, support=1 + 8 + 3 * 4, window=8, block_size=4)[0]
    assert kept.tolist() == [0, *range(1, 13), *range(41, 49)]


def test_short_last_block_makes_list_shorter():
    n, window, block = 1 + 3 * 16 + 5 + 64, 64, 16  # the distant region ends in a 5-position block
    keys = torch.zeros(1, n, 4)
    keys[0, 1 + 3 * 16 : n - window] = 10.0  # make the short block the best one
    kept = select_support(torch.ones(1, 4), keys, support=1 + 64 + 16, window=window, block_size=block)[0]
    assert len(kept) == 1 + 5 + 64
    assert kept[1:6].tolist() == list(range(49, 54))


def test_support_is_floored_to_whole_blocks():
    cfg = SparseConfig(support=200)
    assert cfg.blocks == 8 and cfg.effective_support == 193
    assert [SparseConfig(support=s).blocks for s in (97, 193, 385, 769)] == [2, 8, 20, 44]


def test_centroids_are_block_means():
    keys = torch.randn(2, 100, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    layout = BlockLayout(n=100, window=10, block_size=16)
    cents = block_centroids(keys, layout)
    assert cents.shape == (2, layout.n_blocks, 4)
    # float32 centroids of float64 keys (|key| < 3.2): rounding each key (1.9e-7 after the mean) and 15 float32
    # additions of partial sums up to 16 * 3.2 (1.4e-6 after dividing by 16, in any summation order): 2e-6 at worst
    assert torch.allclose(cents[:, 0].double(), keys[:, 1:17].mean(1), atol=2e-6, rtol=0)
    assert torch.allclose(cents[:, -1].double(), keys[:, 1 + 5 * 16 : 90].mean(1), atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_statistics_of_a_batch_equal_each_row_alone(dtype, monkeypatch):
    """The compiled step completes an equal-length batch's blocks in one pass (centroids.store_statistics over rows and
    KV heads): each row's statistics bit for bit those its own BlockStatistics computes, from any first block, and
    those of the whole span reduced at once however the half-precision span is cut (SPAN_FLOATS)."""
    from sparsedecode.selectors import statistics as centroids
    from sparsedecode.selectors.statistics import BlockStatistics, block_span, reduce_blocks, store_statistics

    generator = torch.Generator().manual_seed(1)
    kinds = ("mean", "min", "max")
    for block, d, length, spans in ((16, 8, 200, ((0, 11), (4, 12), (7, 8))), (16, 64, 8200, ((0, 507),)),
                                    (32, 128, 2100, ((0, 60), (59, 60))), (8, 7, 300, ((0, 37), (5, 36)))):  # fmt: skip
        keys = torch.randn(3, 2, length, d, generator=generator).to(dtype)
        for first, stop in spans:
            whole = block_span(keys, first, stop, block)
            for floats in (centroids.SPAN_FLOATS, 6 * block * d * 5, 1):  # whole, 5 blocks, 1 block at a time
                monkeypatch.setattr(centroids, "SPAN_FLOATS", floats)
                targets = {kind: torch.full((3, 2, d, stop), float("nan")) for kind in kinds}
                store_statistics(keys, first, stop, block, targets)
                for kind in kinds:
                    batched = targets[kind][..., first:].transpose(-1, -2)
                    assert torch.equal(batched, reduce_blocks(whole, kind))
                    for row in range(3):
                        alone = BlockStatistics(block, (kind,))
                        alone.update(keys[row], first)
                        assert torch.equal(batched[row], alone.update(keys[row], stop)[:, first:])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(support=64),
        dict(support=100, window=-1),
        dict(support=100, block_size=0),
        dict(support=100, reuse=0),
        dict(support=100, selector="nope"),
    ],
)
def test_bad_configs_are_rejected(kwargs):
    with pytest.raises(SparseDecodeError):
        SparseConfig(**kwargs)


def test_bad_shapes_are_rejected():
    with pytest.raises(SparseDecodeError):
        select_support(torch.ones(3, 4), torch.ones(2, 10, 4), support=97)
    with pytest.raises(SparseDecodeError):
        select_support(torch.ones(4), torch.ones(2, 10, 4), support=97)


def test_block_top_p_estimates_shares_at_the_attentions_own_scale():
    """Two heads with the same attention, one by a scale multiplier (Granite's, Gemma 2's) and one by queries scaled
    under 1/sqrt(d): block-top-p keeps the same blocks for both (its estimated shares are the attention's)."""
    from sparsedecode.selectors.registry import parse_selector
    from sparsedecode.selectors.select import choose_blocks
    from sparsedecode.selectors.statistics import BlockStatistics

    torch.manual_seed(0)
    d, n, multiplier = 16, 400, 0.02
    queries, keys = torch.randn(4, d) * 3, torch.randn(2, n, d) * 3
    selector = parse_selector("block-top-p:p=0.5")

    def kept(q, scale):
        layout = BlockLayout(n=n, window=32, block_size=8, scale=scale)
        cache = BlockStatistics(8, selector.cached_statistics())
        choice = choose_blocks(selector, 20, cache, q, keys, layout)
        return [row[mask].tolist() for row, mask in zip(choice.blocks, choice.budget_mask)]

    by_multiplier = kept(queries, multiplier)
    assert by_multiplier == kept(queries * multiplier * math.sqrt(d), d**-0.5)
    assert by_multiplier != kept(queries, d**-0.5)  # the multiplier matters: a sharper or flatter estimate
