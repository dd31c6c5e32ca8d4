"""``sparsedecode calibrate``: the cheapest per-layer supports that meet quality targets on calibration prompts,
checked on held-out prompts beside every uniform support (:mod:`sparsedecode.experiments.calibrate`)."""

from __future__ import annotations

import argparse
import sys

from rich.table import Table

from ..errors import SparseDecodeError
from ..files import LOCK_FILE
from .arguments import comma_list, int_list, path_arg, selector_arg
from .backend import add_backend_args, check_backend_args, executor
from .conditions import environment
from .display import console, plain, progress_bars
from .loading import check_whole_blocks, load
from .outputs import check_output_folder, inputs_of
from .parser import add_model_args

WRITTEN = (
    "study.db",
    "budget.json",
    "calibration.json",
    "calibration.md",
    "trials.csv",
    "front.png",
    "supports.png",
    LOCK_FILE,
)


def target_arg(text: str):
    from ..experiments.calibration_targets import parse_target

    try:
        return str(parse_target(text))
    except SparseDecodeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def search_param_arg(text: str) -> tuple[str, tuple[str, ...]]:
    """``--search-param NAME=V1,V2[,...]``: a selector parameter and the values a trial picks among (as text; the
    selector types them)."""
    name, eq, values = text.partition("=")
    if not eq or not name.strip() or not values.strip():
        raise argparse.ArgumentTypeError(f"give NAME=V1,V2[,...] (a parameter of the selector), got {text!r}")
    return name.strip(), tuple(comma_list(values, str, f"values of {name.strip()}"))


def add_parsers(sub) -> None:
    parser = sub.add_parser(
        "calibrate",
        help="the cheapest per-layer supports that meet a quality target, checked on held-out prompts",
        description="Searches one support per layer among --choices (Optuna's TPE with constraints; the study in "
        "OUT/study.db, so a stopped search, even one killed mid-trial, resumes to what it would have found) for the "
        "fewest positions read per step that meets every --target on the calibration prompts (tf-match, dppl) and "
        "task samples (task-accuracy, length-ratio: the RULER-style tasks of eval); then measures it on held-out "
        "ones the search never saw, beside each uniform support, with 95% bootstrap intervals. Writes "
        "OUT/budget.json (for --budget), calibration.json and calibration.md. Needs Optuna (pip install optuna).",
        epilog="examples:\n"
        "  sparsedecode calibrate --context 2048 --target 'tf-match>=95' --trials 30 --out runs/calibrate\n"
        "  sparsedecode calibrate --tasks niah_single_noise,vt --target 'task-accuracy>=dense-2' "
        "--target 'length-ratio<=1.05' --out runs/tasks",
    )
    add_model_args(parser)
    parser.add_argument("--corpus", default="python-docs")
    parser.add_argument("--context", type=int, default=2048, help="prompt length in tokens")
    parser.add_argument("--selector", type=selector_arg, default="mean-pooled")
    parser.add_argument("--choices", type=int_list, default=[97, 193, 385, 769], help="the supports a layer may take")
    parser.add_argument(
        "--target", type=target_arg, action="append", default=[], metavar="MEASURE{>=,<=}X",
        help="tf-match>=X (mean teacher-forced match, %%), dppl<=X (mean change of perplexity, %%), "
        "task-accuracy>=X or >=dense-X (mean task score, %%, or X points under dense's on the same samples), "
        "length-ratio<=X (answer tokens, sparse / dense); repeat to combine",
    )  # fmt: skip
    parser.add_argument("--prompts", type=int, default=4, help="calibration prompts (corpus prefixes 0..n-1) and "
                        "task samples per task (samples 0..n-1)")  # fmt: skip
    parser.add_argument("--held-out", type=int, default=4, help="held-out prompts (and samples per task), the ones "
                        "after those")  # fmt: skip
    parser.add_argument(
        "--held-out-from", type=int, default=None, metavar="K",
        help="the first held-out prompt (and sample) index, at least --prompts (default: --prompts): a fresh held-out "
        "set after one already looked at",
    )  # fmt: skip
    parser.add_argument(
        "--split", choices=("random", "order"), default="random",
        help="random: the calibration and held-out corpus prompts drawn at random from the corpus (seeded by --seed), "
        "so both are samples of it; order: the first --prompts prompts, the held-out ones after them (a corpus's "
        "topics come in runs, so those sides can differ; studies made before --split used order)",
    )  # fmt: skip
    parser.add_argument(
        "--tasks",
        default="all",
        metavar="NAME[,NAME...]|all",
        help="the tasks of eval that task-accuracy and length-ratio targets read (default: all)",
    )
    parser.add_argument("--answer-tokens", type=int, default=None,
                        help="answer budget of a task sample in tokens (default: each task's own)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens T per prompt")
    parser.add_argument("--trials", type=int, default=40, help="trials the study holds when the search stops")
    parser.add_argument(
        "--search-reuse",
        type=int_list,
        default=None,
        metavar="R[,R...]",
        help="also search the reuse interval R among these (the cost then counts the block "
        "statistics a selection reads, at one step in R; uniform supports at the smallest R)",
    )
    parser.add_argument(
        "--search-param", type=search_param_arg, action="append", default=[], metavar="NAME=V1,V2[,...]",
        help="also search this parameter of --selector among these values (e.g. p=0.8,0.9,0.95 for block-top-p); "
        "repeat for several. An adaptive selector's cost is what it read on the corpus prompts",
    )  # fmt: skip
    parser.add_argument(
        "--feasible", choices=("mean", "bound"), default="mean",
        help="mean: a trial meets a target by its mean over the calibration units; bound: by the safe end of the "
        "95%% bootstrap interval (the low end for >=, the high end for <=), so that a trial its few units happened to "
        "favour is not chosen",
    )  # fmt: skip
    parser.add_argument(
        "--groups", type=int, default=0, metavar="G",
        help="search G supports, each for a run of consecutive layers (layer i in run i * G // layers), instead of "
        "one per layer: fewer parameters for the sampler to learn in few trials (default: one per layer)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--out", type=path_arg, required=True, help="folder of the study and its results")
    add_backend_args(parser, unit="trial (a round of as many trials as workers, proposed together)")
    parser.set_defaults(handler=cmd_calibrate)


