"""The parser every command is built of: one-line usage errors, no abbreviated options, help that shows each option's
form and default, and the options that mean the same in every command (the model, the prompt, shared help texts)."""

from __future__ import annotations

import argparse

from ..errors import SparseDecodeError
from .arguments import (
    at_least_one,
    file_arg,
    float_list,
    int_list,
    layer_list,
    layer_supports_arg,
    path_arg,
    positive_seconds,
    selector_arg,
    selector_list,
    shard_arg,
)

__all__ = [
    "DEFAULT_MODEL",
    "DRAFT_TOKENS",
    "check_adaptive_draft",
    "DTYPES",
    "SHARED_HELP",
    "HelpFormatter",
    "Parser",
    "add_dense_layers_arg",
    "apply_budget_file",
    "given",
    "layer_budget",
    "add_model_args",
    "add_weights_arg",
    "add_prompt_args",
]

DTYPES = ("float32", "bfloat16", "float16")
DRAFT_TOKENS = 4
"""``--draft-tokens`` of run and bench e2e under ``--mode lossless`` when not given (``generate``'s default)."""
MAX_DRAFT_TOKENS = 16
"""The library's :data:`~sparsedecode.decoding.lossless.MAX_DRAFT_TOKENS`, spelled here so that checking the command
line imports no torch (a test keeps the two equal)."""
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
        if args and str(args[0]).startswith("-") and kwargs.get("action", "store") == "store":
            kwargs["action"] = Store  # records that the option was given (:func:`given`)
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


GIVEN = "given_options"
"""The namespace attribute naming the options a command line gave (their ``dest``), set by :class:`Store`."""


