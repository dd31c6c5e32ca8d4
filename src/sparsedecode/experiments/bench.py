"""Benchmarks (DESIGN.md section 4, "Operator timings"): timings live here, never in tests.

* :func:`bench_op`: one decode-attention call on synthetic post-RoPE queries/keys/values: torch SDPA dense against
  the sparse step (selection over cached block centroids, then attention over the gathered support), with bytes
  touched and the machine's read bandwidth measured in the same run. Consecutive calls cycle through ``layers``
  distinct per-layer caches, as a decode step walks every layer: by default the shape's layer count, so that each
  call reads what the others evicted from the caches (cold); ``layers=1`` times one layer over and over (warm).
* :func:`bench_e2e`: a real model, real prefill, then greedy decoding dense vs sparse in the same process.

Every time is a median over repeated calls, measured side by side in one process; isolated operator timings
say nothing about matched-quality or end-to-end speed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import math
import numbers
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import SparseConfig
from ..decoding.generate import lossless_decode
from ..decoding.loop import Progress, decode_tokens, prefill
from ..errors import SparseDecodeError
from ..kernels import cpu as cpu_kernel
from ..kernels.triton import attention as triton_attention
from ..layout import BlockLayout
from ..memory import available_memory_bytes
from ..models.catalog import attention_shape
from ..selectors import resolve_selector
from ..selectors.statistics import BlockStatistics
from ..session import LayerState, SparseSession, sparse_decode_step, sparse_decoding
from ..session.kv_cache import GrowingCache, crop_cache, crop_rewinds, growing_copy
from .op_calls import op_calls

SHAPES = {
    "qwen2-0.5b": (14, 2, 64),  # query heads, KV heads, head dim (also Qwen2.5-Coder-0.5B)
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
}
SHAPE_LAYERS = {"qwen2-0.5b": 24, "llama3-8b": 32, "smollm2-135m": 30}  # decoder layers: per-layer caches to cycle
DEFAULT_CONTEXTS = (2048, 8192, 32768, 131072)
MEMORY_FRACTION = 0.5  # bench op's per-layer caches take at most this share of the memory available when it starts


DEFAULT_SUPPORTS = (97, 193, 769)


def median_time(fn: Callable[[], object], *, min_calls: int = 10, budget_s: float = 0.6) -> float:
    """Median seconds per call: a warm-up, then calls until ``min_calls`` and ``budget_s`` are both spent."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < min_calls or spent < budget_s:
        started = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - started
        times.append(elapsed)
        spent += elapsed
        if len(times) >= 2000:
            break
    return statistics.median(times)


def cuda_median_time(fn: Callable[[], object], *, budget_s: float = 0.6, **_) -> float:
    """Median seconds per call on a CUDA device, timed with device events by ``triton.testing.do_bench``, which
    also flushes the L2 cache before every call (so a context that fits in L2 is not timed from L2)."""
    from triton.testing import do_bench

    return (
        do_bench(fn, warmup=max(25, int(budget_s * 100)), rep=max(100, int(budget_s * 1000)), return_mode="median")
        / 1e3
    )


def read_bandwidth_gbs(megabytes: int = 512, device: str = "cpu") -> float:
    """The device's read bandwidth now: median GB/s of summing a float32 buffer larger than the caches."""
    megabytes = megabytes if device == "cpu" else 4 * megabytes
    buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32, device=device)
    timer = median_time if device == "cpu" else cuda_median_time
    seconds = timer(buffer.sum, min_calls=7, budget_s=1.0)
    return buffer.nelement() * 4 / seconds / 1e9