def _check(args) -> None:
    from ..config import SparseConfig

    if not args.target:
        raise SparseDecodeError("give at least one --target (tf-match>=X, dppl<=X, task-accuracy>=dense-X, "
                                "length-ratio<=X): what the supports must meet")  # fmt: skip
    args.tasks = _tasks(args.tasks)
    if args.answer_tokens is not None and args.answer_tokens < 1:
        raise SparseDecodeError(f"--answer-tokens must be >= 1, got {args.answer_tokens}")
    if args.prompts < 1 or args.held_out < 1:
        raise SparseDecodeError("--prompts and --held-out must be >= 1: the chosen supports are checked on prompts "
                                "the search never saw")  # fmt: skip
    if args.held_out_from is None:
        args.held_out_from = args.prompts
    if args.held_out_from < args.prompts:
        raise SparseDecodeError(f"--held-out-from {args.held_out_from} would hold out calibration prompts: give at "
                                f"least --prompts ({args.prompts})")  # fmt: skip
    if args.tokens < 2 or args.trials < 1 or args.groups < 0:
        raise SparseDecodeError("--tokens must be >= 2, --trials >= 1 and --groups >= 0")
    if len(set(args.choices)) != len(args.choices) or len(args.choices) < 2:
        raise SparseDecodeError(f"--choices needs two or more distinct supports, got {args.choices}")
    check_whole_blocks([SparseConfig(support=s, selector=args.selector) for s in args.choices])
    if args.search_reuse is not None:
        from ..experiments.calibrate import check_reuse_search

        check_reuse_search(_base(args), tuple(args.search_reuse))
    names = [name for name, _ in args.search_param]
    if len(set(names)) != len(names):
        raise SparseDecodeError(f"--search-param names a parameter twice: {', '.join(names)}")
    from ..experiments.calibrate import check_param_search, parse_target

    args.search_param = check_param_search(_base(args), dict(args.search_param),
                                           [parse_target(t) for t in args.target])  # fmt: skip
    _check_measured_choices(args)
    check_backend_args(args)
    check_output_folder(args.out, inputs=inputs_of(args), files=WRITTEN, results="calibration.json")
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise SparseDecodeError("calibrate searches with Optuna, which is not installed: pip install optuna") from None


