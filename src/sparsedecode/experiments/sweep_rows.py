"""A sweep's rows (:mod:`.sweep`): what one ``runs.jsonl`` row holds (:func:`make_row`), and the file that stores
them: appended one whole line at a time with an ``fsync``, a torn last line (a killed write) ignored or cut, older rows
upgraded to today's ``first_divergence`` convention when read. Evaluation folders store their rows the same way."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import SparseDecodeError, naming
from ..files import write_text_atomic
from ..protocol.results import FIRST_DIVERGENCE_CONVENTION, CompareResult, upgrade_row
from .fields import INTEGER, INTEGERS, STRING, Fields, check_rows
from .specs import KEY_FIELDS, RunKey


def key_of(row: dict) -> RunKey:
    return tuple(row[name] for name in KEY_FIELDS)  # type: ignore[return-value]


RESULT_FIELDS = (
    "first_divergence",
    "survives",
    "teacher_forced_match",
    "delta_ppl_percent",
    "dense_ppl",
    "sparse_ppl",
    "mean_unique_distant_positions_per_kv",
    "sparse_steps",
    "dense_fallback_steps",
    "centroid_cache_bytes",
    "certified_fraction",
    "flips",
    "certificate_violations",
    "margin_at_divergence",
    "warning_regime",
)
CERTIFICATE_FIELDS = ("uncertified_flips", "delta_at_divergence", "median_margin", "median_delta")
AUDIT_FIELDS = (
    "identity_residual_max",
    "bound_violations",
    "omitted_mass_mean",
    "selector_recall_mean",
    "captured_mass_ratio_mean",
    "selector_recall_per_head_best_mean",
    "captured_mass_ratio_per_head_best_mean",
)
SUPPORT_READ_FIELDS = ("support_read_mean", "support_read_min", "support_read_max")
TOKEN_FIELDS = ("dense_tokens", "sparse_tokens", "teacher_forced_tokens")
TIMING_FIELDS = ("prefill_s", "dense_decode_s", "sparse_decode_s", "teacher_forced_s")


def make_row(key: RunKey, result: CompareResult, *, run_s: float, audit: bool = False) -> dict:
    """One ``runs.jsonl`` row: the key, the settings, the scalar results, the token ids and the timings.

    The long per-step lists of :class:`CompareResult` (NLL, margins, logit errors) are left out to keep
    rows small; the token id lists are kept, so continuations can be decoded and compared later.
    """
    context, prompt_index, support, reuse, selector = key
    settings = result.settings
    row: dict = {
        "context": context,
        "prompt_index": prompt_index,
        "support": support,
        "reuse": reuse,
        "selector": selector,
        "effective_support": settings["effective_support"],
        "blocks": settings["blocks"],
        "window": settings["window"],
        "block_size": settings["block_size"],
        "tokens": result.tokens,
        "selector_params": settings.get("selector_params", {}),
    }
    if "selector_sha256" in settings:
        row["selector_sha256"] = settings["selector_sha256"]
    for name in ("dense_layers", "layer_supports"):  # rows of runs of one support everywhere hold neither
        if settings.get(name):
            row[name] = [list(item) if isinstance(item, tuple) else item for item in settings[name]]
    row.update({name: getattr(result, name) for name in RESULT_FIELDS})
    row.update({name: result.certificate.get(name) for name in CERTIFICATE_FIELDS})
    if audit:
        row.update({name: getattr(result, name) for name in AUDIT_FIELDS})
    row.update({name: list(getattr(result, name)) for name in TOKEN_FIELDS})
    row.update({name: getattr(result, name) for name in TIMING_FIELDS})
    row["run_s"] = run_s
    row.update({name: getattr(result, name) for name in SUPPORT_READ_FIELDS})
    row["first_divergence_convention"] = result.first_divergence_convention
    return row


ROW_FIELDS: Fields = {name: INTEGER for name in KEY_FIELDS[:-1]} | {"selector": STRING, "dense_tokens": INTEGERS}
"""The fields of a row that resuming and merging read (a report reads more, and names what a row lacks)."""


def read_rows(path: Path, *, repair: bool = False, check: bool = True) -> list[dict]:
    """The rows of a ``runs.jsonl`` in today's ``first_divergence`` convention (older rows upgraded, see
    :func:`~sparsedecode.protocol.results.upgrade_row`); a torn last line (no final newline: a killed write) is ignored.
    With ``check``, a row lacking a field of :data:`ROW_FIELDS` is one line naming the file and the run.

    With ``repair`` the torn tail is also cut from the file, so the next append starts on a fresh line.
    """
    rows = _upgraded(path, parse_rows(path, repair=repair))
    return check_rows(path, rows, ROW_FIELDS) if check else rows


def _upgraded(path: Path, rows: list[dict]) -> list[dict]:
    """``rows`` of ``path`` upgraded by :func:`~sparsedecode.protocol.paired.upgrade_row`; a row that cannot be is
    named."""
    upgraded = []
    for number, row in enumerate(rows, start=1):
        try:
            upgraded.append(upgrade_row(row))
        except SparseDecodeError as error:
            raise SparseDecodeError(f"{path} run {number}: {error}") from error
    return upgraded


def upgrade_rows_file(path: Path) -> int:
    """Rewrite ``runs.jsonl`` in today's ``first_divergence`` convention when it holds older rows; returns how
    many rows were upgraded. Every other byte of a row stays as it was (the mark is appended to the row)."""
    raw = parse_rows(path)
    old = sum(row.get("first_divergence_convention") != FIRST_DIVERGENCE_CONVENTION for row in raw)
    if old:
        write_rows(path, _upgraded(path, raw))
    return old


def parse_rows(path: Path, *, repair: bool = False) -> list[dict]:
    """The rows of a JSON-lines file as written (no convention upgrade: evaluation folders use this too); a torn
    last line (no final newline: a killed write) is ignored, and with ``repair`` cut from the file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    complete, _, torn = data.rpartition(b"\n")
    if torn and repair:
        with open(path, "r+b") as handle:
            handle.truncate(len(data) - len(torn))
            handle.flush()
            os.fsync(handle.fileno())
    rows = []
    for number, line in enumerate(complete.split(b"\n") if complete else [], start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:  # invalid JSON or invalid UTF-8
            reason = error.msg if isinstance(error, json.JSONDecodeError) else type(error).__name__
            raise SparseDecodeError(f"{path} line {number} is not valid JSON ({reason}); fix or remove it") from error
        if not isinstance(row, dict):
            raise SparseDecodeError(f"{path} line {number} is not a JSON object (a run); fix or remove it")
        rows.append(row)
    return rows


def append_row(path: Path, row: dict) -> None:
    """Append one row as a single ``os.write`` of the whole line, then ``fsync``; undone on failure, but for an
    interrupt (Ctrl-C, SIGTERM) arriving once the whole line is written: that row is done, and kept."""
    data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
    with naming(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except BaseException as error:
                if view or not isinstance(error, KeyboardInterrupt):  # a row not whole, or not on disk (a failed fsync)
                    os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)


def write_rows(path: Path, rows: list[dict]) -> None:
    """Replace ``runs.jsonl`` with ``rows`` (one JSON line each) through a temporary file and a rename."""
    write_text_atomic(path, "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))
