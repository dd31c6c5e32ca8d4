"""``bench op``: one decode-attention call on synthetic post-RoPE queries/keys/values, timed: torch SDPA dense
against the sparse step (selection over cached block centroids, then attention over the gathered support), with bytes
touched and the machine's read bandwidth measured in the same run. Consecutive calls cycle through ``layers``
distinct per-layer caches, as a decode step walks every layer: by default the shape's layer count, so that each call
reads what the others evicted from the caches (cold); ``layers=1`` times one layer over and over (warm).

What the calls run on (shapes, synthetic layers, bytes, argument checks) is :mod:`.bench_operator_inputs`; the two
halves of the sparse call timed apart are :mod:`.op_calls`.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

from ..config import SparseConfig
from ..decoding.loop import Progress
from ..kernels import cpu as cpu_kernel
from ..kernels.triton import attention as triton_attention
from ..layout import BlockLayout
from ..memory import available_memory_bytes
from ..session import LayerState, SparseSession, sparse_decode_step
from .bench_measures import cuda_median_time, last_level_cache_bytes, median_time, read_bandwidth_gbs
from .bench_operator_inputs import (
    DEFAULT_CONTEXTS,
    DEFAULT_SUPPORTS,
    OpLayer,
    check_op_args,
    op_bytes,
    op_layer,
    op_layer_bytes,
    plan_layers,
)
from .op_calls import op_calls


def _cycle(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs ``calls`` in turn (0, 1, ..., L - 1, 0, ...): each call's data was last touched
    ``L - 1`` calls ago."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


@dataclass
class OpRow:
    shape: str
    context: int
    support: int
    selector: str
    dtype: str
    dense_ms: float
    sparse_ms: float
    select_ms: float
    attend_ms: float
    bytes_dense: int
    bytes_sparse: int
    bandwidth_gbs: float
    speedup: float
    bound_ratio: float
    dense_bound_ratio: float
    dense_gbs: float
    sparse_gbs: float
    layers: int  # distinct per-layer caches the calls cycled through (1: warm)
    layers_requested: int
    working_set_mb: float  # what the sparse calls read in one cycle through the layers: layers x bytes_sparse
    dense_working_set_mb: float  # the same for dense: layers x bytes_dense
    kernel: str = "torch"
    device: str = "cpu"
    dense_triton_ms: float | None = None
    layers_note: str | None = None  # why fewer layers than requested (memory)
    llc_mb: float | None = None  # the CPU's last-level cache, for comparison with the working sets (CPU only)


def fresh_step(session, state, query, keys, values, n, scale):
    """One whole sparse step at context ``n`` as the next contiguous step (fresh selection, no rebuild)."""
    state.step, state.blocks = 0, None
    return sparse_decode_step(session, state, query, keys, values, n, scale)


@dataclass
class _OpRun:
    """What every row of one :func:`bench_op` call shares: the checked arguments, the timer and the machine's
    figures measured before the first call."""

    name: str
    dims: tuple[int, int, int]
    requested: int
    selector: str
    defaults: SparseConfig  # window and block size: every support's, as in decoding
    dtype: torch.dtype
    device: str
    budget_s: float
    timer: Callable[..., float]
    bandwidth: float
    llc: int | None

    @property
    def element(self) -> int:
        return torch.finfo(self.dtype).bits // 8

    @property
    def scale(self) -> float:
        return self.dims[2] ** -0.5


def bench_op(
    shape: str | tuple[int, ...] = "qwen2-0.5b",
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    supports: tuple[int, ...] = DEFAULT_SUPPORTS,
    *,
    dtype: torch.dtype = torch.float32,
    selector: str = "mean-pooled",
    budget_s: float = 0.6,
    device: str = "cpu",
    kernels: tuple[str, ...] | None = None,
    layers: int | None = None,
    progress: Progress | None = None,
) -> tuple[list[OpRow], float]:
    """Time one decode-attention call per (context, support, kernel); returns rows and the measured bandwidth.

    ``shape`` names a :data:`SHAPES` entry or gives (query heads, KV heads, head dim[, layers]). Calls cycle through
    ``layers`` distinct per-layer caches (default: the shape's layer count), 0, 1, ..., L - 1, 0, ..., as a decode
    step walks every layer, so the working set exceeds the last-level cache the way it does in decoding;
    ``layers=1`` repeats one layer (the warm figure). Where ``layers`` caches would take more than
    :data:`MEMORY_FRACTION` of the memory available, fewer are used and the row says why (``layers_note``). Bytes
    and bounds are per call (one layer's reads, the same for every layer).

    ``kernels`` (``SparseConfig.kernel`` values) default to torch's operations and the fused kernel of the device:
    the C kernel on the CPU (float32, bfloat16 or float16), the Triton kernels on CUDA; torch's alone for token-level
    selectors and adaptive budgets (:mod:`.op_calls`: what each times). ``device="cuda"`` times with
    device events (L2 flushed before every call). Raises :class:`SparseDecodeError` before any work for a support at
    or above a context (nothing sparse to time there), a context or layer count below 1 or a budget that is not
    positive.
    """
    name, dims, requested = check_op_args(
        shape,
        tuple(contexts),
        tuple(supports),
        selector=selector,
        budget_s=budget_s,
        layers=layers,
        dtype=dtype,
        device=device,
    )
    defaults = SparseConfig(selector=selector)  # window and block size: every support's, as in decoding
    kernels = _kernels(kernels, defaults, selector, dtype, device, dims[-1])
    timer = median_time if device == "cpu" else cuda_median_time
    llc = last_level_cache_bytes() if device == "cpu" else None
    bandwidth = read_bandwidth_gbs(device=device)
    run = _OpRun(name, dims, requested, selector, defaults, dtype, device, budget_s, timer, bandwidth, llc)
    rows: list[OpRow] = []
    total = len(contexts) * len(supports) * len(kernels)
    generator = torch.Generator().manual_seed(0)
    for n in contexts:
        for row in _time_context(run, n, supports, kernels, generator):
            rows.append(row)
            if progress:
                progress("bench op", len(rows), total)
        gc.collect()  # the context's layers went with its timings
    return rows, bandwidth


def _kernels(kernels, defaults: SparseConfig, selector: str, dtype: torch.dtype, device: str, d: int):
    """The kernels :func:`bench_op` times: ``kernels`` as given, else torch's operations beside the fused kernel the
    device has, where it takes the head dim ``d`` and ``dtype``; each checked as :class:`SparseConfig` checks it."""
    if kernels is None and not defaults.kernels_serve:  # torch's operations serve them
        kernels = ("torch",)
    elif kernels is None:  # torch's operations beside the fused kernel the device has (the C one on the CPU)
        if device == "cpu":
            kernels = ("torch", "c") if dtype in cpu_kernel.DTYPES and cpu_kernel.library() is not None else ("torch",)
        else:
            fits = dtype in triton_attention.DTYPES and triton_attention.head_dim_refusal(d) is None
            usable = fits and triton_attention.usable(torch.device(device), 16)
            kernels = ("torch", "triton") if usable else ("torch",)
    for kernel in kernels:  # an explicit fused kernel for a token-level selector is refused here, as SparseConfig does
        SparseConfig(selector=selector, kernel=kernel)
    return kernels


def _time_context(run: _OpRun, n: int, supports, kernels, generator) -> Iterator[OpRow]:
    """The rows of context ``n``, one per (support, kernel): the per-layer caches that fit are built, dense is timed
    over them, then each sparse step; the caches go when the rows are done."""
    layout = BlockLayout(n=n, window=run.defaults.window, block_size=run.defaults.block_size)
    count, note = plan_layers(
        run.requested,
        op_layer_bytes(n, run.dims, run.element, run.selector, layout),
        available_memory_bytes(run.device),
    )
    stack = [op_layer(n, run.dims, run.dtype, run.device, run.selector, layout, generator) for _ in range(count)]
    dense_s, dense_triton_s = _time_dense(run, stack, layout, "triton" in kernels)
    for support, kernel in ((s, k) for s in supports for k in kernels):
        cfg, sparse = _time_sparse(run, stack, layout, support, kernel)
        yield _op_row(run, cfg, n, kernel, (count, note), {"dense": dense_s, "dense_triton": dense_triton_s, **sparse})


def _time_dense(run: _OpRun, stack: list[OpLayer], layout: BlockLayout, triton: bool) -> tuple[float, float | None]:
    """Seconds of one dense call over the layers in turn: torch SDPA's, and (``triton``) the split-KV Triton
    kernel's over every position."""
    query_heads, kv_heads, d = run.dims
    # transformers' one-token SDPA path: query heads packed per KV head, no repeat_kv
    dense = _cycle(
        [
            partial(
                F.scaled_dot_product_attention,
                layer.query.view(1, kv_heads, query_heads // kv_heads, d),
                layer.keys,
                layer.values,
                scale=run.scale,
            )
            for layer in stack
        ]
    )
    dense_s = run.timer(dense, budget_s=run.budget_s)
    if not triton:
        return dense_s, None
    # a split-KV dense baseline: the same kernel over every position
    every = torch.arange(layout.n_blocks, device=run.device).expand(kv_heads, -1)
    whole_cache = [
        partial(
            triton_attention.support_attention,
            layer.query[0, :, 0],
            layer.keys[0],
            layer.values[0],
            every,
            layout,
            run.scale,
        )
        for layer in stack
    ]
    return dense_s, run.timer(_cycle(whole_cache), budget_s=run.budget_s)


def _time_sparse(run: _OpRun, stack: list[OpLayer], layout: BlockLayout, support: int, kernel: str):
    """``(config, seconds)``: the seconds of the whole sparse step, of its selection and of its attention at
    ``support`` with ``kernel``, each over the layers in turn."""
    cfg = SparseConfig(support=support, selector=run.selector, kernel=kernel)
    session = SparseSession(config=cfg, model=None)
    n, kv_heads, scale = layout.n, run.dims[1], run.scale
    uses_history = run.defaults.selector.uses_history
    wholes, selects, attends = [], [], []
    for index, layer in enumerate(stack):
        state = LayerState(index, layer.centroids)
        wholes.append(partial(fresh_step, session, state, layer.query, layer.keys, layer.values, n, scale))
        history = state.history_until(n, kv_heads, layer.keys.device).uniform_() if uses_history else None
        select, attend = op_calls(cfg, layer, layout, scale, kernel, history)
        selects.append(select)
        attends.append(attend)
    sparse_s = run.timer(_cycle(wholes), budget_s=run.budget_s)
    select_s = run.timer(_cycle(selects), budget_s=run.budget_s / 2)
    attend_s = run.timer(_cycle(attends), budget_s=run.budget_s / 2)
    return cfg, {"sparse": sparse_s, "select": select_s, "attend": attend_s}


def _op_row(run: _OpRun, cfg: SparseConfig, n: int, kernel: str, layers: tuple, seconds: dict) -> OpRow:
    """One row from the seconds measured (``dense``, ``dense_triton``, ``sparse``, ``select``, ``attend``), the
    bytes a call reads and the layers cycled through (``(count, note)``)."""
    query_heads, kv_heads, d = run.dims
    count, note = layers
    dense_s, sparse_s, dense_triton_s = seconds["dense"], seconds["sparse"], seconds["dense_triton"]
    bandwidth = run.bandwidth
    bytes_dense, bytes_sparse = op_bytes(cfg, n, kv_heads, query_heads, d, run.element)
    return OpRow(
        shape=run.name,
        context=n,
        support=cfg.effective_support,
        selector=run.selector,
        dtype=str(run.dtype).removeprefix("torch."),
        dense_ms=dense_s * 1e3,
        sparse_ms=sparse_s * 1e3,
        select_ms=seconds["select"] * 1e3,
        attend_ms=seconds["attend"] * 1e3,
        bytes_dense=bytes_dense,
        bytes_sparse=bytes_sparse,
        bandwidth_gbs=bandwidth,
        speedup=dense_s / sparse_s,
        bound_ratio=sparse_s / (bytes_sparse / (bandwidth * 1e9)),
        dense_bound_ratio=dense_s / (bytes_dense / (bandwidth * 1e9)),
        dense_gbs=bytes_dense / dense_s / 1e9,
        sparse_gbs=bytes_sparse / sparse_s / 1e9,
        layers=count,
        layers_requested=run.requested,
        working_set_mb=count * bytes_sparse / 1e6,
        dense_working_set_mb=count * bytes_dense / 1e6,
        kernel=kernel,
        device=run.device,
        dense_triton_ms=None if dense_triton_s is None else dense_triton_s * 1e3,
        layers_note=note,
        llc_mb=None if run.llc is None else run.llc / 1e6,
    )


def op_rows_as_dicts(rows: list[OpRow]) -> list[dict]:
    return [asdict(row) for row in rows]
