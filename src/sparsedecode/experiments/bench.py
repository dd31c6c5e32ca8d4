"""Benchmarks (DESIGN.md section 4, "Operator timings"): timings live here, never in tests.

* :func:`bench_op`: one decode-attention call of one layer on synthetic post-RoPE queries/keys/values: torch
  SDPA dense against the sparse step (selection over cached block centroids, then attention over the gathered
  support), with bytes touched and the machine's read bandwidth measured in the same run.
* :func:`bench_e2e`: a real model, real prefill, then greedy decoding dense vs sparse in the same process.

Every time is a median over repeated calls, measured side by side in one process; isolated operator timings
say nothing about matched-quality or end-to-end speed.
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .. import cpu_kernel, triton_attention
from ..attention import LayerState, SparseSession, attend_positions, attend_support, sparse_decode_step, sparse_decoding
from ..cache import GrowingCache
from ..centroids import BlockCentroids
from ..compare import Progress, crop_cache, greedy_decode, prefill
from ..config import SparseConfig
from ..selectors import STAT_KINDS, BlockLayout, select_blocks, select_positions
from ..speculative import lossless_decode

SHAPES = {
    "qwen2-0.5b": (14, 2, 64),  # query heads, KV heads, head dim (also Qwen2.5-Coder-0.5B)
    "llama3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
}
DEFAULT_CONTEXTS = (2048, 8192, 32768, 131072)


def model_shape(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers model config, as in :data:`SHAPES`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads, config.num_key_value_heads, head_dim


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
    kernel: str = "torch"
    device: str = "cpu"
    dense_triton_ms: float | None = None


def _fresh_step(session, state, query, keys, values, n, scale):
    """One whole sparse step at context ``n`` as the next contiguous step (fresh selection, no rebuild)."""
    state.step, state.blocks = 0, None
    return sparse_decode_step(session, state, query, keys, values, n, scale)


def _op_bytes(cfg: SparseConfig, n: int, kv_heads: int, query_heads: int, d: int, element: int) -> tuple[int, int]:
    """Bytes one call must read: dense = all keys and values; sparse = what selection reads + support K/V.

    Selection reads: float32 block statistics and the tail keys for ``mean-pooled`` (one statistic) and ``quest``
    (two); every key for the oracles; H2O's float32 history (one value per position); nothing for random blocks and
    streaming.
    """
    layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size)
    query = query_heads * d * element
    dense = 2 * kv_heads * n * d * element + query
    support = 2 * kv_heads * cfg.effective_support * d * element
    if cfg.selector in STAT_KINDS:
        tail = (layout.distant_end - 1 - layout.n_full * cfg.block_size) * kv_heads * d * element
        statistics = kv_heads * layout.n_full * len(STAT_KINDS[cfg.selector]) * d * 4
        selection = statistics + tail
    elif cfg.selector in ("oracle-blocks", "oracle-tokens"):
        selection = kv_heads * n * d * element
    elif cfg.selector == "h2o":
        selection = kv_heads * n * 4
    else:
        selection = 0
    return dense, selection + support + query


def bench_op(
    shape: str | tuple[int, int, int] = "qwen2-0.5b",
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
    supports: tuple[int, ...] = DEFAULT_SUPPORTS,
    *,
    dtype: torch.dtype = torch.float32,
    selector: str = "mean-pooled",
    budget_s: float = 0.6,
    device: str = "cpu",
    kernels: tuple[str, ...] | None = None,
    progress: Progress | None = None,
) -> tuple[list[OpRow], float]:
    """Time one decode-attention call per (context, support, kernel); returns rows and the measured bandwidth.

    ``kernels`` (``SparseConfig.kernel`` values) default to torch's operations and the fused kernel of the device:
    the C kernel for float32 on the CPU, the Triton kernels on CUDA. ``device="cuda"`` times with device events
    (L2 flushed before every call).
    """
    dims = SHAPES[shape] if isinstance(shape, str) else tuple(shape)  # or (query heads, KV heads, head dim)
    if not isinstance(shape, str):
        shape = next((name for name, known in SHAPES.items() if known == dims), "{}q-{}kv-d{}".format(*dims))
    query_heads, kv_heads, d = dims
    element = torch.finfo(dtype).bits // 8
    if kernels is None:  # torch's operations beside the fused kernel the device has (the C one on the CPU)
        if device == "cpu":
            kernels = ("torch", "c") if dtype == torch.float32 and cpu_kernel.library() is not None else ("torch",)
        else:
            kernels = ("torch", "triton") if triton_attention.usable(torch.device(device), 16) else ("torch",)
    token_level = SparseConfig(selector=selector).token_level
    kernels = ("torch",) if token_level else kernels  # the fused kernels serve block selectors
    timer = median_time if device == "cpu" else cuda_median_time
    bandwidth = read_bandwidth_gbs(device=device)
    rows: list[OpRow] = []
    total = len(contexts) * len(supports) * len(kernels)
    generator = torch.Generator().manual_seed(0)
    for n in contexts:
        keys = torch.randn(1, kv_heads, n, d, generator=generator).to(device, dtype)
        values = torch.randn(1, kv_heads, n, d, generator=generator).to(device, dtype)
        query = torch.randn(1, query_heads, 1, d, generator=generator).to(device, dtype)
        scale = d**-0.5
        packed = query.view(1, kv_heads, query_heads // kv_heads, d)
        # transformers' one-token SDPA path: query heads packed per KV head, no repeat_kv
        dense = partial(F.scaled_dot_product_attention, packed, keys, values, scale=scale)
        dense_s = timer(dense, budget_s=budget_s)
        dense_triton_s = None
        if "triton" in kernels:  # a split-KV dense baseline: the same kernel over every position
            layout = BlockLayout(n=n, window=64, block_size=16)
            every = torch.arange(layout.n_blocks, device=device).expand(kv_heads, -1)
            whole_cache = partial(
                triton_attention.support_attention, query[0, :, 0], keys[0], values[0], every, layout, d**-0.5
            )
            dense_triton_s = timer(whole_cache, budget_s=budget_s)
        for support, kernel in ((s, k) for s in supports for k in kernels):
            if support >= n:  # decoding attends densely there (support >= context): nothing sparse to time
                continue
            cfg = SparseConfig(support=support, selector=selector, kernel=kernel)
            layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size)
            session = SparseSession(config=cfg, model=None)
            state = LayerState(0, BlockCentroids(cfg.block_size, STAT_KINDS.get(selector, ("mean",))))
            q, k, v = query[0, :, 0], keys[0], values[0]
            state.centroids.update(k, layout.n_full)  # built once after prefill, as in decoding
            history = state.history_until(n, k.shape[0], k.device).uniform_() if selector == "h2o" else None
            whole = partial(_fresh_step, session, state, query, keys, values, n, scale)
            if cfg.token_level:
                select = partial(select_positions, cfg, q, k, layout, scale=scale, accumulated=history)
                attend = partial(attend_positions, q, k, v, select(), scale)
            else:
                select = partial(select_blocks, cfg, state.centroids, q, k, layout, scale=scale)
                attention = {"triton": triton_attention.support_attention, "c": cpu_kernel.attend_support}.get(
                    kernel, attend_support
                )
                attend = partial(attention, q, k, v, select(), layout, scale)
            sparse_s = timer(whole, budget_s=budget_s)
            select_s = timer(select, budget_s=budget_s / 2)
            attend_s = timer(attend, budget_s=budget_s / 2)
            bytes_dense, bytes_sparse = _op_bytes(cfg, n, kv_heads, query_heads, d, element)
            rows.append(
                OpRow(
                    shape=shape,
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
                    kernel=kernel,
                    device=device,
                    dense_triton_ms=None if dense_triton_s is None else dense_triton_s * 1e3,
                )
            )
            if progress:
                progress("bench op", len(rows), total)
        del keys, values
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
    progress: Progress | None = None,
) -> list[E2ERow]:
    """Dense prefill once, then ``tokens`` greedy tokens per mode from the same prefilled KV cache.

    Modes: dense on transformers' ``DynamicCache`` (concatenates every step), dense on :class:`GrowingCache`
    (appends in place), and sparse on ``GrowingCache`` per support. The dense modes run first and again last and
    report the median of their two runs, so a drift of the shared machine shows up instead of favouring one
    mode. ``speedup_vs_best_dense`` divides by the faster dense mode. Peak RSS is the process peak so far.
    ``lossless`` lists draft lengths k for self-speculative rows (sparse drafts, dense verification) per support.
    ``kernel`` is the sparse attention kernel (``SparseConfig.kernel``; ``auto`` = Triton on CUDA, else torch).
    """
    started = time.perf_counter()
    dynamic, logits = prefill(model, prompt_ids, progress=progress)
    prefill_s = time.perf_counter() - started
    growing = GrowingCache(config=model.config)
    for index, layer in enumerate(dynamic.layers):
        growing.layers[index].update(layer.keys, layer.values)
    first = int(logits.argmax())
    context = int(prompt_ids.shape[1])

    def timed(cache, stage: str) -> tuple[float, list[int]]:
        begun = time.perf_counter()
        out, _ = greedy_decode(model, cache, first, tokens, progress=progress, stage=stage)
        elapsed = time.perf_counter() - begun
        crop_cache(cache, context)
        return elapsed, out

    dense_runs = {
        "dynamic": [timed(dynamic, "dense, DynamicCache")],
        "growing": [timed(growing, "dense, GrowingCache")],
    }
    sparse_runs = []
    for support in supports:
        with sparse_decoding(model, SparseConfig(support=support, kernel=kernel)):
            sparse_runs.append((support, *timed(growing, f"sparse S={support}")))
    lossless_runs = []
    for support in supports:
        for k in lossless:
            generation = lossless_decode(
                model,
                growing,
                context,
                first,
                SparseConfig(support=support, kernel=kernel),
                tokens + 1,
                draft_tokens=k,
                adaptive=adaptive,
                progress=progress,
            )
            crop_cache(growing, context)
            lossless_runs.append((support, k, generation))
    dense_runs["growing"].append(timed(growing, "dense, GrowingCache (again)"))
    dense_runs["dynamic"].append(timed(dynamic, "dense, DynamicCache (again)"))
    dense_tokens = dense_runs["dynamic"][0][1]
    dense_s = {cache: statistics.median(t for t, _ in runs) for cache, runs in dense_runs.items()}
    best = min(dense_s.values())
    rss = peak_rss_mb()

    def agreeing(out: list[int]) -> int:
        return next((i for i, (a, b) in enumerate(zip(out, dense_tokens)) if a != b), tokens)

    def row(mode: str, cache: str, support: int | None, seconds: float, out: list[int], **extra) -> E2ERow:
        return E2ERow(
            name,
            mode,
            cache,
            context,
            support,
            tokens,
            prefill_s,
            seconds,
            tokens / seconds,
            best / seconds,
            rss,
            agreeing(out),
            **extra,
        )

    rows = [row("dense", cache, None, seconds, dense_runs[cache][0][1]) for cache, seconds in dense_s.items()]
    rows += [row("sparse", "growing", support, seconds, out, kernel=kernel) for support, seconds, out in sparse_runs]
    rows += [
        row(
            "lossless",
            "growing",
            support,
            g.decode_s,
            g.tokens[1:],
            draft_tokens=k,
            acceptance_rate=g.acceptance_rate,
            mean_accepted=g.mean_accepted,
            draft_s=g.draft_s,
            verify_s=g.verify_s,
            kernel=kernel,
        )
        for support, k, g in lossless_runs
    ]
    return rows
