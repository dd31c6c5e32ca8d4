"""Command-line interface: ``sparsedecode run | sweep | merge | report | probe mass | probe retrieval | models``.

Bad input gets one line on stderr and exit status 2, never a traceback, and nothing half-written.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from .errors import SparseDecodeError
from .experiments.sweep import write_json_atomic

console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)
DTYPES = ("float32", "bfloat16", "float16")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SparseDecodeError(f"{self.prog}: {message}")


def int_list(text: str) -> list[int]:
    """Parse ``"97,193"`` into ``[97, 193]``."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def float_list(text: str) -> list[float]:
    """Parse ``"0,0.5,1"`` into ``[0.0, 0.5, 1.0]``."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from error
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    from .models import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="alias, local dir or .gguf, or hub id")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)


def _add_prompt_args(parser: argparse.ArgumentParser, *, tokens: int) -> None:
    parser.add_argument("--corpus", default="python-docs", help="python-docs (offline), wikitext2, or a path")
    parser.add_argument("--context", type=int_list, default=[2048], help="prompt length(s), comma-separated")
    parser.add_argument("--support", type=int_list, default=[97, 193], help="support size(s) S = 1 + W + b*B")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reuse", type=int, default=1, help="selection reuse interval R (1 = fresh each step)")
    parser.add_argument("--selector", default="mean-pooled")
    parser.add_argument("--tokens", type=int, default=tokens, help="greedy tokens T per run")
    parser.add_argument("--prompt-index", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sparsedecode", description="Sparse decoding, measured against dense decoding.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="paired dense vs sparse decoding of one prompt")
    _add_model_args(run)
    _add_prompt_args(run, tokens=128)
    run.add_argument("--json", type=Path, help="write {settings, results} here")
    run.add_argument(
        "--mode",
        default="compare",
        choices=("compare", "lossless"),
        help="compare: paired dense/sparse protocol; lossless: sparse drafts verified densely (output = dense)",
    )
    run.add_argument("--draft-tokens", type=int, default=4, help="draft length k for --mode lossless")
    run.add_argument("--adaptive", action="store_true", help="adapt k from the recent acceptance (lossless)")
    run.add_argument(
        "--audit",
        action="store_true",
        help="omitted-mass audit of every sparse step (one extra dense attention pass per step); "
        "per-step arrays go to .npz files next to --json",
    )

    probe = sub.add_parser("probe", help="probes: mass (attention-mass decomposition), retrieval (passkey)")
    probes = probe.add_subparsers(dest="probe", required=True, parser_class=_Parser)
    mass = probes.add_parser("mass", help="attention-mass decomposition per layer and head for one prompt")
    _add_model_args(mass)
    _add_prompt_args(mass, tokens=16)
    mass.add_argument("--out", type=Path, default=Path("runs/probe-mass"), help="folder for PNG and JSON")

    sub.add_parser("models", help="list built-in model aliases and what is cached")
    selectors = sub.add_parser("compare-selectors", help="all selectors on the same prompts and budget, side by side")
    _add_model_args(selectors)
    selectors.add_argument("--corpus", default="python-docs")
    selectors.add_argument("--context", type=int_list, default=[2048])
    selectors.add_argument("--support", type=int_list, default=[97, 193])
    selectors.add_argument("--prompts", type=int, default=2)
    selectors.add_argument("--tokens", type=int, default=64)
    selectors.add_argument("--selectors", default="all", help="comma-separated selectors, or all")
    selectors.add_argument("--audit", action="store_true", help="captured-mass ratio from the omitted-mass audit")
    selectors.add_argument(
        "--retrieval",
        type=int,
        default=0,
        metavar="N",
        help="passkey retrieval trials per context (depths spread over 0..1), answered by every selector; 0 = off",
    )
    selectors.add_argument("--out", type=Path, default=Path("runs/selectors"), help="folder for JSON, CSV, markdown")
    _add_experiment_parsers(sub, probes)
    _add_bench_parsers(sub)
    return parser


def _add_bench_parsers(sub) -> None:
    from .experiments.bench import DEFAULT_CONTEXTS, DEFAULT_SUPPORTS, SHAPES

    bench = sub.add_parser("bench", help="benchmarks: op (one decode-attention call), e2e (real model decoding)")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    op = benches.add_parser("op", help="one decode-attention call: torch SDPA dense vs sparse select + attend")
    op.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    op.add_argument("--context", type=int_list, default=list(DEFAULT_CONTEXTS))
    op.add_argument("--support", type=int_list, default=list(DEFAULT_SUPPORTS))
    op.add_argument("--dtype", default="float32", choices=DTYPES)
    op.add_argument("--selector", default="mean-pooled", help="any selector (see `run --help`)")
    op.add_argument("--budget", type=float, default=0.6, help="seconds of calls per timing, > 0 (at least 10 calls)")
    op.add_argument(
        "--layers",
        type=int,
        help="distinct per-layer caches the calls cycle through (default: the shape's layer count, so each call "
        "reads from memory as in a decode step: cold); 1 = one layer over and over (warm)",
    )
    op.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda[:i]: device-event timings, and the Triton kernel beside torch's gather + SDPA",
    )
    op.add_argument("--json", type=Path, help="write {machine, bandwidth_gbs, rows} here")
    e2e = benches.add_parser("e2e", help="real model: prefill, then greedy decoding dense vs sparse, same process")
    _add_model_args(e2e)
    e2e.add_argument("--corpus", default="python-docs")
    e2e.add_argument("--context", type=int_list, default=[8192])
    e2e.add_argument("--support", type=int_list, default=[193])
    e2e.add_argument("--tokens", type=int, default=64)
    e2e.add_argument("--prompt-index", type=int, default=0)
    e2e.add_argument("--json", type=Path, help="write {machine, rows} here")
    e2e.add_argument(
        "--mode",
        default="standard",
        choices=("standard", "lossless"),
        help="lossless adds self-speculative rows (sparse drafts, dense verification) beside dense and sparse",
    )
    e2e.add_argument("--draft-tokens", type=int_list, default=[4], help="draft length(s) k for --mode lossless")
    e2e.add_argument("--adaptive", action="store_true", help="adapt k from the acceptance (lossless)")
    e2e.add_argument(
        "--repeats", type=int, default=2, help="timed runs of every mode (in order, then reversed); medians reported"
    )


def _add_experiment_parsers(sub, probes) -> None:
    """``sweep``, ``merge``, ``report`` and ``probe retrieval``."""
    sweep = sub.add_parser("sweep", help="survival sweep: paired dense/sparse runs over contexts x prompts x supports")
    _add_model_args(sweep)
    sweep.add_argument("--corpus", default="python-docs", help="python-docs (offline), wikitext2, or a path")
    sweep.add_argument("--context", type=int_list, default=[2048], help="prompt lengths, comma-separated")
    sweep.add_argument("--support", type=int_list, default=[97, 193, 385, 769], help="supports S, comma-separated")
    sweep.add_argument("--reuse", type=int_list, default=[1], help="selection reuse intervals R, comma-separated")
    sweep.add_argument("--selector", default=None, help="one selector (default mean-pooled)")
    sweep.add_argument(
        "--selectors", default=None, help="comma-separated selectors, or all: one more dimension of the grid"
    )
    sweep.add_argument("--prompts", type=int, default=5, help="prompts per context (corpus prefixes 0..n-1)")
    sweep.add_argument("--tokens", type=int, default=128, help="greedy tokens T per run")
    sweep.add_argument("--window", type=int, default=64)
    sweep.add_argument("--block-size", type=int, default=16)
    sweep.add_argument("--audit", action="store_true", help="omitted-mass audit of every sparse step (slower)")
    sweep.add_argument("--shard", default=None, help="i/n: run every n-th (context, prompt) group from the i-th")
    sweep.add_argument("--out", type=Path, required=True, help="sweep folder (sweep.json, runs.jsonl); resumable")

    merge = sub.add_parser("merge", help="combine shard folders of one sweep into one folder")
    merge.add_argument("sources", type=Path, nargs="+", help="sweep folders with the same settings")
    merge.add_argument("--out", type=Path, required=True, help="folder for the merged sweep.json and runs.jsonl")

    report = sub.add_parser("report", help="report.md with tables, CSVs and plots for a sweep and/or retrieval folder")
    report.add_argument("directory", type=Path, help="a sweep folder (sweep.json) or a retrieval folder")
    report.add_argument("--retrieval", type=Path, help="retrieval.json (or its folder) to include")

    retrieval = probes.add_parser("retrieval", help="passkey retrieval, dense vs sparse, with captured mass")
    _add_model_args(retrieval)
    retrieval.add_argument("--context", type=int_list, default=[2048], help="prompt lengths, question included")
    retrieval.add_argument("--depths", type=float_list, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="0 = start")
    retrieval.add_argument("--trials", type=int, default=3, help="passkeys per (context, depth)")
    retrieval.add_argument("--support", type=int_list, default=[97, 193], help="supports S, comma-separated")
    retrieval.add_argument("--window", type=int, default=64)
    retrieval.add_argument("--block-size", type=int, default=16)
    retrieval.add_argument("--reuse", type=int, default=1)
    retrieval.add_argument("--selector", default="mean-pooled")
    retrieval.add_argument("--haystack", default="filler", help="filler (repeated sentences), or a corpus name/path")
    retrieval.add_argument("--digits", type=int, default=5, help="passkey length")
    retrieval.add_argument("--answer-tokens", type=int, default=8)
    retrieval.add_argument("--seed", type=int, default=0)
    retrieval.add_argument("--out", type=Path, default=Path("runs/probe-retrieval"), help="folder for retrieval.json")


@contextlib.contextmanager
def progress_bars(speed_estimate_period: float = 30.0) -> Iterator:
    """A ``progress(stage, done, total)`` callback drawing one rich bar per stage.

    The ETA of a bar comes from its progress over the last ``speed_estimate_period`` seconds.
    """
    bars = Progress(
        TextColumn("{task.description:>16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        speed_estimate_period=speed_estimate_period,
    )
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bars.add_task(stage, total=total, completed=done)  # work done before is not speed
        bars.update(tasks[stage], completed=done, total=total)
        if done >= total:
            bars.remove_task(tasks.pop(stage))

    with bars:
        yield update


def environment() -> dict:
    """Where numbers were measured: library versions, device, threads."""
    from .experiments.environment import environment as measured_environment

    return measured_environment()


def _continuation_table(tokenizer, result) -> Table:
    """Dense and sparse continuations side by side, tokens from the first divergence in red."""
    table = Table(show_header=True, header_style="bold", expand=True)
    table.add_column("dense", ratio=1)
    table.add_column(f"sparse S={result.settings['effective_support']}", ratio=1)
    cut = result.first_divergence - 1 if not result.survives else len(result.dense_tokens)
    cells = []
    for tokens in (result.dense_tokens, result.sparse_tokens):
        text = Text(tokenizer.decode(tokens[:cut]))
        if cut < len(tokens):
            text.append(f"⟦step {cut + 1}⟧", style="bold yellow")
            text.append(tokenizer.decode(tokens[cut:]), style="red")
        cells.append(text)
    table.add_row(*cells)
    return table


def _summary_table(title: str, results: list) -> Table:
    table = Table(title=title, title_justify="left")
    columns = (
        "S",
        "b",
        "first div.",
        "survives",
        "TF match %",
        "sparse PPL",
        "ΔPPL %",
        "certified %",
        "flips",
        "distant/KV",
        "tok/s",
    )
    for name in columns:
        table.add_column(name, justify="right")
    for r in results:
        table.add_row(
            str(r.settings["effective_support"]),
            str(r.settings["blocks"]),
            "-" if r.survives else str(r.first_divergence),
            "[green]yes[/]" if r.survives else "[red]no[/]",
            f"{r.teacher_forced_match:.1f}",
            f"{r.sparse_ppl:.3f}",
            f"{r.delta_ppl_percent:+.2f}",
            f"{100 * r.certified_fraction:.1f}",
            str(r.flips),
            f"{r.mean_unique_distant_positions_per_kv:.0f}",
            f"{(r.tokens - 1) / r.sparse_decode_s:.1f}",
        )
    return table


def _configs(args, audit: bool = False) -> list:
    from .config import SparseConfig

    return [
        SparseConfig(
            support=s,
            window=args.window,
            block_size=args.block_size,
            reuse=args.reuse,
            selector=args.selector,
            audit=audit,
        )
        for s in args.support
    ]


def _check_json_target(path: Path | None) -> None:
    if path is not None and path.exists() and path.is_dir():
        raise SparseDecodeError(f"--json {path} is a directory; give a file name")


def _prepare(args, audit: bool = False):
    """Validate prompt arguments, load the model, cut the prompts: ``(configs, model, tokenizer, prompts)``."""
    from .experiments.corpus import check_context_fits, prompt_ids
    from .models import load_model

    if args.tokens < 2:
        raise SparseDecodeError(f"--tokens must be >= 2 (got {args.tokens}): step 1 is shared with dense")
    if any(c < 1 for c in args.context):
        raise SparseDecodeError("--context values must be >= 1")
    configs = _configs(args, audit=audit)
    with console.status(f"loading {args.model} ({args.dtype})"):
        model, tokenizer = load_model(args.model, dtype=args.dtype)
    check_context_fits(model, args.context, args.tokens)
    prompts = {c: prompt_ids(tokenizer, args.corpus, c, args.prompt_index, args.tokens) for c in args.context}
    return configs, model, tokenizer, prompts


def _settings(args, command: str) -> dict:
    keys = ("model", "dtype", "corpus", "window", "block_size", "reuse", "selector", "tokens", "prompt_index")
    return {
        "command": command,
        **{key: getattr(args, key) for key in keys},
        "contexts": args.context,
        "supports": args.support,
        "environment": environment(),
    }


def _kernel_in_use(dtype: str, selector: str) -> str:
    """How sparse steps run here (``SparseConfig.kernel="auto"`` on the CPU)."""
    from . import cpu_kernel
    from .config import TOKEN_SELECTORS

    if selector in TOKEN_SELECTORS:
        return "sparse steps: torch operations (token-level selector)"
    if dtype != "float32":
        return "sparse steps: torch operations (the C kernel takes float32)"
    if cpu_kernel.library() is None:
        return f"sparse steps: torch operations (C kernel unavailable: {cpu_kernel.BUILD_ERROR})"
    if selector != "mean-pooled":
        return "sparse steps: torch selection, C kernel attention"
    return "sparse steps: C kernel"


def _conditions(args) -> str:
    import torch

    return (
        f"[bold]{args.model}[/] {args.dtype} on cpu, {torch.get_num_threads()} threads; corpus {args.corpus}, "
        f"prompt {args.prompt_index}; T = {args.tokens}; W = {args.window}, B = {args.block_size}, "
        f"R = {args.reuse}, selector {args.selector}; {_kernel_in_use(args.dtype, args.selector)}"
    )


def _layer_table(title: str, summary: dict) -> Table:
    table = Table(title=title, title_justify="left")
    columns = (
        "layer",
        "omitted ε",
        "anchor",
        "window",
        "blocks",
        "recall",
        "captured/best",
        "max |residual|",
        "bound viol.",
    )
    for name in columns:
        table.add_column(name, justify="right")
    for row in summary["layers"]:
        table.add_row(
            str(row["layer"]),
            f"{row['omitted_mass_mean']:.4f}",
            f"{row['mass_anchor_mean']:.3f}",
            f"{row['mass_window_mean']:.3f}",
            f"{row['mass_blocks_mean']:.3f}",
            f"{row['selector_recall_mean']:.3f}",
            f"{row['captured_mass_ratio_mean']:.3f}",
            f"{row['identity_residual_max']:.1e}",
            str(row["bound_violations"]),
        )
    return table


def _margin_line(result) -> str:
    cert = result.certificate
    where = (
        f"dense margin at the divergence (step {result.first_divergence}) {cert['margin_at_divergence']:.3f} vs "
        f"logit error {cert['delta_at_divergence']:.3f}"
        if cert["margin_at_divergence"] is not None
        else "no free-running divergence"
    )
    line = (
        f"S={result.settings['effective_support']}: {100 * result.certified_fraction:.1f}% of teacher-forced steps "
        f"certified (margin > 2·max|Δlogit|); {result.flips} flips, {result.certificate_violations} at certified "
        f"steps; median margin {cert['median_margin']:.3f}, median max|Δlogit| {cert['median_delta']:.3f}; {where}"
    )
    if result.warning_regime:
        from .diagnostics import WARNING_NOTE

        line += f"\n[red]warning regime:[/] {WARNING_NOTE}"
    return line


def cmd_run(args) -> int:
    from .compare import compare, dense_reference
    from .diagnostics import save_audit

    if args.mode == "lossless":
        return cmd_run_lossless(args)
    _check_json_target(args.json)
    configs, model, tokenizer, prompts = _prepare(args, audit=args.audit)
    settings = {**_settings(args, "run"), "audit": args.audit}
    console.print(_conditions(args))
    results = []
    for context, ids in prompts.items():
        with progress_bars() as progress:
            reference = dense_reference(model, ids, tokens=args.tokens, progress=progress)
            per_context = [
                compare(model, tokenizer, ids, cfg, args.tokens, reference=reference, progress=progress)
                for cfg in configs
            ]
        results.extend(per_context)
        console.print(
            f"\ncontext {context}: dense prefill {reference.prefill_s:.1f} s; dense PPL {reference.ppl:.3f} over "
            f"tokens 2..{args.tokens}; dense decode {(args.tokens - 1) / reference.decode_s:.1f} tok/s"
        )
        console.print(_summary_table(f"dense vs sparse, context {context}", per_context))
        for result in per_context:
            console.print(_margin_line(result))
            if result.audit and result.audit.get("audited_steps"):
                console.print(
                    _layer_table(
                        f"audit, context {context}, S={result.settings['effective_support']}: mean over "
                        f"{result.audit['audited_steps']} sparse steps and all heads; max identity residual "
                        f"{result.identity_residual_max:.1e} (relative), {result.bound_violations} bound violations",
                        result.audit,
                    )
                )
        for result in per_context:
            console.print(_continuation_table(tokenizer, result))
    console.print(
        "[dim]first div. = 1-based step of the first token that differs from dense (step 1 comes from dense "
        "prefill); TF = teacher-forced on the dense continuation; ΔPPL is on the dense model's own tokens, not "
        "on free-running output; certified = dense top-1/top-2 margin > 2·max|Δlogit| on the same prefix, which "
        "rules a flip out (the converse does not hold); distant/KV = distinct distant positions read per layer and "
        "KV head. A support covering context + tokens reproduces dense exactly.[/]"
    )
    if args.json:
        for result in results:
            if result.audit_arrays is not None:
                name = f"{args.json.stem}.audit-c{result.context}-s{result.settings['support']}.npz"
                save_audit(args.json.with_name(name), result.audit_arrays)
                result.audit["arrays"] = name
        write_json_atomic(args.json, {"settings": settings, "results": [r.to_dict() for r in results]})
        console.print(f"wrote {args.json}")
    return 0


def cmd_run_lossless(args) -> int:
    from .speculative import compare_lossless, generate

    _check_json_target(args.json)
    if args.draft_tokens < 1:
        raise SparseDecodeError(f"--draft-tokens must be >= 1 (got {args.draft_tokens})")
    configs, model, tokenizer, prompts = _prepare(args)
    console.print(_conditions(args) + f"; lossless, k = {args.draft_tokens}{' (adaptive)' if args.adaptive else ''}")
    table = Table(title="lossless self-speculative decoding against plain dense greedy decoding (same process)")
    for name in (
        "context",
        "S",
        "equal to dense",
        "first mismatch",
        "accepted / draft",
        "verifications",
        "draft s",
        "verify s",
        "lossless tok/s",
        "dense tok/s",
        "speedup",
    ):
        table.add_column(name, justify="right")
    results = []
    for context, ids in prompts.items():
        with progress_bars() as progress:
            dense = generate(model, ids, None, args.tokens, mode="dense", progress=progress)
            checks = [
                compare_lossless(
                    model,
                    ids,
                    cfg,
                    args.tokens,
                    draft_tokens=args.draft_tokens,
                    adaptive=args.adaptive,
                    progress=progress,
                    dense=dense,
                )
                for cfg in configs
            ]
        for cfg, check in zip(configs, checks):
            lossless = check.lossless
            first = check.mismatches[0] if check.mismatches else None
            table.add_row(
                str(context),
                str(cfg.effective_support),
                "[green]yes[/]" if check.equal else "[red]no[/]",
                f"step {first['position']} (dense margin {first['dense_margin']:.2e})" if first else "-",
                f"{100 * lossless.acceptance_rate:.0f}% ({lossless.mean_accepted:.2f}/round)",
                str(lossless.verifications),
                f"{lossless.draft_s:.2f}",
                f"{lossless.verify_s:.2f}",
                f"{lossless.decode_tokens_per_s:.2f}",
                f"{dense.decode_tokens_per_s:.2f}",
                f"{lossless.decode_tokens_per_s / dense.decode_tokens_per_s:.2f}x",
            )
            results.append({"context": context, "settings": cfg.to_dict(), **check.to_dict()})
    console.print(table)
    console.print(
        "[dim]A mismatch can only come from floating point: a (k+1)-token dense pass rounds differently from "
        "one-token steps, which can flip a near-tie; its dense top-1/top-2 margin is shown.[/]"
    )
    if args.json:
        settings = {
            **_settings(args, "run --mode lossless"),
            "draft_tokens": args.draft_tokens,
            "adaptive": args.adaptive,
        }
        write_json_atomic(args.json, {"settings": settings, "results": results})
        console.print(f"wrote {args.json}")
    return 0


def cmd_probe(args) -> int:
    return {"mass": cmd_probe_mass, "retrieval": cmd_probe_retrieval}[args.probe](args)


def cmd_probe_mass(args) -> int:
    from .compare import prefill
    from .diagnostics import save_audit
    from .experiments.probes import mass_probe
    from .plots import heatmap

    configs, model, _, prompts = _prepare(args, audit=True)
    console.print(_conditions(args))
    rows = []
    for context, ids in prompts.items():
        with progress_bars() as progress:
            cache, logits = prefill(model, ids, progress=progress)
            first = int(logits.argmax())
            probes = [
                mass_probe(model, ids, cfg, tokens=args.tokens, progress=progress, cache=cache, first=first)
                for cfg in configs
            ]
        for probe in probes:
            support = probe.settings["support"]
            if not probe.summary.get("audited_steps"):
                console.print(f"context {context}, S={support}: the support covers the context; nothing to audit")
                continue
            console.print(_layer_table(f"attention mass, context {context}, S={support}", probe.summary))
            omitted = probe.per_head("omitted_mass")
            stem = f"mass-c{context}-s{support}"
            png = heatmap(
                omitted,
                args.out / f"{stem}.png",
                title=f"{args.model}: omitted attention mass ε, context {context}, S={support}\n"
                f"mean over {probe.summary['audited_steps']} sparse decode steps",
                xlabel="query head",
                ylabel="layer",
                colorbar="omitted mass ε",
                vmax=max(float(omitted.max()), 1e-6),
            )
            save_audit(args.out / f"{stem}.npz", probe.arrays)
            rows.append(
                {
                    "context": context,
                    "settings": probe.settings,
                    "summary": probe.summary,
                    "png": png.name,
                    "seconds": probe.seconds,
                }
            )
            console.print(f"wrote {png}")
    write_json_atomic(args.out / "mass.json", {"settings": _settings(args, "probe mass"), "results": rows})
    return 0


def cmd_compare_selectors(args) -> int:
    import csv
    from dataclasses import asdict

    from .config import SELECTORS, SparseConfig
    from .experiments.bench import model_shape
    from .experiments.corpus import check_context_fits
    from .experiments.selector_comparison import ANSWER_TOKENS, PRACTICAL, compare_selectors
    from .models import load_model

    chosen = SELECTORS if args.selectors == "all" else tuple(s.strip() for s in args.selectors.split(","))
    for selector in chosen:
        for support in args.support:
            SparseConfig(support=support, selector=selector)
    if args.tokens < 2 or args.prompts < 1:
        raise SparseDecodeError("--tokens must be >= 2 and --prompts >= 1")
    if args.retrieval < 0:
        raise SparseDecodeError(f"--retrieval must be >= 0 (passkey trials per context), got {args.retrieval}")
    with console.status(f"loading {args.model} ({args.dtype})"):
        model, tokenizer = load_model(args.model, dtype=args.dtype)
    check_context_fits(model, args.context, max(args.tokens, ANSWER_TOKENS if args.retrieval else 0))
    shape = model_shape(model.config)
    with progress_bars() as progress:
        rows, runs, trials = compare_selectors(
            model,
            tokenizer,
            corpus=args.corpus,
            contexts=tuple(args.context),
            supports=tuple(args.support),
            prompts=args.prompts,
            tokens=args.tokens,
            selectors=chosen,
            audit=args.audit,
            retrieval=args.retrieval,
            op_shape=shape,
            progress=progress,
        )
    headers = (
        "context",
        "selector",
        "practical",
        "S",
        "survived",
        "median first div.",
        "median TF match %",
        "median ΔPPL %",
        "certified %",
        "captured / best",
        "passkey found",
        "op ms",
    )
    cells = [
        (
            str(r.context),
            r.selector,
            "yes" if r.practical else "reference",
            str(r.support),
            f"{r.survived}/{r.runs}",
            f"{r.median_first_divergence:g}",
            f"{r.median_teacher_forced_match:.1f}",
            f"{r.median_delta_ppl_percent:+.2f}",
            f"{100 * r.certified_fraction:.1f}",
            "-" if r.captured_mass_ratio is None else f"{r.captured_mass_ratio:.3f}",
            "-" if r.retrieval_correct is None else f"{r.retrieval_correct}/{r.retrieval_trials}",
            "-" if r.op_ms is None else f"{r.op_ms:.3f}",
        )
        for r in rows
    ]
    table = Table(
        title=f"selectors under one budget: {args.model} {args.dtype} cpu, {args.prompts} prompts of "
        f"{args.corpus}, T = {args.tokens}"
    )
    for name in headers:
        table.add_column(name, justify="right")
    for row in cells:
        table.add_row(*row)
    console.print(table)
    for line in _dense_retrieval_lines(rows)[:1]:
        console.print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {
        key: getattr(args, key)
        for key in ("model", "dtype", "corpus", "context", "support", "prompts", "tokens", "audit", "retrieval")
    }
    settings["selectors"] = list(chosen)
    settings["environment"] = environment()
    write_json_atomic(
        args.out / "selectors.json",
        {"settings": settings, "summary": [asdict(r) for r in rows], "runs": runs, "retrieval": trials},
    )
    with open(args.out / "selectors.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(list(asdict(rows[0])))
        writer.writerows(list(asdict(r).values()) for r in rows)
    reads = "\n".join(
        f"| `{name}` | {'practical' if practical else 'reference'} | {what} |"
        for name, (practical, what) in PRACTICAL.items()
        if name in chosen
    )
    markdown = [
        f"# Selectors under one budget: {args.model}",
        "",
        f"Produced by `sparsedecode compare-selectors --model {args.model} --context "
        f"{','.join(map(str, args.context))} --support {','.join(map(str, args.support))} --prompts {args.prompts} "
        f"--tokens {args.tokens}{' --audit' if args.audit else ''}"
        f"{f' --retrieval {args.retrieval}' if args.retrieval else ''}` ({args.dtype}, cpu, "
        f"{settings['environment']['threads']} threads, corpus {args.corpus}, torch "
        f"{settings['environment']['torch']}, transformers {settings['environment']['transformers']}).",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(row) + " |" for row in cells),
        "",
        *_dense_retrieval_lines(rows),
        "What each selector reads per step:",
        "",
        "| selector | kind | reads |",
        "|---|---|---|",
        reads,
        "",
        "Medians over the prompts; ΔPPL is teacher-forced on the dense continuation; certified = share of "
        "teacher-forced steps whose dense margin exceeds twice the logit error; captured / best = true attention "
        "mass on the kept distant positions over the best mass at the same budget (needs --audit); passkey found = "
        "passkey retrieval trials answered correctly (needs --retrieval N: N passkeys per context at depths spread "
        f"over the haystack, filler haystack, {ANSWER_TOKENS} greedy answer tokens, exact match); op ms = one "
        "sparse decode-attention call on synthetic data of this model's shape (selection + attention), measured "
        "in the same process. Few prompts and one model: this ranks selectors on this setup, it does not "
        "establish a general ordering.",
        "",
    ]
    (args.out / "selectors.md").write_text("\n".join(markdown))
    console.print(f"wrote {args.out / 'selectors.md'}, selectors.csv, selectors.json")
    return 0


def _dense_retrieval_lines(rows) -> list[str]:
    """The dense baseline of the passkey trials, one sentence per context (nothing when retrieval was off)."""
    dense = {r.context: r for r in rows if r.retrieval_trials}
    if not dense:
        return []
    found = "; ".join(
        f"{r.dense_retrieval_correct}/{r.retrieval_trials} at context {context}" for context, r in dense.items()
    )
    return [f"Dense attention found the passkey in {found} (the same trials).", ""]


def cmd_models(args) -> int:
    from .models import list_models

    table = Table(title="models")
    for name in ("alias", "description", "gguf cached", "converted", "path"):
        table.add_column(name)
    for row in list_models():
        table.add_row(
            row["alias"],
            row.get("description", ""),
            "yes" if row.get("cached_gguf") else "no",
            "yes" if row.get("converted") else "no",
            str(row.get("path") or ""),
        )
    console.print(table)
    return 0


def _sweep_spec(args):
    from .experiments.sweep import SweepSpec

    return SweepSpec(
        model=args.model,
        dtype=args.dtype,
        corpus=args.corpus,
        contexts=tuple(args.context),
        supports=tuple(args.support),
        reuse=tuple(args.reuse),
        selectors=_sweep_selectors(args),
        prompts=args.prompts,
        tokens=args.tokens,
        window=args.window,
        block_size=args.block_size,
        audit=args.audit,
    )


def _sweep_selectors(args) -> tuple[str, ...]:
    """``--selector NAME`` or ``--selectors A,B,C`` (or ``all``); not both."""
    from .config import SELECTORS

    if args.selector is not None and args.selectors is not None:
        raise SparseDecodeError("give --selector NAME or --selectors A,B,C, not both")
    if args.selectors is None:
        return (args.selector or "mean-pooled",)
    if args.selectors.strip() == "all":
        return SELECTORS
    chosen = tuple(part.strip() for part in args.selectors.split(",") if part.strip())
    if not chosen:
        raise SparseDecodeError("--selectors expects comma-separated selector names, or all")
    return chosen


def _row_line(row: dict) -> str:
    fate = "[green]survives[/]" if row["survives"] else f"first divergence at step {row['first_divergence']}"
    return (
        f"context {row['context']}, prompt {row['prompt_index']}, {row['selector']}, S={row['support']}, "
        f"R={row['reuse']}: {fate}; "
        f"TF match {row['teacher_forced_match']:.1f}%, ΔPPL {row['delta_ppl_percent']:+.2f}% ({row['run_s']:.1f} s)"
    )


def cmd_sweep(args) -> int:
    from .experiments.sweep import Shard, read_meta, run_sweep
    from .models import load_model

    spec = _sweep_spec(args)
    shard = Shard.parse(args.shard) if args.shard else None
    meta = read_meta(args.out)
    if meta is not None:  # refuse a changed spec before spending time on the model
        from .experiments.sweep import check_meta

        check_meta(args.out, meta, spec, None, shard or Shard())
    with console.status(f"loading {args.model} ({args.dtype})"):
        loaded = load_model(args.model, dtype=args.dtype)
    console.print(
        f"[bold]{args.model}[/] {args.dtype}; corpus {args.corpus}; contexts {args.context}; supports {args.support}; "
        f"R {args.reuse}; {args.prompts} prompts; T = {args.tokens}; W = {args.window}, B = {args.block_size}; "
        f"selector(s) {', '.join(spec.selectors)}" + (f"; shard {shard}" if shard else "")
    )
    with progress_bars(speed_estimate_period=24 * 3600.0) as progress:

        def started(done: int, total: int) -> None:
            if done:
                console.print(f"resuming {args.out}: {done} of {total} runs already done")
            progress("runs", done, total)

        def finished(row: dict, done: int, total: int) -> None:
            console.print(_row_line(row))
            progress("runs", done, total)

        outcome = run_sweep(
            spec, args.out, shard=shard, loaded=loaded, progress=progress, on_row=finished, on_start=started
        )
    console.print(
        f"{outcome.ran} runs now, {outcome.done_before} before: {outcome.done_before + outcome.ran} of {outcome.total}"
        f" in {args.out / 'runs.jsonl'}; `sparsedecode report {args.out}` summarises them"
    )
    return 0


def cmd_merge(args) -> int:
    from .experiments.sweep import merge_sweeps

    outcome = merge_sweeps(args.sources, args.out)
    console.print(
        f"merged {len(args.sources)} folder(s) into {args.out}: {outcome.rows} runs, {outcome.duplicates} duplicate(s) "
        f"dropped, {outcome.missing} run(s) of the grid still missing"
    )
    return 0


def cmd_report(args) -> int:
    from .report import write_report

    with console.status(f"writing the report for {args.directory}"):
        path = write_report(args.directory, retrieval=args.retrieval)
    console.print(f"wrote {path}")
    return 0


def _retrieval_command(args) -> str:
    return (
        f"sparsedecode probe retrieval --model {args.model} --dtype {args.dtype} "
        f"--context {','.join(map(str, args.context))} --depths {','.join(f'{d:g}' for d in args.depths)} "
        f"--trials {args.trials} --support {','.join(map(str, args.support))} --haystack {args.haystack} "
        f"--out {args.out}"
    )


def cmd_probe_retrieval(args) -> int:
    from .experiments.environment import environment as measured_environment
    from .experiments.retrieval import RetrievalSpec, accuracy, run_retrieval
    from .models import load_model

    spec = RetrievalSpec(
        model=args.model,
        dtype=args.dtype,
        contexts=tuple(args.context),
        depths=tuple(args.depths),
        trials=args.trials,
        supports=tuple(args.support),
        window=args.window,
        block_size=args.block_size,
        reuse=args.reuse,
        selector=args.selector,
        haystack=args.haystack,
        digits=args.digits,
        answer_tokens=args.answer_tokens,
        seed=args.seed,
    )
    with console.status(f"loading {args.model} ({args.dtype})"):
        loaded = load_model(args.model, dtype=args.dtype)
    console.print(
        f"[bold]{args.model}[/] {args.dtype}; passkey retrieval, haystack {args.haystack}; contexts {args.context}; "
        f"depths {args.depths}; {args.trials} trials; supports {args.support}"
    )

    def show(trial: dict) -> None:
        mode = "dense" if trial["mode"] == "dense" else f"S={trial['support']}"
        mass = trial["captured_mass_ratio_mean"]
        console.print(
            f"context {trial['context']}, depth {trial['depth']:g}, trial {trial['trial']}, {mode}: "
            + ("[green]found[/]" if trial["correct"] else "[red]missed[/]")
            + f" {trial['passkey']} in {trial['answer']!r}"
            + (f"; captured mass {mass:.3f}, needle read {trial['needle_read_mean']:.2f}" if mass is not None else "")
        )

    with progress_bars(speed_estimate_period=3600.0) as progress:
        trials = run_retrieval(spec, loaded=loaded, progress=progress, on_trial=show)
    data = {
        "spec": spec.to_dict(),
        "command": _retrieval_command(args),
        "environment": measured_environment(loaded[0]),
        "trials": trials,
    }
    write_json_atomic(args.out / "retrieval.json", data)
    table = Table(title="passkey exact-match accuracy")
    for name in ("mode", "context", "depth", "correct"):
        table.add_column(name, justify="right")
    for row in accuracy(trials):
        table.add_row(row["mode"], str(row["context"]), f"{row['depth']:g}", f"{row['correct']}/{row['trials']}")
    console.print(table)
    console.print(f"wrote {args.out / 'retrieval.json'}; `sparsedecode report {args.out}` renders it")
    return 0


def cmd_bench(args) -> int:
    return {"op": cmd_bench_op, "e2e": cmd_bench_e2e}[args.bench](args)


def cmd_bench_op(args) -> int:
    import torch

    from .experiments.bench import bench_op, check_op_args, op_rows_as_dicts

    _check_json_target(args.json)
    check_op_args(
        args.shape,
        tuple(args.context),
        tuple(args.support),
        selector=args.selector,
        budget_s=args.budget,
        layers=args.layers,
    )
    dtype = getattr(torch, args.dtype)
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SparseDecodeError(f"--device {args.device}: torch sees no CUDA device here")
        where = f"{torch.cuda.get_device_name(args.device)}, torch SDPA dense (its own backend choice)"
    elif args.device == "cpu":
        where = f"cpu, {torch.get_num_threads()} threads"
    else:
        raise SparseDecodeError(f"--device must be cpu or cuda[:i] (got {args.device!r})")
    console.print(
        f"bench op: shape {args.shape}, {args.dtype}, {where}; medians over repeated calls, dense and sparse "
        "measured side by side in this process"
    )
    with progress_bars() as progress:
        rows, bandwidth = bench_op(
            args.shape,
            tuple(args.context),
            tuple(args.support),
            dtype=dtype,
            selector=args.selector,
            budget_s=args.budget,
            device=args.device,
            layers=args.layers,
            progress=progress,
        )
    table = Table(
        title=f"one decode-attention call, {args.shape}, calls cycling through per-layer caches; "
        f"read bandwidth measured now: {bandwidth:.1f} GB/s"
    )
    for name in (
        "N",
        "S",
        "layers",
        "sparse WS MB",
        "kernel",
        "dense ms",
        "sparse ms",
        "select ms",
        "attend ms",
        "speedup",
        "dense MB",
        "sparse MB",
        "sparse / bound",
        "dense / bound",
    ):
        table.add_column(name, justify="right")

    def fits(mb: float, llc: float | None) -> str:
        return "*" if llc is not None and mb <= llc else ""

    for r in rows:
        table.add_row(
            str(r.context),
            str(r.support),
            str(r.layers) if r.layers == r.layers_requested else f"{r.layers} of {r.layers_requested}!",
            f"{r.working_set_mb:.1f}{fits(r.working_set_mb, r.llc_mb)}",
            r.kernel,
            f"{r.dense_ms:.3f}",
            f"{r.sparse_ms:.3f}",
            f"{r.select_ms:.3f}",
            f"{r.attend_ms:.3f}",
            f"{r.speedup:.1f}x",
            f"{r.bytes_dense / 1e6:.1f}",
            f"{r.bytes_sparse / 1e6:.2f}",
            f"{r.bound_ratio:.1f}x",
            f"{r.dense_bound_ratio:.1f}x",
        )
    console.print(table)
    for context, note in dict((r.context, r.layers_note) for r in rows if r.layers_note).items():
        console.print(f"[yellow]N = {context}: {note}; rows marked ! cycle through fewer layers than asked[/]")
    llc = next((r.llc_mb for r in rows if r.llc_mb is not None), None)
    console.print(
        "[dim]Calls cycle through the layers' caches (0, 1, ..., L - 1, 0, ...) as a decode step does; sparse WS = "
        "what the sparse calls read in one cycle"
        + (f" (* = fits in the {llc:.0f} MB last-level cache: partly warm even when cycling)" if llc else "")
        + ". bound = bytes one call must read / measured read bandwidth. Isolated operator timings say nothing about "
        "matched-quality or end-to-end speed.[/]"
    )
    if args.json:
        data = {"machine": environment(), "bandwidth_gbs": bandwidth, "rows": op_rows_as_dicts(rows)}
        write_json_atomic(args.json, data)
        console.print(f"wrote {args.json}")
    return 0


def cmd_bench_e2e(args) -> int:
    from dataclasses import asdict

    from .config import SparseConfig
    from .experiments.bench import bench_e2e
    from .experiments.corpus import check_context_fits, prompt_ids
    from .models import load_model

    _check_json_target(args.json)
    if args.tokens < 1:
        raise SparseDecodeError(f"--tokens must be >= 1 (got {args.tokens})")
    if min(args.draft_tokens) < 1:
        raise SparseDecodeError("--draft-tokens values must be >= 1")
    if args.repeats < 1:
        raise SparseDecodeError(f"--repeats must be >= 1 (got {args.repeats})")
    for support in args.support:
        SparseConfig(support=support)
    with console.status(f"loading {args.model} ({args.dtype})"):
        model, tokenizer = load_model(args.model, dtype=args.dtype)
    check_context_fits(model, args.context, args.tokens)
    rows = []
    for context in args.context:
        ids = prompt_ids(tokenizer, args.corpus, context, args.prompt_index, args.tokens)
        with progress_bars() as progress:
            rows.extend(
                bench_e2e(
                    model,
                    args.model,
                    ids,
                    tuple(args.support),
                    tokens=args.tokens,
                    progress=progress,
                    lossless=tuple(args.draft_tokens) if args.mode == "lossless" else (),
                    adaptive=args.adaptive,
                    repeats=args.repeats,
                )
            )
    table = Table(
        title=f"end to end, {args.model} {args.dtype} on cpu: {args.tokens} greedy tokens after a dense prefill"
    )
    for name in (
        "context",
        "mode",
        "KV cache",
        "S",
        "k",
        "accepted",
        "prefill s",
        "decode tok/s",
        "vs best dense",
        "same tokens",
        "peak RSS MB",
    ):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            str(r.context),
            r.mode,
            r.cache,
            str(r.support or "-"),
            str(r.draft_tokens or "-"),
            f"{100 * r.acceptance_rate:.0f}%" if r.acceptance_rate is not None else "-",
            f"{r.prefill_s:.1f}",
            f"{r.decode_tokens_per_s:.2f}",
            f"{r.speedup_vs_best_dense:.2f}x",
            f"{r.tokens_equal_to_dense}/{r.tokens}",
            f"{r.peak_rss_mb:.0f}",
        )
    console.print(table)
    console.print(
        f"[dim]every mode runs {args.repeats} times (in order, then reversed) and reports the median; 'same tokens' = "
        "leading tokens equal to dense greedy output; peak RSS is the process peak so far.[/]"
    )
    if args.json:
        write_json_atomic(args.json, {"machine": environment(), "rows": [asdict(r) for r in rows]})
        console.print(f"wrote {args.json}")
    return 0


COMMANDS = {
    "compare-selectors": cmd_compare_selectors,
    "bench": cmd_bench,
    "run": cmd_run,
    "models": cmd_models,
    "probe": cmd_probe,
    "sweep": cmd_sweep,
    "merge": cmd_merge,
    "report": cmd_report,
}


def _quiet_transformers() -> None:
    """Our own progress bars replace transformers' tqdm bars and info logging."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _quiet_transformers()
        return COMMANDS[args.command](args)
    except SparseDecodeError as error:
        print(f"sparsedecode: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sparsedecode: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
