"""What every command shares: the console, argument types, progress bars, loading a model and cutting prompts.

Nothing here imports torch or transformers at import time: ``--help`` and argument errors answer at once, and
the library is imported by the command that runs.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
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

from ..errors import SparseDecodeError
from .outputs import check_writable_folder

__all__ = [
    "BACKENDS",
    "DTYPES",
    "Parser",
    "add_backend_args",
    "add_model_args",
    "add_prompt_args",
    "check_backend_args",
    "check_whole_blocks",
    "conditions",
    "console",
    "environment",
    "executor",
    "float_list",
    "int_list",
    "layer_table",
    "load",
    "path_arg",
    "file_arg",
    "positive_seconds",
    "at_least_one",
    "comma_list",
    "check_prompt_source",
    "DRAFT_TOKENS",
    "shard_arg",
    "selector_list",
    "prepare",
    "progress_bars",
    "quiet_transformers",
    "run_settings",
]

console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)
DTYPES = ("float32", "bfloat16", "float16")
DRAFT_TOKENS = 4
"""``--draft-tokens`` of run and bench e2e under ``--mode lossless`` when not given (``generate``'s default)."""
DEFAULT_MODEL = "smollm2-135m"
""":data:`sparsedecode.models.catalog.DEFAULT_MODEL`, spelled out so that building the parser imports no torch (a test
keeps the two equal)."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2, and an option is matched only as spelt: argparse's
    default would take ``--mode`` for ``--model`` (the only option it begins), so a misspelt or missing option ran
    as another one. Subparsers are made of this class too, so every command refuses abbreviations. Help shows every
    option's default and form (:class:`HelpFormatter`), and options that mean the same in every command take their
    help from :data:`SHARED_HELP` where they are added without one."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.help is None and action.option_strings:
            action.help = SHARED_HELP.get(action.option_strings[-1])
        return action

    def error(self, message: str) -> None:  # type: ignore[override]
        raise SparseDecodeError(f"{self.prog}: {message}")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """A command's parser names itself for arguments it does not know (argparse leaves them to the top-level
        parser, whose message would name only ``sparsedecode``)."""
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and " " in self.prog:  # "sparsedecode run", "sparsedecode bench op", ...
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def int_list(text: str) -> list[int]:
    """Parse ``"97,193"`` into ``[97, 193]`` (no empty items, no value twice)."""
    return comma_list(text, int, "integers")


def float_list(text: str) -> list[float]:
    """Parse ``"0,0.5,1"`` into ``[0.0, 0.5, 1.0]`` (no empty items, no value twice, finite)."""
    values = comma_list(text, float, "numbers")
    if not all(math.isfinite(value) for value in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers, got {text!r}")
    return values


def comma_list(text: str, kind, what: str, *, split=None) -> list:
    """``text``'s comma-separated items, each through ``kind`` (a ``ValueError`` names the list, an
    ``ArgumentTypeError`` speaks for itself), refusing empty items and repeated values. ``split`` cuts the text into
    items (default: at every comma)."""
    parts = [part.strip() for part in (split(text) if split else text.split(","))]
    if not any(parts):
        raise argparse.ArgumentTypeError(f"expected at least one of the comma-separated {what}")
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated {what} without empty items, got {text!r}")
    try:
        values = [kind(part) for part in parts]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from error
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{', '.join(map(str, repeated))} given twice in {text!r}")
    return values


def shard_arg(text: str) -> str:
    """``--shard i/n`` with ``1 <= i <= n``, checked as the arguments are parsed (the library parses it again)."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected i/n such as 1/4, got {text!r}") from None
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"need 1 <= i <= n in i/n, got {text!r}")
    return text


def positive_seconds(text: str) -> float:
    """A time budget: a finite number of seconds above 0."""
    return _number(text, float, lambda v: math.isfinite(v) and v > 0, "a finite number of seconds above 0")


def at_least_one(text: str) -> int:
    """A count that must be 1 or more."""
    return _number(text, int, lambda v: v >= 1, "an integer >= 1")


