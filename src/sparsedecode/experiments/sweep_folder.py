"""A sweep's folder (:mod:`.sweep`): ``sweep.json`` (the spec, the corpus text's sha256, the shard, one entry per
session) and the rules by which a folder takes another run: the same spec, or one that only adds to its grid, over the
same corpus text and shard; the lock one writer holds; the shards a sweep is cut into. Evaluation folders follow the
same rules (:mod:`.evaluate`)."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import SparseDecodeError
from ..files import LOCK_FILE
from .corpus import load_text
from .fields import check_run_keys
from .specs import Group, Spec, SweepSpec, adopt_stored
from .sweep_rows import key_of, read_rows

SPEC_FILE = "sweep.json"
RUNS_FILE = "runs.jsonl"


def union_spec(specs: list[Spec]) -> Spec:
    """The smallest spec whose grid holds every spec's grid (:meth:`.specs.Spec.union`: values in first-seen order,
    the largest counts); a sweep's or an evaluation's.

    Raises :class:`SparseDecodeError` when the specs differ outside their grid fields.
    """
    return type(specs[0]).union(specs)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (1-based): every ``count``-th (context, prompt) group, starting at ``index``."""

    index: int = 1
    count: int = 1

    def __post_init__(self) -> None:
        if not (1 <= self.index <= self.count):
            raise SparseDecodeError(f"shard {self.index}/{self.count}: need 1 <= i <= n in --shard i/n")

    @classmethod
    def parse(cls, text: str) -> Shard:
        try:
            index, count = (int(part) for part in text.split("/"))
        except ValueError as error:
            raise SparseDecodeError(f"--shard expects i/n such as 1/4, got {text!r}") from error
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def groups(self, spec: SweepSpec) -> list[Group]:
        return [g for number, g in enumerate(spec.groups()) if number % self.count == self.index - 1]


def corpus_sha256(name: str) -> str:
    """sha256 of the corpus text, so a sweep notices when its prompts would change (another Python, a new file)."""
    return hashlib.sha256(load_text(name).encode("utf-8")).hexdigest()


def check_weights_alike(directory: Path, meta: dict, weights: str | None, what: str) -> None:
    """Refuse to add rows of a model whose :func:`~sparsedecode.models.weights.weights_sha256` is ``weights`` to a
    folder whose rows came from other weights (``what``: "swept", "evaluated"); a folder written before the
    fingerprint was recorded takes it."""
    if weights is not None and meta.get("weights_sha256") not in (None, weights):
        raise SparseDecodeError(
            f"{directory} was {what} with other weights under the model name {meta['spec'].get('model')!r} "
            "(their fingerprint differs: a checkpoint replaced in place?), so its rows would mix two models: use "
            "another --out"
        )
    if weights is not None:
        meta["weights_sha256"] = weights


def read_meta(directory: Path) -> dict | None:
    """The parsed ``sweep.json`` of ``directory``, or ``None`` when there is none; a folder without one that holds
    another experiment's runs (an evaluation's ``eval.json``, or a ``runs.jsonl`` of its own) is refused, not
    joined."""
    directory = Path(directory)
    path = directory / SPEC_FILE
    if not path.exists():
        if (directory / "eval.json").exists() or (directory / RUNS_FILE).exists():
            raise SparseDecodeError(
                f"{directory} holds runs that are not a sweep's (no {SPEC_FILE}): give a new folder, or a sweep folder"
            )
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise TypeError("not a JSON object")
        SweepSpec.from_dict(meta["spec"])
    except OSError as error:
        raise SparseDecodeError(f"cannot read {path}: {error.strerror or error}") from error
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # SparseDecodeError is a ValueError
        reason = (
            f"missing {error.args[0]!r}" if isinstance(error, KeyError) else (str(error).splitlines() or [""])[0][:160]
        )
        raise SparseDecodeError(
            f"{path} is not a valid sweep description ({reason or type(error).__name__}); fix it, or use the "
            "sparsedecode that wrote it (it holds the settings of the folder's runs)"
        ) from error
    return meta


