"""The survival sweep: the paired protocol (docs/definitions.md, section 3) over contexts, prompts, selectors,
supports, reuse.

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

This module runs a sweep; a row and ``runs.jsonl`` are :mod:`.sweep_rows`, the folder's ``sweep.json``, lock and
shards :mod:`.sweep_folder`, merging :mod:`.sweep_merge` (their names are importable from here too).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..decoding.loop import Progress
from ..errors import SparseDecodeError
from ..files import write_json_atomic
from ..models.weights import weights_sha256
from ..protocol.paired import compare, dense_reference
from .corpus import check_context_fits, prompt_count, prompt_ids
from .environment import environment
from .merging import timing_fields, without_timings
from .specs import KEY_FIELDS, Group, RunKey, Spec, SweepSpec, adopt_stored, record_selector_files
from .sweep_folder import (
    LOCK_FILE,
    RUNS_FILE,
    SPEC_FILE,
    Shard,
    check_growth,
    check_meta,
    check_sweep_keys,
    check_weights_alike,
    corpus_sha256,
    load_sweep,
    locked,
    read_meta,
    session_record,
    union_spec,
)
from .sweep_merge import merge_sweeps
from .sweep_rows import (
    AUDIT_FIELDS,
    CERTIFICATE_FIELDS,
    RESULT_FIELDS,
    ROW_FIELDS,
    SUPPORT_READ_FIELDS,
    TIMING_FIELDS,
    TOKEN_FIELDS,
    append_row,
    key_of,
    make_row,
    parse_rows,
    read_rows,
    upgrade_rows_file,
    write_rows,
)
from .work import Executor

__all__ = [  # this module's names, and those of the modules a sweep's folder, rows and merging moved to
    "AUDIT_FIELDS",
    "CERTIFICATE_FIELDS",
    "KEY_FIELDS",
    "LOCK_FILE",
    "RESULT_FIELDS",
    "ROW_FIELDS",
    "RUNS_FILE",
    "SPEC_FILE",
    "SUPPORT_READ_FIELDS",
    "TIMING_FIELDS",
    "TOKEN_FIELDS",
    "Group",
    "GroupUnit",
    "RowHook",
    "RunKey",
    "Shard",
    "Spec",
    "SweepOutcome",
    "SweepSpec",
    "append_row",
    "check_growth",
    "check_meta",
    "corpus_sha256",
    "key_of",
    "load_sweep",
    "locked",
    "make_row",
    "merge_sweeps",
    "parse_rows",
    "read_meta",
    "read_rows",
    "run_group",
    "run_sweep",
    "timing_fields",
    "union_spec",
    "upgrade_rows_file",
    "without_timings",
    "write_rows",
]

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
    _check_batch(batch, execute)
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
    _check_prompts(model, tokenizer, spec)

    runs = directory / RUNS_FILE
    with locked(directory):
        extended = _record_session(directory, spec, corpus, shard, model, batch, execute)
        parse_rows(runs, repair=True)  # cut a torn tail
        upgrade_rows_file(runs)  # rows appended below must not join rows of another convention
        rows = read_rows(runs)
        if meta is not None:  # a run listed twice, or outside the stored grid, would count wrongly
            check_sweep_keys(runs, rows, meta)
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
        _run_here(model, tokenizer, spec, directory, groups, done, rows, store_row, progress)
    return outcome


def _check_batch(batch: int, execute: Executor | None) -> None:
    """Refuse a batch size :func:`run_sweep` cannot run."""
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise SparseDecodeError(f"batch must be an integer >= 1, got {batch!r}")
    if batch > 1 and execute is not None:
        raise SparseDecodeError(
            "batch > 1 decodes prompts together in this process; units elsewhere run one group each"
        )


def _check_prompts(model, tokenizer, spec: SweepSpec) -> None:
    """Refuse, before any folder is written, a context the model cannot hold or a corpus too short for the prompts."""
    check_context_fits(model, spec.contexts, spec.tokens)
    for context in spec.contexts:
        available = prompt_count(tokenizer, spec.corpus, context, spec.tokens, spec.gap)
        if available < spec.prompts:
            raise SparseDecodeError(
                f"corpus {spec.corpus} holds {available} non-overlapping prompt(s) of {context} tokens, "
                f"fewer than --prompts {spec.prompts}: use fewer prompts, a shorter context or a bigger corpus"
            )


def _record_session(
    directory: Path, spec: SweepSpec, corpus: str, shard: Shard, model, batch: int, execute
) -> list[str]:
    """Under the lock, before any row: ``sweep.json`` with this session added (the spec grown where the run only adds
    to its grid; a changed selector file refused). Returns one line per grown grid field."""
    meta = read_meta(directory)  # again, under the lock
    extended: list[str] = []
    if meta is None:
        meta = {"spec": spec.to_dict(), "corpus_sha256": corpus, "shard": str(shard), "sessions": []}
    else:
        extended = check_meta(directory, meta, spec, corpus, shard)
        if extended:
            meta["spec"] = spec.to_dict()
    check_weights_alike(directory, meta, weights_sha256(model), "swept")
    record_selector_files(directory, meta, spec)  # a changed file is refused
    session = session_record(shard, environment(model))
    if batch > 1:
        session["batch"] = batch
    if extended:
        session["extended"] = extended
    if execute is not None:
        session["backend"] = execute.description
    meta["sessions"] = [*meta.get("sessions", []), session]
    write_json_atomic(directory / SPEC_FILE, meta)
    return extended


def _run_here(model, tokenizer, spec, directory, groups, done, rows, store_row, progress) -> None:
    """The pending runs of every group in this process, one group at a time (no dense reference for a finished
    group)."""
    for group in groups:
        pending = [key for key in spec.group_keys(group) if key not in done]
        if not pending:
            continue  # no dense reference for a finished group
        stored = [r for r in rows if (r["context"], r["prompt_index"]) == group]
        check = functools.partial(_check_reference, directory, group, stored=stored)
        run_group(model, tokenizer, spec, group, pending, progress=progress, check_reference=check, on_row=store_row)


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
