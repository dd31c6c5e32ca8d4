"""``sparsedecode eval`` and ``sparsedecode lm-eval``, and ``merge`` / ``report`` of evaluation folders.

* ``eval``: :func:`add_eval_parser` adds its arguments, :func:`cmd_eval` runs (or resumes) an evaluation folder, or
  with ``--export DIR`` writes the generated tasks as lm-evaluation-harness tasks instead.
* ``merge`` and ``report`` on an evaluation folder (``eval.json``): :func:`cmd_merge_eval`, :func:`cmd_report_eval`;
  the existing commands branch to them when :func:`is_eval_folder` holds for their first folder.
* ``lm-eval``: :func:`run_lm_eval` registers the ``sparsedecode`` model and hands every argument to lm-eval's own
  command line. argparse cannot pass options such as ``--model`` through a subcommand untouched, so ``main``
  dispatches ``sparsedecode lm-eval ...`` before parsing (``argv[0] == LM_EVAL_COMMAND``).

Errors a user can cause raise :class:`SparseDecodeError` (one line, exit 2 in ``main``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SparseDecodeError
from ..files import LOCK_FILE
from .arguments import comma_list, path_arg, selector_list, shard_arg
from .backend import add_backend_args, check_backend_args, executor
from .display import plain, run_hooks
from .loading import check_one_support_per_budget, check_whole_blocks, load, quiet_transformers
from .outputs import check_output_folder, inputs_of
from .parser import add_dense_layers_arg, layer_budget

LM_EVAL_COMMAND = "lm-eval"


def _names(text: str | None, choices: tuple[str, ...], what: str) -> tuple[str, ...] | None:
    """``"a,b"`` as a tuple, ``"all"`` as every choice, ``None`` as ``None``; empty and repeated items are refused as
    in every other list option (the names themselves are checked by :class:`EvalSpec`)."""
    if text is None:
        return None
    if text.strip() == "all":
        return choices
    try:
        return tuple(comma_list(text, str, f"{what} (or all)"))
    except argparse.ArgumentTypeError as error:
        raise SparseDecodeError(f"--{what}: {error}") from None


def add_eval_parser(sub, *, int_list, add_model_args) -> argparse.ArgumentParser:
    """The ``eval`` subcommand; ``int_list`` and ``add_model_args`` are the CLI's own helpers."""
    parser = sub.add_parser(
        "eval",
        help="RULER-style task accuracy, dense vs sparse on the same samples (resumable); or --export",
        description="Generate RULER-style tasks (seeded, offline, sized in the model's tokens), answer each sample "
        "densely and under each (selector, support) after one dense prefill, and score them; rows go to "
        "OUT/runs.jsonl, resumable like a sweep. --export DIR writes the same tasks for lm-eval instead.",
        epilog="examples:\n"
        "  sparsedecode eval --tasks niah_single_noise,vt --context 1024 --samples 2 --out runs/eval-small\n"
        "  sparsedecode eval --tasks all --context 2048 --export runs/lm-eval-tasks",
    )
    add_model_args(parser)
    parser.add_argument(
        "--tasks",
        default="all",
        metavar="NAME[,NAME...]|all",
        help="comma-separated task names (niah_single_noise, niah_single_prose, niah_multikey, niah_multivalue, "
        "niah_multiquery, vt, cwe, fwe), or all",
    )
    parser.add_argument(
        "--context", type=int_list, default=[4096], help="prompt lengths in the model's tokens, comma-separated"
    )
    parser.add_argument("--samples", type=int, default=5, help="samples per task and context")
    parser.add_argument(
        "--selectors",
        type=selector_list,
        default="mean-pooled",
        metavar="SELECTOR[,SELECTOR...]|all",
        help="comma-separated selectors (see `run --help` for the forms), or all",
    )
    parser.add_argument("--support", type=int_list, default=[193])
    add_dense_layers_arg(parser)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reuse", type=int, default=1, help="selection reuse interval R, in decode steps")
    parser.add_argument(
        "--corpus",
        default="python-docs",
        help="prose haystacks and cwe words: python-docs or a local text file or folder",
    )
    parser.add_argument(
        "--template",
        default="auto",
        choices=("auto", "chat", "plain"),
        help="auto: the chat template where the tokenizer has one; chat: refuse a tokenizer without one; plain: none",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated samples")
    parser.add_argument(
        "--answer-tokens", type=int, default=None, help="answer budget in tokens (default: each task's own)"
    )
    parser.add_argument(
        "--shard",
        type=shard_arg,
        default=None,
        help="run every n-th sample group from the i-th (1-based; default: all)",
    )
    parser.add_argument(
        "--out",
        type=path_arg,
        default=None,
        help="evaluation folder (eval.json, runs.jsonl); resumable (this or --export is needed)",
    )
    parser.add_argument(
        "--export",
        type=path_arg,
        default=None,
        help="write lm-eval tasks (YAML + data) to this folder instead of running (default: none)",
    )
    add_backend_args(parser, unit="sample")
    return parser


def eval_spec(args):
    from ..experiments.eval_spec import EvalSpec
    from ..experiments.ruler import TASK_NAMES

    return EvalSpec(
        model=args.model,
        dtype=args.dtype,
        tasks=_names(args.tasks, TASK_NAMES, "tasks"),
        contexts=tuple(args.context),
        samples=args.samples,
        selectors=args.selectors,
        supports=tuple(args.support),
        window=args.window,
        block_size=args.block_size,
        reuse=args.reuse,
        corpus=args.corpus,
        template=args.template,
        seed=args.seed,
        answer_tokens=args.answer_tokens,
        **layer_budget(args),
    )


def _row_line(row: dict) -> str:
    from ..experiments.eval_summary import mode_label

    mark = "[green]correct[/]" if row["correct"] else f"score {row['score']:.2f}"
    return (
        f"{row['task']}, context {row['context']}, sample {row['sample']}, "
        f"{plain(mode_label(row['selector'], row['support']))}: {mark}; {plain(repr(row['output'][:60]))} "
        f"({row['run_s']:.1f} s)"
    )


def _check_eval_args(args):
    """The evaluation's spec and everything the arguments alone decide, checked before torch is imported (an answer
    in well under a second): the spec's own checks, whole blocks, ``--out`` or ``--export`` (``--shard``'s format is
    checked as it is parsed), the output folder, the backend options and the corpus (read once, so an empty or
    binary file is refused here)."""
    from ..experiments.corpus import check_corpus

    spec = eval_spec(args)
    check_whole_blocks(spec.configs())
    check_one_support_per_budget(args)  # found by probing: several ran one configuration under several labels
    if (args.out is None) == (args.export is None):
        raise SparseDecodeError("give one of --out DIR (run the evaluation) and --export DIR (write lm-eval tasks)")
    if args.export is not None:
        if args.shard:
            raise SparseDecodeError("--shard applies to runs, not to --export")
        ray = {"--backend ray": args.backend == "ray", "--address": args.address is not None}
        ray.update({"--workers": args.workers is not None, "--worker-threads": args.worker_threads is not None})
        given = [flag for flag, on in ray.items() if on]
        if given:
            raise SparseDecodeError(f"{', '.join(given)} applies to runs, not to --export (which runs no model)")
        check_output_folder(
            args.export, "--export", inputs=inputs_of(args), files=("export.json",), results="export.json"
        )
    else:
        check_backend_args(args)
        check_output_folder(
            args.out, inputs=inputs_of(args), files=("eval.json", "runs.jsonl", LOCK_FILE), results="eval.json"
        )
    check_corpus(spec.corpus)
    return spec


def cmd_eval(args, *, console, progress_bars) -> int:
    """``sparsedecode eval``; ``console`` and ``progress_bars`` are the CLI's own."""
    spec = _check_eval_args(args)
    if args.export is not None:
        from ..experiments.lm_eval_tasks import export_tasks
        from ..models.catalog import load_tokenizer

        quiet_transformers()
        with console.status(f"loading the tokenizer of {args.model}"):
            tokenizer = load_tokenizer(args.model)
        with console.status(f"writing {len(spec.tasks) * len(spec.contexts)} tasks"):
            outcome = export_tasks(spec, tokenizer, args.export)
        if outcome.removed:
            console.print(
                f"removed {len(outcome.removed)} task(s) of the previous export that this one does not hold: "
                + ", ".join(outcome.removed)
            )
        console.print(
            f"wrote {len(outcome.tasks)} lm-eval tasks ({outcome.documents} samples) into {outcome.directory}: "
            f"`sparsedecode lm-eval --model sparsedecode --model_args pretrained={args.model},support=... "
            f"--include_path {outcome.directory} --tasks sparsedecode_ruler` (no --apply_chat_template: the samples "
            "hold the template already)"
        )
        return 0
    from ..experiments.evaluate import check_folder, run_eval
    from ..experiments.sweep import Shard
    from ..reports.tables import shell_word

    shard = Shard.parse(args.shard) if args.shard else None
    # another folder, bad files or changed settings: before the model; a grid that grows says so
    for line in check_folder(args.out, spec, shard or Shard()):
        console.print(line)
    loaded = load(args)
    console.print(
        f"[bold]{plain(args.model)}[/] {args.dtype}; tasks {', '.join(spec.tasks)}; contexts {list(spec.contexts)}; "
        f"{spec.samples} samples; selectors {', '.join(spec.selectors)}; supports {list(spec.supports)}; "
        f"W = {spec.window}, B = {spec.block_size}, R = {spec.reuse}" + (f"; shard {shard}" if shard else "")
    )
    with progress_bars(speed_estimate_period=24 * 3600.0) as progress, executor(args, progress) as execute:
        started, finished = run_hooks(progress, args.out, _row_line)

        outcome = run_eval(
            spec, args.out, shard=shard, loaded=loaded, on_row=finished, on_start=started, execute=execute
        )
    console.print(
        f"{outcome.ran} runs now, {outcome.done_before} before: {outcome.done_before + outcome.ran} of {outcome.total}"
        f" in {plain(args.out / 'runs.jsonl')}; `sparsedecode report {plain(shell_word(args.out))}` summarises them"
    )
    return 0


def is_eval_folder(directory: Path) -> bool:
    from ..experiments.evaluate import is_eval_folder as check

    return check(directory)


def cmd_merge_eval(args, *, console) -> int:
    """``sparsedecode merge`` of evaluation folders (``args.sources``, ``args.out``)."""
    from ..experiments.evaluate import merge_evals

    outcome = merge_evals(args.sources, args.out)
    console.print(
        f"merged {len(args.sources)} folder(s) into {plain(args.out)}: {outcome.rows} runs, {outcome.duplicates} "
        f"duplicate(s) dropped, {outcome.missing} run(s) of the grid still missing"
    )
    return 0


def cmd_report_eval(args, *, console) -> int:
    """``sparsedecode report`` of an evaluation folder (``args.directory``)."""
    from ..reports.evaluation import write_eval_report

    with console.status(f"writing the report for {plain(args.directory)}"):
        path = write_eval_report(args.directory)
    console.print(f"wrote {plain(path)}")
    return 0


def run_lm_eval(argv: list[str]) -> int:
    """Register the ``sparsedecode`` model, then run lm-eval's command line on ``argv`` (lm-eval's own arguments);
    returns its exit status.

    lm-eval's own parsers are used, with what every ``sparsedecode`` command does: an option is matched only as
    spelt (no abbreviations), and a usage error, a malformed ``--model_args`` or a task lm-eval does not know is one
    line and exit status 2 (a :class:`SparseDecodeError`), not argparse's usage text or a traceback.
    """
    try:
        from lm_eval._cli import HarnessCLI
        from lm_eval.config.evaluate_config import EvaluatorConfig
        from lm_eval.utils import setup_logging
    except ImportError:  # as the model's module says it (imported only once the arguments are parsed)
        raise SparseDecodeError(
            "the lm-evaluation-harness model needs lm-eval: pip install 'sparsedecode[eval]'"
        ) from None

    setup_logging()
    cli = HarnessCLI()
    parsers = [cli._parser, *cli._subparsers.choices.values()]  # lm-eval 0.4.13's own parser and its subcommands
    for parser in parsers:
        parser.allow_abbrev = False
        parser.error = _lm_eval_usage_error(parser.prog)
    saved = sys.argv
    originals = {name: EvaluatorConfig.__dict__[name] for name in ("from_cli", "process_tasks")}
    sys.argv = [LM_EVAL_COMMAND, *argv]
    # lm-eval's own checks of its arguments (options that go together, tasks it knows), as one line
    EvaluatorConfig.from_cli = classmethod(_one_line_errors(originals["from_cli"].__func__))
    EvaluatorConfig.process_tasks = _one_line_errors(originals["process_tasks"])
    try:
        try:
            args = cli.parse_args()
        except SparseDecodeError:
            raise
        except (ValueError, TypeError) as error:  # a malformed key=value list: lm-eval's actions raise these
            raise SparseDecodeError(f"sparsedecode {LM_EVAL_COMMAND}: {_first_line(error)}") from None
        # after parsing: the model imports torch and transformers, which --help and usage errors need not wait for
        from ..integrations.lm_eval import MODEL_NAME, register, sparse_settings

        register()
        if getattr(args, "model", None) == MODEL_NAME and isinstance(getattr(args, "model_args", None), dict):
            sparse_settings(**args.model_args)  # our model's arguments, before lm-eval starts (the model checks again)
        cli.execute(args)
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved
        for name, original in originals.items():
            setattr(EvaluatorConfig, name, original)
    return 0


def _lm_eval_usage_error(prog: str):
    def error(message: str):
        raise SparseDecodeError(f"sparsedecode {prog}: {message}")

    return error


def _one_line_errors(function):
    """``function`` (one of lm-eval's checks of its configuration) with the errors it raises for bad arguments as
    a :class:`SparseDecodeError`."""

    def checked(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except SparseDecodeError:
            raise
        except (ValueError, TypeError, FileNotFoundError) as error:
            raise SparseDecodeError(f"sparsedecode {LM_EVAL_COMMAND}: {_first_line(error)}") from None

    return checked


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
