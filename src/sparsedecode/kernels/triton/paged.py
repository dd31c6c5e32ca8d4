"""The Triton form of the sparse step over a paged KV cache (vLLM's): every sequence of a batch attends over its
own support, each position read from its page through the sequence's block table, as FlashInfer's page-table
decode reads a cache; no contiguous copy of the cache or of the support is made.

:func:`paged_support_attention` computes what :func:`sparsedecode.integrations.vllm.step.attend_supports` computes
with torch (gather the support's keys and values, then SDPA): ``queries (R, H, d)``, keys and values as
``(pages, kv_heads, P, d)`` *views* in any strides (vLLM's CUDA layout ``(pages, P, kv, d)`` permuted, or its CPU
``vec`` layout with keys transposed), block tables ``(R, width)``, supports ``index (R, rows, S)`` in each sequence's
own positions with ``valid`` (or ``None``). A support row is a KV head (its ``H / kv`` query heads read it together)
or, for a selector choosing per query head, a query head (``rows == H``). One launch serves the batch: a grid of
sequences x rows x splits, the splits merged by :func:`~.programs.combine_kernel`.

What it assumes, checked first (:func:`paged_refusal`): Triton and a CUDA device (or the interpreter on the CPU
under ``TRITON_INTERPRET=1``), float32, float16 or bfloat16 keys and values alike, a power-of-two head dim from 16 to
:data:`~.attention.MAX_HEAD_DIM` equal for keys, values and queries, and element offsets below 2**31 in each
tensor. Float32 caches multiply in IEEE float32; half-precision ones in their own precision, accumulating in float32.
"""

from __future__ import annotations

import math

import torch

from ...errors import SparseDecodeError
from ..common import largest_offset
from .attention import (
    DTYPES,
    MAX_OFFSET,
    environment_refusal,
    head_dim_refusal,
    interpreter_refusal,
    on_device,
    triton_next_power_of_2,
)

TILE = 16
"""Support positions per tile (``tl.dot`` needs at least 16 along every dimension)."""


def paged_refusal(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> str | None:
    """Why :func:`paged_support_attention` cannot serve these tensors, or ``None``."""
    d = keys.shape[-1]
    reason = environment_refusal(keys.device, TILE) or head_dim_refusal(d)
    if reason is not None:
        return reason
    if keys.dtype not in DTYPES or values.dtype != keys.dtype or queries.dtype not in DTYPES:
        got = f"query {queries.dtype}, keys {keys.dtype}, values {values.dtype}".replace("torch.", "")
        return f"it takes float32, float16 or bfloat16, keys and values alike ({got})"
    reason = interpreter_refusal(keys.device, queries.dtype, keys.dtype, values.dtype)
    if reason is not None:
        return reason
    if values.shape[-1] != d or queries.shape[-1] != d:
        return f"it needs one head dim for queries, keys and values (got {queries.shape[-1]}, {d}, {values.shape[-1]})"
    if max(largest_offset(keys), largest_offset(values)) > MAX_OFFSET:
        return "the cache spans more than 2**31 elements per layer (the kernel uses 32-bit offsets)"
    return None


def paged_support_attention(queries, keys, values, tables, index, valid, scale: float, *, splits: int | None = None):
    """Every sequence's attention over its support, read through its block table: ``(R, H, d)`` float32 (see the
    module). ``index`` positions outside a sequence's table are the caller's to avoid (as for the torch path);
    ``valid`` ``False`` (or an index of ``-1``) reads nothing."""
    from . import programs as kernels

    reason = paged_refusal(queries, keys, values)
    if reason is not None:
        raise SparseDecodeError(f"the Triton kernels cannot run on these tensors: {reason}")
    n_rows, query_heads, d = queries.shape
    pages, kv_heads, page, _ = keys.shape
    rows, support = index.shape[1], index.shape[2]
    if query_heads % kv_heads or rows not in (kv_heads, query_heads) or index.shape[0] != n_rows:
        raise SparseDecodeError(f"supports ({tuple(index.shape)}) must have a row per KV head ({kv_heads}) or per "
                                f"query head ({query_heads}) of each of the {n_rows} sequences")  # fmt: skip
    group = query_heads // rows
    heads_per_kv = rows // kv_heads
    positions = index.to(keys.device, torch.int32)
    if valid is not None:
        positions = torch.where(valid.to(keys.device), positions, -1)
    positions = positions.contiguous()
    table = tables.to(keys.device, torch.int32).contiguous()
    q = queries.to(keys.dtype).contiguous()
    tiles = max(1, -(-support // TILE))
    splits = max(1, min(splits or (1 if keys.device.type != "cuda" else 4), tiles))
    out = torch.empty(n_rows, query_heads, d, dtype=torch.float32, device=keys.device)
    if splits > 1:
        acc = torch.empty(n_rows * query_heads, splits, d, dtype=torch.float32, device=keys.device)
        m = torch.empty(n_rows * query_heads, splits, dtype=torch.float32, device=keys.device)
        l_sum = torch.empty_like(m)
    else:
        acc = m = l_sum = out
    with on_device(keys.device):
        kernels.paged_attention_kernel[(n_rows, rows, splits)](
            q, keys, values, table, positions, out, acc, m, l_sum, support, scale * math.log2(math.e), rows,
            q.stride(0), q.stride(1), *_strides(keys), *_strides(values), table.stride(0), positions.stride(0),
            positions.stride(1), HEADS_PER_KV=heads_per_kv, GROUP=group, HEAD_DIM=d, PAGE=page, TILE=TILE,
            GROUP_PAD=max(16, triton_next_power_of_2(group)), SPLITS=splits, IEEE=keys.dtype == torch.float32,
        )  # fmt: skip
        if splits > 1:
            kernels.combine_kernel[(n_rows * query_heads,)](
                acc, m, l_sum, out, SPLITS=splits, SPLITS_PAD=triton_next_power_of_2(splits), HEAD_DIM=d
            )
    return out


def _strides(view: torch.Tensor) -> tuple[int, int, int, int]:
    """A ``(pages, kv, P, d)`` view's strides, in the kernel's order (page, KV head, offset, dim)."""
    return tuple(view.stride())