def _check_measured_choices(args) -> None:
    """A selector whose reads vary is costed by what its sparse layers read, measured over all of them together
    (:func:`~sparsedecode.experiments.calibrate.measured_cost`): a support from ``--context`` to ``--context +
    --tokens`` decodes sparse in part of the steps only, and its reads there would be counted as the other layers'
    (found by probing: quest's 97-layers cost 158 positions beside a layer at 321, at context 300 and 64 tokens)."""
    from ..experiments.calibrate import reads_vary

    partial = [s for s in args.choices if args.context <= s < args.context + args.tokens]
    if partial and reads_vary(_base(args)):
        raise SparseDecodeError(
            f"--choices {','.join(map(str, partial))}: a support from --context {args.context} to --context + "
            f"--tokens ({args.context + args.tokens}) decodes sparse in part of the steps only, and "
            f"{args.selector}'s cost is measured over its sparse layers together; use supports below the context or "
            "past the last step"
        )


def _tasks(text: str) -> tuple[str, ...]:
    """``--tasks``: every task for ``all``, else the names listed, empty and repeated items refused as in every
    list option (they were dropped: ``vt,,cwe`` ran as ``vt,cwe``)."""
    from ..experiments.ruler_tasks import TASK_NAMES, check_tasks

    if text.strip() == "all":
        return TASK_NAMES
    try:
        return check_tasks(tuple(comma_list(text, str, "tasks (or all)")))
    except argparse.ArgumentTypeError as error:
        raise SparseDecodeError(f"--tasks: {error}") from None


def cmd_calibrate(args) -> int:
    from ..experiments import calibrate as search_module
    from ..experiments.calibration_targets import TASKS

    _check(args)
    targets = [search_module.parse_target(text) for text in args.target]
    model, tokenizer = load(args)
    from ..validate import attention_modules

    layers = len(attention_modules(model))
    if args.groups > layers:
        raise SparseDecodeError(f"--groups {args.groups}: {args.model} has {layers} layers, so at most {layers} groups")
    tasks = args.tasks if any(t.kind == TASKS for t in targets) else ()
    if tasks:
        _check_answer_room(model, args, tasks)
    available = _check_prompt_room(tokenizer, args, targets)
    calibration, held = _specs(args, targets, tasks, available)
    for side in (calibration, held):  # found by probing: a held-out sample that cannot be fitted, after the search
        side.samples(tokenizer)
    if calibration.need_end:
        from ..experiments.calibration_tasks import check_end

        check_end(model, tokenizer)
    base = _base(args)
    from ..experiments.ruler import GENERATOR_VERSION
    from ..experiments.sweep_folder import locked

    with locked(args.out):  # one search per study: a trial left running is one a killed search left
        with progress_bars(piped_lines=True) as progress, executor(args, progress) as execute:
            search = search_module.Search(
                model=args.model, selector=args.selector, context=args.context, tokens=args.tokens,
                prompts=args.prompts, choices=tuple(args.choices), targets=tuple(args.target), layers=layers,
                seed=args.seed, tasks=tasks, answer_tokens=args.answer_tokens if tasks else None,
                reuses=tuple(args.search_reuse or ()), params=args.search_param,
                batch=1 if execute is None else execute.description["workers"],
                feasible=args.feasible, groups=args.groups, split=args.split, corpus=str(args.corpus),
                dtype=args.dtype, generator=GENERATOR_VERSION if tasks else None,
            )  # fmt: skip
            fresh = not (args.out / "study.db").exists()
            study = search_module.open_study(args.out / "study.db", search)
            units = None
            if execute is None and len(search_module.finished(study)) < args.trials:  # Ray's workers build theirs
                try:
                    units = calibration.build(model, tokenizer, progress=progress, side=", calibration")
                except SparseDecodeError:  # refused before any trial: no study left to block the corrected command
                    if fresh:
                        (args.out / "study.db").unlink(missing_ok=True)
                    raise

            def searched(done, total, best):
                note = "no configuration meets the targets yet" if best is None else f"best: {best:.1f} positions"
                progress("search", done, total, note)
                if not console.is_terminal:  # a log: a line per round of trials
                    print(f"search: {done}/{total} trials, {note}", file=sys.stderr, flush=True)

            best = search_module.run_search(model, units, base, search, study, args.trials, progress=searched,
                                            execute=execute, spec=calibration)  # fmt: skip
        configs = {f"uniform S={s}": search_module.layer_config(base, [s] * layers) for s in args.choices}
        if best is not None:
            configs = {"calibrated": search.config(base, best.params), **configs}
        with progress_bars(piped_lines=True) as progress:
            held_units = held.build(model, tokenizer, progress=progress, side=", held out")
            rows = search_module.held_out(model, held_units, configs, targets, search, progress=progress)
        _write(args, search, study, best, rows, (calibration.indices, held.indices))
        _print(args, best, rows)
    return 0


