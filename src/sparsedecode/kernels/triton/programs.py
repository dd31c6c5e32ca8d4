"""Triton kernels of the sparse decode step (imported only by :mod:`sparsedecode.kernels.triton.attention` and
:mod:`sparsedecode.kernels.triton.paged`).

``support_attention_kernel``: one program per (KV head, split) walks its share of the support tiles (tile 0 is
the anchor, then the window in tiles of ``BLOCK`` positions, then the chosen blocks), loads each tile's keys and
values straight from the KV cache (no gathered copy), and keeps a flash-decoding online softmax for all the query
heads of the group at once. With one split it writes the normalised output; otherwise ``combine_kernel`` merges
the splits' partial sums. Scores are in log2 units (the scale carries log2(e)), accumulation is float32.

``paged_attention_kernel``: the same attention for a batch of sequences over a paged cache (vLLM's), one program
per (sequence, support row, split), each position of the support read through the sequence's block table.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_tile(q, k, v, valid, m_i, l_i, acc, scale_log2, IEEE: tl.constexpr):
    """One tile of the flash-decoding online softmax: scores of ``q (G, d)`` against the tile's keys (``valid``
    positions only), the running maximum, sum and weighted values updated; returns ``(m_i, l_i, acc)``. A tile with no
    valid position leaves them as they were (``m_i`` starts finite)."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def store_rows(out_ptr, acc_ptr, m_ptr, l_ptr, out_rows, live_rows, dims, acc, m_i, l_i, split, SPLITS: tl.constexpr,
               HEAD_DIM: tl.constexpr):  # fmt: skip
    """A program's result for output rows ``out_rows``: normalised when it is the only split, else its partial sums
    for :func:`combine_kernel`."""
    if SPLITS == 1:
        tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :], acc / l_i[:, None], mask=live_rows[:, None])
    else:
        slot = out_rows * SPLITS + split
        tl.store(acc_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc, mask=live_rows[:, None])
        tl.store(m_ptr + slot, m_i, mask=live_rows)
        tl.store(l_ptr + slot, l_i, mask=live_rows)


@triton.jit
def support_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    blocks_ptr,
    out_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    n,
    distant_end,
    n_chosen,
    scale_log2,
    stride_qh,
    stride_qg,
    stride_kh,
    stride_kn,
    stride_vh,
    stride_vn,
    stride_bh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    WINDOW_TILES: tl.constexpr,
    SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):
    head = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    offsets = tl.arange(0, BLOCK)
    live_rows = rows < GROUP
    q = tl.load(
        q_ptr + head * stride_qh + rows[:, None] * stride_qg + dims[None, :], mask=live_rows[:, None], other=0.0
    )
    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)  # finite: a tile with no valid position leaves the state alone
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    tiles = 1 + WINDOW_TILES + n_chosen
    for tile in range(split, tiles, SPLITS):
        is_window = tile <= WINDOW_TILES
        chosen = tl.maximum(tile - 1 - WINDOW_TILES, 0)
        block = tl.load(blocks_ptr + head * stride_bh + chosen, mask=tile > WINDOW_TILES, other=0).to(tl.int32)
        start = tl.where(tile == 0, 0, tl.where(is_window, distant_end + (tile - 1) * BLOCK, 1 + block * BLOCK))
        limit = tl.where(tile == 0, 1, tl.where(is_window, n, distant_end))
        positions = start + offsets
        # [lowest, limit) is the anchor, the window or the distant region: a block index outside [0, n_blocks)
        # (negative or past the region) reads nothing
        lowest = tl.where(tile == 0, 0, tl.where(is_window, distant_end, 1))
        valid = (positions >= lowest) & (positions < limit)
        k = tl.load(
            k_ptr + head * stride_kh + positions[:, None] * stride_kn + dims[None, :], mask=valid[:, None], other=0.0
        )
        v = tl.load(
            v_ptr + head * stride_vh + positions[:, None] * stride_vn + dims[None, :], mask=valid[:, None], other=0.0
        )
        m_i, l_i, acc = online_softmax_tile(q, k, v, valid, m_i, l_i, acc, scale_log2, IEEE)
    store_rows(out_ptr, acc_ptr, m_ptr, l_ptr, head * GROUP + rows, live_rows, dims, acc, m_i, l_i, split, SPLITS,
               HEAD_DIM)  # fmt: skip


@triton.jit
def combine_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr
):
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    live = splits < SPLITS
    m = tl.load(m_ptr + row * SPLITS + splits, mask=live, other=-1.0e30)
    l_part = tl.load(l_ptr + row * SPLITS + splits, mask=live, other=0.0)
    acc = tl.load(acc_ptr + (row * SPLITS + splits[:, None]) * HEAD_DIM + dims[None, :], mask=live[:, None], other=0.0)
    weights = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(acc * weights[:, None], 0) / tl.sum(l_part * weights, 0)
    tl.store(out_ptr + row * HEAD_DIM + dims, out)


