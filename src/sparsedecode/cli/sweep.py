"""``sparsedecode sweep | merge | report``: the survival sweep, combining its shards, and its report."""

from __future__ import annotations

import time

from ..errors import SparseDecodeError
from ..files import LOCK_FILE
from .arguments import int_list, path_arg, selector_arg, selector_list, shard_arg
from .backend import add_backend_args, check_backend_args, executor
from .display import console, plain, progress_bars, run_hooks
from .loading import check_one_support_per_budget, check_whole_blocks, load
from .outputs import RESULTS, check_output_folder, check_writable_folder, inputs_of
from .parser import add_dense_layers_arg, add_model_args, layer_budget


def add_parsers(sub) -> None:
    """``sweep``, ``merge`` and ``report``, under the top-level subparsers ``sub``."""
    _add_sweep_parser(sub)
    _add_merge_parser(sub)
    _add_report_parser(sub)


def _add_sweep_parser(sub) -> None:
    """``sweep``: the grid, the run settings, sharding, batching, the output folder and the backend."""
    sweep = sub.add_parser(
        "sweep",
        help="survival sweep: paired dense/sparse runs over contexts x prompts x supports",
        description="The paired protocol over contexts x prompts x supports x reuse intervals (x selectors), one row "
        "per run appended to OUT/runs.jsonl; rerun the same command to resume.",
        epilog="examples:\n"
        "  sparsedecode sweep --context 1024 --support 97,193 --prompts 2 --tokens 32 --out runs/small\n"
        "  sparsedecode sweep --context 1024 --support 97,193 --prompts 2 --tokens 32 --shard 1/2 --out runs/small-1",
    )
    add_model_args(sweep)
    sweep.add_argument("--corpus", default="python-docs")
    sweep.add_argument("--context", type=int_list, default=[2048])
    sweep.add_argument("--support", type=int_list, default=[97, 193, 385, 769])
    sweep.add_argument(
        "--reuse", type=int_list, default=[1], help="selection reuse intervals R in decode steps, comma-separated"
    )
    sweep.add_argument("--selector", type=selector_arg, default=None, help="one selector (default: mean-pooled)")
    add_dense_layers_arg(sweep)
    sweep.add_argument(
        "--selectors",
        type=selector_list,
        default=None,
        help="comma-separated selectors, or all: one more dimension of the grid (default: --selector)",
    )
    sweep.add_argument("--prompts", type=int, default=5)
    sweep.add_argument("--tokens", type=int, default=128)
    sweep.add_argument("--window", type=int, default=64)
    sweep.add_argument("--block-size", type=int, default=16)
    sweep.add_argument(
        "--audit", action="store_true", help="omitted-mass audit of every sparse step (one extra dense pass per step)"
    )
    sweep.add_argument(
        "--shard",
        type=shard_arg,
        default=None,
        help="run every n-th (context, prompt) group from the i-th (1-based; default: all)",
    )
    sweep.add_argument(
        "--batch",
        type=int,
        default=1,
        help="decode up to this many prompts of one context together (same rows, faster)",
    )
    sweep.add_argument("--out", type=path_arg, required=True, help="sweep folder (sweep.json, runs.jsonl); resumable")
    add_backend_args(sweep, unit="(context, prompt) group")
    sweep.set_defaults(handler=cmd_sweep)


def _add_merge_parser(sub) -> None:
    """``merge``: the folders to combine and the folder to combine them into."""
    merge = sub.add_parser(
        "merge",
        help="combine shard folders of one sweep (or one evaluation, or selector comparisons) into one folder",
        description="Combine sweep (or evaluation) folders of the same settings, or of grids that differ only in "
        "contexts, prompts, supports, reuse or selectors, into one folder; duplicates are dropped. Selector "
        "comparison folders (compare-selectors) of the same settings and different selectors merge into one "
        "comparison (their dense references must agree); --out may be one of them, and a comparison already in "
        "--out is merged too.",
        epilog="examples (the second after `sparsedecode sweep --help`'s second example):\n"
        "  sparsedecode sweep --context 1024 --support 97,193 --prompts 2 --tokens 32 --shard 2/2 --out runs/small-2\n"
        "  sparsedecode merge runs/small-1 runs/small-2 --out runs/small-merged",
    )
    merge.add_argument(
        "sources",
        type=path_arg,
        nargs="+",
        help="sweep, evaluation or selector comparison folders (all of one kind) with the same settings",
    )
    merge.add_argument(
        "--out",
        type=path_arg,
        required=True,
        help="folder for the merged settings file (sweep.json or eval.json) and runs.jsonl, or for selectors.json, "
        ".csv and .md",
    )
    merge.set_defaults(handler=cmd_merge)


