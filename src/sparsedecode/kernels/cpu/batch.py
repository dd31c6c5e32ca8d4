"""The C kernel's batched sparse step: every sparse sequence of a layer of a left-padded batch in one call (see
:func:`sparse_step_batch`); the single-sequence calls and the build are in
:mod:`sparsedecode.kernels.cpu`."""

from __future__ import annotations

import array

import torch

from ...errors import SparseDecodeError
from . import centroid_storage, check_status, dtype_code, library, refusal


def sparse_step_batch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    out: torch.Tensor,
    rows: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor, bool]],
    window: int,
    block_size: int,
    scale: float,
) -> None:
    """The sparse step of several sequences of a batch in one call, written into ``out``; what
    :func:`select_mean_pooled` (where a sequence selects afresh) and then :func:`attend_support` compute for each
    sequence alone, in its own coordinates.

    ``q (batch, H, d)``, ``keys``/``values (batch, kv, positions, d)`` of one dtype the C code reads (float32,
    bfloat16 or float16), ``out (batch, H, d)`` float32 contiguous whatever that dtype (only the rows named are
    written). Each entry of ``rows`` is ``(sequence, pad, n, centroids, chosen, fresh)``: sequence ``sequence`` of
    the batch occupies cache positions ``[pad, pad + n)``, its own positions ``0 .. n - 1`` (its layout has ``n``
    positions); ``centroids`` its cache's ``(kv, d, capacity)`` float32 storage
    (:meth:`~sparsedecode.selectors.statistics.BlockStatistics.storage`, holding at least its ``n_full`` blocks; read
    only when ``fresh``); ``chosen`` its ``(kv, b)`` int64 blocks, contiguous: written when ``fresh`` (the ``b <=
    n_blocks`` best, ascending, as :func:`select_mean_pooled`), read as they are otherwise. No two rows may share
    ``chosen`` storage, nor two fresh rows the same output row.

    Bytes read per sequence: the support's keys and values, ``S x kv x d x 2 x e`` (``S = 1 + b*B + W``, ``e`` the
    element size: 4 or 2), plus at a fresh step its ``n_full x kv x d x 4`` float32 centroid bytes and the tail
    block's keys. Checks the tensors and every row first (:class:`~sparsedecode.errors.SparseDecodeError`), so no
    row can move a read outside its tensors.
    """
    if q.dim() != 3 or keys.dim() != 4 or values.dim() != 4:
        raise SparseDecodeError(
            f"expected q (batch, heads, d) and keys/values (batch, kv_heads, positions, d); got {tuple(q.shape)}, "
            f"{tuple(keys.shape)}, {tuple(values.shape)}"
        )
    reason = refusal(q[0], keys[0], values[0])
    if reason is not None:
        raise SparseDecodeError(f"the C kernel cannot run on these tensors: {reason}")
    run_step_batch(q, keys, values, out, rows, window, block_size, scale)


def run_step_batch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    out: torch.Tensor,
    rows: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor, bool]],
    window: int,
    block_size: int,
    scale: float,
) -> None:
    """:func:`sparse_step_batch` on tensors whose device and row strides the dispatch has checked (:func:`refusal`);
    shapes, the dtype and every row are checked here."""
    batch, heads, d = q.shape
    kv_heads = keys.shape[1]
    if window < 1 or block_size < 1:
        raise SparseDecodeError(f"a window and blocks of at least one position; got {window} and {block_size}")
    if not (
        keys.shape[0] == values.shape[0] == batch
        and values.shape[1] == kv_heads
        and keys.shape[3] == values.shape[3] == d
        and kv_heads
        and heads % kv_heads == 0
        and q.is_contiguous()
        and out.shape == q.shape
        and out.dtype == torch.float32
        and out.is_cpu
        and out.is_contiguous()
    ):
        raise SparseDecodeError(
            f"q {tuple(q.shape)}, keys {tuple(keys.shape)}, values {tuple(values.shape)} and out {tuple(out.shape)} "
            "do not fit together (q and out contiguous (batch, heads, d), out float32, heads a multiple of KV heads)"
        )
    code = dtype_code(q, keys, values)
    fields = row_table(q, keys, values, rows, window, block_size)
    if not fields:
        return
    table = array.array("q", fields)
    status = library().sparse_step_batch(
        q.data_ptr(),
        keys.data_ptr(),
        keys.stride(1),
        keys.stride(2),
        values.data_ptr(),
        values.stride(1),
        values.stride(2),
        out.data_ptr(),
        table.buffer_info()[0],
        len(rows),
        kv_heads,
        heads // kv_heads,
        d,
        window,
        block_size,
        scale,
        torch.get_num_threads(),
        code,
    )
    check_status(status)


def row_table(q, keys, values, rows, window: int, block_size: int) -> list[int]:
    """The C call's table of rows (11 integers each), every row checked to stay inside its tensors."""
    batch, heads, d = q.shape
    kv_heads = keys.shape[1]
    positions = min(keys.shape[2], values.shape[2])
    k_batch, k_position = keys.stride(0), keys.stride(2)
    v_batch, v_position = values.stride(0), values.stride(2)
    per_row = heads * d
    fields: list[int] = []
    for sequence, pad, n, centroids, chosen, fresh in rows:
        if not (0 <= sequence < batch and pad >= 0 and n >= 1 and pad + n <= positions):
            raise SparseDecodeError(
                f"row {sequence}: positions [{pad}, {pad + n}) do not lie in a batch of {batch} x {positions}"
            )
        if not (
            chosen.dim() == 2
            and chosen.shape[0] == kv_heads
            and chosen.dtype == torch.int64
            and chosen.is_cpu
            and chosen.is_contiguous()
        ):
            raise SparseDecodeError(
                f"row {sequence}: blocks must be a contiguous ({kv_heads}, b) int64 CPU tensor; got "
                f"{tuple(chosen.shape)} {chosen.dtype} on {chosen.device}"
            )
        b = chosen.shape[1]
        c_pointer = c_head = c_dim = 0
        if fresh and b:
            distant = max(n - window, 1) - 1
            n_full = distant // block_size
            if b > -(-distant // block_size):
                raise SparseDecodeError(f"row {sequence}: {b} blocks asked of {-(-distant // block_size)}")
            c_pointer, c_head, c_dim = centroid_storage(centroids, kv_heads, d, n_full, f"row {sequence}: ")
        fields += (
            sequence * per_row,
            sequence * k_batch + pad * k_position,
            sequence * v_batch + pad * v_position,
            sequence * per_row,
            n,
            c_pointer,
            c_head,
            c_dim,
            chosen.data_ptr(),
            b,
            1 if fresh else 0,
        )
    return fields
