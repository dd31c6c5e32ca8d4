"""What ``bench op`` (:func:`.bench_operator.bench_op`) times its calls on: the attention shapes it knows, one
layer's synthetic decode state, the memory that state takes and how many layers of it fit, the bytes one call must
read, and the checks of its arguments before any work."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..config import SparseConfig
from ..errors import SparseDecodeError
from ..layout import BlockLayout
from ..memory import available_memory_bytes
from ..selectors import resolve_selector
from ..selectors.statistics import BlockStatistics

SHAPES = {
    "qwen2-0.5b": (14, 2, 64),  # query heads, KV heads, head dim (also Qwen2.5-Coder-0.5B)
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
}
SHAPE_LAYERS = {"qwen2-0.5b": 24, "llama3-8b": 32, "smollm2-135m": 30}  # decoder layers: per-layer caches to cycle
DEFAULT_CONTEXTS = (2048, 8192, 32768, 131072)
MEMORY_FRACTION = 0.5  # bench op's per-layer caches take at most this share of the memory available when it starts


DEFAULT_SUPPORTS = (97, 193, 769)


def plan_layers(requested: int, layer_bytes: int, available: int | None) -> tuple[int, str | None]:
    """How many per-layer caches of ``layer_bytes`` to cycle through: ``requested``, or as many as fit in
    :data:`MEMORY_FRACTION` of ``available`` bytes (at least one), with the reason when that is fewer."""
    if available is None:
        return requested, None
    fit = int(MEMORY_FRACTION * available // max(layer_bytes, 1))
    if fit >= requested:
        return requested, None
    layers = max(1, fit)
    return layers, (
        f"{layers} of {requested} layers: {requested} x {layer_bytes / 1e6:.0f} MB would exceed "
        f"{MEMORY_FRACTION:.0%} of the {available / 1e9:.1f} GB available"
    )


@dataclass
class OpLayer:
    """One layer's synthetic decode state: the query and the KV cache of ``(1, KV heads, N, d)``, and the block
    statistics a block selector reads (built once, as after prefill)."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    centroids: BlockStatistics


def op_layer(
    n: int, dims: tuple[int, int, int], dtype, device: str, selector: str, layout: BlockLayout, generator
) -> OpLayer:
    """One layer's :class:`OpLayer` at context ``n`` of ``dims`` (query heads, KV heads, head dim), drawn from
    ``generator``, with the block statistics ``selector`` reads (the mean where it reads none)."""
    query_heads, kv_heads, d = dims
    keys = torch.randn(1, kv_heads, n, d, generator=generator).to(device, dtype)
    values = torch.randn(1, kv_heads, n, d, generator=generator).to(device, dtype)
    query = torch.randn(1, query_heads, 1, d, generator=generator).to(device, dtype)
    statistics = resolve_selector(selector).statistics
    centroids = BlockStatistics(layout.block_size, statistics or ("mean",))
    if statistics:
        centroids.update(keys[0], layout.n_full)
    return OpLayer(query, keys, values, centroids)


def op_layer_bytes(n: int, dims: tuple[int, int, int], element: int, selector: str, layout: BlockLayout) -> int:
    """Memory one :class:`OpLayer` holds: query, keys, values and (block statistics selectors) the statistics."""
    query_heads, kv_heads, d = dims
    kinds = resolve_selector(selector).statistics
    statistics = kv_heads * layout.n_full * len(kinds) * d * 4
    return (2 * kv_heads * n + query_heads) * d * element + statistics


