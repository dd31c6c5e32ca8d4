"""What the benchmarks measure beside the calls they time (:mod:`.bench`): median timers on the CPU and on CUDA, the
machine's read bandwidth and last-level cache, the process's peak memory, and the size of a KV cache (the batched
benchmark's memory check, the llama.cpp baseline's bytes per token)."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..models.catalog import attention_shape

MAX_CALLS = 2000
"""A timing stops after this many calls even with budget left: the median of 2,000 calls moves no more."""


def median_time(fn: Callable[[], object], *, min_calls: int = 10, budget_s: float = 0.6) -> float:
    """Median seconds per call: a warm-up, then calls until ``min_calls`` and ``budget_s`` are both spent, or
    :data:`MAX_CALLS` made."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < min_calls or spent < budget_s:
        started = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - started
        times.append(elapsed)
        spent += elapsed
        if len(times) >= MAX_CALLS:
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


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
