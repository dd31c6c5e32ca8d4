"""An evaluation's folder (:mod:`.evaluate`): ``eval.json`` and what it must hold, the rows of ``runs.jsonl`` and
what each must hold, and the rules by which a folder takes another run (those of a sweep's folder,
:func:`.sweep_folder.check_growth`, plus the task generator's version)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SparseDecodeError
from .eval_spec import DENSE, KEY_FIELDS, EvalSpec, RunKey
from .fields import (
    FLAG,
    INTEGER,
    INTEGERS,
    NUMBER,
    STRING,
    Fields,
    check_rows,
    check_run_keys,
    integer,
    json_kind,
    or_null,
    strings,
)
from .ruler import GENERATOR_VERSION
from .specs import adopt_stored
from .sweep_folder import RUNS_FILE, Shard, check_growth
from .sweep_folder import SPEC_FILE as SWEEP_FILE
from .sweep_rows import parse_rows

SPEC_FILE = "eval.json"


def key_of(row: dict) -> RunKey:
    return tuple(row[name] for name in KEY_FIELDS)  # type: ignore[return-value]


META_FIELDS = ("spec", "corpus_sha256", "weights_sha256", "generator_version", "shard", "sessions")
"""The fields of ``eval.json``; only ``spec`` is required (files written before the others lack them)."""


def read_meta(directory: Path) -> dict | None:
    """The parsed ``eval.json`` of ``directory``, or ``None`` when there is none; a folder without one that holds
    another experiment's results (``sweep.json``, or a ``runs.jsonl`` of its own) is refused, not joined."""
    directory = Path(directory)
    path = directory / SPEC_FILE
    if not path.exists():
        foreign = [name for name in (SWEEP_FILE, RUNS_FILE) if (directory / name).exists()]
        if foreign:
            raise SparseDecodeError(
                f"{directory} holds {' and '.join(foreign)} but no {SPEC_FILE}: it is not an evaluation folder (a "
                f"sweep's?); give an evaluation folder, or a new or empty one"
            )
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SparseDecodeError(f"cannot read {path}: {error.strerror or error}") from error
    except ValueError as error:  # invalid JSON or invalid UTF-8
        reason = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8 text"
        raise SparseDecodeError(f"{path} is not valid JSON ({reason}); fix or remove it") from error
    problem = _meta_problem(meta)
    if problem:
        raise SparseDecodeError(
            f"{path} is not a valid evaluation description ({problem}); fix it, or use the sparsedecode that wrote "
            "it (it holds the settings of the folder's runs)"
        )
    return meta


def _meta_problem(meta) -> str | None:
    """What keeps ``meta`` (parsed ``eval.json``) from describing an evaluation, in a few words; ``None`` if nothing."""
    if not isinstance(meta, dict):
        return f"expected a JSON object with fields {', '.join(META_FIELDS)}, got {json_kind(meta)}"
    if "spec" not in meta:
        return "lacks field 'spec'"
    spec = meta["spec"]
    if not isinstance(spec, dict):
        return f"field 'spec' should be a JSON object of the evaluation's settings, got {json_kind(spec)}"
    if "model" not in spec:
        return "its spec lacks field 'model'"
    if not isinstance(meta.get("sessions", []), list):
        return f"field 'sessions' should be a list, got {json_kind(meta['sessions'])}"
    try:
        EvalSpec.from_dict(spec)
    except SparseDecodeError as error:
        return str(error)
    except (TypeError, ValueError, AttributeError) as error:  # a value of the wrong kind for EvalSpec's checks
        return f"a spec value of the wrong kind: {(str(error).splitlines() or [type(error).__name__])[0][:160]}"
    return None


ROW_FIELDS: Fields = {
    "task": STRING,
    "context": INTEGER,
    "sample": INTEGER,
    "selector": STRING,
    "support": ("an integer or null", or_null(integer)),
    "prompt_format": STRING,
    "prompt_sha256": STRING,
    "answers": ("a list of strings", strings),
    "output": STRING,
    "output_ids": INTEGERS,
    "score": NUMBER,
    "correct": FLAG,
}
"""The fields of a ``runs.jsonl`` row that resuming, merging and reporting read, each with what it must hold."""