def last_level_cache_bytes() -> int | None:
    """The size of the CPU's largest cache as Linux reports it (for core 0), or ``None`` where it does not."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes) if sizes else None


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


def _cycle(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs ``calls`` in turn (0, 1, ..., L - 1, 0, ...): each call's data was last touched
    ``L - 1`` calls ago."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


@dataclass
class OpLayer:
    """One layer's synthetic decode state: the query and the KV cache of ``(1, KV heads, N, d)``, and the block
    statistics a block selector reads (built once, as after prefill)."""

    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    centroids: BlockStatistics


def _op_layer(
    n: int, dims: tuple[int, int, int], dtype, device: str, selector: str, layout: BlockLayout, generator
) -> OpLayer:
    query_heads, kv_heads, d = dims
    keys = torch.randn(1, kv_heads, n, d, generator=generator).to(device, dtype)
    values = torch.randn(1, kv_heads, n, d, generator=generator).to(device, dtype)
    query = torch.randn(1, query_heads, 1, d, generator=generator).to(device, dtype)
    statistics = resolve_selector(selector).statistics
    centroids = BlockStatistics(layout.block_size, statistics or ("mean",))
    if statistics:
        centroids.update(keys[0], layout.n_full)
    return OpLayer(query, keys, values, centroids)


def _layer_bytes(n: int, dims: tuple[int, int, int], element: int, selector: str, layout: BlockLayout) -> int:
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
        one_layer = _layer_bytes(n, dims, torch.finfo(dtype).bits // 8, selector, layout)
        if available is not None and one_layer > MEMORY_FRACTION * available:
            raise SparseDecodeError(
                f"bench op: context {n} needs {one_layer / 1e9:.1f} GB for one layer's cache, more than "
                f"{MEMORY_FRACTION:.0%} of the {available / 1e9:.1f} GB available on {device}: give a shorter context"
            )
    return name, dims, requested


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


def _fresh_step(session, state, query, keys, values, n, scale):
    """One whole sparse step at context ``n`` as the next contiguous step (fresh selection, no rebuild)."""
    state.step, state.blocks = 0, None
    return sparse_decode_step(session, state, query, keys, values, n, scale)


def _op_bytes(cfg: SparseConfig, n: int, kv_heads: int, query_heads: int, d: int, element: int) -> tuple[int, int]:
    """Bytes one call must read: dense = all keys and values; sparse = what selection reads + support K/V.

    Selection reads: float32 block statistics and the tail keys for a selector handed statistics (one per
    statistic: mean-pooled one, quest two); a float32 history (one value per position) for one handed a history (H2O);
    otherwise its share of every key (:meth:`~sparsedecode.selectors.Selector.key_fraction`: all of it for the
    oracles, none for random blocks and streaming).
    """
    layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size)
    query = query_heads * d * element
    dense = 2 * kv_heads * n * d * element + query
    support = 2 * kv_heads * cfg.effective_support * d * element
    selector = cfg.selector
    if selector.statistics:
        tail = (layout.distant_end - 1 - layout.n_full * cfg.block_size) * kv_heads * d * element
        statistics = kv_heads * layout.n_full * len(selector.statistics) * d * 4
        selection = statistics + tail
    elif selector.uses_history:
        selection = kv_heads * n * 4
    else:
        selection = round(kv_heads * n * d * element * selector.key_fraction(d))
    return dense, selection + support + query


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
    query_heads, kv_heads, d = dims
    element = torch.finfo(dtype).bits // 8
    defaults = SparseConfig(selector=selector)  # window and block size: every support's, as in decoding
    uses_history = defaults.selector.uses_history
    if kernels is None and (defaults.token_level or defaults.selector.adaptive):  # torch's operations serve them
        kernels = ("torch",)
    elif kernels is None:  # torch's operations beside the fused kernel the device has (the C one on the CPU)
        if device == "cpu":
            kernels = ("torch", "c") if dtype in cpu_kernel.DTYPES and cpu_kernel.library() is not None else ("torch",)
        else:
            kernels = ("torch", "triton") if triton_attention.usable(torch.device(device), 16) else ("torch",)
    for kernel in kernels:  # an explicit fused kernel for a token-level selector is refused here, as SparseConfig does
        SparseConfig(selector=selector, kernel=kernel)
    timer = median_time if device == "cpu" else cuda_median_time
    llc = last_level_cache_bytes() if device == "cpu" else None
    bandwidth = read_bandwidth_gbs(device=device)
    rows: list[OpRow] = []
    total = len(contexts) * len(supports) * len(kernels)
    generator = torch.Generator().manual_seed(0)
    scale = d**-0.5
    for n in contexts:
        layout = BlockLayout(n=n, window=defaults.window, block_size=defaults.block_size)
        count, note = plan_layers(
            requested, _layer_bytes(n, dims, element, selector, layout), available_memory_bytes(device)
        )
        stack = [_op_layer(n, dims, dtype, device, selector, layout, generator) for _ in range(count)]
        # transformers' one-token SDPA path: query heads packed per KV head, no repeat_kv
        dense = _cycle(
            [
                partial(
                    F.scaled_dot_product_attention,
                    layer.query.view(1, kv_heads, query_heads // kv_heads, d),
                    layer.keys,
                    layer.values,
                    scale=scale,
                )
                for layer in stack
            ]
        )
        dense_s = timer(dense, budget_s=budget_s)
        dense_triton_s = None
        if "triton" in kernels:  # a split-KV dense baseline: the same kernel over every position
            every = torch.arange(layout.n_blocks, device=device).expand(kv_heads, -1)
            whole_cache = [
                partial(
                    triton_attention.support_attention,
                    layer.query[0, :, 0],
                    layer.keys[0],
                    layer.values[0],
                    every,
                    layout,
                    scale,
                )
                for layer in stack
            ]
            dense_triton_s = timer(_cycle(whole_cache), budget_s=budget_s)
        for support, kernel in ((s, k) for s in supports for k in kernels):
            cfg = SparseConfig(support=support, selector=selector, kernel=kernel)
            session = SparseSession(config=cfg, model=None)
            wholes, selects, attends = [], [], []
            for index, layer in enumerate(stack):
                state = LayerState(index, layer.centroids)
                wholes.append(partial(_fresh_step, session, state, layer.query, layer.keys, layer.values, n, scale))
                history = state.history_until(n, kv_heads, layer.keys.device).uniform_() if uses_history else None
                select, attend = op_calls(cfg, layer, layout, scale, kernel, history)
                selects.append(select)
                attends.append(attend)
            sparse_s = timer(_cycle(wholes), budget_s=budget_s)
            select_s = timer(_cycle(selects), budget_s=budget_s / 2)
            attend_s = timer(_cycle(attends), budget_s=budget_s / 2)
            bytes_dense, bytes_sparse = _op_bytes(cfg, n, kv_heads, query_heads, d, element)
            rows.append(
                OpRow(
                    shape=name,
                    context=n,
                    support=cfg.effective_support,
                    selector=selector,
                    dtype=str(dtype).removeprefix("torch."),
                    dense_ms=dense_s * 1e3,
                    sparse_ms=sparse_s * 1e3,
                    select_ms=select_s * 1e3,
                    attend_ms=attend_s * 1e3,
                    bytes_dense=bytes_dense,
                    bytes_sparse=bytes_sparse,
                    bandwidth_gbs=bandwidth,
                    speedup=dense_s / sparse_s,
                    bound_ratio=sparse_s / (bytes_sparse / (bandwidth * 1e9)),
                    dense_bound_ratio=dense_s / (bytes_dense / (bandwidth * 1e9)),
                    dense_gbs=bytes_dense / dense_s / 1e9,
                    sparse_gbs=bytes_sparse / sparse_s / 1e9,
                    layers=count,
                    layers_requested=requested,
                    working_set_mb=count * bytes_sparse / 1e6,
                    dense_working_set_mb=count * bytes_dense / 1e6,
                    kernel=kernel,
                    device=device,
                    dense_triton_ms=None if dense_triton_s is None else dense_triton_s * 1e3,
                    layers_note=note,
                    llc_mb=None if llc is None else llc / 1e6,
                )
            )
            if progress:
                progress("bench op", len(rows), total)
        del stack, dense, wholes, selects, attends
        gc.collect()
    return rows, bandwidth


def op_rows_as_dicts(rows: list[OpRow]) -> list[dict]:
    return [asdict(row) for row in rows]


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class E2ERow:
    model: str
    mode: str
    cache: str
    context: int
    support: int | None
    tokens: int
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float
    speedup_vs_best_dense: float
    peak_rss_mb: float
    tokens_equal_to_dense: int
    draft_tokens: int | None = None
    acceptance_rate: float | None = None
    mean_accepted: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    kernel: str | None = None
    runs: int = 1  # timed runs of this mode; decode_s (and draft_s, verify_s) are their medians
    compile_s: float | None = None  # compiled modes: the first step's time, compiling included (not in decode_s)
    vs_llama_cpp: float | None = None  # with a llama.cpp baseline: its dense decode seconds over this row's
    bytes_per_token_mb: float | None = None  # with a baseline: weights + attention reads per token (MB)
    bound_tokens_per_s: float | None = None  # with a baseline: read bandwidth / bytes per token


def bench_e2e(
    model: torch.nn.Module,
    name: str,
    prompt_ids: torch.Tensor,
    supports: tuple[int, ...] = (193,),
    *,
    tokens: int = 64,
    lossless: tuple[int, ...] = (),
    adaptive: bool = False,
    kernel: str = "auto",
    repeats: int = 2,
    progress: Progress | None = None,
    selector: str = "mean-pooled",
    compile: bool = False,
    baseline: dict | None = None,
) -> list[E2ERow]:
    """Dense prefill once, then ``tokens`` greedy tokens per mode from the same prefilled KV cache.

    Modes: dense on transformers' ``DynamicCache`` (concatenates every step), dense on :class:`GrowingCache`
    (appends in place), sparse on ``GrowingCache`` per support, and (``lossless`` lists draft lengths k)
    self-speculative decoding per support and k. Every mode runs ``repeats`` times and reports the median of its
    runs: the modes run in order, then in reverse order, and so on, so a drift of a shared machine moves every
    mode's median alike instead of favouring one mode. ``speedup_vs_best_dense`` divides by the fastest dense mode.
    Peak RSS is the process peak so far. ``kernel`` is the sparse attention kernel (``SparseConfig.kernel``;
    ``auto`` = the C kernel on the CPU (float32, bfloat16, float16), Triton on CUDA, else torch). ``compile`` adds
    dense and each sparse mode over a static cache with the decode step compiled (:mod:`sparsedecode.compiled.decoder`),
    their compile time in ``compile_s``. ``baseline`` (``{label: LlamaCpp}``, :mod:`.baseline`) adds llama.cpp's dense
    decoding of the same token ids, timed in the same rotation, and every row's ratio to it and bytes per token.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise SparseDecodeError(f"bench e2e: repeats must be an integer >= 1 (got {repeats!r})")
    if compile:  # before the prefill
        from ..compiled.decoder import check_compilable

        for cfg in (None, *(SparseConfig(support=s, kernel=kernel, selector=selector) for s in supports)):
            check_compilable(model, cfg, "bench e2e --compile")
    started = time.perf_counter()
    dynamic, logits = prefill(model, prompt_ids, progress=progress)
    prefill_s = time.perf_counter() - started
    growing = growing_copy(dynamic, model.config)
    first = int(logits.argmax())
    context = int(prompt_ids.shape[1])

    def timed(cache, stage: str) -> tuple[float, list[int]]:
        begun = time.perf_counter()
        (out,), _ = decode_tokens(model, cache, [first], tokens, progress=progress, stage=stage)
        elapsed = time.perf_counter() - begun
        crop_cache(cache, context)
        return elapsed, out

    def sparse(support: int, stage: str) -> tuple[float, list[int]]:
        with sparse_decoding(model, SparseConfig(support=support, kernel=kernel, selector=selector)):
            return timed(growing, stage)

    def speculative(support: int, k: int, stage: str):
        generation = lossless_decode(
            model,
            growing,
            context,
            first,
            SparseConfig(support=support, kernel=kernel, selector=selector),
            tokens + 1,
            draft_tokens=k,
            adaptive=adaptive,
            progress=progress,
        )
        crop_cache(growing, context)
        return generation

    modes = {
        ("dense", "dynamic", None, None): partial(timed, dynamic),
        ("dense", "growing", None, None): partial(timed, growing),
    }
    modes.update({("sparse", "growing", support, None): partial(sparse, support) for support in supports})
    modes.update({("lossless", "growing", s, k): partial(speculative, s, k) for s in supports for k in lossless})
    compile_s = {}
    if compile:
        cfgs = {None: None, **{s: SparseConfig(support=s, kernel=kernel, selector=selector) for s in supports}}
        compiled, compile_s = _compiled_modes(model, prompt_ids, first, cfgs, tokens, progress, lossless, adaptive)
        modes.update({("dense" if s is None else "sparse", "static, compiled", s, None): compiled[s] for s in cfgs})
        modes.update({("lossless", "static, compiled", s, k): compiled[s, k] for s in supports for k in lossless})
    prefills: dict = {}
    if baseline:
        from .baseline import baseline_modes

        modes.update(baseline_modes(baseline, prompt_ids, tokens, prefills))
    runs: dict[tuple, list] = {mode: [] for mode in modes}
    order = list(modes)
    for repeat in range(repeats):
        for mode in order if repeat % 2 == 0 else order[::-1]:
            kind, cache, support, k = mode
            label = {"dense": f"dense, {cache}", "sparse": f"sparse S={support}, {cache}"}.get(
                kind, f"lossless S={support} k={k}, {cache}"
            )
            runs[mode].append(modes[mode](f"{label} (run {repeat + 1}/{repeats})"))
    rss = peak_rss_mb()

    def seconds(result) -> float:
        return result[0] if isinstance(result, tuple) else result.decode_s

    median_s = {mode: statistics.median(seconds(r) for r in results) for mode, results in runs.items()}
    # our fastest dense mode (compiled dense too); llama.cpp's rows say their own ratio (vs_llama_cpp)
    best = min(seconds for mode, seconds in median_s.items() if mode[0] == "dense" and mode[1] not in (baseline or {}))
    dense_tokens = runs[("dense", "dynamic", None, None)][0][1]

    def agreeing(out: list[int]) -> int:
        return next((i for i, (a, b) in enumerate(zip(out, dense_tokens)) if a != b), tokens)

    rows = []
    for mode, results in runs.items():
        kind, cache, support, k = mode
        decode_s = median_s[mode]
        extra = {"kernel": None if kind == "dense" else kernel, "runs": len(results)}
        if cache == "static, compiled":
            extra["compile_s"] = compile_s[support]
        if kind == "lossless":
            g = results[0]  # greedy and deterministic: every run drafts and accepts the same
            out = g.tokens[1:]
            extra.update(
                draft_tokens=k,
                acceptance_rate=g.acceptance_rate,
                mean_accepted=g.mean_accepted,
                draft_s=statistics.median(r.draft_s for r in results),
                verify_s=statistics.median(r.verify_s for r in results),
            )
        else:
            out = results[0][1]
        rows.append(
            E2ERow(
                name,
                kind,
                cache,
                context,
                support,
                tokens,
                prefill_s,
                decode_s,
                tokens / decode_s,
                best / decode_s,
                rss,
                agreeing(out),
                **extra,
            )
        )
    if baseline:
        from .baseline import annotate

        annotate(rows, model, baseline, prefills, read_bandwidth_gbs())
    return rows


