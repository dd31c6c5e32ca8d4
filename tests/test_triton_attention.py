"""The optional Triton kernel of the sparse step, run on CPU through Triton's interpreter (no GPU needed).

The kernel must compute what the torch path (:func:`attend_support`: gather + SDPA) computes, for every shape of
support: splits or none, a chosen short last block, no distant blocks, contexts shorter than the window, GQA
groups of 1..8, float32 and float16 caches. Triton's interpreter multiplies bfloat16 wrongly (a numpy limitation
of the interpreter, not of the kernel), so bfloat16 is left to the GPU check (``bench op --device cuda``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_attention_close, logits_tolerance, prompt, tiny_model
from test_attention import greedy_loop

from sparsedecode import SparseConfig, SparseDecodeError, sparse_decoding
from sparsedecode.layout import BlockLayout
from sparsedecode.selectors import select_blocks
from sparsedecode.selectors.statistics import BlockStatistics
from sparsedecode.session import attend_support

pytest.importorskip("triton", reason="the Triton kernel tests need the test extra (pip install -e '.[test]')")
pytestmark = pytest.mark.triton


def random_case(query_heads, kv_heads, d, n, b, *, dtype, seed, short_tail=False):
    generator = torch.Generator().manual_seed(seed)
    layout = BlockLayout(n=n, window=64, block_size=16)
    keys = torch.randn(kv_heads, n + 7, d, generator=generator).to(dtype)  # spare capacity, as in a KV cache
    values = torch.randn(kv_heads, n + 7, d, generator=generator).to(dtype)
    q = (3 * torch.randn(query_heads, d, generator=generator)).to(dtype)
    b = min(b, layout.n_blocks)
    rows = []
    for _ in range(kv_heads):
        chosen = torch.randperm(layout.n_blocks, generator=generator)[:b]
        if short_tail and b:
            chosen[0] = layout.n_blocks - 1
            chosen = chosen.unique()
            chosen = torch.cat([chosen, torch.tensor([i for i in range(layout.n_blocks) if i not in chosen])])[:b]
        rows.append(chosen.sort().values)
    blocks = torch.stack(rows) if b else torch.zeros(kv_heads, 0, dtype=torch.long)
    return q, keys, values, blocks, layout


CASES = [
    # query heads, KV heads, head dim, context, blocks, splits
    (14, 2, 64, 2048, 8, None),  # qwen2 0.5B shape, S = 193
    (14, 2, 64, 2048, 8, 1),  # one split: the kernel normalises its own output
    (14, 2, 64, 2048, 8, 13),  # one tile per split
    (32, 8, 128, 1100, 44, 7),  # llama3-8b shape, S = 769
    (4, 4, 16, 300, 3, 5),  # no GQA
    (8, 1, 32, 500, 4, 2),  # one KV head for 8 query heads
    (4, 2, 16, 70, 2, 3),  # one distant block, a short one
    (4, 2, 16, 20, 0, 2),  # context inside the window: no distant block, empty window tiles
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_kernel_matches_gather_and_sdpa(case):
    from sparsedecode.kernels.triton.attention import support_attention

    *shape, splits = case
    q, keys, values, blocks, layout = random_case(*shape, dtype=torch.float32, seed=sum(shape))
    scale = shape[2] ** -0.5
    out = support_attention(q, keys, values, blocks, layout, scale, splits=splits)
    reference = attend_support(q, keys, values, blocks, layout, scale)
    assert out.shape == reference.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert_attention_close(out, reference, q, keys, values, scale)


@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_masks_a_chosen_short_last_block(splits):
    from sparsedecode.kernels.triton.attention import support_attention

    # n = 2048: distant region [1, 1984) holds 123 full blocks and a 15-position last one
    q, keys, values, blocks, layout = random_case(14, 2, 64, 2048, 8, dtype=torch.float32, seed=3, short_tail=True)
    assert layout.n_blocks > layout.n_full and bool((blocks == layout.n_blocks - 1).any())
    out = support_attention(q, keys, values, blocks, layout, 0.125, splits=splits)
    reference = attend_support(q, keys, values, blocks, layout, 0.125)
    assert_attention_close(out, reference, q, keys, values, 0.125)
    # the position just past the distant region is a window key: counting it twice would move the output
    keys[:, layout.distant_end] += 5.0
    moved = support_attention(q, keys, values, blocks, layout, 0.125, splits=splits)
    assert_attention_close(moved, attend_support(q, keys, values, blocks, layout, 0.125), q, keys, values, 0.125)


def test_kernel_in_half_precision():
    from sparsedecode.kernels.triton.attention import support_attention

    q, keys, values, blocks, layout = random_case(14, 2, 64, 2048, 8, dtype=torch.float16, seed=5)
    out = support_attention(q, keys, values, blocks, layout, 0.125, splits=3)
    reference = attend_support(q, keys, values, blocks, layout, 0.125)
    # float16 inputs and output: one rounding is 2**-11 relative (4.9e-4); 2e-3 is a few of them, while the
    # accumulation runs in float32 (a float16 sum over 193 positions would be off by ~7e-3)
    assert (out - reference).norm() / reference.norm() < 2e-3


@pytest.mark.parametrize("selector", ["mean-pooled", "quest"])  # quest: blocks per query head
def test_decoding_with_the_triton_kernel_matches_torch(arch, selector):
    model = tiny_model(arch)
    ids = prompt(180)
    results = {}
    for kernel in ("torch", "triton"):
        with sparse_decoding(model, SparseConfig(support=97, kernel=kernel, selector=selector)) as session:
            results[kernel] = greedy_loop(model, ids, 12)
        assert session.sparse_steps == 12 * 2
    (torch_tokens, torch_logits), (triton_tokens, triton_logits) = results["torch"], results["triton"]
    assert triton_tokens == torch_tokens
    # Triton and torch sum the same attention in another order: float32 round-off apart
    tolerance = logits_tolerance(torch_logits, model, positions=192)
    assert torch.allclose(triton_logits, torch_logits, atol=tolerance, rtol=0)


def test_triton_kernel_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # CPU without the interpreter: the kernel cannot run
    model = tiny_model("llama")
    with (
        sparse_decoding(model, SparseConfig(support=97, kernel="triton")),
        pytest.raises(SparseDecodeError, match="CUDA"),
    ):
        greedy_loop(model, prompt(180), 2)
    with pytest.raises(SparseDecodeError, match="kernel"):
        SparseConfig(kernel="cuda")


@pytest.mark.parametrize(
    "query_heads, kv_heads, d, n, b",
    [(14, 2, 64, 2048, 8), (14, 2, 64, 4100, 44), (32, 8, 128, 1500, 8), (4, 2, 16, 200, 2), (8, 1, 32, 90, 1)],
)
def test_triton_selection_picks_the_blocks_top_blocks_picks(query_heads, kv_heads, d, n, b):
    from sparsedecode.kernels.triton.attention import mean_pooled_top_blocks

    generator = torch.Generator().manual_seed(n + b)
    layout = BlockLayout(n=n, window=64, block_size=16)
    keys = torch.randn(kv_heads, n + 3, d, generator=generator)
    q = torch.randn(query_heads, d, generator=generator)
    cfg = SparseConfig(support=1 + 64 + 16 * b, kernel="torch")
    cache = BlockStatistics(16)
    expected = select_blocks(cfg, cache, q, keys, layout, scale=d**-0.5)  # torch scores + top_blocks
    centroids = cache.update(keys, layout.n_full)
    chosen = mean_pooled_top_blocks(q, keys, centroids, layout, min(b, layout.n_blocks))
    assert torch.equal(chosen.sort(dim=-1).values, expected)
    if layout.n_blocks > layout.n_full:  # the short tail block is scored from its keys: make it the best
        keys[:, 1 + layout.n_full * 16 : layout.distant_end] = 10 * q.view(kv_heads, -1, d).mean(1, keepdim=True)
        chosen = mean_pooled_top_blocks(q, keys, centroids, layout, min(b, layout.n_blocks))
        assert bool((chosen[:, 0] == layout.n_blocks - 1).all())


def test_triton_selection_breaks_ties_towards_the_lowest_block():
    from sparsedecode.kernels.triton.attention import mean_pooled_top_blocks

    layout = BlockLayout(n=64 + 1 + 16 * 10, window=64, block_size=16)
    keys = torch.zeros(2, layout.n, 16)
    keys[:, 1 + 16 * 7 : 1 + 16 * 8] = 1.0  # block 7 is best; the other nine tie at 0
    centroids = BlockStatistics(16).update(keys, layout.n_full)
    chosen = mean_pooled_top_blocks(torch.ones(4, 16), keys, centroids, layout, 3)
    assert chosen.tolist() == [[7, 0, 1], [7, 0, 1]]