def _specs(args, targets, tasks, available: int | None):
    """The calibration and held-out units' specs: corpus prompts where a target reads them, task samples where one
    reads those; the calibration ones first, the held-out ones from ``--held-out-from``: in the corpus's order, or,
    with ``--split random``, in the order :func:`~sparsedecode.experiments.calibrate.drawn_prompts` draws the
    corpus's ``available`` prompts (task samples are drawn from their generators' seeds already)."""
    from ..experiments.calibrate import UnitsSpec, drawn_prompts
    from ..experiments.calibration_targets import CORPUS

    corpus = any(t.kind == CORPUS for t in targets)
    need_end = any(t.measure == "length-ratio" for t in targets)
    common = dict(corpus=args.corpus, context=args.context, tokens=args.tokens, prompts=corpus, tasks=tasks,
                  answer_tokens=args.answer_tokens, need_end=need_end)  # fmt: skip
    sides = [(0, args.prompts), (args.held_out_from, args.held_out)]
    if not corpus or args.split == "order":
        return tuple(UnitsSpec(first=first, count=count, **common) for first, count in sides)
    order = drawn_prompts(available, args.seed)
    return tuple(UnitsSpec(first=first, count=count, indices=tuple(order[first : first + count]), **common)
                 for first, count in sides)  # fmt: skip


def _check_prompt_room(tokenizer, args, targets) -> int | None:
    """Before any measuring: the corpus holds the calibration and held-out prompts a corpus target reads; returns how
    many it holds (``None`` where no target reads the corpus)."""
    from ..experiments.calibration_targets import CORPUS
    from ..experiments.corpus import prompt_count

    if not any(t.kind == CORPUS for t in targets):
        return None
    available = prompt_count(tokenizer, args.corpus, args.context, args.tokens)
    wanted = args.held_out_from + args.held_out
    if wanted > available:
        raise SparseDecodeError(f"corpus {args.corpus} holds {available} prompts of {args.context} tokens; --prompts "
                                f"{args.prompts}, --held-out-from {args.held_out_from} and --held-out {args.held_out} "
                                f"need {wanted}")  # fmt: skip
    return available


def _check_answer_room(model, args, tasks) -> None:
    from ..experiments.ruler_tasks import TASKS

    longest = args.answer_tokens or max(TASKS[t].max_new_tokens for t in tasks)
    from ..validate import max_positions

    limit = max_positions(model)
    if limit is not None and args.context + longest > limit:
        raise SparseDecodeError(f"--context {args.context} + {longest} answer tokens exceeds the model's {limit} "
                                "positions; use a shorter --context or fewer --answer-tokens")  # fmt: skip


