"""What a results folder's JSON records must hold, checked by one rule for every kind of folder: a record (a sweep's
or an evaluation's row, a comparison's run, summary row or passkey trial) either holds every field its reader uses,
each of the right kind, or is refused in one line naming the file, the record and the field. A hand-edited file
then gets that line, never a ``KeyError``, ``TypeError`` or ``StatisticsError`` from deep inside a merge or a
report.

``FIELDS`` tables map a field's name to ``(what it must hold, in words; a test of a value)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ..errors import SparseDecodeError

Fields = dict[str, tuple[str, Callable[[object], bool]]]


def integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def string(value) -> bool:
    return isinstance(value, str)


def flag(value) -> bool:
    return isinstance(value, bool)


def integers(value) -> bool:
    return isinstance(value, list) and all(integer(item) for item in value)


def strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def or_null(test: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or test(value)


INTEGER = ("an integer", integer)
NUMBER = ("a number", number)
NUMBER_OR_NULL = ("a number or null", or_null(number))
STRING = ("a string", string)
FLAG = ("true or false", flag)
INTEGERS = ("a list of integers", integers)


def json_kind(value) -> str:
    """What a parsed JSON value is, in words: ``null``, ``a list``, ``a string``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    kinds = {dict: "a JSON object", list: "a list", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def problem(record, fields: Fields) -> str | None:
    """What keeps ``record`` from holding ``fields``, in a few words (``lacks field 'x'``, ``field 'x' should be a
    number, not "3"``); ``None`` if nothing."""
    if not isinstance(record, dict):
        return f"is {json_kind(record)}, not a JSON object"
    missing = [name for name in fields if name not in record]
    if missing:
        shown = ", ".join(repr(name) for name in missing[:4]) + (
            f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        )
        return f"lacks field{'s' if len(missing) > 1 else ''} {shown}"
    for name, (kind, holds) in fields.items():
        if not holds(record[name]):
            return f"field {name!r} should be {kind}, not {json.dumps(record[name])[:40]}"
    return None


def check_records(records, fields: Fields, where: str, what: str) -> list[dict]:
    """``records`` (a list of ``what``) if each holds ``fields``, else one line naming ``where`` and the record."""
    if not isinstance(records, list):
        raise SparseDecodeError(f"{where}: its {what}s should be a list, not {json_kind(records)}")
    for number_, record in enumerate(records, start=1):
        found = problem(record, fields)
        if found:
            raise SparseDecodeError(f"{where}: {what} {number_} {found}")
    return records


def check_rows(path, rows: list[dict], fields: Fields) -> list[dict]:
    """A results folder's ``runs.jsonl`` rows if each holds ``fields``, else one line naming the file and the run."""
    for number_, row in enumerate(rows, start=1):
        found = problem(row, fields)
        if found:
            raise SparseDecodeError(
                f"{path} run {number_} {found}; fix or remove that line (a removed run is redone on resume)"
            )
    return rows


def check_run_keys(path, rows: list[dict], keys, key_of: Callable[[dict], tuple], what: str) -> None:
    """Refuse rows of ``path`` (a hand-edited ``runs.jsonl``) that would be counted wrongly: a run listed twice, or a
    run outside ``keys`` (the runs of the folder's settings; ``key_of`` a row's key). Rows lacking a key field are
    left to the caller's field check."""
    keys, seen = set(keys), set()
    for number, row in enumerate(rows, start=1):
        try:
            key = key_of(row)
        except KeyError:
            continue
        try:
            listed, inside = key in seen, key in keys
        except TypeError:  # a list where a value belongs: not hashable, not a run of the spec
            listed, inside = False, False
        if listed:
            raise SparseDecodeError(f"{path} lists run {key} twice (line {number} again): it would count twice")
        if not inside:
            raise SparseDecodeError(f"{path} holds a run {key} (line {number}) that is not part of {what}")
        seen.add(key)
