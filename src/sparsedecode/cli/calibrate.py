"""``sparsedecode calibrate``: the cheapest per-layer supports that meet quality targets on calibration prompts,
checked on held-out prompts beside every uniform support (:mod:`sparsedecode.experiments.calibrate`)."""

from __future__ import annotations

import argparse

from rich.table import Table

from ..errors import SparseDecodeError
from ..experiments.sweep_folder import locked
from .arguments import int_list, path_arg, selector_arg
from .conditions import environment
from .display import console, progress_bars
from .loading import check_whole_blocks, load
from .outputs import check_output_folder
from .parser import add_model_args

WRITTEN = ("study.db", "budget.json", "calibration.json", "calibration.md", "trials.csv", "front.png", "supports.png")


def target_arg(text: str):
    from ..experiments.calibrate import parse_target

    try:
        return str(parse_target(text))
    except SparseDecodeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_parsers(sub) -> None:
    parser = sub.add_parser(
        "calibrate",
        help="the cheapest per-layer supports that meet a quality target, checked on held-out prompts",
        description="Searches one support per layer among --choices (Optuna's TPE with constraints; the study in "
        "OUT/study.db, so a stopped search resumes) for the fewest positions read per step whose mean over the "
        "calibration prompts meets every --target; then measures it on held-out prompts the search never saw, "
        "beside each uniform support, with 95%% bootstrap intervals. Writes OUT/budget.json (for --budget), "
        "calibration.json and calibration.md. Needs Optuna (pip install optuna).",
        epilog="examples:\n"
        "  sparsedecode calibrate --context 2048 --target 'tf-match>=95' --trials 30 --out runs/calibrate\n"
        "  sparsedecode calibrate --selector quest --target 'tf-match>=90' --target 'dppl<=5' --out runs/quest",
    )
    add_model_args(parser)
    parser.add_argument("--corpus", default="python-docs")
    parser.add_argument("--context", type=int, default=2048, help="prompt length in tokens")
    parser.add_argument("--selector", type=selector_arg, default="mean-pooled")
    parser.add_argument("--choices", type=int_list, default=[97, 193, 385, 769], help="the supports a layer may take")
    parser.add_argument(
        "--target", type=target_arg, action="append", default=[], metavar="MEASURE{>=,<=}X",
        help="tf-match>=X (mean teacher-forced match, %%) or dppl<=X (mean change of perplexity, %%); repeat to "
        "combine",
    )  # fmt: skip
    parser.add_argument("--prompts", type=int, default=4, help="calibration prompts (corpus prefixes 0..n-1)")
    parser.add_argument("--held-out", type=int, default=4, help="held-out prompts, the prefixes after those")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens T per prompt")
    parser.add_argument("--trials", type=int, default=40, help="trials the study holds when the search stops")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--out", type=path_arg, required=True, help="folder of the study and its results")
    parser.set_defaults(handler=cmd_calibrate)


def _check(args) -> None:
    from ..config import SparseConfig

    if not args.target:
        raise SparseDecodeError("give at least one --target (tf-match>=X or dppl<=X): what the supports must meet")
    if args.prompts < 1 or args.held_out < 1:
        raise SparseDecodeError("--prompts and --held-out must be >= 1: the chosen supports are checked on prompts "
                                "the search never saw")  # fmt: skip
    if args.tokens < 2 or args.trials < 1:
        raise SparseDecodeError("--tokens must be >= 2 and --trials >= 1")
    if len(set(args.choices)) != len(args.choices) or len(args.choices) < 2:
        raise SparseDecodeError(f"--choices needs two or more distinct supports, got {args.choices}")
    check_whole_blocks([SparseConfig(support=s, selector=args.selector) for s in args.choices])
    check_output_folder(args.out, files=WRITTEN)
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise SparseDecodeError("calibrate searches with Optuna, which is not installed: pip install optuna") from None


