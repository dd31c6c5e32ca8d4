"""The survival sweep: the paired protocol of DESIGN.md section 3 over contexts, prompts, selectors, supports, reuse.

One dense reference per (context, prompt) group, then one paired sparse run (free-running and teacher-forced)
per (selector, support, reuse). A sweep directory holds

* ``sweep.json``: the :class:`SweepSpec` (every argument that defines the results), the sha256 of the corpus
  text, the shard, and one entry per session (start time and :func:`environment`). Written before any row; a
  later run into the same directory with another spec, corpus or shard is refused, except a spec that only
  adds to the grid (:data:`.specs.GRID_FIELDS`: more contexts, prompts, supports, reuse intervals or selectors, the
  stored values kept in their order): the stored spec becomes the requested one and the session says so.
* ``runs.jsonl``: one JSON row per finished run (see :func:`make_row`), appended with a single ``os.write``
  of the whole line and an ``fsync``. A run killed mid-write leaves at most a torn last line, which is
  dropped on resume, so a rerun with the same arguments continues where it stopped and never repeats a row.
  Rows carry ``first_divergence_convention``; older rows are upgraded when read (see
  :func:`sparsedecode.protocol.paired.upgrade_row`) and rewritten before a resumed sweep appends to them, so a file
  never mixes conventions.

``--shard i/n`` runs every n-th (context, prompt) group (round-robin, 1-based ``i``), so a shard never
recomputes another shard's dense reference; :func:`merge_sweeps` combines shard directories into one, and
directories whose specs differ only in the grid into their union. ``run_sweep(..., execute=...)`` runs the groups
elsewhere instead (on Ray workers with ``--backend ray``, see :mod:`.work`), still writing every row here.
Nothing is random: the rows of two runs with the same spec differ only in timing fields (names ending in
``_s``).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..decoding.loop import Progress
from ..errors import SparseDecodeError, naming
from ..files import write_json_atomic, write_text_atomic
from ..protocol.paired import compare, dense_reference
from ..protocol.results import FIRST_DIVERGENCE_CONVENTION, CompareResult, upgrade_row
from .corpus import check_context_fits, load_text, prompt_count, prompt_ids
from .environment import environment
from .fields import INTEGER, INTEGERS, STRING, Fields, check_rows
from .merging import (  # noqa: F401 - timing_fields and without_timings are this module's too
    MergeOutcome,
    SelectorVersions,
    merge_run,
    merged_provenance,
    read_once,
    source_metas,
    timing_fields,
    without_timings,
)
from .specs import KEY_FIELDS, Group, RunKey, Spec, SweepSpec, adopt_stored, record_selector_files
from .work import Executor

SPEC_FILE = "sweep.json"
RUNS_FILE = "runs.jsonl"
LOCK_FILE = ".lock"


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


def key_of(row: dict) -> RunKey:
    return tuple(row[name] for name in KEY_FIELDS)  # type: ignore[return-value]


# --- rows -------------------------------------------------------------------------------------------------

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
    """Append one row as a single ``os.write`` of the whole line, then ``fsync``; undone on failure."""
    data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
    with naming(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)


def write_rows(path: Path, rows: list[dict]) -> None:
    """Replace ``runs.jsonl`` with ``rows`` (one JSON line each) through a temporary file and a rename."""
    write_text_atomic(path, "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))


# --- the sweep directory ------------------------------------------------------------------------------------


def corpus_sha256(name: str) -> str:
    """sha256 of the corpus text, so a sweep notices when its prompts would change (another Python, a new file)."""
    return hashlib.sha256(load_text(name).encode("utf-8")).hexdigest()


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
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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


def _session(shard: Shard | None, env: dict) -> dict:
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"started": started, "shard": str(shard) if shard else None, "environment": env}


# --- running ------------------------------------------------------------------------------------------------

RowHook = Callable[[dict, int, int], None]
"""``on_row(row, done, total)``: called after each row is safely on disk (``done`` counts this shard's runs)."""


@dataclass
class SweepOutcome:
    directory: Path
    total: int
    done_before: int
    ran: int
    rows: list[dict] = field(default_factory=list, repr=False)
    extended: list[str] = field(default_factory=list)
    """One line per grid field this run added to the stored spec (empty when the spec was the stored one)."""

    @property
    def complete(self) -> bool:
        return self.done_before + self.ran == self.total


def run_sweep(
    spec: SweepSpec,
    directory: Path,
    *,
    shard: Shard | None = None,
    loaded: tuple | None = None,
    progress: Progress | None = None,
    on_row: RowHook | None = None,
    on_start: Callable[[int, int], None] | None = None,
    batch: int = 1,
    execute: Executor | None = None,
) -> SweepOutcome:
    """Run (or resume) ``spec`` into ``directory``; returns what was there and what ran.

    ``loaded`` is an already loaded ``(model, tokenizer)`` for ``spec.model`` (otherwise it is loaded here).
    ``on_start(done, total)`` is called once the work is known, before the first run. ``batch > 1`` decodes up to
    ``batch`` prompts of one context together (:func:`~sparsedecode.protocol.paired.compare` of a batch): the same rows
    apart from timing fields (each row's timings are its share, the batch's wall time over the batch size) and float32
    round-off in the perplexities and margins; the session record in ``sweep.json`` notes the batch size. With
    ``execute`` the pending groups run as units elsewhere (:class:`GroupUnit`, see :mod:`.work`) and only this process
    writes their rows (one group per unit: not with ``batch > 1``).
    """
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise SparseDecodeError(f"batch must be an integer >= 1, got {batch!r}")
    if batch > 1 and execute is not None:
        raise SparseDecodeError(
            "batch > 1 decodes prompts together in this process; units elsewhere run one group each"
        )
    directory = Path(directory)
    shard = shard or Shard()
    meta = read_meta(directory)
    corpus = corpus_sha256(spec.corpus)
    if meta is not None:
        spec = adopt_stored(spec, meta, directory)  # its file selectors as the folder names them
        check_meta(directory, meta, spec, corpus, shard)
    if loaded is None:
        from ..models.catalog import load_model

        loaded = load_model(spec.model, dtype=spec.dtype)
    model, tokenizer = loaded
    check_context_fits(model, spec.contexts, spec.tokens)
    for context in spec.contexts:
        available = prompt_count(tokenizer, spec.corpus, context, spec.tokens, spec.gap)
        if available < spec.prompts:
            raise SparseDecodeError(
                f"corpus {spec.corpus} holds {available} non-overlapping prompt(s) of {context} tokens, "
                f"fewer than --prompts {spec.prompts}: use fewer prompts, a shorter context or a bigger corpus"
            )

    runs = directory / RUNS_FILE
    with locked(directory):
        meta = read_meta(directory)  # again, under the lock
        extended: list[str] = []
        if meta is None:
            meta = {"spec": spec.to_dict(), "corpus_sha256": corpus, "shard": str(shard), "sessions": []}
        else:
            extended = check_meta(directory, meta, spec, corpus, shard)
            if extended:
                meta["spec"] = spec.to_dict()
        record_selector_files(directory, meta, spec)  # a changed file is refused
        session = _session(shard, environment(model))
        if batch > 1:
            session["batch"] = batch
        if extended:
            session["extended"] = extended
        if execute is not None:
            session["backend"] = execute.description
        meta["sessions"] = [*meta.get("sessions", []), session]
        write_json_atomic(directory / SPEC_FILE, meta)

        parse_rows(runs, repair=True)  # cut a torn tail
        upgrade_rows_file(runs)  # rows appended below must not join rows of another convention
        rows = read_rows(runs)
        done = {key_of(row) for row in rows}
        groups = shard.groups(spec)
        total = sum(len(spec.group_keys(g)) for g in groups)
        done_before = sum(key in done for g in groups for key in spec.group_keys(g))
        outcome = SweepOutcome(directory, total, done_before, 0, rows, extended)
        if on_start:
            on_start(done_before, total)
        configs = {(cfg.support, cfg.reuse, cfg.selector_name): cfg for cfg in spec.configs()}
        if batch > 1:
            _run_batched(
                spec, directory, groups, done, rows, outcome, configs, model, tokenizer, batch, progress, on_row
            )
            return outcome

        def store_row(row: dict) -> None:
            append_row(runs, row)
            done.add(key_of(row))
            rows.append(row)
            outcome.ran += 1
            if on_row:
                on_row(row, outcome.done_before + outcome.ran, total)

        if execute is not None:
            _run_elsewhere(execute, spec, directory, tokenizer, groups, done, rows, store_row)
            return outcome
        for group in groups:
            pending = [key for key in spec.group_keys(group) if key not in done]
            if not pending:
                continue  # no dense reference for a finished group
            stored = [r for r in rows if (r["context"], r["prompt_index"]) == group]
            check = functools.partial(_check_reference, directory, group, stored=stored)
            run_group(
                model, tokenizer, spec, group, pending, progress=progress, check_reference=check, on_row=store_row
            )
    return outcome


def _run_batched(spec, directory, groups, done, rows, outcome, configs, model, tokenizer, batch, progress, on_row):
    """The group loop of :func:`run_sweep` with up to ``batch`` prompts of one context decoded together."""
    runs = directory / RUNS_FILE
    pending_groups = [g for g in groups if any(key not in done for key in spec.group_keys(g))]
    by_context: dict[int, list[Group]] = {}
    for group in pending_groups:  # a chunk holds prompts of one context (one length: no padding)
        by_context.setdefault(group[0], []).append(group)
    chunks = [same[i : i + batch] for same in by_context.values() for i in range(0, len(same), batch)]
    for chunk in chunks:
        ids = [prompt_ids(tokenizer, spec.corpus, context, index, spec.tokens, spec.gap) for context, index in chunk]
        reference = dense_reference(model, ids, tokens=spec.tokens, progress=progress)
        for group, ref in zip(chunk, reference.references):
            _check_reference(
                directory, group, ref.tokens, [r for r in rows if (r["context"], r["prompt_index"]) == group]
            )
        for condition, cfg in configs.items():
            wanted = [(group, (*group, *condition)) for group in chunk]
            if all(key in done for _, key in wanted):
                continue
            started = time.perf_counter()
            results = compare(model, None, ids, cfg, spec.tokens, reference=reference, progress=progress)
            share = (time.perf_counter() - started) / len(chunk)
            for (_, key), result in zip(wanted, results):
                if key in done:
                    continue  # resumed: this prompt's row is on disk already
                row = make_row(key, result, run_s=share, audit=spec.audit)
                append_row(runs, row)
                done.add(key)
                rows.append(row)
                outcome.ran += 1
                if on_row:
                    on_row(row, outcome.done_before + outcome.ran, outcome.total)


def run_group(
    model,
    tokenizer,
    spec: SweepSpec,
    group: Group,
    keys: list[RunKey],
    *,
    ids=None,
    progress: Progress | None = None,
    check_reference: Callable[[list[int]], None] | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """The rows of ``keys``, runs of one ``group``: its dense reference, then each paired run in order. Writes nothing.

    ``ids`` is the group's prompt (cut from ``spec.corpus`` when ``None``); ``check_reference(tokens)`` may refuse the
    dense tokens before any sparse run; ``on_row(row)`` sees each row as soon as it is made.
    """
    context, prompt_index = group
    if ids is None:
        ids = prompt_ids(tokenizer, spec.corpus, context, prompt_index, spec.tokens, spec.gap)
    reference = dense_reference(model, ids, tokens=spec.tokens, progress=progress)
    if check_reference:
        check_reference(reference.tokens)
    configs = {(cfg.support, cfg.reuse, cfg.selector_name): cfg for cfg in spec.configs()}
    made = []
    for key in keys:
        started = time.perf_counter()
        result = compare(model, tokenizer, ids, configs[key[2:]], spec.tokens, reference=reference, progress=progress)
        row = make_row(key, result, run_s=time.perf_counter() - started, audit=spec.audit)
        made.append(row)
        if on_row:
            on_row(row)
    return made


@dataclass(eq=False)
class GroupUnit:
    """The pending runs of one (context, prompt) group as a :class:`~.work.Unit`; ``ids`` is its prompt, cut by the
    process that writes the rows, so a worker needs only the model."""

    spec: SweepSpec
    group: Group
    keys: list[RunKey]
    ids: object

    def __str__(self) -> str:
        return f"context {self.group[0]}, prompt {self.group[1]}"

    def run(self, model, tokenizer, *, progress: Progress | None = None, on_row=None) -> list[dict]:
        return run_group(
            model, tokenizer, self.spec, self.group, self.keys, ids=self.ids, progress=progress, on_row=on_row
        )


def _run_elsewhere(execute, spec, directory, tokenizer, groups, done, rows, store_row) -> None:
    """The pending groups as units on ``execute``; each unit's rows are checked against the dense reference the
    group's stored rows were paired with and kept (a row already stored is dropped, never written twice)."""
    todo = [(group, [key for key in spec.group_keys(group) if key not in done]) for group in groups]
    todo = [(group, keys) for group, keys in todo if keys]
    units = (
        GroupUnit(spec, group, keys, prompt_ids(tokenizer, spec.corpus, *group, spec.tokens, spec.gap))
        for group, keys in todo
    )
    for unit, made in execute.run(units, len(todo)):
        stored = [r for r in rows if (r["context"], r["prompt_index"]) == unit.group]
        for row in made:
            _check_reference(directory, unit.group, row["dense_tokens"], stored)
        for row in made:
            if key_of(row) not in done:
                store_row(row)


def _check_reference(directory: Path, group: Group, tokens: list[int], stored: list[dict]) -> None:
    """Refuse to pair new runs with a dense reference that differs from the one the group's stored rows used."""
    for row in stored:
        if row["dense_tokens"] != tokens[: len(row["dense_tokens"])]:
            context, prompt_index = group
            raise SparseDecodeError(
                f"the dense reference of context {context}, prompt {prompt_index} differs from the one the rows in "
                f"{directory} were paired with (another thread count, library version or machine?): rerun where "
                "they were made, or remove that group's rows from runs.jsonl to redo the whole group"
            )


def load_sweep(directory: Path) -> tuple[dict, list[dict]]:
    """``(meta, rows)`` of a sweep directory (read-only: a torn last line is ignored, not cut)."""
    directory = Path(directory)
    meta = read_meta(directory)
    if meta is None:
        raise SparseDecodeError(f"{directory} is not a sweep directory (no {SPEC_FILE})")
    return meta, read_rows(directory / RUNS_FILE, check=False)  # a report names what a row lacks


def merge_sweeps(sources: list[Path], directory: Path) -> MergeOutcome:
    """Combine the rows of sweep directories into ``directory`` (which may be one of them).

    The sources' specs may differ only in the grid (:data:`.specs.GRID_FIELDS`); the merged spec is their union (see
    :func:`union_spec`). Rows are de-duplicated by key (the first source listing a key wins; ``directory``'s own
    rows come first; a folder listed twice counts its rows twice, as two copies of it would), upgraded to today's
    ``first_divergence`` convention, and written in the order of an unsharded sweep of the merged spec. Refused:
    specs that differ outside the grid, other corpus texts, a row outside its own folder's spec, two folders holding
    the same run with other results (timings aside) when their specs differ, and rows of one (context, prompt)
    paired with different dense references.
    """
    directory = Path(directory)
    metas = source_metas(sources, "sweep directory", read_meta, SPEC_FILE)
    with locked(directory):
        own = read_meta(directory)
        if own is not None:
            metas.insert(0, (directory, own))
        first_dir = metas[0][0]
        corpus = next((meta["corpus_sha256"] for _, meta in metas if meta.get("corpus_sha256")), None)
        specs = [SweepSpec.from_dict(meta["spec"]) for _, meta in metas]
        for (source, meta), other in zip(metas, specs):
            outside = specs[0].differences_outside_grid(other)
            if outside:
                raise SparseDecodeError(
                    f"cannot merge {source} with {first_dir}: their settings differ outside the grid "
                    f"({'; '.join(outside)}, {first_dir.name} vs {source.name})"
                )
            if corpus is not None and meta.get("corpus_sha256") not in (None, corpus):
                raise SparseDecodeError(f"cannot merge {source} with {first_dir}: their corpus texts differ")
        spec = union_spec(specs)
        order = {key: i for i, key in enumerate(spec.keys())}
        merged: dict[RunKey, tuple[dict, Path, SweepSpec]] = {}
        dense: dict[Group, tuple[list[int], Path]] = {}
        duplicates, versions = 0, SelectorVersions()
        for source, meta in metas:
            versions.add_meta(source, meta)
        for (source, _), own_spec in read_once(list(zip(metas, specs)), directory, own is not None):
            own_keys = set(own_spec.keys())
            for row in read_rows(source / RUNS_FILE):
                versions.add_row(source, row)
                key = key_of(row)
                if key not in own_keys:
                    raise SparseDecodeError(f"{source} holds a run {key} that is not part of its sweep spec")
                group = (row["context"], row["prompt_index"])
                tokens, where = dense.setdefault(group, (row["dense_tokens"], source))
                if row["dense_tokens"] != tokens:
                    raise SparseDecodeError(
                        f"cannot merge {source} with {where}: their runs of context {group[0]}, prompt {group[1]} "
                        "were paired with different dense references (another thread count, version or machine?)"
                    )
                duplicates += merge_run(merged, key, row, source, own_spec)
        meta = {"spec": spec.to_dict(), "corpus_sha256": corpus, **merged_provenance(metas, directory)}
        meta.update(versions.record())  # every selector file's one version and path, as the folders had them
        rows = sorted((row for row, _, _ in merged.values()), key=lambda row: order[key_of(row)])
        write_json_atomic(directory / SPEC_FILE, meta)
        write_rows(directory / RUNS_FILE, rows)
    return MergeOutcome(directory, len(rows), duplicates, len(order) - len(rows))
