"""Markdown tables from `sparsedecode bench op` / `bench e2e` JSON files (for docs/benchmarks.md).

python scripts/bench_tables.py docs/bench/op-qwen2-0.5b.json docs/bench/e2e-smollm2-135m-8k.json ...
python scripts/bench_tables.py --cold-warm docs/bench/op-qwen2-0.5b.json docs/bench/op-qwen2-0.5b-warm.json
python scripts/bench_tables.py --targets docs/bench/op-qwen2-0.5b.json   # issue 11's goals, cold, S = 193, C kernel
"""

from __future__ import annotations

import json
import sys


def conditions(data: dict) -> str:
    """Versions, device and revision; the start date and wall time too where the file has them (later files)."""
    machine = data["machine"]
    where = machine.get("gpu") or f"cpu, {machine.get('threads')} threads"
    run = data.get("run")
    when = f", started {run['started_utc']} UTC, {run['wall_s']:.0f} s in all" if run else ""
    return (
        f"Python {machine.get('python')}, torch {machine.get('torch')}, transformers {machine.get('transformers')}, "
        f"{where}, revision {machine.get('revision')}{when}"
    )


def layers(row: dict) -> str:
    """Layers cycled through; "10 of 32" where memory capped them (rows written before layers existed: 1)."""
    got, asked = row.get("layers", 1), row.get("layers_requested", 1)
    return str(got) if got == asked else f"{got} of {asked}"


def working_set(row: dict) -> str:
    """The sparse working set in MB, starred where it fits in the last-level cache (partly warm when cycling)."""
    mb = row.get("working_set_mb", row["bytes_sparse"] / 1e6)
    fits = row.get("llc_mb") is not None and mb <= row["llc_mb"]
    return f"{mb:.1f}{'*' if fits else ''}"


def notes(data: dict) -> str:
    """The memory caps the rows report, one line per context."""
    capped = {r["context"]: r["layers_note"] for r in data["rows"] if r.get("layers_note")}
    return "\n".join(f"N = {context}: {note}." for context, note in capped.items())


def op_table(data: dict) -> str:
    lines = [
        f"Measured with {conditions(data)}; read bandwidth measured in the same run: {data['bandwidth_gbs']:.1f} GB/s.",
        "",
        "| N | S | layers | sparse WS MB | kernel | dense ms | sparse ms | select ms | attend ms | speedup | dense MB "
        "| sparse MB | sparse / bound | dense / bound |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['context']} | {r['support']} | {layers(r)} | {working_set(r)} | {r.get('kernel', 'torch')} | "
            f"{r['dense_ms']:.3f} | "
            f"{r['sparse_ms']:.3f} | {r['select_ms']:.3f} | {r['attend_ms']:.3f} | {r['speedup']:.1f}x | "
            f"{r['bytes_dense'] / 1e6:.1f} | {r['bytes_sparse'] / 1e6:.2f} | {r['bound_ratio']:.1f}x | "
            f"{r['dense_bound_ratio']:.1f}x |"
        )
    if notes(data):
        lines += ["", notes(data)]
    return "\n".join(lines)


def cold_warm_table(cold: dict, warm: dict) -> str:
    """Cold rows (calls cycling through every layer's cache) beside warm rows (one layer over and over)."""
    key = ("context", "support", "kernel")
    warm_rows = {tuple(r.get(k) for k in key): r for r in warm["rows"]}
    lines = [
        f"Cold: {conditions(cold)}, read bandwidth {cold['bandwidth_gbs']:.1f} GB/s. "
        f"Warm: {conditions(warm)}, {warm['bandwidth_gbs']:.1f} GB/s.",
        "",
        "| N | S | kernel | layers | sparse WS MB | dense ms | sparse ms | speedup | sparse / bound "
        "| warm: dense ms | warm: sparse ms | warm: speedup | warm: sparse / bound |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in cold["rows"]:
        w = warm_rows.get(tuple(r.get(k) for k in key))
        warm_cells = (
            f"{w['dense_ms']:.3f} | {w['sparse_ms']:.3f} | {w['speedup']:.1f}x | {w['bound_ratio']:.1f}x"
            if w
            else "- | - | - | -"
        )
        lines.append(
            f"| {r['context']} | {r['support']} | {r.get('kernel', 'torch')} | {layers(r)} | {working_set(r)} | "
            f"{r['dense_ms']:.3f} | {r['sparse_ms']:.3f} | {r['speedup']:.1f}x | {r['bound_ratio']:.1f}x | "
            f"{warm_cells} |"
        )
    if notes(cold):
        lines += ["", notes(cold)]
    return "\n".join(lines)


def targets_table(data: dict, support: int = 193, kernel: str = "c") -> str:
    """Issue 11's goals for the sparse step under the cold condition, against the rows of one bench op run."""
    rows = {r["context"]: r for r in data["rows"] if r["support"] == support and r.get("kernel") == kernel}
    lines = ["| target | measured | met |", "| --- | --- | --- |"]

    def add(target: str, measured: str, met: bool) -> None:
        lines.append(f"| {target} | {measured} | {'yes' if met else 'no'} |")

    if 131072 in rows:
        r = rows[131072]
        add(
            "N = 131072: at least 50x faster than torch SDPA",
            f"{r['speedup']:.1f}x ({r['sparse_ms']:.3f} ms vs {r['dense_ms']:.3f} ms; {layers(r)} layers)",
            r["speedup"] >= 50,
        )
    far = [rows[n] for n in sorted(rows) if n >= 32768]
    if far:
        add(
            "N >= 32768: within 2x of its bytes / bandwidth bound",
            ", ".join(f"{r['bound_ratio']:.1f}x at {r['context']}" for r in far),
            all(r["bound_ratio"] <= 2 for r in far),
        )
    if 2048 in rows:
        r = rows[2048]
        add(
            "N = 2048: not slower than dense",
            f"{r['sparse_ms']:.3f} ms vs {r['dense_ms']:.3f} ms dense ({r['speedup']:.2f}x)",
            r["speedup"] >= 1,
        )
    return "\n".join(lines)


def e2e_table(data: dict) -> str:
    lines = [
        f"Measured with {conditions(data)}.",
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


def load(path: str) -> dict:
    with open(path) as handle:
        return json.load(handle)


MODES = {"--cold-warm": 3, "--targets": 2}
"""The two table modes and how many arguments each takes (the mode included)."""


def main(paths: list[str]) -> int:
    if not paths or paths[0] in ("-h", "--help") or (paths[0].startswith("-") and paths[0] not in MODES):
        print(__doc__.strip(), file=sys.stdout if paths[:1] in (["-h"], ["--help"]) else sys.stderr)
        return 0 if paths[:1] in (["-h"], ["--help"]) else 2
    if paths[0] in MODES and len(paths) != MODES[paths[0]]:
        print(f"{paths[0]} takes {MODES[paths[0]] - 1} file(s); see --help", file=sys.stderr)
        return 2
    if paths[:1] == ["--cold-warm"] and len(paths) == 3:
        print(cold_warm_table(load(paths[1]), load(paths[2])))
        return 0
    if paths[:1] == ["--targets"] and len(paths) == 2:
        print(targets_table(load(paths[1])))
        return 0
    for path in paths:
        try:
            with open(path) as handle:
                data = json.load(handle)
        except (OSError, ValueError) as error:
            print(f"{path}: {error}", file=sys.stderr)
            return 2
        rows = data["rows"]
        print(f"<!-- {path} -->")
        print(op_table(data) if rows and "dense_ms" in rows[0] else e2e_table(data))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