def cmd_calibrate(args) -> int:
    from ..experiments import calibrate as search_module

    _check(args)
    model, tokenizer = load(args)
    prompts, references, layers = _references(args, model, tokenizer)
    base, targets = _base(args), [search_module.parse_target(text) for text in args.target]
    search = search_module.Search(
        model=args.model, selector=args.selector, context=args.context, tokens=args.tokens, prompts=args.prompts,
        choices=tuple(args.choices), targets=tuple(args.target), layers=layers, seed=args.seed,
    )  # fmt: skip
    with locked(args.out):  # one search per study: a trial left running is one a killed search left
        study = search_module.open_study(args.out / "study.db", search)
        with progress_bars() as progress:

            def shown(done, total, best):
                note = "no configuration meets the targets yet" if best is None else f"best: {best:.1f} positions"
                progress("search", done, total, note)

            best = search_module.run_search(
                model, prompts[: args.prompts], references[: args.prompts], base, search, study, args.trials,
                progress=shown,
            )  # fmt: skip
        _finish(args, model, prompts, references, base, search, study, best, targets)
    return 0


def _finish(args, model, prompts, references, base, search, study, best, targets) -> None:
    """The held-out check of the chosen and uniform configurations, the files and the table."""
    from ..experiments import calibrate as search_module

    layers = search.layers
    configs = {f"uniform S={s}": search_module.layer_config(base, [s] * layers) for s in args.choices}
    if best is not None:
        chosen = [best.params[f"layer_{i}"] for i in range(layers)]
        configs = {"calibrated": search_module.layer_config(base, chosen), **configs}
    held = search_module.held_out(
        model, prompts[args.prompts :], references[args.prompts :], configs, targets, args.tokens, layers
    )
    _write(args, search, study, best, held, layers)
    _print(args, best, held)


def _references(args, model, tokenizer):
    from ..experiments.corpus import prompt_ids
    from ..protocol.paired import dense_reference

    layers = sum(1 for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config"))
    count = args.prompts + args.held_out
    prompts = [prompt_ids(tokenizer, args.corpus, args.context, index, args.tokens) for index in range(count)]
    references = []
    with progress_bars() as progress:
        for index, ids in enumerate(prompts):
            references.append(dense_reference(model, ids, tokens=args.tokens))
            progress("dense references", index + 1, count)
    return prompts, references, layers


def _base(args):
    from ..config import SparseConfig

    return SparseConfig(support=min(args.choices), selector=args.selector)


def _write(args, search, study, best, held, layers) -> None:
    from ..experiments import calibrate as search_module
    from ..files import write_json_atomic, write_text_atomic
    from ..reports.calibration import write_calibration_report

    trials = [
        {"number": t.number, "state": t.state.name.lower(), "supports": [t.params.get(f"layer_{i}") for i in
         range(layers)], "cost": t.value, "means": t.user_attrs.get("means"),
         "feasible": all(c <= 0 for c in t.user_attrs.get("constraints", [1]))}
        for t in search_module.finished(study)
    ]  # fmt: skip
    chosen = None if best is None else [best.params[f"layer_{i}"] for i in range(layers)]
    failed = [t.number for t in study.trials if t.state.name == "FAIL"]  # left unfinished by a stopped search
    data = {"settings": {**search.record(), "corpus": args.corpus, "held_out": args.held_out, "trials": args.trials},
            "environment": environment(), "chosen": chosen, "trials": trials, "failed_trials": failed,
            "held_out": held}  # fmt: skip
    if chosen is not None:
        write_json_atomic(args.out / "budget.json", {"layer_supports": {str(i): s for i, s in enumerate(chosen)}})
    write_json_atomic(args.out / "calibration.json", data)
    write_text_atomic(args.out / "calibration.md", write_calibration_report(args.out, data))


def _print(args, best, held) -> None:
    if best is None:
        console.print(f"no configuration met {', '.join(args.target)} on the calibration prompts in {args.trials} "
                      "trials: the held-out table shows the uniform supports")  # fmt: skip
    table = Table(title=f"held out ({held[0]['prompts']} prompts): mean [95% bootstrap interval]")
    for column in ("configuration", "positions read", "TF match %", "ΔPPL %", "targets met"):
        table.add_column(column)
    for row in held:
        met = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in row["targets_met"].items())
        table.add_row(row["configuration"], f"{row['cost']:.1f}", _interval(row["tf-match"]),
                      _interval(row["dppl"]), met)  # fmt: skip
    console.print(table)
    console.print(f"wrote {args.out / 'calibration.md'}, calibration.json" + (", budget.json" if best else ""))


def _interval(value: dict) -> str:
    return f"{value['mean']:.1f} [{value['low']:.1f}, {value['high']:.1f}]"
