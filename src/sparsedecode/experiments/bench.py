"""Benchmarks (docs/definitions.md, section 4, "Operator timings"): timings live here, never in tests.

* :func:`bench_op` (:mod:`.bench_operator`): one decode-attention call on synthetic post-RoPE queries/keys/values:
  torch SDPA dense against the sparse step (selection over cached block centroids, then attention over the gathered
  support), with bytes touched and the machine's read bandwidth measured in the same run. Consecutive calls cycle
  through ``layers`` distinct per-layer caches, as a decode step walks every layer: by default the shape's layer
  count, so that each call reads what the others evicted from the caches (cold); ``layers=1`` times one layer over
  and over (warm). What it times its calls on is :mod:`.bench_operator_inputs`.
* :func:`bench_e2e` (:mod:`.bench_end_to_end`): a real model, real prefill, then greedy decoding dense vs sparse in
  the same process; :func:`bench_e2e_batch` (:mod:`.bench_batch`) the same per batch size.

Every time is a median over repeated calls, measured side by side in one process; isolated operator timings
say nothing about matched-quality or end-to-end speed. The timers, the machine's figures and the size of a KV cache
are :mod:`.bench_measures`. This module gathers the benchmarks' public names where their callers import them.
"""

from __future__ import annotations

from .bench_batch import BatchRow, bench_e2e_batch, check_batches_fit, over_best_dense
from .bench_end_to_end import E2ERow, bench_e2e
from .bench_measures import (
    cuda_median_time,
    current_peak_rss_mb,
    kv_cache_bytes,
    last_level_cache_bytes,
    median_time,
    peak_rss_mb,
    read_bandwidth_gbs,
    reset_peak_rss,
)
from .bench_operator import OpRow, bench_op, fresh_step, op_rows_as_dicts
from .bench_operator_inputs import (
    DEFAULT_CONTEXTS,
    DEFAULT_SUPPORTS,
    MEMORY_FRACTION,
    SHAPE_LAYERS,
    SHAPES,
    OpLayer,
    check_op_args,
    plan_layers,
)

__all__ = [
    "DEFAULT_CONTEXTS",
    "DEFAULT_SUPPORTS",
    "MEMORY_FRACTION",
    "SHAPES",
    "SHAPE_LAYERS",
    "BatchRow",
    "E2ERow",
    "OpLayer",
    "OpRow",
    "bench_e2e",
    "bench_e2e_batch",
    "bench_op",
    "check_batches_fit",
    "check_op_args",
    "cuda_median_time",
    "current_peak_rss_mb",
    "fresh_step",
    "kv_cache_bytes",
    "last_level_cache_bytes",
    "median_time",
    "op_rows_as_dicts",
    "over_best_dense",
    "peak_rss_mb",
    "plan_layers",
    "read_bandwidth_gbs",
    "reset_peak_rss",
]