def read_rows(path: Path, *, repair: bool = False) -> list[dict]:
    """The rows of an evaluation's ``runs.jsonl`` (see :func:`.sweep.parse_rows`: a torn last line is ignored, with
    ``repair`` cut from the file); a row that lacks a field of :data:`ROW_FIELDS` or holds the wrong kind of value
    is refused in one line naming the file and the run. Selectors are named as today
    (:func:`~sparsedecode.protocol.results.upgrade_selector`: rows of ``quest`` or ``sparq`` written before issue #39
    ran the group-mean variants)."""
    from ..protocol.results import upgrade_selector  # results imports torch: command-line errors come before it

    rows = check_rows(path, parse_rows(path, repair=repair), ROW_FIELDS)
    return [row if row["selector"] == DENSE else upgrade_selector(row) for row in rows]


def check_folder(directory: Path, spec: EvalSpec, shard: Shard | None) -> list[str]:
    """Everything :func:`run_eval` refuses about ``directory`` before it loads a model, checked before the command
    line loads one: another experiment's folder, a malformed ``eval.json`` or run, other settings (beyond a grid
    that grows) or another shard (the corpus text is compared by :func:`run_eval`). Returns one line per grid field
    ``spec`` adds to the stored one."""
    meta = read_meta(directory)
    grown = [] if meta is None else check_meta(directory, meta, spec, None, shard)
    rows = read_rows(Path(directory) / RUNS_FILE)
    if meta is not None:
        check_eval_keys(Path(directory) / RUNS_FILE, rows, meta)
    return grown


def check_meta(directory: Path, meta: dict, spec: EvalSpec, corpus: str | None, shard: Shard | None) -> list[str]:
    """Refuse to add runs of ``spec`` to a folder holding another evaluation, another corpus text or shard; a spec
    that only adds to the stored grid is taken in an unsharded folder (:func:`.sweep.check_growth`): returns one
    line per grown grid field."""
    spec = adopt_stored(spec, meta, directory)  # a file selector the folder names otherwise
    stored = EvalSpec.from_dict(meta["spec"])
    grown = check_growth(directory, stored, spec, meta.get("shard"), shard, "an evaluation")
    if meta.get("generator_version", GENERATOR_VERSION) != GENERATOR_VERSION:
        raise SparseDecodeError(
            f"{directory} was generated by task generator version {meta.get('generator_version')}, this is version "
            f"{GENERATOR_VERSION}: its samples would differ, use another --out"
        )
    if corpus is not None and meta.get("corpus_sha256") not in (None, corpus):
        raise SparseDecodeError(
            f"{directory} was generated from another text of corpus {spec.corpus!r} (sha256 differs): use another --out"
        )
    stored_shard = meta.get("shard")
    if shard is not None and stored_shard is not None and stored_shard != str(shard):
        raise SparseDecodeError(
            f"{directory} holds shard {stored_shard} of this evaluation, not {shard}: give each shard its own --out "
            "and combine them with `sparsedecode merge`"
        )
    return grown


def load_eval(directory: Path) -> tuple[dict, list[dict]]:
    """``(meta, rows)`` of an evaluation folder (read-only: a torn last line is ignored, not cut)."""
    directory = Path(directory)
    meta = read_meta(directory)
    if meta is None:
        raise SparseDecodeError(f"{directory} is not an evaluation folder (no {SPEC_FILE})")
    rows = read_rows(directory / RUNS_FILE)
    check_eval_keys(directory / RUNS_FILE, rows, meta)
    return meta, rows


def check_eval_keys(path: Path, rows: list[dict], meta: dict) -> None:
    """No run of ``rows`` listed twice, none outside the grid of the folder's ``meta``."""
    check_run_keys(path, rows, EvalSpec.from_dict(meta["spec"]).keys(), key_of, "its evaluation spec")


def is_eval_folder(directory: Path) -> bool:
    return (Path(directory) / SPEC_FILE).exists()
