"""One layer's sparse decode step for a batch: the per-sequence loop against one C kernel call, side by side.

    PYTHONPATH=src python scripts/bench_batch_step.py [--context 8192] [--batch 8] [--support 193] [--layers 30]
        [--ragged] [--reuse 1] [--threads 2] [--json FILE]

Random keys, values and queries of a model shape (default SmolLM2-135M: 9 query heads, 3 KV heads, d = 64, 30
layers) in float32; each layer has its own cache and the calls cycle through the layers (0, 1, ..., L - 1, 0, ...),
as a decode step does, so a call's centroids and support come from memory, not from the last-level cache. Each
call is the attention function itself (``sparse_attention_forward`` inside a session), bookkeeping included, at a
step that continues the previous one (the context grows by one position per step). ``--ragged`` left-pads the
sequences to lengths spread over [N / 2, N]. The two paths alternate call by call (by the parity of layer + step)
inside one session: they keep the same per-sequence state, so either may take any call. A fresh session per turn;
its first two steps, which build the centroid caches, are not timed. The figure is the median time of one layer's
call on each path. ``--dense`` also times transformers' batched SDPA over every position after each call (the
baseline: dense batched decoding of the same layer).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import sparsedecode.session as attention
from sparsedecode import SparseConfig, sparse_decoding
from sparsedecode.kernels import cpu
from sparsedecode.step.plan import StepPlan

PER_ROW = StepPlan("c", "c", one_call=False)
"""Each row's selection, then its attention, in C calls of their own."""

SHAPES = {"smollm2-135m": (9, 3, 64, 30, 576)}  # query heads, KV heads, head dim, layers, hidden size
WARMUP_STEPS = 2


class _Layer:
    def __init__(self, keys):
        self.keys = keys


class _Cache:
    """What a session's pre-hook looks at: the layers' key tensors."""

    def __init__(self, keys):
        self.layers = [_Layer(k) for k in keys]


def dense_mask(mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if mask is None else mask[..., :n]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--support", type=int, default=193)
    parser.add_argument("--layers", type=int, default=None, help="caches cycled through (default: the shape's)")
    parser.add_argument("--reuse", type=int, default=1)
    parser.add_argument("--ragged", action="store_true")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per turn")
    parser.add_argument("--turns", type=int, default=6, help="sessions, one after the other")
    parser.add_argument("--dense", action="store_true", help="also time dense batched SDPA after every call")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    heads, kv_heads, d, shape_layers, hidden = SHAPES[args.shape]
    layers = args.layers or shape_layers
    batch, n0 = args.batch, args.context
    capacity = n0 + WARMUP_STEPS + args.steps
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d,
        max_position_embeddings=capacity,
    )
    model = LlamaForCausalLM(config).eval()
    modules = [layer.self_attn for layer in model.model.layers]
    generator = torch.Generator().manual_seed(0)
    keys = [torch.randn(batch, kv_heads, capacity, d, generator=generator) for _ in range(layers)]
    values = [torch.randn(batch, kv_heads, capacity, d, generator=generator) for _ in range(layers)]
    pads = [i * (n0 // 2) // max(batch - 1, 1) for i in range(batch)] if args.ragged else [0] * batch
    cfg = SparseConfig(support=args.support, reuse=args.reuse)
    cache = _Cache(keys)
    results = {"per row": [], "one call": [], "dense": []}

    def turn() -> None:
        """One session; calls alternate between the paths (layer + step parity), both advancing the same states."""
        with torch.no_grad(), sparse_decoding(model, cfg) as session:
            for step in range(WARMUP_STEPS + args.steps):
                n = n0 + step
                query = torch.randn(batch, 1, heads, d, generator=generator).transpose(1, 2)
                mask = None
                if args.ragged:
                    mask = torch.zeros(batch, 1, 1, capacity, dtype=torch.bool)
                    for i, pad in enumerate(pads):
                        mask[i, :, :, pad:n] = True
                position_ids = torch.full((batch, 1), n - 1)
                for layer, (module, k, v) in enumerate(zip(modules, keys, values)):
                    path = ("per row", "one call")[(layer + step) % 2]
                    session.plan = None if path == "one call" else PER_ROW  # else each row attends on its own
                    session.look(module, (), {"cache": cache})
                    start = time.perf_counter_ns()
                    attention.sparse_attention_forward(
                        module, query, k, v, mask, scaling=d**-0.5, position_ids=position_ids
                    )
                    if step >= WARMUP_STEPS:
                        results[path].append((time.perf_counter_ns() - start) / 1e6)
                    if args.dense and step >= WARMUP_STEPS:  # the baseline: every position of every sequence
                        start = time.perf_counter_ns()
                        sdpa_attention_forward(
                            module, query, k[:, :, :n], v[:, :, :n], dense_mask(mask, n), scaling=d**-0.5
                        )
                        results["dense"].append((time.perf_counter_ns() - start) / 1e6)
            expected = batch * layers * (WARMUP_STEPS + args.steps)
            assert session.sparse_steps == expected, (session.sparse_steps, expected)

    for _ in range(args.turns):
        turn()
    medians = {path: statistics.median(times) for path, times in results.items() if times}
    blocks = cfg.blocks
    support = 1 + cfg.window + blocks * cfg.block_size
    lengths = [n0 - pad for pad in pads]
    n_full = [(m - cfg.window - 1) // cfg.block_size for m in lengths]
    bytes_support = sum(support * kv_heads * d * 2 * 4 for _ in lengths)
    bytes_centroids = sum(f * kv_heads * d * 4 for f in n_full)  # at a step that selects afresh
    row = {
        "shape": args.shape,
        "query_heads": heads,
        "kv_heads": kv_heads,
        "head_dim": d,
        "context": n0,
        "lengths": lengths,
        "batch": batch,
        "support": support,
        "reuse": args.reuse,
        "layers": layers,
        "threads": args.threads,
        "calls_per_path": len(results["one call"]),
        "per_row_ms": round(medians["per row"], 4),
        "one_call_ms": round(medians["one call"], 4),
        "speedup": round(medians["per row"] / medians["one call"], 2),
        "dense_ms": round(medians["dense"], 4) if "dense" in medians else None,
        "bytes_support_per_call": bytes_support,
        "bytes_centroids_per_fresh_call": bytes_centroids,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "processor": cpu._processor(),
        },
    }
    print(
        f"{args.shape} N={n0}{' ragged' if args.ragged else ''} batch={batch} S={support} R={args.reuse} "
        f"layers={layers} threads={args.threads}: one layer's sparse step, median of {row['calls_per_path']} calls: "
        f"per-row loop {row['per_row_ms']:.3f} ms, one call {row['one_call_ms']:.3f} ms ({row['speedup']}x)"
        + (f"; dense SDPA {row['dense_ms']:.3f} ms" if row["dense_ms"] is not None else "")
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(row, file, indent=1)
            file.write("\n")


if __name__ == "__main__":
    sys.exit(main())