def _add_report_parser(sub) -> None:
    """``report``: the results folder to render, and a retrieval file to include."""
    report = sub.add_parser(
        "report",
        help="report.md (or selectors.md) with tables, CSVs and plots for a results folder",
        description="Render a sweep, retrieval, evaluation or selector-comparison folder: Markdown, CSVs and plots "
        "written into the folder.",
        epilog="examples (after `sparsedecode sweep --help`'s first example):\n  sparsedecode report runs/small",
    )
    report.add_argument(
        "directory",
        type=path_arg,
        help="a sweep folder (sweep.json, and retrieval.json beside it if any), a retrieval, evaluation or selector-"
        "comparison folder",
    )
    report.add_argument(
        "--retrieval",
        type=path_arg,
        metavar="PATH",
        help="retrieval.json (or its folder) to include (default: retrieval.json beside sweep.json, if any)",
    )
    report.set_defaults(handler=cmd_report)


def _sweep_spec(args):
    from ..experiments.specs import SweepSpec

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
        **layer_budget(args),
    )


def _sweep_selectors(args) -> tuple[str, ...]:
    """``--selector NAME`` or ``--selectors A,B,C`` (or ``all``); not both."""

    if args.selector is not None and args.selectors is not None:
        raise SparseDecodeError("give --selector NAME or --selectors A,B,C, not both")
    if args.selectors is None:
        return (args.selector or "mean-pooled",)
    return args.selectors  # checked as it was parsed (selector_list)


def _row_line(row: dict) -> str:
    fate = "[green]survives[/]" if row["survives"] else f"first divergence at step {row['first_divergence']}"
    return (
        f"context {row['context']}, prompt {row['prompt_index']}, {plain(row['selector'])}, S={row['support']}, "
        f"R={row['reuse']}: {fate}; "
        f"TF match {row['teacher_forced_match']:.1f}%, ΔPPL {row['delta_ppl_percent']:+.2f}% ({row['run_s']:.1f} s)"
    )


def _check_sweep_args(args):
    """The sweep's spec, checked from the arguments alone, before torch is imported (an answer in well under a
    second): the spec's own checks, the command line's whole-blocks rule, and what only the command line has."""
    if args.batch < 1:
        raise SparseDecodeError(f"--batch must be >= 1, got {args.batch}")
    if args.batch > 1 and args.backend != "local":
        raise SparseDecodeError("--batch applies to --backend local: with ray every (context, prompt) group is a unit")
    spec = _sweep_spec(args)
    check_whole_blocks(spec.configs())
    check_one_support_per_budget(args)  # found by probing: several ran one configuration under several labels
    return spec


def cmd_sweep(args) -> int:
    spec = _check_sweep_args(args)
    from ..experiments.sweep import Shard, read_meta, run_sweep
    from ..reports.tables import shell_word

    shard = Shard.parse(args.shard) if args.shard else None
    check_backend_args(args)
    check_output_folder(
        args.out, inputs=inputs_of(args), files=("sweep.json", "runs.jsonl", LOCK_FILE), results="sweep.json"
    )
    meta = read_meta(args.out)  # another experiment's folder is refused here, before the model
    if meta is not None:  # refuse a changed spec before spending time on the model
        from ..experiments.sweep import check_meta

        for line in check_meta(args.out, meta, spec, None, shard or Shard()):  # a grid that grows says so
            console.print(line)
    loaded = load(args)
    console.print(
        f"[bold]{plain(args.model)}[/] {args.dtype}; corpus {plain(args.corpus)}; contexts {args.context}; "
        f"supports {args.support}; R {args.reuse}; {args.prompts} prompts; T = {args.tokens}; W = {args.window}, "
        f"B = {args.block_size}; selector(s) {plain(', '.join(spec.selectors))}"
        + (f"; shard {shard}" if shard else "")
        + (f"; batch {args.batch}" if args.batch > 1 else "")
    )
    clock = time.perf_counter()
    with progress_bars(speed_estimate_period=24 * 3600.0) as progress, executor(args, progress) as execute:
        started, finished = run_hooks(progress, args.out, _row_line)

        outcome = run_sweep(
            spec,
            args.out,
            shard=shard,
            loaded=loaded,
            progress=progress,
            on_row=finished,
            on_start=started,
            batch=args.batch,
            execute=execute,
        )
    elapsed = time.perf_counter() - clock
    console.print(
        f"{outcome.ran} runs now, {outcome.done_before} before: {outcome.done_before + outcome.ran} of {outcome.total}"
        f" in {plain(args.out / 'runs.jsonl')}; `sparsedecode report {plain(shell_word(args.out))}` summarises them"
    )
    if outcome.ran and execute is None:  # with Ray the clock holds its start-up too
        console.print(
            f"{elapsed:.1f} s for {outcome.ran} runs at batch {args.batch}: {elapsed / outcome.ran:.2f} s per run "
            "(dense references included; compare with a batch-1 run of the same grid for the speed-up)"
        )
    return 0


