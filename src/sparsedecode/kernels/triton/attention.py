"""Optional Triton path for a sparse step on CUDA (block selectors): mean-pooled selection and attention.

:func:`support_attention` computes exactly what :func:`sparsedecode.session.attend_support` computes (softmax
attention of every query head over its KV head's anchor, chosen blocks and window), but in one fused kernel that
reads the support straight from the KV cache instead of gathering a copy and calling SDPA, plus a small kernel
merging the splits (flash-decoding: the support is split over several programs per KV head so a GPU has enough
work in flight at batch size 1). It reads ``2 * kv_heads * S * d`` cache elements and allocates only
``query_heads * splits * (d + 2)`` floats per call, whatever the context. :func:`mean_pooled_top_blocks` scores
and picks the blocks in two more kernels.

Which kernel serves a step is decided in :mod:`sparsedecode.kernels.dispatch`: ``kernel="auto"`` takes these on a
CUDA device, ``"triton"`` insists (and may use Triton's interpreter on CPU tensors under ``TRITON_INTERPRET=1``,
set before the first call: that is how the tests check them without a GPU). What the kernels assume, all checked
first (:func:`refusal`, :func:`sparsedecode.kernels.check_inputs` and the entry points below):

* Triton installed; a CUDA device, or the interpreter on the CPU; query, cache, blocks and centroids on it (the
  launch runs under that device);
* the block size and the head dim powers of two >= 16 (``tl.arange`` needs powers of two, ``tl.dot`` at least
  16 along every dimension), the head dim at most :data:`MAX_HEAD_DIM` and a ``B x d`` tile of the cache at most
  :data:`MAX_TILE_BYTES` (the limits of on-chip memory the kernels are written for; larger ones are untested);
* float32, float16 or bfloat16, keys and values of one dtype (``tl.dot`` takes two operands of one type);
* the value head dim equal to the key head dim and to the query's (one ``HEAD_DIM`` for every tile);
* each key and value row contiguous (the head dim is indexed with stride 1); any head and position strides;
* every element offset into the cache below 2**31 (the kernels compute offsets in 32-bit integers);
* query heads a multiple of KV heads; the cache holding at least the layout's ``n`` positions;
* blocks ``(kv, b)``; an index outside ``[0, n_blocks)`` reads nothing (clamped here, masked in the kernel);
* selection only: at most :data:`MAX_TRITON_BLOCKS` distant blocks (one tile of scores per KV head), centroids
  ``(kv, >= n_full, d)`` float32 (any strides).

Batches: these kernels serve one sequence per launch. A batch on CUDA is served sequence by sequence (the
per-sequence loop of :mod:`sparsedecode.session`, each sequence on its own slice of the cache: its own
launches per sparse sequence and layer); only the C kernel has a batched entry point
(:func:`sparsedecode.kernels.cpu.batch.sparse_step_batch`). A batched launch (a grid over sequences x KV heads x
splits, per-sequence lengths and centroid pointers) is not written yet.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from typing import TYPE_CHECKING

import torch

from ...errors import SparseDecodeError
from ..common import check_inputs, largest_offset

if TYPE_CHECKING:
    from ...layout import BlockLayout

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
"""The largest head dim the kernels take (current models go up to 256)."""
MAX_TILE_BYTES = 16 * 1024
"""The largest ``block_size x head_dim`` tile of keys (or values) the attention kernel loads at once."""
MAX_OFFSET = 2**31 - 1


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def environment_refusal(device: torch.device, block_size: int) -> str | None:
    """Why the Triton kernels cannot run for a cache on ``device`` with blocks of ``block_size``, or ``None``."""
    if not triton_installed():
        return "Triton is not installed (pip install -e '.[gpu]')"
    if device.type != "cuda" and not (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return f"it needs a CUDA device, or TRITON_INTERPRET=1 on the CPU (the cache is on {device})"
    if block_size < 16 or block_size & (block_size - 1):
        return f"its tiles need a power-of-two block size >= 16 (got {block_size})"
    return None


def head_dim_refusal(d: int) -> str | None:
    """Why the kernels' tiles cannot take a head dim of ``d``, or ``None``."""
    if d < 16 or d & (d - 1) or d > MAX_HEAD_DIM:
        return f"its tiles need a power-of-two head dim from 16 to {MAX_HEAD_DIM} (got {d})"
    return None


def interpreter_refusal(device: torch.device, *dtypes: torch.dtype) -> str | None:
    """Why attention over tensors of ``dtypes`` on ``device`` cannot run, or ``None``: Triton's CPU interpreter
    multiplies bfloat16 wrongly (its ``tl.dot``; CUDA is right)."""
    if device.type == "cpu" and torch.bfloat16 in dtypes:
        return "Triton's CPU interpreter multiplies bfloat16 wrongly (its tl.dot; CUDA is right): use float32"
    return None