def _number(text: str, kind, holds, expected: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not holds(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def selector_arg(text: str) -> str:
    """``--selector``: a name, ``NAME:key=value,...`` or ``path.py:Class[:...]``, as its canonical spec string."""
    from ..errors import SparseDecodeError
    from ..selectors import resolve_selector

    try:
        return resolve_selector(text).spec()
    except SparseDecodeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def selector_list(text: str) -> tuple[str, ...]:
    """``--selectors A,B:k=v,C``, or ``all`` alone (every registered selector): each once."""
    from ..selectors import selector_names, split_selector_list

    if text.strip() == "all":
        return selector_names()

    def known(name: str) -> str:
        if name == "all":
            raise argparse.ArgumentTypeError("all stands alone (it means every selector); or name the selectors")
        return selector_arg(name)

    return tuple(comma_list(text, known, "selectors (or all)", split=split_selector_list))


def path_arg(text: str) -> Path:
    """A path option's value: an empty string is refused (``Path("")`` would quietly mean the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string")
    return Path(text)


def file_arg(text: str) -> Path:
    """An output file option's value (``--json``): a path, but not one that ends in a slash, which names a folder
    (``Path("o.json/")`` would quietly drop the slash and write a file)."""
    path = path_arg(text)
    if text.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"expected a file name, got {text!r}, which ends in a slash")
    return path


SHARED_HELP = {
    "--dtype": "weights and activations dtype",
    "--corpus": "prompt text: python-docs (offline), wikitext2 (needs the hub), or a local text file or folder",
    "--context": "prompt length(s) in tokens, comma-separated",
    "--support": "support size(s) S in positions, comma-separated; block selectors take S = 1 + W + b*B",
    "--window": "local window W, in positions",
    "--block-size": "block size B, in positions",
    "--reuse": "selection reuse interval R, in decode steps (1 = select afresh every step)",
    "--selector": "a registered name (mean-pooled, quest, top-p, ...; see docs/selectors.md), NAME:key=value,... "
    "to set its parameters, or path/to/file.py:ClassName[:key=value,...] for a class of your own",
    "--tokens": "greedy tokens T per run",
    "--prompt-index": "which prompt: the i-th non-overlapping prefix of the tokenised corpus",
    "--prompts": "prompts per context (corpus prefixes 0..n-1)",
    "--seed": "seed of the generated passkeys or samples",
    "--answer-tokens": "greedy answer tokens decoded per trial",
}
"""Help of options added without one: what they mean is the same in every command."""

_METAVARS = {
    int_list: "N[,N...]",
    float_list: "X[,X...]",
    int: "N",
    at_least_one: "N",
    positive_seconds: "SECONDS",
    shard_arg: "I/N",
    selector_list: "NAME[,NAME...]|all",
    path_arg: "DIR",
    file_arg: "FILE",
}


class HelpFormatter(argparse.HelpFormatter):
    """Help that teaches: each option's value is named by its form (``N[,N...]``, ``SECONDS``, ``I/N``, ``FILE``,
    ``DIR``), each option's help ends with its default unless it states one itself, and the examples (an epilog
    that starts with ``examples``) keep their lines, so each can be copied as it is."""

    def _fill_text(self, text, width, indent):
        if text.startswith("examples"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_default_metavar_for_optional(self, action):
        return _METAVARS.get(action.type, "NAME")

    def _get_default_metavar_for_positional(self, action):
        return action.dest.upper()

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text.lower():
            return text
        if action.required:
            return f"{text} (required)"
        return f"{text} (default: {_shown(action)})"


def _shown(action) -> str:
    """An option's default as one would type it: a list comma-separated, a flag as off, nothing as none."""
    default = action.default
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if default is None:
        return "none"
    if isinstance(default, (list, tuple)):
        return ",".join(str(item) for item in default)
    return str(default).replace("%", "%%")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model alias (see `sparsedecode models`), local folder or .gguf file, or hub id",
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and activations dtype")


def add_prompt_args(parser: argparse.ArgumentParser, *, tokens: int) -> None:
    parser.add_argument("--corpus", default="python-docs")
    parser.add_argument("--context", type=int_list, default=[2048])
    parser.add_argument("--support", type=int_list, default=[97, 193])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reuse", type=int, default=1)
    parser.add_argument("--selector", type=selector_arg, default="mean-pooled")
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--prompt-index", type=int, default=0)


BACKENDS = ("local", "ray")