def check_op_args(
    shape: str | tuple[int, ...],
    contexts: tuple[int, ...],
    supports: tuple[int, ...],
    *,
    selector: str = "mean-pooled",
    budget_s: float = 0.6,
    layers: int | None = None,
    kernels: tuple[str, ...] = ("auto",),
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[str, tuple[int, int, int], int]:
    """What :func:`bench_op` checks before any work: (shape name, (query heads, KV heads, head dim), layers to
    request). Raises :class:`SparseDecodeError` (one line) for what would time nothing or nonsense, or for a context
    whose one layer's cache would not fit in :data:`MEMORY_FRACTION` of the memory ``device`` has available."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise SparseDecodeError(f"unknown shape {shape!r}; choose one of: {', '.join(SHAPES)}")
        name, dims, shape_layers = shape, SHAPES[shape], SHAPE_LAYERS[shape]
    else:
        dims = tuple(shape[:3])
        known = next((known for known, given in SHAPES.items() if given == dims), None)
        name = known or "{}q-{}kv-d{}".format(*dims)
        shape_layers = shape[3] if len(shape) > 3 else SHAPE_LAYERS.get(known)
    requested = layers if layers is not None else shape_layers
    if requested is None:
        raise SparseDecodeError(f"bench op: no layer count known for shape {dims}; pass layers")

    def whole(value) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    if not contexts or not supports:
        raise SparseDecodeError("bench op needs at least one context and one support")
    for n in contexts:
        if not whole(n) or n < 1:
            raise SparseDecodeError(f"bench op: contexts must be positive integers (got {n!r})")
    if not isinstance(budget_s, numbers.Real) or isinstance(budget_s, bool) or not math.isfinite(budget_s):
        raise SparseDecodeError(f"bench op: the time budget must be a number of seconds (got {budget_s!r})")
    if budget_s <= 0:
        raise SparseDecodeError(f"bench op: the time budget must be above 0 seconds (got {budget_s!r})")
    if not whole(requested) or requested < 1:
        raise SparseDecodeError(f"bench op: layers must be an integer >= 1 (got {requested!r})")
    for support in supports:
        for kernel in kernels:
            SparseConfig(support=support, selector=selector, kernel=kernel)
        dense = [n for n in contexts if support >= n]
        if dense:
            raise SparseDecodeError(
                f"bench op: support {support} >= context {dense[0]}: decoding attends densely there, so there is no "
                "sparse step to time; give supports below every context"
            )
    available = available_memory_bytes(device) if device == "cpu" or torch.cuda.is_available() else None
    defaults = SparseConfig(selector=selector)  # window and block size: every support's, as in decoding
    for n in contexts:  # one layer must fit, or its allocation fails after the earlier contexts' work
        layout = BlockLayout(n=n, window=defaults.window, block_size=defaults.block_size)
        one_layer = op_layer_bytes(n, dims, torch.finfo(dtype).bits // 8, selector, layout)
        if available is not None and one_layer > MEMORY_FRACTION * available:
            raise SparseDecodeError(
                f"bench op: context {n} needs {one_layer / 1e9:.1f} GB for one layer's cache, more than "
                f"{MEMORY_FRACTION:.0%} of the {available / 1e9:.1f} GB available on {device}: give a shorter context"
            )
    return name, dims, requested


def op_bytes(cfg: SparseConfig, n: int, kv_heads: int, query_heads: int, d: int, element: int) -> tuple[int, int]:
    """Bytes one call must read: dense = all keys and values; sparse = what selection reads + support K/V.

    Selection reads: float32 block statistics and the tail keys for a selector handed statistics (one per
    statistic: mean-pooled one, quest two); a float32 history (one value per position) for one handed a history (H2O);
    otherwise its share of every key (:meth:`~sparsedecode.selectors.Selector.key_fraction`: all of it for the
    oracles, none for random blocks and streaming). Support K/V: one support per KV head, or per query head for a
    selector choosing one per query head (per-head ``quest``, ``twilight``: attended once per member of a group, each
    call reading its own ``S`` positions).
    """
    layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size)
    query = query_heads * d * element
    dense = 2 * kv_heads * n * d * element + query
    selector = cfg.selector
    support = 2 * selector.rows(query_heads, kv_heads) * cfg.effective_support * d * element
    if selector.statistics:
        tail = (layout.distant_end - 1 - layout.n_full * cfg.block_size) * kv_heads * d * element
        statistics = kv_heads * layout.n_full * len(selector.statistics) * d * 4
        selection = statistics + tail
    elif selector.uses_history:
        selection = kv_heads * n * 4
    else:
        selection = round(kv_heads * n * d * element * selector.key_fraction(d))
    return dense, selection + support + query
