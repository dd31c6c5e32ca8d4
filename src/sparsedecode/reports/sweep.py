"""``sparsedecode report DIR``: a sweep folder (and optional retrieval results) rendered as Markdown, CSV and PNG.

Reads ``sweep.json`` and ``runs.jsonl`` (see :mod:`sparsedecode.experiments.sweep`) and, when present,
``retrieval.json`` (see :mod:`sparsedecode.experiments.retrieval`), and writes next to them ``report.md``,
one CSV per table and the plots. A folder of ``compare-selectors`` (``selectors.json``) is rendered as
``selectors.md`` and ``selectors.csv``, its summary recomputed from its stored runs with today's code (see
:func:`sparsedecode.experiments.selector_comparison.rebuild`). Every number is computed from the rows by
:mod:`sparsedecode.experiments.summary`; the report states the conditions the rows were measured under and
what they do not establish. This module sits on top of the library; the library never imports it.

This module reads and checks the inputs and puts the report together; the sections are rendered by
:mod:`.survival` (with :mod:`.findings`), :mod:`.retrieval` and :mod:`.selector_comparison`, from the cells and
tables of :mod:`.tables`. Their public names are importable from here too, where they lived before.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

from ..errors import SparseDecodeError
from ..experiments.sweep import RUNS_FILE, SPEC_FILE, load_sweep
from ..files import write_text_atomic
from .findings import REFERENCE
from .retrieval import retrieval_section
from .selector_comparison import (
    SELECTOR_HEADERS,
    SELECTORS_FILE,
    dense_retrieval_lines,
    selector_cells,
    selector_markdown,
    write_selector_comparison,
)
from .survival import sweep_command, sweep_section
from .tables import restored_on_failure, write_csv

__all__ = [
    "CAVEATS",
    "REFERENCE",
    "REPORT_FILE",
    "RETRIEVAL_CAVEATS",
    "RETRIEVAL_FILE",
    "SELECTORS_FILE",
    "SELECTOR_HEADERS",
    "SWEEP_CAVEATS",
    "dense_retrieval_lines",
    "read_retrieval",
    "selector_cells",
    "selector_markdown",
    "sweep_command",
    "write_csv",
    "write_report",
    "write_selector_comparison",
]

REPORT_FILE = "report.md"
RETRIEVAL_FILE = "retrieval.json"

CAVEATS = [
    "Each run is one prompt under one setting, measured on the device and dtype stated above; nothing here measures "
    "speed at matched quality or end-to-end throughput, and the timing fields (names ending in _s) were taken on a "
    "machine that may have been running other work.",
    "The model (the built-in aliases are dequantised 4-bit GGUF weights), corpus and prompts differ from the "
    "reference study's (Qwen2-0.5B, fp16, WikiText-2): agreement or disagreement with it is qualitative, not a "
    "replication of its numbers.",
]
SWEEP_CAVEATS = [
    "Teacher-forced ΔPPL is measured on the dense model's own greedy continuation, not on text the sparse model "
    "produced, nor on held-out human text; a small ΔPPL does not mean free-running output stays close.",
    "A few prompts per condition: medians and ranges are descriptive; there are no confidence intervals, and a "
    "single bad prefix can move a condition.",
    "Greedy decoding only; sampling, batch > 1, other selectors, reuse intervals and window sizes are not covered "
    "unless listed in the conditions.",
    "The 70% teacher-forced-match line is the reference study's observation, used as a warning, not a threshold "
    "with any guarantee.",
]
RETRIEVAL_CAVEATS = [
    "Retrieval: passkey exact match with a few trials per cell on a small model says little about other retrieval "
    "tasks or longer contexts; a model that fails densely tells nothing about the selector.",
    "Captured-mass ratios are averages over steps, layers and heads and can hide the one head that matters; the "
    "relation to success is observed on these trials, not a general law.",
]


def _problem(error: BaseException) -> str:
    """What a malformed input file lacks or holds, in a few words."""
    if isinstance(error, KeyError):
        return f"a field {error.args[0]!r} is missing"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:160]}" if lines else type(error).__name__


def read_retrieval(path: Path) -> dict:
    """The parsed ``retrieval.json`` at ``path``: an object with a ``spec`` object and a list of ``trials`` objects."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SparseDecodeError(f"cannot read retrieval results {path}: {error.strerror or error}") from error
    except ValueError as error:  # invalid JSON or invalid UTF-8
        raise SparseDecodeError(
            f"{path} is not valid JSON ({_problem(error)}); rerun `sparsedecode probe retrieval`"
        ) from error
    if not isinstance(data, dict) or not isinstance(data.get("spec"), dict) or not isinstance(data.get("trials"), list):
        raise SparseDecodeError(
            f"{path} is not a retrieval result (expected an object with 'spec' and a list of 'trials'); "
            "rerun `sparsedecode probe retrieval`"
        )
    if not all(isinstance(trial, dict) for trial in data["trials"]):
        raise SparseDecodeError(f"{path} holds a trial that is not a JSON object; rerun `sparsedecode probe retrieval`")
    seen = set()
    for number, trial in enumerate(data["trials"], start=1):  # a trial listed twice would count twice
        key = tuple(repr(trial.get(name)) for name in ("context", "depth", "trial", "mode", "selector", "support"))
        if key in seen:
            raise SparseDecodeError(f"{path} lists trial {number} twice (same context, depth, trial and mode)")
        seen.add(key)
    from ..protocol.results import upgrade_audit_fields

    return {**data, "trials": [upgrade_audit_fields(trial) for trial in data["trials"]]}


