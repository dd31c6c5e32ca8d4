"""``sparsedecode compare-selectors``: every selector on the same prompts and budget, side by side."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from ..errors import SparseDecodeError
from .arguments import int_list, path_arg, selector_list
from .backend import add_backend_args, check_backend_args, executor
from .conditions import environment, plain_layers
from .display import console, plain, progress_bars
from .loading import check_one_support_per_budget, check_whole_blocks, load
from .outputs import VOLATILE, check_output_folder, check_replaced_alike, inputs_of
from .parser import add_dense_layers_arg, add_model_args, layer_budget

HOW_MADE = (*VOLATILE, "parts", "op_ms_remeasured")
"""Settings of ``selectors.json`` that say how a comparison was made, not what it compares: the folders a ``merge``
joined (``parts``) and a re-measurement of its op times (``scripts/retime_selector_ops.py``). A rerun of the same
settings replaces such a comparison, as any other; a rerun of other settings is refused naming the one that differs."""


def add_parsers(sub) -> None:
    selectors = sub.add_parser(
        "compare-selectors",
        help="all selectors on the same prompts and budget, side by side",
        description="One dense reference per context and prompt, every selector at every support paired with it: "
        "survival, first divergence, teacher-forced match, perplexity, the certificate, and with the options "
        "captured mass and passkey retrieval; selectors.md, CSV and JSON in OUT.",
        epilog="examples:\n"
        "  sparsedecode compare-selectors --context 1024 --support 97,193 --prompts 1 --tokens 32\n"
        "  sparsedecode compare-selectors --context 2048 --support 97,193 --audit --retrieval 5 "
        "--out runs/selectors-audit",
    )
    add_model_args(selectors)
    selectors.add_argument("--corpus", default="python-docs")
    selectors.add_argument("--context", type=int_list, default=[2048])
    selectors.add_argument("--support", type=int_list, default=[97, 193])
    selectors.add_argument("--prompts", type=int, default=2)
    selectors.add_argument("--tokens", type=int, default=64)
    selectors.add_argument(
        "--selectors", type=selector_list, default="all", help="comma-separated selector names, or all"
    )
    add_dense_layers_arg(selectors)
    selectors.add_argument(
        "--audit",
        action="store_true",
        help="captured-mass ratio from the omitted-mass audit (one extra dense pass per step)",
    )
    selectors.add_argument(
        "--retrieval",
        type=int,
        default=0,
        metavar="N",
        help="passkey retrieval trials per context (depths spread over 0..1), answered by every selector; 0 = off",
    )
    selectors.add_argument(
        "--batch",
        type=int,
        default=1,
        help="decode up to this many prompts of one context together (same runs, faster)",
    )
    selectors.add_argument(
        "--out",
        type=path_arg,
        default=Path("runs/selectors"),
        help="folder for selectors.json, selectors.csv and selectors.md",
    )
    add_backend_args(selectors, unit="(context, prompt) and passkey trial")
    selectors.set_defaults(handler=cmd_compare_selectors)


def cmd_compare_selectors(args) -> int:
    from dataclasses import asdict

    from ..config import SparseConfig

    chosen = args.selectors
    budget = layer_budget(args)  # its per-layer supports are whole blocks too, as --support is
    check_whole_blocks([SparseConfig(support=s, selector=c, **budget) for c in chosen for s in args.support])
    check_one_support_per_budget(args)  # found by probing: the default 97,193 ran one configuration twice
    if args.tokens < 2 or args.prompts < 1:
        raise SparseDecodeError("--tokens must be >= 2 and --prompts >= 1")
    if args.batch < 1:
        raise SparseDecodeError(f"--batch must be >= 1, got {args.batch}")
    if args.retrieval < 0:
        raise SparseDecodeError(f"--retrieval must be >= 0 (passkey trials per context), got {args.retrieval}")
    check_backend_args(args)
    written = ("selectors.md", "selectors.csv", "selectors.json")
    check_output_folder(args.out, inputs=inputs_of(args), files=written, results="selectors.json")
    check_replaced_alike(args.out, "selectors.json", _settings(args, chosen, None, machine=False), volatile=HOW_MADE)
    model, tokenizer = load(args)
    from ..experiments.corpus import check_context_fits
    from ..experiments.selector_comparison import ANSWER_TOKENS, compare_selectors
    from ..models.catalog import attention_shape

    check_context_fits(model, args.context, max(args.tokens, ANSWER_TOKENS if args.retrieval else 0))
    shape = attention_shape(model.config)
    with progress_bars(piped_lines=("prompts", "retrieval")) as progress, executor(args, progress) as execute:
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
            **layer_budget(args),
            op_shape=shape,
            progress=progress,
            batch=args.batch,
            execute=execute,
        )
    from ..reports.sweep import SELECTOR_HEADERS, dense_retrieval_lines, selector_cells, write_selector_comparison

    summary = [asdict(r) for r in rows]
    table = Table(
        title=f"selectors under one budget: {plain(args.model)} {args.dtype} cpu, {args.prompts} prompts of "
        f"{plain(args.corpus)}, T = {args.tokens}"
    )
    for name in SELECTOR_HEADERS:
        table.add_column(name, justify="right")
    for row, cells in zip(summary, selector_cells(summary)):
        table.add_row(*map(plain, cells), style="dim" if row["dense_by_construction"] else None)
    console.print(table)
    if any(row["dense_by_construction"] for row in summary):
        console.print(
            "[dim]dim rows: dense by construction (effective S >= context + T - 1, or no sparse step: every layer "
            "kept dense by --dense-layers or --layer-supports), they compare nothing[/]"
        )
    for line in dense_retrieval_lines(summary)[:1]:
        console.print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = _settings(args, chosen, execute)
    write_selector_comparison(args.out, {"settings": settings, "summary": summary, "runs": runs, "retrieval": trials})
    console.print(f"wrote {plain(args.out / 'selectors.md')}, selectors.csv, selectors.json")
    return 0


def _settings(args, chosen, execute, *, machine: bool = True) -> dict:
    """What ``selectors.json`` records of the command: its arguments, the selectors, the machine and the backend."""
    settings = {
        key: getattr(args, key)
        for key in (
            "model",
            "dtype",
            "corpus",
            "context",
            "support",
            "prompts",
            "tokens",
            "audit",
            "retrieval",
            "batch",
        )
    }
    settings["selectors"] = list(chosen)
    settings.update({name: plain_layers(value) for name, value in layer_budget(args).items() if value})
    if machine:
        settings["environment"] = environment()
    if execute is not None:
        settings["backend"] = execute.description
    return settings
