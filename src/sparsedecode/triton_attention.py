"""Optional Triton path for the attention half of a sparse step on CUDA (block selectors).

:func:`support_attention` computes exactly what :func:`sparsedecode.attention.attend_support` computes (softmax
attention of every query head over its KV head's anchor, chosen blocks and window), but in one fused kernel that
reads the support straight from the KV cache instead of gathering a copy and calling SDPA, plus a small kernel
merging the splits (flash-decoding: the support is split over several programs per KV head so a GPU has enough
work in flight at batch size 1). It reads ``2 * kv_heads * S * d`` cache elements and allocates only
``query_heads * splits * (d + 2)`` floats per call, whatever the context.

It is used when the KV cache lives on a CUDA device, Triton is importable and ``SparseConfig.kernel`` is
``"auto"`` or ``"triton"``; the CPU path never needs it. Under ``TRITON_INTERPRET=1`` (set before the first call)
the same kernels run on CPU tensors through Triton's interpreter, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import TYPE_CHECKING

import torch

from .errors import SparseDecodeError

if TYPE_CHECKING:  # selectors imports this module
    from .selectors import BlockLayout


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def usable(device: torch.device, block_size: int) -> bool:
    """Whether the Triton path can run here: Triton installed, a CUDA device (or the interpreter on CPU), and a
    block size the kernel tiles by (a power of two, at least 16)."""
    if not triton_installed() or block_size < 16 or block_size & (block_size - 1):
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def wanted(kernel: str, device: torch.device, block_size: int) -> bool:
    """Whether a step with ``SparseConfig.kernel == kernel`` on ``device`` should run the Triton kernels."""
    return (kernel == "triton" or (kernel == "auto" and device.type == "cuda")) and usable(device, block_size)


MAX_TRITON_BLOCKS = 1 << 15
"""Above this many distant blocks (512K positions at B = 16) selection stays with torch's top-k."""


def mean_pooled_top_blocks(
    q: torch.Tensor, keys: torch.Tensor, centroids: torch.Tensor, layout: BlockLayout, b: int
) -> torch.Tensor:
    """The ``b`` best distant blocks per KV head by the mean-pooled score, ``(kv, b)`` int64, best first.

    ``q (H, d)``, ``keys (kv, >= n, d)``, ``centroids (kv, n_full, d)`` float32 (the cached ones, any strides).
    Two kernels and no host synchronisation: scores for every block (the short tail block averaged from its keys
    on the fly), then ``b`` rounds of argmax per KV head, ties to the lowest index as
    :func:`sparsedecode.selectors.top_blocks`; the same set, in score order rather than ascending.
    """
    from . import _triton_kernels as kernels

    query_heads, d = q.shape
    kv_heads = keys.shape[0]
    group = query_heads // kv_heads
    n_blocks = layout.n_blocks
    if b >= n_blocks:
        return torch.arange(n_blocks, device=keys.device).expand(kv_heads, -1)
    if b == 0:
        return torch.zeros(kv_heads, 0, dtype=torch.long, device=keys.device)
    qg = q.reshape(kv_heads, group, d)
    scores = torch.empty(kv_heads, n_blocks, dtype=torch.float32, device=keys.device)
    tile = 64
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
    chosen = torch.empty(kv_heads, b, dtype=torch.int32, device=keys.device)
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

    Returns ``(H, d)`` float32, as :func:`sparsedecode.attention.attend_support`. Positions of a chosen short last
    block past the distant region are masked inside the kernel. Float32 caches are multiplied in IEEE float32
    (no TF32); half-precision caches multiply in their own precision and accumulate in float32.
    """
    from . import _triton_kernels as kernels  # imports Triton; only reached when usable() said so

    query_heads, d = q.shape
    kv_heads = keys.shape[0]
    if query_heads % kv_heads:
        raise SparseDecodeError(f"{query_heads} query heads cannot share {kv_heads} KV heads evenly")
    if d < 16 or d & (d - 1):
        raise SparseDecodeError(f"the Triton sparse kernel needs a power-of-two head dim >= 16 (got {d})")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise SparseDecodeError("the Triton sparse kernel needs the head dim contiguous in the KV cache")
    group = query_heads // kv_heads
    block = layout.block_size
    window_tiles = -(-layout.window // block)
    tiles = 1 + window_tiles + blocks.shape[1]
    splits = splits or default_splits(tiles, kv_heads, keys.device)
    ieee = keys.dtype == torch.float32
    qg = q.to(keys.dtype).reshape(kv_heads, group, d).contiguous()
    chosen = blocks.to(torch.int32).contiguous()
    out = torch.empty(query_heads, d, dtype=torch.float32, device=keys.device)
    if splits > 1:
        acc = torch.empty(query_heads, splits, d, dtype=torch.float32, device=keys.device)
        m = torch.empty(query_heads, splits, dtype=torch.float32, device=keys.device)
        l_sum = torch.empty_like(m)
    else:
        acc = m = l_sum = out  # unused by the kernel when it writes the output itself
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
