"""A selector comparison's document (``selectors.json``, written by ``compare-selectors`` and ``merge``) as ``merge``
and ``report`` read it: one reader, :func:`read_comparison`, that checks everything they use (:mod:`.fields`), so a
hand-edited file is one line naming what is wrong, never a traceback from deep inside a merge or a summary.

Checked: the settings (model, selectors as a list of distinct names, contexts, supports, prompts, tokens); every run
(the fields the summary, the report and a merge read, its context, support and selector among the settings', its
prompt among the prompts, no run twice: a copy would count twice in every median and count); every summary row;
every passkey trial (a dense trial's passkey and answer ids, a sparse trial's selector among the settings'; none
twice); and that every (context, selector, support) of the settings has a run to summarise.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SparseDecodeError
from .fields import (
    FLAG,
    INTEGER,
    INTEGERS,
    NUMBER,
    NUMBER_OR_NULL,
    STRING,
    Fields,
    integer,
    integers,
    json_kind,
    or_null,
    problem,
    string,
    strings,
)

COMPARISON_FILE = "selectors.json"

SETTINGS_FIELDS: Fields = {
    "model": STRING,
    "dtype": STRING,
    "corpus": STRING,
    "selectors": ("a list of selector names", lambda v: strings(v) and bool(v) and len(set(v)) == len(v)),
    "context": ("a list of distinct contexts", lambda v: integers(v) and bool(v) and len(set(v)) == len(v)),
    "support": ("a list of distinct supports", lambda v: integers(v) and bool(v) and len(set(v)) == len(v)),
    "prompts": INTEGER,
    "tokens": INTEGER,
}
RUN_FIELDS: Fields = {
    "selector": STRING,
    "support": INTEGER,
    "context": INTEGER,
    "prompt_index": INTEGER,
    "tokens": INTEGER,
    "dense_tokens": INTEGERS,
    "sparse_tokens": INTEGERS,
    "first_divergence": INTEGER,
    "survives": FLAG,
    "teacher_forced_match": NUMBER,
    "delta_ppl_percent": NUMBER,
    "certified_fraction": NUMBER,
    "captured_mass_ratio_mean": NUMBER_OR_NULL,
}
SUMMARY_FIELDS: Fields = {"selector": STRING, "context": INTEGER, "support": INTEGER, "op_ms": NUMBER_OR_NULL}
TRIAL_FIELDS: Fields = {
    "context": INTEGER,
    "trial": INTEGER,
    "mode": STRING,
    "selector": ("a selector name or null", or_null(string)),
    "support": ("an integer or null", or_null(integer)),
    "correct": FLAG,
}
DENSE_TRIAL_FIELDS: Fields = {"passkey": ("a string", string), "answer_ids": INTEGERS}


def read_comparison(folder: Path) -> dict:
    """The parsed, checked ``selectors.json`` of ``folder`` (as stored: :func:`.selector_comparison.rebuild` makes
    it today's); one line naming the file and what is wrong otherwise."""
    path = Path(folder) / COMPARISON_FILE
    if not path.is_file():
        raise SparseDecodeError(f"{folder} is not a selector comparison folder (no {COMPARISON_FILE})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SparseDecodeError(f"cannot read {path}: {error.strerror or error}") from None
    except ValueError as error:  # invalid JSON or invalid UTF-8
        reason = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8 text"
        raise SparseDecodeError(f"{path} is not a selector comparison (not valid JSON: {reason})") from None
    found = comparison_problem(data)
    if found:
        raise SparseDecodeError(f"{path} is not a selector comparison ({found}): fix it, or write it again")
    return data


def comparison_problem(data) -> str | None:
    """What keeps ``data`` from being a comparison document (see the module), in a few words; ``None`` if nothing."""
    if not isinstance(data, dict):
        return f"expected a JSON object with settings, summary, runs and retrieval, got {json_kind(data)}"
    for name in ("settings", "summary", "runs"):
        if name not in data:
            return f"lacks field {name!r}"
    settings = data["settings"]
    found = problem(settings, SETTINGS_FIELDS)
    if found:
        return f"its settings {found}"
    for name, fields, records in (
        ("run", RUN_FIELDS, data["runs"]),
        ("summary row", SUMMARY_FIELDS, data["summary"]),
        ("passkey trial", TRIAL_FIELDS, data.get("retrieval", [])),
    ):
        if not isinstance(records, list):
            return f"its {name}s should be a list, not {json_kind(records)}"
        for number, record in enumerate(records, start=1):
            found = problem(record, fields) or _outside(record, settings, name)
            if found:
                return f"{name} {number} {found}"
    return _repeated(data["runs"], "run") or _repeated(data.get("retrieval", []), "passkey trial") or _missing(data)


def _outside(record: dict, settings: dict, what: str) -> str | None:
    """A record naming a context, support, selector or prompt that the settings do not hold."""
    if record["context"] not in settings["context"]:
        return f"is at context {record['context']}, not one of the settings' {settings['context']}"
    if what == "passkey trial" and record["selector"] is None:
        return problem(record, DENSE_TRIAL_FIELDS)
    if record["selector"] not in settings["selectors"]:
        return f"is of selector {record['selector']!r}, not one of the settings' selectors"
    if record["support"] not in settings["support"]:
        return f"is at support {record['support']}, not one of the settings' {settings['support']}"
    if what == "run" and not 0 <= record["prompt_index"] < settings["prompts"]:
        return f"is of prompt {record['prompt_index']}, outside the settings' {settings['prompts']} prompts"
    return None


def _repeated(records: list[dict], what: str) -> str | None:
    """Two records of one run (or trial): a hand-edited copy would count twice in every median and count."""
    seen: dict[tuple, int] = {}
    for number, record in enumerate(records, start=1):
        index = record["prompt_index"] if what == "run" else record["trial"]
        key = (record["context"], index, record["selector"], record["support"])
        first = seen.setdefault(key, number)
        if first != number:
            return (
                f"{what} {number} repeats {what} {first} (context {key[0]}, {'prompt' if what == 'run' else 'trial'} "
                f"{key[1]}, selector {key[2]}, support {key[3]}): each counts once, remove the copy"
            )
    return None


def _missing(data: dict) -> str | None:
    """A (context, selector, support) of the settings without a run: nothing to summarise it by."""
    settings, held = data["settings"], {(r["context"], r["selector"], r["support"]) for r in data["runs"]}
    for context in settings["context"]:
        for selector in settings["selectors"]:
            for support in settings["support"]:
                if (context, selector, support) not in held:
                    return f"no run of selector {selector} at context {context}, support {support}"
    return None
