"""The value types of command-line options: comma-separated lists, counts, seconds, shards, selectors and paths.

Each turns an option's text into its value or raises ``argparse.ArgumentTypeError`` with a message a user can act
on, so argparse names the option and the command in one line. Selectors are resolved through the registry, imported
when such an option is parsed, not when the parser is built.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

__all__ = [
    "at_least_one",
    "comma_list",
    "file_arg",
    "float_list",
    "int_list",
    "layer_list",
    "layer_supports_arg",
    "path_arg",
    "positive_seconds",
    "selector_arg",
    "selector_list",
    "shard_arg",
]


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


def layer_list(text: str) -> tuple[int, ...]:
    """``--dense-layers 0,1``: layer indices, each once (:func:`sparsedecode.config.parse_layers`)."""
    from ..config import parse_layers
    from ..errors import SparseDecodeError

    try:
        return parse_layers(text)
    except SparseDecodeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def layer_supports_arg(text: str) -> tuple[tuple[int, int], ...]:
    """``--layer-supports 5:385,6:385``: per-layer supports (:func:`sparsedecode.config.parse_layer_supports`)."""
    from ..config import parse_layer_supports
    from ..errors import SparseDecodeError

    try:
        return parse_layer_supports(text)
    except SparseDecodeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
