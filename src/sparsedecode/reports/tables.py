"""The cells, Markdown tables and CSV files every report is built of.

One way to print a value (``-`` for a missing one, ``yes``/``no`` for a flag), a median with its range, a Markdown
table and a CSV of result rows, shared by the sweep, retrieval and evaluation reports so their tables read alike.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

from ..files import atomic_path, write_text_atomic


def _number(value, digits: int | None, sign: str = "") -> str:
    """``value`` to ``digits`` decimals; ``None``: a count or step as it is (a median of two counts may end in .5).
    NaN (the median of no run) is ``-``."""
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if digits is None:
        digits = 0 if float(value).is_integer() else 1
    return f"{value:{sign}.{digits}f}"


def format_value(value, digits: int | None = 1, sign: str = "") -> str:
    """A table cell: ``-`` for a missing or NaN value, ``yes``/``no`` for a flag, floats to ``digits`` decimals
    (``None``: whole numbers without decimals, others with one; ``sign`` ``"+"``: a sign on every number)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return _number(value, digits, sign)
    return str(value)


def format_range(entry: dict, name: str, digits: int | None = 1, sign: str = "") -> str:
    """``median [min, max]`` of the summary fields ``{name}_median``, ``{name}_min`` and ``{name}_max``."""
    median, low, high = (_number(entry[f"{name}_{part}"], digits, sign) for part in ("median", "min", "max"))
    return f"{median} [{low}, {high}]"


def shell_word(value) -> str:
    """``value`` as one shell word, quoted only where it must be (a path with spaces, ``|`` or ``*``), so that a
    printed command line runs as pasted."""
    return shlex.quote(str(value))


def shard_flags(shard: str | None) -> list[str]:
    """``--shard i/n`` for a folder that holds one shard of a grid (it takes no other), none for a whole one."""
    return [f"--shard {shard}"] if shard and shard != "1/1" else []


def layer_flags(dense_layers, layer_supports) -> list[str]:
    """The command-line flags that give a stored spec's per-layer settings (``--dense-layers 0,1``,
    ``--layer-supports 5:385``; ``layer_supports`` as pairs or a dict), none where it has none."""
    flags = [f"--dense-layers {','.join(map(str, dense_layers))}"] if dense_layers else []
    if layer_supports:
        pairs = layer_supports.items() if isinstance(layer_supports, dict) else layer_supports
        flags.append(f"--layer-supports {','.join(f'{layer}:{support}' for layer, support in pairs)}")
    return flags


def changed_flags(spec, default, names) -> list[str]:
    """A command's ``--name value`` for each of ``names`` where ``spec`` differs from ``default``, then the flags of its
    per-layer settings (:func:`layer_flags`)."""
    flags = [
        f"--{n.replace('_', '-')} {shell_word(getattr(spec, n))}"
        for n in names
        if getattr(spec, n) != getattr(default, n)
    ]
    return flags + layer_flags(spec.dense_layers, spec.layer_supports)


def code(text) -> str:
    """``text`` as one Markdown code span on one line, whatever backticks it holds (a fence longer than any run of
    them inside), so a user's path or selector spec shows as written."""
    text = " ".join(str(text).splitlines())
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def spec_cell(spec: str) -> str:
    """A selector spec (or another name the user chose) as Markdown: as it is, or a code span where Markdown would
    read part of it as markup (``*``, ``_``, a backtick, a backslash, brackets), so that it shows as written."""
    return code(spec) if re.search(r"[*_`\\\[\]<>&]", str(spec)) else str(spec)


def table_cell(text: str) -> str:
    """A Markdown table cell of ``text``: on one line, its ``|`` escaped so that it does not end the cell."""
    return " ".join(str(text).splitlines()).replace("|", "\\|")


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of ready-made cells (:func:`table_cell` applied), every column right-aligned (the columns
    are mostly numbers)."""
    lines = ["| " + " | ".join(map(table_cell, header)) + " |", "|" + "|".join(" ---: " for _ in header) + "|"]
    lines += ["| " + " | ".join(map(table_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> Path:
    """Rows of dicts as CSV (columns in first-seen order; lists written as JSON)."""
    columns: list[str] = []
    for row in rows:
        columns += [name for name in row if name not in columns]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, tuple, dict)) else v for k, v in row.items()})
    write_text_atomic(path, text.getvalue())
    return path


@contextlib.contextmanager
def restored_on_failure(directory: Path) -> Iterator[dict[Path, bytes]]:
    """Yields the folder's CSVs and plots as they were; when the block raises (an interrupt too: Ctrl-C, SIGTERM) the
    files written since are removed and those put back, so no report's tables stand beside another report.md."""
    before = set(directory.iterdir())
    kept = {path: path.read_bytes() for path in before if path.suffix in {".csv", ".png"} and path.is_file()}
    try:
        yield kept
    except BaseException:
        for path in set(directory.iterdir()) - before:  # the CSVs and plots written so far: nothing half-done
            if path.is_file():
                path.unlink()
        for path, data in kept.items():  # and those of an earlier report, as they were
            if not path.is_file() or path.read_bytes() != data:
                with atomic_path(path) as tmp:
                    tmp.write_bytes(data)
        raise
