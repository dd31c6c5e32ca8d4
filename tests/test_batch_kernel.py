"""The batched sparse step: one C kernel call per layer for every sparse sequence of a left-padded batch.

The kernel call equals the single-sequence calls sequence by sequence (same blocks, same outputs).
"""

from __future__ import annotations

import pytest
import torch

from sparsedecode import SparseDecodeError
from sparsedecode.centroids import BlockCentroids
from sparsedecode.kernels import cpu
from sparsedecode.layout import BlockLayout


@pytest.fixture(autouse=True)
def built():
    assert cpu.library() is not None, cpu.BUILD_ERROR


def random_cache(batch, kv_heads, d, lengths, pads, seed):
    """Random keys and values of a batch holding sequences of ``lengths`` at ``pads``, and the generator."""
    generator = torch.Generator().manual_seed(seed)
    positions = max(p + n for p, n in zip(pads, lengths)) + 3
    keys = torch.randn(batch, kv_heads, positions, d, generator=generator)
    values = torch.randn(batch, kv_heads, positions, d, generator=generator)
    return keys, values, generator


CASES = [
    # query heads, KV heads, head dim, lengths, blocks
    (9, 3, 64, (2000, 1200, 900, 1999), 8),
    (4, 2, 16, (300, 150, 97 + 16, 233), 2),
    (6, 2, 12, (400, 333, 250), 3),  # a head dim that is not a multiple of 8
    (8, 1, 32, (200, 190, 181), 6),  # short last blocks, likely chosen
    (6, 3, 24, (500, 517), 5),  # one of 16 + 8
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:3])) + f"-{len(c[3])}rows")
def test_batch_call_equals_single_calls_sequence_by_sequence(case, threads):
    query_heads, kv_heads, d, lengths, b = case
    batch = len(lengths) + 1  # one sequence of the batch is not served by the call (a dense row)
    pads = [7 * i for i in range(len(lengths))]
    keys, values, generator = random_cache(batch, kv_heads, d, lengths, pads, seed=sum(lengths))
    q = 3 * torch.randn(batch, query_heads, d, generator=generator)
    out = torch.full((batch, query_heads, d), 123.0)
    rows, expected = [], []
    for i, (pad, n) in enumerate(zip(pads, lengths)):
        layout = BlockLayout(n=n, window=64, block_size=16)
        k_i, v_i = keys[i + 1, :, pad:], values[i + 1, :, pad:]
        cache = BlockCentroids(16)
        fresh = i % 2 == 0
        blocks = cpu.select_mean_pooled(q[i + 1], k_i, cache.update(k_i, layout.n_full), layout, b)
        if fresh:
            chosen = torch.full_like(blocks, -1)
        else:  # reused blocks, in any order, one outside the distant region (read as nothing)
            blocks = torch.randint(0, layout.n_blocks, (kv_heads, b), generator=generator)
            blocks[0, 0] = layout.n_blocks + 5
            chosen = blocks.clone()
        expected.append((blocks, cpu.attend_support(q[i + 1], k_i, v_i, blocks, layout, d**-0.5)))
        rows.append((i + 1, pad, n, cache.storage(), chosen, fresh))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        cpu.sparse_step_batch(q, keys, values, out, rows, 64, 16, d**-0.5)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(out[0], torch.full((query_heads, d), 123.0))  # a row not named is not written
    for i, ((*_, chosen, _), (blocks, single)) in enumerate(zip(rows, expected)):
        assert torch.equal(chosen, blocks)
        assert torch.equal(out[i + 1], single)  # the same attention code over the same support


def test_batch_call_refuses_rows_it_cannot_read():
    keys = torch.randn(2, 2, 300, 16)
    q, out = torch.randn(2, 4, 16), torch.empty(2, 4, 16)
    cache = BlockCentroids(16)
    layout = BlockLayout(n=250, window=64, block_size=16)
    cache.update(keys[0], layout.n_full)
    blocks = torch.zeros(2, 2, dtype=torch.int64)

    def call(row, k=keys, query=q):
        cpu.sparse_step_batch(query, k, k, out, [row], 64, 16, 0.25)

    call((0, 50, 250, cache.storage(), blocks, True))  # fits
    with pytest.raises(SparseDecodeError, match="positions"):
        call((0, 51, 250, cache.storage(), blocks, True))  # one position past the cache
    with pytest.raises(SparseDecodeError, match="positions"):
        call((2, 0, 250, cache.storage(), blocks, True))  # no such sequence
    with pytest.raises(SparseDecodeError, match="centroid"):
        call((0, 0, 250, torch.zeros(2, 16, 10), blocks, True))  # 11 full blocks, storage for 10
    with pytest.raises(SparseDecodeError, match="centroid"):
        call((0, 0, 250, torch.zeros(2, 10, 16).transpose(1, 2), blocks, True))  # the block stride is not 1
    with pytest.raises(SparseDecodeError, match="centroid"):
        call((0, 0, 250, None, blocks, True))
    with pytest.raises(SparseDecodeError, match="int64"):
        call((0, 0, 250, cache.storage(), blocks.int(), False))
    with pytest.raises(SparseDecodeError, match="blocks asked"):
        call((0, 0, 90, cache.storage(), torch.zeros(2, 3, dtype=torch.int64), True))  # 2 blocks in all
    with pytest.raises(SparseDecodeError, match="float32"):
        call((0, 0, 250, cache.storage(), blocks, True), k=keys.double(), query=q.double())
    with pytest.raises(SparseDecodeError, match="contiguous"):
        call((0, 0, 250, cache.storage(), blocks, True), query=q.transpose(0, 1).contiguous().transpose(0, 1))