def add_backend_args(parser: argparse.ArgumentParser, *, unit: str) -> None:
    """``--backend``, ``--address``, ``--workers``, ``--worker-threads``; ``unit`` names what one work unit is."""
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="local",
        help=f"local: run here; ray: each {unit} is a unit of work on a Ray cluster's workers, rows written here",
    )
    parser.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="with --backend ray: the cluster to join (HOST:PORT, or auto); default: a Ray instance for this command",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="with --backend ray: worker processes, each loading the model once (default: as many as the CPUs hold)",
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="with --backend ray: torch threads (and CPUs reserved) per worker (default 1, or the most that fit)",
    )


def check_backend_args(args) -> None:
    """Refuse Ray options without ``--backend ray``, counts below 1, ``--backend ray`` without Ray installed (checked
    without importing it) and an ``--address`` nothing answers on, before any model is loaded."""
    options = {"--address": args.address, "--workers": args.workers, "--worker-threads": args.worker_threads}
    if args.backend != "ray":
        given = [flag for flag, value in options.items() if value is not None]
        if given:
            raise SparseDecodeError(f"{', '.join(given)} applies to --backend ray only")
        return
    for flag in ("--workers", "--worker-threads"):
        if options[flag] is not None and options[flag] < 1:
            raise SparseDecodeError(f"{flag} must be >= 1, got {options[flag]}")
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise SparseDecodeError(
            "--backend ray needs Ray, which is not installed: pip install 'sparsedecode[ray]' (or pip install ray)"
        )
    if args.address is not None:
        from .ray_backend import check_reachable

        check_reachable(args.address)


@contextlib.contextmanager
def executor(args, progress=None) -> Iterator:
    """``None`` for ``--backend local``; for ``--backend ray`` a pool of Ray workers (Ray is imported here, not
    before), shut down on the way out."""
    if args.backend != "ray":
        yield None
        return
    from .ray_backend import ray_executor

    with ray_executor(args, console=console, progress=progress) as pool:
        yield pool


def run_hooks(progress, out, row_line):
    """``(on_start, on_row)`` for a resumable run into ``out`` (sweep, eval): say what a resume finds, print one line
    per finished row with ``row_line(row)``, and move the ``runs`` bar of ``progress``."""

    def started(done: int, total: int) -> None:
        if done:
            console.print(f"resuming {out}: {done} of {total} runs already done")
        progress("runs", done, total)

    def finished(row: dict, done: int, total: int) -> None:
        console.print(row_line(row))
        progress("runs", done, total)

    return started, finished


@contextlib.contextmanager
def progress_bars(speed_estimate_period: float = 30.0) -> Iterator:
    """A ``progress(stage, done, total, note="")`` callback drawing one rich bar per stage (``note`` after it).

    The ETA of a bar comes from its progress over the last ``speed_estimate_period`` seconds.
    """
    bars = Progress(
        TextColumn("{task.description:>16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
        console=console,
        transient=True,
        speed_estimate_period=speed_estimate_period,
    )
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int, note: str = "") -> None:
        if stage not in tasks:
            tasks[stage] = bars.add_task(stage, total=total, completed=done, note=note)  # work done before: no speed
        bars.update(tasks[stage], completed=done, total=total, note=note)
        if done >= total:
            bars.remove_task(tasks.pop(stage))

    with bars:
        yield update


def environment() -> dict:
    """Where numbers were measured: library versions, device, threads."""
    from ..experiments.environment import environment as measured_environment

    return measured_environment()