@triton.jit
def mean_pooled_scores_kernel(
    q_ptr,
    c_ptr,
    k_ptr,
    scores_ptr,
    n_full,
    n_blocks,
    distant_end,
    stride_qh,
    stride_qg,
    stride_ch,
    stride_cb,
    stride_cd,
    stride_kh,
    stride_kn,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
):
    """<group mean query, block centroid> for TILE blocks of one KV head; the short tail block (index n_full,
    not in the centroid cache) is averaged from its keys by the program whose tile holds it."""
    head = tl.program_id(0)
    tile = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + head * stride_qh + rows[:, None] * stride_qg + dims[None, :], mask=(rows < GROUP)[:, None], other=0.0
    )
    q_mean = tl.sum(q.to(tl.float32), 0) / GROUP
    blocks = tile * TILE + tl.arange(0, TILE)
    centroids = tl.load(
        c_ptr + head * stride_ch + blocks[:, None] * stride_cb + dims[None, :] * stride_cd,
        mask=(blocks < n_full)[:, None],
        other=0.0,
    )
    scores = tl.sum(centroids * q_mean[None, :], 1)
    if (n_blocks > n_full) & (n_full >= tile * TILE) & (n_full < tile * TILE + TILE):
        offsets = tl.arange(0, BLOCK)
        positions = 1 + n_full * BLOCK + offsets
        valid = positions < distant_end
        tail = tl.load(
            k_ptr + head * stride_kh + positions[:, None] * stride_kn + dims[None, :], mask=valid[:, None], other=0.0
        )
        tail_mean = tl.sum(tail.to(tl.float32), 0) / tl.sum(valid.to(tl.float32), 0)
        scores = tl.where(blocks == n_full, tl.sum(tail_mean * q_mean, 0), scores)
    tl.store(scores_ptr + head * n_blocks + blocks, scores, mask=blocks < n_blocks)


@triton.jit
def top_blocks_kernel(scores_ptr, out_ptr, n_blocks, CHOSEN: tl.constexpr, BLOCKS_PAD: tl.constexpr):
    """The CHOSEN best scores of one KV head by repeated argmax (ties: the lowest index first)."""
    head = tl.program_id(0)
    offsets = tl.arange(0, BLOCKS_PAD)
    scores = tl.load(scores_ptr + head * n_blocks + offsets, mask=offsets < n_blocks, other=float("-inf"))
    for i in range(CHOSEN):
        best = tl.argmax(scores, 0, tie_break_left=True)
        tl.store(out_ptr + head * CHOSEN + i, best)
        scores = tl.where(offsets == best, float("-inf"), scores)


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, index_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, support, scale_log2, rows_per_seq,
    stride_qr, stride_qh, stride_kp, stride_kh, stride_ko, stride_kd, stride_vp, stride_vh, stride_vo, stride_vd,
    stride_tr, stride_ir, stride_iw, HEADS_PER_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr
):  # fmt: skip
    """One program per (sequence, support row, split): the row's ``GROUP`` query heads attend over its positions
    ``index[seq, row, :]`` (``-1``: none), each read through the sequence's block table from its page (``PAGE``
    positions a page; keys and values addressed by page, KV head, offset, dim strides: any paged layout), in tiles
    of ``TILE`` positions with the online softmax of :func:`online_softmax_tile`."""
    seq = tl.program_id(0)
    row = tl.program_id(1)
    split = tl.program_id(2)
    head = row // HEADS_PER_KV  # the row's KV head (a row per query head reads its group's KV head)
    group_rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    offsets = tl.arange(0, TILE)
    live_rows = group_rows < GROUP
    q_heads = row * GROUP + group_rows
    q = tl.load(
        q_ptr + seq * stride_qr + q_heads[:, None] * stride_qh + dims[None, :], mask=live_rows[:, None], other=0.0
    )
    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile in range(split, tl.cdiv(support, TILE), SPLITS):
        slots = tile * TILE + offsets
        positions = tl.load(index_ptr + seq * stride_ir + row * stride_iw + slots, mask=slots < support, other=-1).to(
            tl.int64
        )
        valid = positions >= 0
        at = tl.where(valid, positions, 0)
        page = tl.load(table_ptr + seq * stride_tr + at // PAGE, mask=valid, other=0).to(tl.int64)
        offset = at % PAGE
        k = tl.load(
            k_ptr
            + page[:, None] * stride_kp
            + head * stride_kh
            + offset[:, None] * stride_ko
            + dims[None, :] * stride_kd,
            mask=valid[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ptr
            + page[:, None] * stride_vp
            + head * stride_vh
            + offset[:, None] * stride_vo
            + dims[None, :] * stride_vd,
            mask=valid[:, None],
            other=0.0,
        )
        m_i, l_i, acc = online_softmax_tile(q, k, v, valid, m_i, l_i, acc, scale_log2, IEEE)
    out_rows = (seq * rows_per_seq + row) * GROUP + group_rows
    store_rows(out_ptr, acc_ptr, m_ptr, l_ptr, out_rows, live_rows, dims, acc, m_i, l_i, split, SPLITS, HEAD_DIM)