# --- batched end to end (issue #12) ---------------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count of this process (Linux: ``/proc/self/clear_refs``); False if it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def current_peak_rss_mb() -> float:
    """Peak RSS since the last :func:`reset_peak_rss` (``VmHWM``), in MB; the process peak where that is unknown."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return peak_rss_mb()


def kv_cache_bytes(config, sequences: int, positions: int, element: int) -> int:
    """Bytes of keys and values of ``sequences`` sequences of ``positions`` positions under ``config``."""
    _, kv_heads, head_dim, layers = attention_shape(config)
    return 2 * layers * sequences * kv_heads * positions * head_dim * element


def check_batches_fit(model: torch.nn.Module, batches: tuple[int, ...], context: int, tokens: int) -> int:
    """Refuse, before any prefill, batches whose KV caches would not fit in the memory available now.

    The run holds one batch-1 cache per prompt (``max(batches)`` of them) and, while a batch runs, the batch's
    stacked copy: the estimate is twice ``max(batches)`` caches of ``context + tokens`` positions (plus the
    in-place cache's growth slack). Returns the estimate in bytes.
    """
    parameter = next(model.parameters())
    element = parameter.element_size()
    largest = max(batches)
    one = kv_cache_bytes(model.config, 1, context + tokens + 1, element)
    needed = 2 * largest * one + largest * kv_cache_bytes(model.config, 1, 256, element)
    available = available_memory_bytes(str(parameter.device) if parameter.is_cuda else "cpu")
    if available is not None and needed > 0.9 * available:
        raise SparseDecodeError(
            f"bench e2e: batch {largest} at context {context} needs about {needed / 2**30:.1f} GiB of KV cache "
            f"({largest} prompts x {one / 2**20:.0f} MiB, held twice: alone and stacked), more than the "
            f"{available / 2**30:.1f} GiB available now: use smaller batches or a shorter context"
        )
    return needed


@dataclass
class BatchRow:
    """One (batch size, mode) of :func:`bench_e2e_batch`."""

    model: str
    mode: str
    context: int
    support: int | None
    batch: int
    tokens: int
    decode_s: float
    step_ms: float
    aggregate_tokens_per_s: float
    speedup_vs_dense_same_batch: float
    speedup_vs_best_dense: float
    peak_rss_mb: float
    kv_cache_mb: float
    tokens_equal_to_batch1: bool
    kernel: str | None
    runs: int
    cache: str = "growing"
    """``growing``: the session's step on an in-place cache; ``static, compiled``: the compiled step."""
    compile_s: float | None = None
    dtype: str = "float32"
    """The model's dtype in this row."""


def over_best_dense(rows: list[BatchRow]) -> list[BatchRow]:
    """``rows`` with "vs best dense" over all their dense rows of the same context (one run's, or several runs'
    together: another dtype's dense rows beside them)."""
    best: dict[int, float] = {}
    for r in rows:
        if r.mode == "dense":
            best[r.context] = max(best.get(r.context, 0.0), r.aggregate_tokens_per_s)
    return [dataclasses.replace(r, speedup_vs_best_dense=r.aggregate_tokens_per_s / best[r.context]) for r in rows]


def _stack_caches(model: torch.nn.Module, caches: list[GrowingCache]) -> GrowingCache:
    """One batched in-place cache holding ``caches`` (each batch 1, equal lengths) as its rows."""
    stacked = GrowingCache(config=model.config)
    for index in range(len(caches[0].layers)):
        keys = torch.cat([c.layers[index].keys for c in caches])
        values = torch.cat([c.layers[index].values for c in caches])
        stacked.layers[index].update(keys, values)
    return stacked


def bench_e2e_batch(
    model: torch.nn.Module,
    name: str,
    prompts: list[torch.Tensor],
    batches: tuple[int, ...],
    supports: tuple[int, ...] = (193,),
    *,
    tokens: int = 64,
    kernel: str = "auto",
    repeats: int = 2,
    progress: Progress | None = None,
    selector: str = "mean-pooled",
    compile: bool = False,
) -> list[BatchRow]:
    """Aggregate decode throughput per batch size, dense vs sparse, side by side in one process.

    ``prompts`` are ``max(batches)`` prompts of one length (``(1, P)`` each). Each is prefilled alone once (dense;
    prefill is not what is measured) into an in-place cache; a batch of ``b`` decodes the first ``b`` prompts
    together from a stacked copy of their caches. Per batch size every mode (dense, then sparse per support) runs
    ``repeats`` times, in order and then reversed, and reports the median decode time of ``tokens`` greedy tokens
    for the whole batch: aggregate tokens/s is ``b * tokens / decode_s``, the step latency ``decode_s / tokens``.
    ``tokens_equal_to_batch1``: every sequence's tokens equal its own batch-1 run in the same mode (each prompt is
    run alone, in every mode, for that). Peak RSS is measured per batch size (the kernel's high-water mark is reset
    before it, where Linux allows). ``compile`` adds every mode with the decode step compiled
    (:mod:`sparsedecode.compiled.decoder`, ``cache`` "static, compiled"), its rows and compile seconds beside the
    others'; "vs dense same batch" and "vs best dense" then divide by the faster dense mode.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise SparseDecodeError(f"bench e2e: repeats must be an integer >= 1 (got {repeats!r})")
    if not batches or any(not isinstance(b, int) or b < 1 for b in batches):
        raise SparseDecodeError(f"bench e2e: batch sizes must be integers >= 1 (got {batches!r})")
    if len(prompts) < max(batches) or len({int(p.shape[1]) for p in prompts}) != 1:
        raise SparseDecodeError(f"bench e2e: needs {max(batches)} prompts of one length")
    context = int(prompts[0].shape[1])
    check_batches_fit(model, batches, context, tokens)
    if not crop_rewinds(GrowingCache(config=model.config)):  # before any prefill
        raise SparseDecodeError(
            "bench e2e --batch: this model has sliding-window or recurrent cache layers, which cannot be stacked "
            "into a batch here; time it at batch 1 (without --batch)"
        )
    modes: list[tuple[str, int | None]] = [("dense", None)] + [("sparse", s) for s in supports]

    def config_of(mode) -> SparseConfig | None:
        return None if mode[0] == "dense" else SparseConfig(support=mode[1], kernel=kernel, selector=selector)

    if compile:  # before any prefill
        from ..compiled.decoder import check_compilable

        for mode in modes:
            check_compilable(model, config_of(mode), "bench e2e --batch --compile")
    prompts = prompts[: max(batches)]
    caches, firsts = [], []
    for number, ids in enumerate(prompts, start=1):
        cache = GrowingCache(config=model.config)
        _, logits = prefill(model, ids, cache=cache)
        caches.append(cache)
        firsts.append(int(logits.argmax()))
        if progress:
            progress("prefill (each prompt alone)", number, len(prompts))

    def context_for(mode):
        cfg = config_of(mode)
        return contextlib.nullcontext() if cfg is None else sparse_decoding(model, cfg)

    alone: dict[tuple, list[list[int]]] = {}
    for mode in modes:  # every prompt alone, every mode: what the batches must reproduce
        outs = []
        for i, cache in enumerate(caches):
            with context_for(mode):
                (out,), _ = decode_tokens(
                    model, cache, [firsts[i]], tokens, progress=progress, stage=f"{mode[0]} alone"
                )
            crop_cache(cache, context)
            outs.append(out)
        alone[mode] = outs

    measured: dict[tuple, dict] = {}
    for b in sorted(batches):
        gc.collect()
        reset_peak_rss()
        stacked = caches[0] if b == 1 else _stack_caches(model, caches[:b])
        mask = torch.ones(b, context, dtype=torch.long, device=prompts[0].device)
        times: dict[tuple, list[float]] = {mode: [] for mode in modes}
        outputs: dict[tuple, list[list[int]]] = {}
        for repeat in range(repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                stage = f"batch {b}, {mode[0]}" + (f" S={mode[1]}" if mode[1] else "") + f" ({repeat + 1}/{repeats})"
                begun = time.perf_counter()
                with context_for(mode):
                    padded = None if b == 1 else mask  # batch 1 runs as one prompt does
                    outs, _ = decode_tokens(
                        model, stacked, firsts[:b], tokens, mask=padded, progress=progress, stage=stage
                    )
                times[mode].append(time.perf_counter() - begun)
                crop_cache(stacked, context)
                outputs[mode] = outs
        rss = current_peak_rss_mb()
        for mode in modes:
            equal = all(outputs[mode][i] == alone[mode][i] for i in range(b))
            measured[(b, *mode, "growing")] = dict(decode_s=statistics.median(times[mode]), equal=equal, rss=rss)
        del stacked
    if compile:
        measured.update(_compiled_batches(model, caches, firsts, batches, modes, config_of, tokens, repeats, progress))
    dense_s = {}  # the faster dense mode's time per batch size
    for (b, kind, _, _), m in measured.items():
        if kind == "dense":
            dense_s[b] = min(dense_s.get(b, m["decode_s"]), m["decode_s"])
    weight = next(model.parameters())
    element, dtype = weight.element_size(), str(weight.dtype).removeprefix("torch.")
    rows = []
    for (b, kind, support, cache), m in measured.items():
        aggregate = b * tokens / m["decode_s"]
        rows.append(
            BatchRow(
                name,
                kind,
                context,
                support,
                b,
                tokens,
                m["decode_s"],
                1000 * m["decode_s"] / tokens,
                aggregate,
                aggregate / (b * tokens / dense_s[b]),
                0.0,  # vs best dense: over_best_dense, below
                m["rss"],
                kv_cache_bytes(model.config, b, context + tokens, element) / 2**20,
                m["equal"],
                None if kind == "dense" else kernel,
                repeats,
                cache,
                m.get("compile_s"),
                dtype,
            )
        )
    return over_best_dense(rows)


def _compiled_decode(model, decoder, context: int, heads: list[int], tokens: int, progress, stage: str):
    """Seconds and tokens of ``tokens`` greedy steps of a compiled ``decoder`` after ``heads`` (a first token per
    row), from the prompt of ``context`` positions in its cache (a warm-up's step left the state one step on)."""
    with decoder.installed():
        decoder.resume(context)
        begun = time.perf_counter()
        outs, _ = decode_tokens(model, None, heads, tokens, progress=progress, stage=stage, step_fn=decoder.step)
        return time.perf_counter() - begun, outs


def _compiled_modes(model, prompt_ids, first: int, cfgs: dict, tokens: int, progress, lossless=(), adaptive=False):
    """:func:`bench_e2e`'s compiled modes: for each ``cfgs`` entry (a name and its config, ``None`` = dense) a
    function ``timed(stage) -> (seconds, tokens)`` decoding ``tokens`` greedy tokens after ``first``, every mode from
    one prefill of ``prompt_ids (1, P)`` into one shared cache; under ``(name, k)`` for each sparse entry and draft
    length in ``lossless``, the lossless loop drafting with it (a :class:`~sparsedecode.decoding.generate.Generation`);
    and each mode's compile seconds (measured here, before any timed run). The configs were checked compilable
    before."""
    from ..compiled.decoder import decoder_for
    from ..decoding.generate import Generation
    from ..decoding.lossless import MAX_DRAFT_TOKENS, StaticDrafter, lossless_loop

    context = int(prompt_ids.shape[1])
    decoders = {name: decoder_for(model, cfg, 1, context + tokens + 1) for name, cfg in cfgs.items()}
    prefilled = next(iter(decoders.values()))
    with prefilled.installed():
        prefilled.prefill(prompt_ids, progress=progress)
    compile_s = {}
    for name, decoder in decoders.items():
        with decoder.installed():
            decoder.resume(context)
            compile_s[name] = decoder.warm_up(torch.tensor([first]))

    def timed(decoder, stage):
        seconds, (out,) = _compiled_decode(model, decoder, context, [first], tokens, progress, stage)
        return seconds, out

    def speculative(decoder, k: int, stage: str):
        with decoder.installed():
            decoder.resume(context)
            return lossless_loop(
                StaticDrafter(decoder), Generation("lossless", [first], 0.0, 0.0), tokens + 1, draft_tokens=k,
                adaptive=adaptive, max_draft_tokens=MAX_DRAFT_TOKENS, progress=progress, eos_token_id=None, stage=stage,
            )  # fmt: skip

    functions = {name: partial(timed, decoder) for name, decoder in decoders.items()}
    sparse = [name for name in decoders if name is not None]
    functions.update({(name, k): partial(speculative, decoders[name], k) for name in sparse for k in lossless})
    return functions, compile_s


def _compiled_batches(model, caches, firsts, batches, modes, config_of, tokens, repeats, progress) -> dict:
    """:func:`bench_e2e_batch`'s compiled modes, measured like the others (each prompt alone at batch 1 first, then
    every batch size, each mode ``repeats`` times in order and reversed), from copies of the same prefilled caches."""
    from ..compiled.decoder import decoder_for

    context = int(caches[0].get_seq_length())

    def decoded(decoder, heads: list[int], stage: str) -> tuple[float, list[list[int]]]:
        return _compiled_decode(model, decoder, context, heads, tokens, progress, stage)

    def loaded(mode, b: int, rows: list):
        decoder = decoder_for(model, config_of(mode), b, context + tokens + 1)
        with decoder.installed():
            decoder.load(rows, context)
            decoder.warm_up(torch.tensor(firsts[: len(rows)]))
        return decoder

    alone = {}
    for mode in modes:  # every prompt alone: what the batches must reproduce
        alone[mode] = []
        for cache, first in zip(caches, firsts):
            _, (out,) = decoded(loaded(mode, 1, [cache]), [first], f"{mode[0]} alone, compiled")
            alone[mode].append(out)
    measured = {}
    for b in sorted(batches):
        gc.collect()
        reset_peak_rss()
        decoders = {mode: loaded(mode, b, caches[:b]) for mode in modes}
        times: dict[tuple, list[float]] = {mode: [] for mode in modes}
        outputs = {}
        for repeat in range(repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                stage = f"batch {b}, {mode[0]} compiled" + (f" S={mode[1]}" if mode[1] else "")
                seconds, outputs[mode] = decoded(decoders[mode], firsts[:b], f"{stage} ({repeat + 1}/{repeats})")
                times[mode].append(seconds)
        rss = current_peak_rss_mb()
        for mode in modes:
            equal = all(outputs[mode][i] == alone[mode][i] for i in range(b))
            median = statistics.median(times[mode])
            compile_s = decoders[mode].compile_s
            measured[(b, *mode, "static, compiled")] = dict(decode_s=median, equal=equal, rss=rss, compile_s=compile_s)
    return measured