def usable(device: torch.device, block_size: int) -> bool:
    """Whether the Triton path can run here at all: Triton installed, a CUDA device (or the interpreter on CPU),
    and a block size the kernels tile by. :func:`refusal` checks the tensors of a call too."""
    return environment_refusal(device, block_size) is None


def refusal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None, layout: BlockLayout) -> str | None:
    """Why the Triton kernels cannot serve these tensors (``values=None``: selection alone), or ``None``.

    Shapes are checked by :func:`~sparsedecode.kernels.check_inputs`; this is what the kernels add to them.
    """
    d = keys.shape[-1]
    reason = environment_refusal(keys.device, layout.block_size) or head_dim_refusal(d)
    if reason is not None:
        return reason
    dtype = keys.dtype
    if dtype not in DTYPES or q.dtype not in DTYPES or (values is not None and values.dtype != dtype):
        got = f"query {q.dtype}, keys {dtype}" + ("" if values is None else f", values {values.dtype}")
        return f"it takes float32, float16 or bfloat16, keys and values alike ({got.replace('torch.', '')})"
    if values is not None and values.shape[-1] != d:
        return f"it needs the value head dim equal to the key head dim (keys {d}, values {values.shape[-1]})"
    reason = None if values is None else interpreter_refusal(keys.device, q.dtype, dtype, values.dtype)
    if reason is not None:
        return reason
    if keys.stride()[-1] != 1 or (values is not None and values.stride()[-1] != 1):
        strides = f"keys {keys.stride()[-1]}" + ("" if values is None else f", values {values.stride()[-1]}")
        return f"it reads each key and value row as contiguous elements (head-dim strides: {strides})"
    if layout.block_size * d * keys.element_size() > MAX_TILE_BYTES:
        return (
            f"a {layout.block_size} x {d} tile of {str(dtype).replace('torch.', '')} exceeds the "
            f"{MAX_TILE_BYTES // 1024} KiB the kernel is written for"
        )
    if largest_offset(keys) > MAX_OFFSET or (values is not None and largest_offset(values) > MAX_OFFSET):
        return "the cache spans more than 2**31 elements per layer (the kernels use 32-bit offsets)"
    return None


def _require(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None, layout: BlockLayout) -> None:
    check_inputs(q, keys, values, layout)
    reason = refusal(q, keys, values, layout)
    if reason is not None:
        raise SparseDecodeError(f"the Triton kernels cannot run on these tensors: {reason}")


def on_device(device: torch.device):
    """Launch on the cache's device (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


MAX_TRITON_BLOCKS = 1 << 15
"""Above this many distant blocks (512K positions at B = 16) selection stays with torch's top-k."""


def mean_pooled_top_blocks(
    q: torch.Tensor, keys: torch.Tensor, centroids: torch.Tensor, layout: BlockLayout, b: int
) -> torch.Tensor:
    """The ``b`` best distant blocks per KV head by the mean-pooled score, ``(kv, b)`` int64, best first.

    ``q (H, d)``, ``keys (kv, >= n, d)``, ``centroids (kv, n_full, d)`` float32 (the cached ones, any strides).
    Two kernels and no host synchronisation: scores for every block (the short tail block averaged from its keys
    on the fly), then ``b`` rounds of argmax per KV head, ties to the lowest index as
    :func:`sparsedecode.selectors.top_blocks`; the same set, in score order rather than ascending. Checks every
    assumption first (:class:`~sparsedecode.errors.SparseDecodeError` if one fails).
    """
    _require(q, keys, None, layout)
    if layout.n_blocks > MAX_TRITON_BLOCKS:
        raise SparseDecodeError(f"Triton selection takes at most {MAX_TRITON_BLOCKS} blocks (got {layout.n_blocks})")
    return run_selection(q, keys, centroids, layout, b)


