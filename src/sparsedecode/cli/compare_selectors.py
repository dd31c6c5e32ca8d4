"""``sparsedecode compare-selectors``: every selector on the same prompts and budget, side by side."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from ..errors import SparseDecodeError
from .common import add_model_args, check_whole_blocks, console, environment, int_list, load, progress_bars
from .outputs import atomic_path, check_output_folder, write_json, write_text


def add_parsers(sub) -> None:
    selectors = sub.add_parser("compare-selectors", help="all selectors on the same prompts and budget, side by side")
    add_model_args(selectors)
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
    selectors.set_defaults(handler=cmd_compare_selectors)


def cmd_compare_selectors(args) -> int:
    import csv
    from dataclasses import asdict

    from ..config import SELECTORS, SparseConfig

    chosen = SELECTORS if args.selectors == "all" else tuple(s.strip() for s in args.selectors.split(","))
    check_whole_blocks([SparseConfig(support=s, selector=selector) for selector in chosen for s in args.support])
    if args.tokens < 2 or args.prompts < 1:
        raise SparseDecodeError("--tokens must be >= 2 and --prompts >= 1")
    if args.retrieval < 0:
        raise SparseDecodeError(f"--retrieval must be >= 0 (passkey trials per context), got {args.retrieval}")
    check_output_folder(args.out)
    model, tokenizer = load(args)
    from ..experiments.bench import model_shape
    from ..experiments.corpus import check_context_fits
    from ..experiments.selector_comparison import ANSWER_TOKENS, PRACTICAL, compare_selectors

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
    write_json(
        args.out / "selectors.json",
        {"settings": settings, "summary": [asdict(r) for r in rows], "runs": runs, "retrieval": trials},
    )
    with atomic_path(args.out / "selectors.csv") as tmp, open(tmp, "w", newline="") as handle:
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
    write_text(args.out / "selectors.md", "\n".join(markdown))
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