def _configs(args, audit: bool = False) -> list:
    from ..config import SparseConfig

    configs = [
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
    check_whole_blocks(configs)
    return configs


def check_whole_blocks(configs) -> None:
    """Refuse a support that a block selector would floor to whole blocks, naming the two nearest that are not.

    The library floors ``support`` to ``1 + W + b*B`` (:attr:`SparseConfig.effective_support`); the command line
    refuses instead, so the support asked for is the support in every table and JSON file.
    """
    for cfg in configs:
        if not cfg.token_level and cfg.effective_support != cfg.support:
            raise SparseDecodeError(
                f"--support {cfg.support} is not 1 + W + b*B with W = {cfg.window}, B = {cfg.block_size} "
                f"(block selectors read whole blocks): use {cfg.effective_support} or "
                f"{cfg.effective_support + cfg.block_size}"
            )


def load(args):
    """``(model, tokenizer)`` of ``--model``, after checking that the model cache can take it if it must."""
    from ..models.catalog import load_model

    quiet_transformers()
    check_model_cache(args.model)
    from ..validate import check_sparse_attention

    with console.status(f"loading {args.model} ({args.dtype})"):
        model, tokenizer = load_model(args.model, dtype=args.dtype)
    check_sparse_attention(model, args.model)
    return model, tokenizer


def quiet_transformers() -> None:
    """Our own progress bars replace transformers' tqdm bars and info logging."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def check_model_cache(spec: str) -> None:
    """A built-in alias that is not converted yet is fetched into the cache: refuse a cache that takes no files."""
    from ..models.aliases import ALIASES
    from ..models.store import cache_dir, verify_converted

    source = ALIASES.get(spec)
    converted = source is not None and verify_converted(
        cache_dir() / "models" / source.alias, source.sha256, check_hashes=False
    )
    if source is not None and not converted:
        check_writable_folder(
            cache_dir(),
            f"{spec} into the model cache {cache_dir()}",
            hint="; set SPARSEDECODE_CACHE to a writable folder, or to one that already holds the model",
        )


def prepare(args, audit: bool = False):
    """Validate prompt arguments, load the model, cut the prompts: ``(configs, model, tokenizer, prompts)``."""
    if args.tokens < 2:
        raise SparseDecodeError(f"--tokens must be >= 2 (got {args.tokens}): step 1 is shared with dense")
    if any(c < 1 for c in args.context):
        raise SparseDecodeError("--context values must be >= 1")
    configs = _configs(args, audit=audit)
    check_prompt_source(args)
    model, tokenizer = load(args)
    from ..experiments.corpus import check_context_fits, prompt_ids

    check_context_fits(model, args.context, args.tokens)
    prompts = {c: prompt_ids(tokenizer, args.corpus, c, args.prompt_index, args.tokens) for c in args.context}
    return configs, model, tokenizer, prompts


def check_prompt_source(args) -> None:
    """``--prompt-index`` and ``--corpus``, before the model loads: the corpus is read once (cached), so a missing,
    empty or binary one is refused here."""
    if args.prompt_index < 0:
        raise SparseDecodeError(f"--prompt-index must be >= 0 (got {args.prompt_index})")
    from ..experiments.corpus import check_corpus

    check_corpus(args.corpus)


def run_settings(args, command: str) -> dict:
    keys = ("model", "dtype", "corpus", "window", "block_size", "reuse", "selector", "tokens", "prompt_index")
    return {
        "command": command,
        **{key: getattr(args, key) for key in keys},
        "contexts": args.context,
        "supports": args.support,
        "environment": environment(),
    }


def _kernel_in_use(dtype: str, selector: str, shape: tuple[int, int, int, int] | None = None) -> str:
    """How sparse steps run here under ``SparseConfig.kernel="auto"`` on the CPU, as the kernel dispatch decides it
    (:func:`sparsedecode.kernels.refusals` on tensors of the run's dtype and the model's head shape
    ``(query_heads, kv_heads, d, dv)``)."""
    import torch

    from .. import kernels
    from ..layout import BlockLayout
    from ..selectors import resolve_selector

    method = resolve_selector(selector)
    if method.token_level:
        return "sparse steps: torch operations (token-level selector)"
    if method.adaptive:
        return "sparse steps: torch operations (adaptive budget)"
    query_heads, kv_heads, d, dv = shape or (2, 1, 16, 16)
    kind = getattr(torch, dtype)
    q = torch.zeros(query_heads, d, dtype=kind)
    keys, values = torch.zeros(kv_heads, 128, d, dtype=kind), torch.zeros(kv_heads, 128, dv, dtype=kind)
    reason = kernels.refusals(q, keys, values, BlockLayout(n=128, window=64, block_size=16))["c"]
    if reason is not None:
        return f"sparse steps: torch operations (the C kernel cannot serve: {reason})"
    if method.kernel_scoring != "mean-dot":
        return "sparse steps: torch selection, C kernel attention"
    return "sparse steps: C kernel"


def conditions(args) -> str:
    import torch

    return (
        f"[bold]{args.model}[/] {args.dtype} on cpu, {torch.get_num_threads()} threads; corpus {args.corpus}, "
        f"prompt {args.prompt_index}; T = {args.tokens}; W = {args.window}, B = {args.block_size}, "
        f"R = {args.reuse}, selector {args.selector}; {_kernel_in_use(args.dtype, args.selector)}"
    )


def layer_table(title: str, summary: dict) -> Table:
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
