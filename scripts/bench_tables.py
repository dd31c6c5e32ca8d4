"""Markdown tables from `sparsedecode bench op` / `bench e2e` JSON files (for docs/benchmarks.md).

python scripts/bench_tables.py docs/bench/op-qwen2-0.5b.json docs/bench/e2e-smollm2-135m-8k.json ...
"""

from __future__ import annotations

import json
import sys


def conditions(machine: dict) -> str:
    where = machine.get("gpu") or f"cpu, {machine.get('threads')} threads"
    return (
        f"Python {machine.get('python')}, torch {machine.get('torch')}, transformers {machine.get('transformers')}, "
        f"{where}, revision {machine.get('revision')}"
    )


def op_table(data: dict) -> str:
    lines = [
        f"Measured with {conditions(data['machine'])}; read bandwidth measured in the same run: "
        f"{data['bandwidth_gbs']:.1f} GB/s.",
        "",
        "| N | S | kernel | dense ms | sparse ms | select ms | attend ms | speedup | dense MB | sparse MB "
        "| sparse / bound | dense / bound |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['context']} | {r['support']} | {r.get('kernel', 'torch')} | {r['dense_ms']:.3f} | "
            f"{r['sparse_ms']:.3f} | {r['select_ms']:.3f} | {r['attend_ms']:.3f} | {r['speedup']:.1f}x | "
            f"{r['bytes_dense'] / 1e6:.1f} | {r['bytes_sparse'] / 1e6:.2f} | {r['bound_ratio']:.1f}x | "
            f"{r['dense_bound_ratio']:.1f}x |"
        )
    return "\n".join(lines)


def e2e_table(data: dict) -> str:
    lines = [
        f"Measured with {conditions(data['machine'])}.",
        "",
        "| model | context | mode | KV cache | S | k | acceptance | prefill s | decode tok/s | vs best dense "
        "| tokens equal to dense | peak RSS MB |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        accepted = "-"
        if r.get("acceptance_rate") is not None:
            accepted = f"{100 * r['acceptance_rate']:.0f}% ({r['mean_accepted']:.2f}/round)"
        lines.append(
            f"| {r['model']} | {r['context']} | {r['mode']} | {r['cache']} | {r['support'] or '-'} | "
            f"{r.get('draft_tokens') or '-'} | {accepted} | {r['prefill_s']:.1f} | {r['decode_tokens_per_s']:.2f} | "
            f"{r['speedup_vs_best_dense']:.2f}x | {r['tokens_equal_to_dense']}/{r['tokens']} | {r['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as handle:
            data = json.load(handle)
        rows = data["rows"]
        print(f"<!-- {path} -->")
        print(op_table(data) if rows and "dense_ms" in rows[0] else e2e_table(data))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
