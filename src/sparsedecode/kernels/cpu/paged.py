"""The C kernel's attention through vLLM's CPU pages (``csrc/paged.h``): every sparse row of a layer call in one
call, its support's keys and values read in place through the row's block table (the page-list form of
:func:`sparsedecode.integrations.vllm.step.attend_supports`, which is its torch reference)."""

from __future__ import annotations

import ctypes

import torch

from . import DTYPES, check_status, library
from .functions import c_function

_ARGS = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 8 + [ctypes.c_float]
         + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64])  # fmt: skip


def paged_refusal(queries: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """Why the C kernel cannot attend over these pages (``None`` if it can)."""
    if library() is None:
        return "the C kernel could not be built here"
    if kv_cache.dtype not in DTYPES or queries.dtype != kv_cache.dtype:
        return f"the C kernel reads float32, bfloat16 or float16 pages and queries alike, got {kv_cache.dtype}"
    if not (kv_cache.is_cpu and kv_cache.is_contiguous()):
        return "the pages are not one contiguous CPU tensor"
    return None


def attend_paged(queries, kv_cache, tables, index, valid, scale: float) -> torch.Tensor:
    """``queries (R, H, d)``, ``kv_cache (pages, kv, P, 2 d)``, ``tables (R, width)``, ``index``/``valid (R, rows, S)``
    (``valid`` ``None``: all valid): ``(R, H, d)`` float32 (see ``csrc/paged.h``; callers check
    :func:`paged_refusal` first)."""
    n_rows, query_heads, d = queries.shape
    kv, page = kv_cache.shape[1], kv_cache.shape[2]
    rows, support = index.shape[1], index.shape[2]
    rep, qpr = (query_heads // kv, 1) if rows == query_heads and rows != kv else (1, query_heads // kv)
    q = queries.contiguous()
    tables = tables.to(torch.int32).contiguous()
    index = index.to(torch.int64).contiguous()
    mask = None if valid is None else valid.to(torch.uint8).contiguous()
    out = torch.empty(n_rows, query_heads, d, dtype=torch.float32)
    status = c_function("attend_paged", _ARGS)(
        q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), tables.shape[1], index.data_ptr(),
        None if mask is None else mask.data_ptr(), n_rows, rows, rep, qpr, kv, d, page, support, scale,
        torch.get_num_threads(), out.data_ptr(), DTYPES[kv_cache.dtype],
    )  # fmt: skip
    check_status(status)
    return out


_SELECT_ARGS = ([ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 9
                + [ctypes.c_void_p, ctypes.c_int64])  # fmt: skip


def select_paged(queries, kv_cache, pieces, firsts, tables, lengths, *, block: int, window: int, b: int):
    """Every row's mean-dot selection through the pages (``csrc/paged.h``): ``queries (R, H, d)``, ``kv_cache``,
    ``pieces``/``firsts (pages, kv, P / B, d)`` float32 (the pages' piece sums and chunks' first keys), ``tables (R,
    width)``, ``lengths`` the rows' ``N``: blocks ``(R, kv, b)`` ascending, ``-1`` where a row has fewer than ``b``
    blocks."""
    n_rows, query_heads, d = queries.shape
    kv, page = kv_cache.shape[1], kv_cache.shape[2]
    q = queries.contiguous()
    tables = tables.to(torch.int32).contiguous()
    lengths = torch.as_tensor(lengths, dtype=torch.int64).contiguous()
    pieces, firsts = pieces.contiguous(), firsts.contiguous()
    blocks = torch.empty(n_rows, kv, b, dtype=torch.int64)
    if b == 0:  # nothing to choose (and an empty tensor's pointer is NULL)
        return blocks
    status = c_function("select_paged", _SELECT_ARGS)(
        q.data_ptr(), kv_cache.data_ptr(), pieces.data_ptr(), firsts.data_ptr(), tables.data_ptr(), tables.shape[1],
        lengths.data_ptr(), n_rows, kv, query_heads // kv, d, page, block, window, b, torch.get_num_threads(),
        blocks.data_ptr(), DTYPES[kv_cache.dtype],
    )  # fmt: skip
    check_status(status)
    return blocks


_BLOCKS_ARGS = ([ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 10
                + [ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64])  # fmt: skip


def attend_paged_blocks(queries, kv_cache, tables, blocks, lengths, *, window: int, block: int, scale: float):
    """:func:`attend_paged` over the supports of chosen ``blocks (R, kv, b)`` (``-1``: none; ``b`` may be 0), the
    positions made in the call from the rows' ``lengths``: ``(R, H, d)`` float32."""
    n_rows, query_heads, d = queries.shape
    kv, page = kv_cache.shape[1], kv_cache.shape[2]
    q = queries.contiguous()
    tables = tables.to(torch.int32).contiguous()
    if blocks.shape[2] == 0:  # b = 0 (support 1 + W): an empty tensor's pointer is NULL, the kernel's "no blocks"
        blocks = torch.full((*blocks.shape[:2], 1), -1, dtype=torch.int64)
    blocks = blocks.to(torch.int64).contiguous()
    lengths = torch.as_tensor(lengths, dtype=torch.int64).contiguous()
    out = torch.empty(n_rows, query_heads, d, dtype=torch.float32)
    status = c_function("attend_paged_blocks", _BLOCKS_ARGS)(
        q.data_ptr(), kv_cache.data_ptr(), tables.data_ptr(), tables.shape[1], blocks.data_ptr(), lengths.data_ptr(),
        n_rows, kv, 1, query_heads // kv, kv, d, page, blocks.shape[2], window, block, scale, torch.get_num_threads(),
        out.data_ptr(), DTYPES[kv_cache.dtype],
    )  # fmt: skip
    check_status(status)
    return out
