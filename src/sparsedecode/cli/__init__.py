"""Command-line interface: ``sparsedecode run | sweep | merge | report | probe mass | probe retrieval |
compare-selectors | bench op | bench e2e | models | eval | lm-eval``.

One module per command group (:mod:`.run`, :mod:`.probe`, :mod:`.models`, :mod:`.compare_selectors`,
:mod:`.sweep` with ``merge`` and ``report``, :mod:`.bench` with :mod:`.bench_op`, :mod:`.bench_e2e` and
:mod:`.bench_batch`, :mod:`.eval` with ``lm-eval``), each adding its parsers and the functions that run them. What
they share has a module per idea: :mod:`.arguments` (option value types), :mod:`.parser` (the parser, its help, the
options every command spells the same), :mod:`.display` (console, progress bars), :mod:`.loading` (the model and
the prompts), :mod:`.conditions` (what numbers were measured under), :mod:`.backend` (``--backend local | ray``)
and :mod:`.failures` (an error as one line); :mod:`.common` gathers them under their old import path, and
:mod:`.outputs` checks and writes output files. Bad input gets one line on stderr and exit status 2, never a
traceback, and nothing half-written. Building the parser imports neither torch nor transformers: each command
imports the library when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from ..errors import SparseDecodeError, one_line
from . import bench, calibrate, compare_selectors, models, probe, run, sweep
from . import eval as evaluation
from .arguments import int_list
from .display import console, progress_bars
from .outputs import MADE_FOLDERS, remove_empty_made_folders
from .parser import Parser, add_model_args, apply_budget_file

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="sparsedecode",
        description="Sparse decoding, measured against dense decoding. `sparsedecode COMMAND --help` shows a "
        "command's options, their defaults and examples.",
        epilog="examples:\n"
        "  sparsedecode run --context 2048 --support 97,193 --tokens 64 --prompt-index 2\n"
        "  sparsedecode models",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    run.add_parsers(sub)
    probe.add_parsers(sub)
    models.add_parsers(sub)
    compare_selectors.add_parsers(sub)
    calibrate.add_parsers(sub)
    sweep.add_parsers(sub)
    bench.add_parsers(sub)
    evaluation.add_eval_parser(sub, int_list=int_list, add_model_args=add_model_args).set_defaults(
        handler=lambda args: evaluation.cmd_eval(args, console=console, progress_bars=progress_bars)
    )
    sub.add_parser(
        evaluation.LM_EVAL_COMMAND,
        help="lm-evaluation-harness with the `sparsedecode` model registered: every argument goes to lm-eval "
        "(`sparsedecode lm-eval --help` is lm-eval's own help)",
        add_help=False,
    )
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``, SLURM before its SIGKILL), raised where the command is, so that it cleans up as
    after Ctrl-C (a sweep's lock file, half-made folders) and can be resumed."""


def _terminate(signum, frame) -> None:
    raise Terminated


@contextlib.contextmanager
def _sigterm_cleans_up():
    """SIGTERM raises :class:`Terminated` while a command runs (in the main thread: where signals are handled)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input (a :class:`SparseDecodeError`, or a file-system error) ends in one line, exit 2;
    running out of memory in one line, exit 1; Ctrl-C exits 130 and SIGTERM 143, each after the command's clean-up."""
    argv = sys.argv[1:] if argv is None else list(argv)
    MADE_FOLDERS.clear()  # of an earlier command in this process
    with _sigterm_cleans_up():
        return _main(argv)


def _main(argv: list[str]) -> int:
    try:
        if argv[:1] == [evaluation.LM_EVAL_COMMAND]:  # lm-eval's own options pass through untouched
            return evaluation.run_lm_eval(argv[1:])
        args = build_parser().parse_args(argv)
        apply_budget_file(args)
        return args.handler(args)
    except (SparseDecodeError, OSError) as error:
        remove_empty_made_folders()
        print(f"sparsedecode: error: {one_line(error)}", file=sys.stderr)
        return 2
    except MemoryError as error:  # a count or size too large for this machine: one line, not a traceback
        remove_empty_made_folders()
        said = f" ({one_line(error)})" if str(error) else ""
        print(f"sparsedecode: error: out of memory{said}: ask for less (samples, prompts, trials, context, batch) "
              "or free memory", file=sys.stderr)  # fmt: skip
        return 1
    except KeyboardInterrupt as stop:
        remove_empty_made_folders()
        terminated = isinstance(stop, Terminated)
        print(f"sparsedecode: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130


if __name__ == "__main__":
    sys.exit(main())
