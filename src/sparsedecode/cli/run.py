"""``sparsedecode run``: paired dense vs sparse decoding of one prompt, or lossless self-speculative decoding."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from ..errors import SparseDecodeError
from .arguments import file_arg
from .conditions import conditions, run_settings
from .display import console, layer_table, plain, progress_bars
from .loading import prepare
from .outputs import check_output_file, inputs_of, write_json
from .parser import DRAFT_TOKENS, add_model_args, add_prompt_args, add_weights_arg, check_adaptive_draft


def add_parsers(sub) -> None:
    run = sub.add_parser(
        "run",
        help="paired dense vs sparse decoding of one prompt",
        description="Dense greedy decoding of one prompt against sparse decoding at each support: free-running "
        "(first divergence) and teacher-forced (match, perplexity), the margin certificate, both continuations "
        "side by side.",
        epilog="examples:\n"
        "  sparsedecode run --context 2048 --support 97,193 --tokens 64 --prompt-index 2\n"
        "  sparsedecode run --mode lossless --draft-tokens 4 --context 1024 --support 193 --tokens 32 --json run.json",
    )
    add_model_args(run)
    add_weights_arg(run)
    add_prompt_args(run, tokens=128)
    run.add_argument("--json", type=file_arg, help="write {settings, results} to this JSON file (default: not written)")
    run.add_argument(
        "--mode",
        default="compare",
        choices=("compare", "lossless"),
        help="compare: paired dense/sparse protocol; lossless: sparse drafts verified densely (output = dense)",
    )
    run.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        help=f"draft length k for --mode lossless (default {DRAFT_TOKENS}, or --tokens - 1 if less)",
    )
    run.add_argument("--adaptive", action="store_true", help="adapt k from the recent acceptance (lossless)")
    run.add_argument(
        "--audit",
        action="store_true",
        help="omitted-mass audit of every sparse step (one extra dense attention pass per step); "
        "per-step arrays go to .npz files next to --json",
    )
    run.set_defaults(handler=cmd_run)


def _continuation_table(tokenizer, result) -> Table:
    """Dense and sparse continuations side by side, tokens from the first divergence in red."""
    table = Table(show_header=True, header_style="bold", expand=True)
    table.add_column("dense", ratio=1)
    table.add_column(f"sparse S={result.settings['effective_support']}", ratio=1)
    cut = len(result.dense_tokens) if result.survives else result.first_divergence  # tokens before s_t != d_t
    cells = []
    for tokens in (result.dense_tokens, result.sparse_tokens):
        text = Text(tokenizer.decode(tokens[:cut]))
        if cut < len(tokens):
            text.append(f"⟦step {cut}⟧", style="bold yellow")
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
        from ..protocol.diagnostics import WARNING_NOTE

        line += f"\n[red]warning regime:[/] {WARNING_NOTE}"
    return line


def cmd_run(args) -> int:
    if args.mode == "lossless":
        if args.audit:  # it would be ignored: lossless output is dense, its drafts are not compared step by step
            raise SparseDecodeError("--audit applies to --mode compare only (the paired comparison's sparse steps)")
        return cmd_run_lossless(args)
    if args.draft_tokens is not None or args.adaptive:
        raise SparseDecodeError("--draft-tokens and --adaptive apply to --mode lossless only")
    audits = (
        tuple(args.json.with_name(_audit_name(args.json, c, s)) for c in args.context for s in args.support)
        if args.json and args.audit
        else ()
    )
    check_output_file(args.json, "--json", inputs=inputs_of(args), also=audits)
    configs, model, tokenizer, prompts = prepare(args, audit=args.audit)
    from ..protocol.diagnostics import save_audit
    from ..protocol.paired import compare, dense_reference

    settings = {**run_settings(args, "run"), "audit": args.audit}
    console.print(conditions(args))
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
                    layer_table(
                        f"audit, context {context}, S={result.settings['effective_support']}: mean over "
                        f"{result.audit['audited_steps']} sparse steps and all heads; max identity residual "
                        f"{result.identity_residual_max:.1e} (relative), {result.bound_violations} bound violations",
                        result.audit,
                    )
                )
        for result in per_context:
            console.print(_continuation_table(tokenizer, result))
    console.print(
        "[dim]first div. = the decode step t >= 1 whose sparse token first differs from dense (token 0 comes from "
        "the shared dense prefill; T when none); TF = teacher-forced on the dense continuation; ΔPPL is on the "
        "dense model's own tokens, not on free-running output; certified = dense top-1/top-2 margin > "
        "2·max|Δlogit| on the same prefix, which rules a flip out (the converse does not hold); distant/KV = "
        "distinct distant positions read per layer and KV head. A support covering context + tokens - 1 "
        "reproduces dense exactly.[/]"
    )
    if args.json:
        for result in results:
            if result.audit_arrays is not None:
                name = _audit_name(args.json, result.context, result.settings["support"])
                save_audit(args.json.with_name(name), result.audit_arrays)
                result.audit["arrays"] = name
        write_json(args.json, {"settings": settings, "results": [r.to_dict() for r in results]})
        console.print(f"wrote {plain(args.json)}")
    return 0


def _audit_name(json_path, context: int, support: int) -> str:
    """The file beside ``--json`` that holds a run's per-step audit arrays."""
    return f"{json_path.stem}.audit-c{context}-s{support}.npz"


def cmd_run_lossless(args) -> int:
    check_output_file(args.json, "--json", inputs=inputs_of(args))
    if args.draft_tokens is None:  # the default, within what --tokens leaves
        args.draft_tokens = max(1, min(DRAFT_TOKENS, args.tokens - 1))
    if not 1 <= args.draft_tokens <= max(args.tokens - 1, 1):  # --tokens itself is checked by prepare
        raise SparseDecodeError(
            f"--draft-tokens must be between 1 and --tokens - 1 = {args.tokens - 1} (got {args.draft_tokens})"
        )
    check_adaptive_draft([args.draft_tokens], args.adaptive)
    configs, model, tokenizer, prompts = prepare(args)
    from ..decoding.generate import compare_lossless, generate

    console.print(conditions(args) + f"; lossless, k = {args.draft_tokens}{' (adaptive)' if args.adaptive else ''}")
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
            **run_settings(args, "run --mode lossless"),
            "draft_tokens": args.draft_tokens,
            "adaptive": args.adaptive,
        }
        write_json(args.json, {"settings": settings, "results": results})
        console.print(f"wrote {plain(args.json)}")
    return 0