class Store(argparse.Action):
    """argparse's ``store``, which also notes in ``namespace.given_options`` that the option was given, so a value
    can be told from its default (:func:`given`)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN, {*getattr(namespace, GIVEN, ()), self.dest})


def check_adaptive_draft(draft_tokens: list[int], adaptive: bool) -> None:
    """With ``--adaptive``, every ``--draft-tokens`` value is at most the longest draft an adaptive ``k`` grows to
    (:data:`~sparsedecode.decoding.lossless.MAX_DRAFT_TOKENS`): ``generate`` refuses a longer one only after the model
    loaded and the dense run, and a longer ``k`` would shrink after a fully accepted draft."""
    if adaptive and max(draft_tokens) > MAX_DRAFT_TOKENS:
        raise SparseDecodeError(
            f"--adaptive grows k up to {MAX_DRAFT_TOKENS}: give --draft-tokens {MAX_DRAFT_TOKENS} or less (got "
            f"{max(draft_tokens)}), or drop --adaptive"
        )


def given(args, dest: str) -> bool:
    """Whether the command line gave the option stored in ``dest`` (not its default)."""
    return dest in getattr(args, GIVEN, ())


SHARED_HELP = {
    "--dtype": "weights and activations dtype",
    "--corpus": "prompt text: python-docs (offline), wikitext2 (needs the hub), or a local text file or folder",
    "--context": "prompt length(s) in tokens, comma-separated",
    "--support": "support size(s) S in positions, comma-separated; block selectors take S = 1 + W + b*B",
    "--window": "local window W, in positions",
    "--block-size": "block size B, in positions",
    "--reuse": "selection reuse interval R, in decode steps (1 = select afresh every step)",
    "--selector": "a registered name (mean-pooled, quest, block-top-p, ...; see docs/selectors.md), NAME:key=value,... "
    "to set its parameters, or path/to/file.py:ClassName[:key=value,...] for a class of your own",
    "--dense-layers": "layers (indices from 0, comma-separated) that decode dense at every step, as Quest's and "
    "Twilight's evaluations keep 0,1 (default: none)",
    "--layer-supports": "layers that read a support of their own, LAYER:S comma-separated (e.g. 5:385,6:385); the "
    "others read --support",
    "--budget": "a JSON file of dense_layers and layer_supports (what --dense-layers and --layer-supports give), "
    "and the reuse, selector, window and block size a calibration chose, if it names them (they set --reuse, "
    "--selector, --window and --block-size where not given)",
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
    if default is None or (isinstance(default, (list, tuple)) and not default):
        return "none"
    if isinstance(default, (list, tuple)):
        return ",".join(str(item) for item in default)
    return str(default).replace("%", "%%")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--dtype``, spelt and explained the same in every command that loads a model."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model alias (see `sparsedecode models`), local folder or .gguf file, or hub id",
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and activations dtype")


def add_weights_arg(parser: argparse.ArgumentParser) -> None:
    """``--weights``: the weights a model decodes with (``load_model``'s ``weights``; the commands that offer it)."""
    from ..models.weights import WEIGHTS

    parser.add_argument(
        "--weights",
        default=None,
        choices=WEIGHTS,
        help="gguf: the linear layers from the model's GGUF as stored (Q4_0/Q4_1/Q4_K as int4, Q5_0 as int5, "
        "Q8_0/Q6_K as int8: "
        "docs/compiled.md); "
        "int4, int8: quantized from the float weights (group-32 min-max / absmax, round to nearest); a float dtype: "
        "as --dtype (default: --dtype). Activations stay in --dtype",
    )


def add_dense_layers_arg(parser: argparse.ArgumentParser) -> None:
    """``--dense-layers``, ``--layer-supports`` and ``--budget FILE`` (which holds the two): the per-layer part of a
    configuration (``SparseConfig.dense_layers``, ``SparseConfig.layer_supports``), merged by :func:`layer_budget`."""
    parser.add_argument("--dense-layers", type=layer_list, default=(), metavar="0,1")
    parser.add_argument("--layer-supports", type=layer_supports_arg, default=(), metavar="LAYER:S[,...]")
    parser.add_argument("--budget", type=file_arg, default=None, dest="budget_file")


def layer_budget(args) -> dict:
    """``dense_layers`` and ``layer_supports`` of the command: from ``--budget FILE``, or from the two options (the
    file's ``reuse`` and ``selector``, if any, are the command's own options: :func:`apply_budget_file`)."""
    from ..config import read_budget

    dense, supports = getattr(args, "dense_layers", ()), getattr(args, "layer_supports", ())
    if getattr(args, "budget_file", None) is None:
        return {"dense_layers": tuple(dense), "layer_supports": tuple(supports)}
    if dense or supports:
        raise SparseDecodeError("give --budget FILE or --dense-layers / --layer-supports, not both")
    budget = read_budget(args.budget_file)
    return {"dense_layers": budget["dense_layers"], "layer_supports": budget["layer_supports"]}


def apply_budget_file(args) -> None:
    """A budget file's ``reuse`` and ``selector`` (a calibration's choice), ``window`` and ``block_size`` (what its
    supports are for) become the command's ``--reuse``, ``--selector`` (``--selectors``, that one alone, where a
    command compares several or a sweep is given ``--selectors``), ``--window`` and ``--block-size`` where the
    command line left them at their defaults; given there with another value, or on a command that takes no such
    option (unless the value is its default), they are refused in one line. A command without ``--budget`` is left
    as is."""
    from ..config import SparseConfig, read_budget

    if getattr(args, "budget_file", None) is None:
        return
    budget = read_budget(args.budget_file)
    for name in ("reuse", "selector", "window", "block_size"):
        if name not in budget:
            continue
        value = budget[name]
        several = hasattr(args, "selectors") and (not hasattr(args, name) or given(args, "selectors"))  # sweep: both
        dest = "selectors" if name == "selector" and several else name
        if not hasattr(args, dest):
            if value == getattr(SparseConfig, name) and name != "selector":  # the command's fixed default
                continue
            raise SparseDecodeError(f"budget file {args.budget_file} sets {name} {value}, which this command does not "
                                    "take; use a budget file without it")  # fmt: skip
        current = getattr(args, dest)
        wanted = (value,) if dest == "selectors" else [value] if isinstance(current, list) else value  # sweep: lists
        if given(args, dest) and current != wanted:
            shown = ",".join(map(str, current)) if isinstance(current, (list, tuple)) else current
            raise SparseDecodeError(f"--{dest} {shown} differs from budget file {args.budget_file}'s {name} {value}: "
                                    "give one of the two")  # fmt: skip
        setattr(args, dest, wanted)


def add_prompt_args(parser: argparse.ArgumentParser, *, tokens: int) -> None:
    """The prompt and sparse settings of ``run`` and ``probe mass``; ``tokens`` is the default ``--tokens``."""
    parser.add_argument("--corpus", default="python-docs")
    parser.add_argument("--context", type=int_list, default=[2048])
    parser.add_argument("--support", type=int_list, default=[97, 193])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reuse", type=int, default=1)
    parser.add_argument("--selector", type=selector_arg, default="mean-pooled")
    add_dense_layers_arg(parser)
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--prompt-index", type=int, default=0)