def _merge_comparisons(args) -> int:
    from ..experiments.comparison_merge import is_comparison_folder, merge_comparisons
    from ..reports.sweep import write_selector_comparison

    check_output_folder(args.out, files=("selectors.md", "selectors.csv", "selectors.json"), results="selectors.json")
    sources, kept = list(args.sources), None
    if is_comparison_folder(args.out) and args.out.resolve() not in {source.resolve() for source in sources}:
        sources.insert(0, args.out)  # kept, not replaced unasked: as a sweep merge keeps the rows of its --out
        kept = args.out
    data = merge_comparisons(sources, out=kept)  # everything checked and built before anything is written
    path = write_selector_comparison(args.out, data)
    console.print(
        f"merged {len(sources)} comparison(s) into {plain(path)}: {len(data['settings']['selectors'])} selectors, "
        f"{len(data['runs'])} runs, {len(data['retrieval'])} retrieval rows"
    )
    return 0


def cmd_merge(args) -> int:
    from ..experiments.comparison_merge import is_comparison_folder
    from ..experiments.sweep import merge_sweeps
    from .eval import cmd_merge_eval, is_eval_folder

    if args.sources and is_eval_folder(args.sources[0]):
        check_output_folder(args.out, files=("eval.json", "runs.jsonl", LOCK_FILE), results="eval.json")
        return cmd_merge_eval(args, console=console)
    if args.sources and is_comparison_folder(args.sources[0]):
        return _merge_comparisons(args)
    check_output_folder(args.out, files=("sweep.json", "runs.jsonl", LOCK_FILE), results="sweep.json")
    outcome = merge_sweeps(args.sources, args.out)
    console.print(
        f"merged {len(args.sources)} folder(s) into {plain(args.out)}: {outcome.rows} runs, {outcome.duplicates} "
        f"duplicate(s) dropped, {outcome.missing} run(s) of the grid still missing"
    )
    return 0


def _check_retrieval_option(directory, retrieval) -> None:
    """``--retrieval`` adds retrieval results to a sweep's report (or renders them where no results are): refused
    beside an evaluation or a selector comparison, whose report would ignore them or be replaced by theirs (its
    selectors.csv removed), and beside retrieval results of the folder's own, which its report would no longer show
    (found by probing)."""
    if retrieval is None:
        return
    for marker in ("eval.json", "selectors.json"):
        if (directory / marker).exists():
            raise SparseDecodeError(
                f"--retrieval adds retrieval results to a sweep's report; {directory} holds {RESULTS[marker]} "
                f"({marker}), whose report does not show them: drop --retrieval"
            )
    own, given = directory / "retrieval.json", retrieval / "retrieval.json" if retrieval.is_dir() else retrieval
    if not (directory / "sweep.json").exists() and own.is_file() and own.resolve() != given.resolve():
        raise SparseDecodeError(
            f"{directory} holds retrieval results of its own ({own.name}), which its report shows: drop --retrieval, "
            f"or report the folder of {given}"
        )


def cmd_report(args) -> int:
    if not args.directory.is_dir():
        what = "does not exist" if not args.directory.exists() else "is a file, not a results folder"
        raise SparseDecodeError(f"{args.directory} {what}: give a sweep, evaluation, retrieval or selector folder")
    _check_retrieval_option(args.directory, args.retrieval)
    check_writable_folder(args.directory, f"the report into {args.directory}")  # it goes next to the data
    for entry in args.directory.iterdir():  # the names a report writes: report.md, CSV tables, PNG plots
        if entry.suffix in (".md", ".csv", ".png") and not entry.is_file():
            raise SparseDecodeError(f"cannot write the report: {entry} is not a regular file (a report file's name)")
    from .eval import cmd_report_eval, is_eval_folder

    if is_eval_folder(args.directory):
        return cmd_report_eval(args, console=console)
    from ..reports.sweep import write_report

    with console.status(f"writing the report for {plain(args.directory)}"):
        path = write_report(args.directory, retrieval=args.retrieval)
    console.print(f"wrote {plain(path)}")
    return 0
