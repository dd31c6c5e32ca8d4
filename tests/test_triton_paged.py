"""The Triton kernel of the sparse step over a paged cache (vLLM's), run through Triton's interpreter on the CPU: it
computes what the torch path of the vLLM step computes (gather each support through the block table, then SDPA),
for vLLM's CUDA page layout and its CPU one, supports by KV head and by query head, ragged supports, shuffled
pages, one split or several, float32 and float16."""

from __future__ import annotations

import pytest
import torch

from sparsedecode.errors import SparseDecodeError
from sparsedecode.integrations.vllm.pages import PagedCache
from sparsedecode.integrations.vllm.step import attend_supports

pytest.importorskip("triton", reason="the Triton kernel tests need the test extra (pip install -e '.[test]')")
pytestmark = pytest.mark.triton


def paged_case(*, kv, group, d, page, lengths, support, per_head, layout, dtype, seed):
    """Random pages of ``lengths`` sequences, tables on shuffled pages, random supports (the last slots of some
    rows invalid); the cache as vLLM lays it out for CUDA (``(2, pages, P, kv, d)``) or its CPU kernels."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // page) for n in lengths]
    pages = sum(widths) + 3  # spare pages nobody's table holds
    order = torch.randperm(pages, generator=g)
    tables = torch.zeros(len(lengths), max(widths), dtype=torch.int32)
    at = 0
    for r, w in enumerate(widths):
        tables[r, :w] = order[at : at + w].to(torch.int32)
        at += w
    if layout == "cuda":
        data = torch.randn(2, pages, page, kv, d, generator=g).to(dtype)
        cache = PagedCache.of_split(data[0], data[1])
    else:
        data = torch.randn(pages, kv, page, 2 * d, generator=g).to(dtype)
        cache = PagedCache.of(data, kernel=False)
    rows = kv * group if per_head else kv
    index = torch.stack([torch.stack([torch.randperm(n, generator=g)[:support] for _ in range(rows)])
                         for n in lengths])  # fmt: skip
    valid = torch.rand(index.shape, generator=g) > 0.2
    valid[..., 0] = True
    queries = (2 * torch.randn(len(lengths), kv * group, d, generator=g)).to(dtype)
    return cache, queries, tables, index, valid


CASES = [
    # kv, group, d, page, lengths, support, per head, layout, splits
    (2, 3, 16, 32, (100, 257, 64), 40, False, "cuda", None),  # GQA 3, a support of 2.5 tiles
    (2, 3, 16, 32, (100, 257, 64), 40, True, "cuda", 3),  # a row per query head, splits merged
    (1, 8, 32, 16, (300,), 97, False, "cpu", 2),  # the CPU vec layout (keys transposed)
    (4, 1, 64, 64, (70, 129), 16, False, "cuda", 1),  # no GQA, one tile
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_paged_kernel_matches_the_gather_through_the_tables(case, dtype):
    from sparsedecode.kernels.triton.paged import paged_support_attention

    kv, group, d, page, lengths, support, per_head, layout, splits = case
    cache, queries, tables, index, valid = paged_case(kv=kv, group=group, d=d, page=page, lengths=lengths,
                                                      support=support, per_head=per_head, layout=layout, dtype=dtype,
                                                      seed=hash(case) % 1000)  # fmt: skip
    scale = d**-0.5
    expected = attend_supports(cache, queries.float(), tables, index, valid, scale)
    got = paged_support_attention(queries, cache.keys.transpose(2, 3), cache.values, tables, index, valid, scale,
                                  splits=splits)  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    if dtype == torch.float32:  # an invalid slot reads nothing: the same supports with those slots moved away
        moved = torch.where(valid, index, torch.zeros_like(index))
        again = paged_support_attention(queries, cache.keys.transpose(2, 3), cache.values, tables, moved, valid, scale)
        torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)


def test_the_paged_kernel_refuses_what_it_cannot_read_in_one_line():
    from sparsedecode.kernels.triton.paged import paged_support_attention

    cache, queries, tables, index, valid = paged_case(kv=2, group=2, d=16, page=16, lengths=(40,), support=20,
                                                      per_head=False, layout="cuda", dtype=torch.float32,
                                                      seed=0)  # fmt: skip
    keys = cache.keys.transpose(2, 3)
    for args, message in [
        ((queries, keys.double(), cache.values), "float32, float16 or bfloat16"),
        ((queries[..., :8], keys[..., :8], cache.values[..., :8]), "power-of-two head dim"),
        ((queries, keys, cache.values), "a row per KV head"),
    ]:
        rows = index[:, :1] if message == "a row per KV head" else index
        with pytest.raises(SparseDecodeError, match=message) as error:
            paged_support_attention(*args, tables, rows, None, 0.25)
        assert "\n" not in str(error.value)