def run_selection(
    q: torch.Tensor, keys: torch.Tensor, centroids: torch.Tensor, layout: BlockLayout, b: int
) -> torch.Tensor:
    """:func:`mean_pooled_top_blocks` on tensors the dispatch has checked (:func:`refusal`, shapes, block count)."""
    from . import programs as kernels

    query_heads, d = q.shape
    kv_heads = keys.shape[0]
    group = query_heads // kv_heads
    n_blocks = layout.n_blocks
    if b >= n_blocks:
        return torch.arange(n_blocks, device=keys.device).expand(kv_heads, -1)
    if b <= 0:
        return torch.zeros(kv_heads, 0, dtype=torch.long, device=keys.device)
    if not (
        centroids.dim() == 3
        and centroids.device == keys.device
        and centroids.dtype == torch.float32
        and centroids.shape[0] == kv_heads
        and centroids.shape[1] >= layout.n_full
        and centroids.shape[2] == d
        and largest_offset(centroids) <= MAX_OFFSET
    ):
        raise SparseDecodeError(
            f"centroids must be float32 ({kv_heads}, >= {layout.n_full}, {d}) on {keys.device}; got "
            f"{tuple(centroids.shape)} {centroids.dtype} on {centroids.device}"
        )
    qg = q.reshape(kv_heads, group, d).contiguous()
    scores = torch.empty(kv_heads, n_blocks, dtype=torch.float32, device=keys.device)
    tile = 64
    chosen = torch.empty(kv_heads, b, dtype=torch.int32, device=keys.device)
    with on_device(keys.device):
        kernels.mean_pooled_scores_kernel[(kv_heads, -(-n_blocks // tile))](
            qg,
            centroids,
            keys,
            scores,
            layout.n_full,
            n_blocks,
            layout.distant_end,
            qg.stride(0),
            qg.stride(1),
            centroids.stride(0),
            centroids.stride(1),
            centroids.stride(2),
            keys.stride(0),
            keys.stride(1),
            GROUP=group,
            GROUP_PAD=max(2, triton_next_power_of_2(group)),
            HEAD_DIM=d,
            BLOCK=layout.block_size,
            TILE=tile,
        )
        kernels.top_blocks_kernel[(kv_heads,)](
            scores, chosen, n_blocks, CHOSEN=b, BLOCKS_PAD=triton_next_power_of_2(n_blocks)
        )
    return chosen.long()


def default_splits(tiles: int, kv_heads: int, device: torch.device) -> int:
    """Splits per KV head: enough programs to occupy every multiprocessor once, never more than the tiles."""
    if device.type != "cuda":
        return min(tiles, 4)
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(tiles, -(-processors // kv_heads)))


def support_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    layout: BlockLayout,
    scale: float,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention over anchor + ``blocks`` + window: ``q (H, d)``, ``keys/values (kv, >= n, d)``, ``blocks (kv, b)``.

    Returns ``(H, d)`` float32, as :func:`sparsedecode.session.attend_support`. Positions of a chosen short last
    block past the distant region are masked inside the kernel. Float32 caches are multiplied in IEEE float32
    (no TF32); half-precision caches multiply in their own precision and accumulate in float32. Checks every
    assumption first (:class:`~sparsedecode.errors.SparseDecodeError` if one fails).
    """
    _require(q, keys, values, layout)
    return run_attention(q, keys, values, blocks, layout, scale, splits=splits)


def run_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    layout: BlockLayout,
    scale: float,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """:func:`support_attention` on tensors the dispatch has checked (:func:`refusal` and shapes)."""
    from . import programs as kernels

    query_heads, d = q.shape
    kv_heads = keys.shape[0]
    if blocks.dim() != 2 or blocks.shape[0] != kv_heads:
        raise SparseDecodeError(f"blocks must be ({kv_heads}, b), one row per KV head; got {tuple(blocks.shape)}")
    if splits is not None and splits < 1:
        raise SparseDecodeError(f"splits must be >= 1 (got {splits})")
    group = query_heads // kv_heads
    block = layout.block_size
    window_tiles = -(-layout.window // block)
    tiles = 1 + window_tiles + blocks.shape[1]
    splits = splits or default_splits(tiles, kv_heads, keys.device)
    ieee = keys.dtype == torch.float32
    qg = q.to(keys.dtype).reshape(kv_heads, group, d).contiguous()
    # clamped before the cast so an index past int32 cannot wrap into the region; the kernel reads nothing for one
    # outside [0, n_blocks)
    chosen = blocks.to(keys.device).clamp(-1, layout.n_blocks).to(torch.int32).contiguous()
    out = torch.empty(query_heads, d, dtype=torch.float32, device=keys.device)
    if splits > 1:
        acc = torch.empty(query_heads, splits, d, dtype=torch.float32, device=keys.device)
        m = torch.empty(query_heads, splits, dtype=torch.float32, device=keys.device)
        l_sum = torch.empty_like(m)
    else:
        acc = m = l_sum = out  # unused by the kernel when it writes the output itself
    with on_device(keys.device):
        kernels.support_attention_kernel[(kv_heads, splits)](
            qg,
            keys,
            values,
            chosen,
            out,
            acc,
            m,
            l_sum,
            layout.n,
            layout.distant_end,
            blocks.shape[1],
            scale * math.log2(math.e),
            qg.stride(0),
            qg.stride(1),
            keys.stride(0),
            keys.stride(1),
            values.stride(0),
            values.stride(1),
            max(chosen.stride(0), 1),
            GROUP=group,
            GROUP_PAD=max(16, triton_next_power_of_2(group)),
            HEAD_DIM=d,
            BLOCK=block,
            WINDOW_TILES=window_tiles,
            SPLITS=splits,
            IEEE=ieee,
        )
        if splits > 1:
            kernels.combine_kernel[(query_heads,)](
                acc, m, l_sum, out, SPLITS=splits, SPLITS_PAD=triton_next_power_of_2(splits), HEAD_DIM=d
            )
    return out


def triton_next_power_of_2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()