def _base(args):
    from ..config import SparseConfig

    reuse = min(args.search_reuse) if args.search_reuse else 1
    return SparseConfig(support=min(args.choices), selector=args.selector, reuse=reuse)


def _write(args, search, study, best, held, indices) -> None:
    from ..experiments import calibrate as search_module
    from ..files import write_json_atomic, write_text_atomic
    from ..reports.calibration import write_calibration_report

    trials = [
        {"number": t.number, "state": t.state.name.lower(), "supports": search.supports(t.params), "cost": t.value,
         "means": t.user_attrs.get("means"),
         "feasible": all(c <= 0 for c in t.user_attrs.get("constraints", [1]))}
        | ({"reuse": t.params.get("reuse")} if search.reuses else {})
        | ({"params": {name: t.params.get(f"param_{name}") for name in search.params}} if search.params else {})
        for t in search_module.finished(study)
    ]  # fmt: skip
    chosen = None if best is None else search.supports(best.params)
    failed = [t.number for t in study.trials if t.state.name == "FAIL"]  # left unfinished by a stopped search
    data = {"settings": {**search.record(), "corpus": args.corpus, "held_out": args.held_out,
                         "held_out_from": args.held_out_from, "trials": len(trials), "trials_asked": args.trials,
                         "prompt_indices": {"calibration": indices[0], "held_out": indices[1]}},
            "environment": environment(), "chosen": chosen, "trials": trials, "failed_trials": failed,
            "held_out": held}  # fmt: skip
    if search.reuses:
        data["chosen_reuse"] = None if best is None else best.params["reuse"]
    cfg = None if best is None else search.config(_base(args), best.params)
    if search.params:
        data["chosen_selector"] = None if cfg is None else cfg.selector.spec()
    if cfg is not None:  # with what it was chosen for: a command using it at another W, B or layer count refuses
        budget = {"layer_supports": {str(i): s for i, s in enumerate(chosen)}, "reuse": cfg.reuse,
                  "selector": cfg.selector.spec(), "window": cfg.window, "block_size": cfg.block_size,
                  "layers": len(chosen)}  # fmt: skip
        write_json_atomic(args.out / "budget.json", budget)
    else:  # nothing chosen: an earlier search's budget in this folder is not this one's choice
        (args.out / "budget.json").unlink(missing_ok=True)
    write_json_atomic(args.out / "calibration.json", data)
    write_text_atomic(args.out / "calibration.md", write_calibration_report(args.out, data))


def _print(args, best, held) -> None:
    from ..reports.calibration import LABELS, cells, measured

    if best is None:
        console.print(f"no configuration met {', '.join(args.target)} on the calibration units in {args.trials} "
                      "trials: the held-out table shows the uniform supports")  # fmt: skip
    table = Table(title="held out: value [95% bootstrap interval]")
    for column in ("configuration", "positions read", *(LABELS[m] for m in measured(held[0])), "targets met"):
        table.add_column(column)
    for row in held:
        met = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in row["targets_met"].items())
        if "targets_met_at_bound" in row:
            met += "; at the bound: " + ", ".join("yes" if ok else "no" for ok in row["targets_met_at_bound"].values())
        table.add_row(row["configuration"], f"{row['cost']:.1f}", *cells(row), met)
    console.print(table)
    console.print(f"wrote {plain(args.out / 'calibration.md')}, calibration.json" + (", budget.json" if best else ""))
    if best is not None and ("reuse" in best.params or any(k.startswith("param_") for k in best.params)):
        chosen = {k.removeprefix("param_"): v for k, v in best.params.items() if k == "reuse" or k.startswith("param_")}
        console.print(f"chosen with the supports: {', '.join(f'{k}={v}' for k, v in chosen.items())} (budget.json "
                      "holds them: --budget budget.json sets them)")  # fmt: skip