def check_meta(directory: Path, meta: dict, spec: SweepSpec, corpus: str | None, shard: Shard | None) -> list[str]:
    """Refuse to add runs of ``spec`` (corpus hash ``corpus``, ``shard``) to a directory holding another sweep.

    A ``spec`` that only adds to the stored grid (see :func:`check_growth`) is accepted in an unsharded directory;
    returns one line per grown grid field (empty when the specs are equal).
    """
    spec = adopt_stored(spec, meta, directory)  # a file selector the folder names otherwise
    stored_shard = meta.get("shard")
    grown = check_growth(directory, SweepSpec.from_dict(meta["spec"]), spec, stored_shard, shard, "a sweep")
    if corpus is not None and meta.get("corpus_sha256") not in (None, corpus):
        raise SparseDecodeError(
            f"{directory} was swept over another text of corpus {spec.corpus!r} (sha256 differs), so its prompts "
            "would differ: use another --out"
        )
    if shard is not None and stored_shard is not None and stored_shard != str(shard):
        raise SparseDecodeError(
            f"{directory} holds shard {stored_shard} of this sweep, not {shard}: give each shard its own --out and "
            "combine them with `sparsedecode merge`"
        )
    return grown


def check_growth(
    directory: Path, stored: Spec, spec: Spec, stored_shard: str | None, shard: Shard | None, what: str
) -> list[str]:
    """The rule by which a results folder of ``what`` (``"a sweep"``, ``"an evaluation"``) holding ``stored``
    takes ``spec``: the same spec, or one that only adds to its grid (:meth:`.specs.Spec.extension_of`) in an
    unsharded folder. Returns one line per grown grid field (none when the specs are equal); anything else is
    refused, naming the fields that differ."""
    differences = stored.differences(spec)
    grown = spec.extension_of(stored)
    if grown is None:
        raise SparseDecodeError(
            f"{directory} holds {what} with other settings "
            f"({'; '.join(differences)}, stored vs requested): rerun with the stored settings to resume, only add to "
            f"its grid ({spec.GRID_WORDS}, the stored ones kept in order), or use another --out"
        )
    if grown and ((shard is not None and shard.count > 1) or stored_shard not in (None, str(Shard()))):
        raise SparseDecodeError(
            f"{directory} is shard {stored_shard} of {what}, and a grid cannot "
            "grow shard by shard: run the new settings in another --out and combine the folders with "
            "`sparsedecode merge`"
            if stored_shard not in (None, str(Shard()))
            else f"the grid of {directory} cannot grow shard by shard (--shard {shard}): run without --shard, or "
            "run the new settings in another --out and combine the folders with `sparsedecode merge`"
        )
    return [f"extending the grid of {directory}: {line}" for line in grown]


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (released by the OS if the process dies).

    The lock file is removed on the way out, while still locked. When the block fails (a refused sweep or merge),
    the folders this call created are removed again if they are still empty, so a refusal leaves nothing behind.
    """
    directory = Path(directory)
    created = [p for p in (directory, *directory.parents) if not p.exists()]  # deepest first
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    busy = f"another process is writing into {directory}; wait for it or use another --out"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            current = os.stat(path).st_ino
        except (BlockingIOError, FileNotFoundError) as error:
            raise SparseDecodeError(busy) from error
        if current != os.fstat(fd).st_ino:  # the holder before us removed the file we locked; a new one is in use
            raise SparseDecodeError(busy)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # still locked: nobody else holds this file
    except BaseException:
        for folder in created:
            try:
                folder.rmdir()
            except OSError:
                break  # not empty (or not ours to remove): keep it and everything above it
        raise
    finally:
        os.close(fd)


def session_record(shard: Shard | None, env: dict) -> dict:
    """One entry of a folder's ``sessions``: when this run started, its shard and ``env`` (the run's
    :func:`.environment.environment`)."""
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"started": started, "shard": str(shard) if shard else None, "environment": env}


def load_sweep(directory: Path) -> tuple[dict, list[dict]]:
    """``(meta, rows)`` of a sweep directory (read-only: a torn last line is ignored, not cut)."""
    directory = Path(directory)
    meta = read_meta(directory)
    if meta is None:
        raise SparseDecodeError(f"{directory} is not a sweep directory (no {SPEC_FILE})")
    rows = read_rows(directory / RUNS_FILE, check=False)  # a report names what a row lacks
    check_sweep_keys(directory / RUNS_FILE, rows, meta)
    return meta, rows


def check_sweep_keys(path: Path, rows: list[dict], meta: dict) -> None:
    """No run of ``rows`` listed twice, none outside the grid of the folder's ``meta``."""
    check_run_keys(path, rows, SweepSpec.from_dict(meta["spec"]).keys(), key_of, "its sweep spec")