OUTPUTS = (
    "conditions.csv", "runs.csv", "warning_runs.csv", "selectors.csv", "match_vs_delta_ppl.png",
    "delta_ppl_by_support.png", "first_divergence.png", "retrieval_accuracy.csv", "mass_vs_retrieval.csv",
    "retrieval_trials.csv", "mass_vs_retrieval.png", "retrieval_*.png",
)  # fmt: skip
"""The CSVs and plots a report writes (patterns): one an earlier report wrote that this one does not is removed."""


def _stamp(path: Path) -> tuple[int, int] | None:
    """What tells a file rewritten (every write renames a new file into place): its inode and modification time."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError)
"""What rendering rows that lack a field or hold a value of the wrong type raises."""


def write_report(directory: Path, *, retrieval: Path | None = None) -> Path:
    """Write ``report.md`` (with CSVs and PNGs) into ``directory``; returns its path.

    ``directory`` holds a sweep (``sweep.json``), retrieval results (``retrieval.json``), or both; ``retrieval``
    points at a retrieval result file or folder elsewhere. A folder holding only a selector comparison
    (``selectors.json``) is rendered by :func:`write_selector_comparison` instead (``selectors.md``).
    """
    directory = Path(directory)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is a file, not a results folder"
        raise SparseDecodeError(f"{directory} {what}: give a sweep, retrieval or selector-comparison folder")
    has_sweep = (directory / SPEC_FILE).exists()
    if retrieval is None:
        for candidate in (directory / RETRIEVAL_FILE, directory / "retrieval" / RETRIEVAL_FILE):
            if candidate.exists():
                retrieval = candidate
                break
    elif Path(retrieval).is_dir():
        retrieval = Path(retrieval) / RETRIEVAL_FILE
    if retrieval is not None and not Path(retrieval).exists():
        raise SparseDecodeError(f"retrieval results {retrieval} not found")
    if retrieval is not None and not Path(retrieval).is_file():  # /dev/zero, a pipe: read forever
        raise SparseDecodeError(f"retrieval results {retrieval} are not a regular file: give a retrieval.json")
    if not has_sweep and retrieval is None and (directory / SELECTORS_FILE).exists():
        return write_selector_comparison(directory)
    if not has_sweep and retrieval is None:
        kinds = {
            "mass.json": " (a probe mass folder: its mass.json and heat maps are its results, which report does not "
            "render)",
            "calibration.json": " (a calibration folder: calibrate writes its report, calibration.md, itself)",
        }
        raise SparseDecodeError(
            f"{directory} holds neither a sweep ({SPEC_FILE}), an evaluation (eval.json), retrieval results "
            f"({RETRIEVAL_FILE}) nor a selector comparison ({SELECTORS_FILE})"
            + "".join(said for name, said in kinds.items() if (directory / name).is_file())
        )
    out: list[str] = []
    if has_sweep:  # read and check every input before writing anything
        meta, rows = load_sweep(directory)
    if retrieval is not None:
        data = read_retrieval(Path(retrieval))
    source = directory / RUNS_FILE
    try:
        with restored_on_failure(directory) as kept:
            stamps = {path: _stamp(path) for path in kept}
            if has_sweep:
                out += sweep_section(directory, meta, rows)
            if retrieval is not None:
                source = Path(retrieval)
                out += retrieval_section(directory, data)
    except BaseException as error:  # the folder is as it was (an interrupt too)
        if isinstance(error, SparseDecodeError) or not isinstance(error, _MALFORMED):
            raise
        raise SparseDecodeError(
            f"{source} does not hold what a report needs ({_problem(error)}); was it written by another version "
            "of sparsedecode?"
        ) from error
    caveats = CAVEATS + (SWEEP_CAVEATS if has_sweep else []) + (RETRIEVAL_CAVEATS if retrieval is not None else [])
    out += ["# What these numbers do not establish", "", *[f"- {line}" for line in caveats], ""]
    written = {p for p in directory.iterdir() if p.suffix in {".csv", ".png"} and _stamp(p) != stamps.get(p)}
    for path in set(kept) - written:  # an earlier report's, of results no longer shown (other retrieval supports)
        if any(fnmatch.fnmatchcase(path.name, pattern) for pattern in OUTPUTS):
            path.unlink()
    files = sorted([p.name for p in written] + [RUNS_FILE] * (directory / RUNS_FILE).exists())
    out += ["Files: " + ", ".join(f"[{name}]({name})" for name in files), ""]
    path = directory / REPORT_FILE
    write_text_atomic(path, "\n".join(out))
    return path
