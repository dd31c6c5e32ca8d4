"""Task accuracy under sparse decoding: RULER-style samples (:mod:`.ruler`), each run dense and under every
(selector, support) from one dense prefill, scored as RULER scores, resumable like the survival sweep.

Per sample (a *group*): one dense prefill of ``ids[:question_start]``; then, for dense and for each sparse setting,
the question tail ``ids[question_start:]`` is fed one token at a time under that attention mode (so the selector
decides what the question reads, as in Quest's passkey protocol and :mod:`.retrieval`), and the answer is decoded
greedily until an end-of-sequence token or the task's token budget. The cache is cropped back to the prefill
between modes, so every mode starts from the same prefilled cache and the results pair per sample.

An evaluation folder holds

* ``eval.json``: the :class:`EvalSpec`, the sha256 of the corpus text, the generator version, the shard and one
  entry per session (start time, environment). A later run with another corpus text or another shard is refused,
  and so is one with other settings, except one that only adds to the grid (more tasks, contexts, samples,
  selectors or supports, the stored ones kept in order), as in a sweep folder (:func:`.sweep.check_growth`): the
  stored spec becomes the requested one and the session says so.
* ``runs.jsonl``: one row per (task, context, sample, selector, support), dense rows with selector ``"dense"``
  and support ``null``; appended and repaired exactly as a sweep's (see :mod:`.sweep`), so ``kill -9`` and a rerun
  lose nothing and repeat nothing. Sparse rows carry the dense score and whether their output equals dense's.

``--shard i/n`` runs every n-th sample group; :func:`merge_evals` combines shard folders, and folders whose specs
differ only in the grid into their union, as :func:`.sweep.merge_sweeps` does.

This module runs an evaluation; one sample's runs and rows are :mod:`.eval_sample`, the folder's ``eval.json`` and
rows :mod:`.eval_folder`, merging :mod:`.eval_merge` (their names are importable from here too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import SparseConfig
from ..decoding.loop import Progress
from ..errors import SparseDecodeError
from ..files import write_json_atomic
from ..models.weights import weights_sha256
from ..validate import max_positions
from .environment import environment
from .eval_folder import (
    META_FIELDS,
    ROW_FIELDS,
    SPEC_FILE,
    check_eval_keys,
    check_folder,
    check_meta,
    is_eval_folder,
    key_of,
    load_eval,
    read_meta,
    read_rows,
)
from .eval_merge import merge_evals
from .eval_sample import answer, eos_ids, make_row, prompt_sha256, run_sample, sample_of
from .eval_spec import DENSE, KEY_FIELDS, EvalSpec, Group, RunKey
from .ruler import GENERATOR_VERSION, Sample
from .specs import adopt_stored, record_selector_files
from .sweep import SweepOutcome
from .sweep_folder import RUNS_FILE, Shard, check_weights_alike, corpus_sha256, locked, session_record
from .sweep_rows import append_row, parse_rows
from .work import Executor

__all__ = [  # this module's names, and those of the modules a sample's runs, the folder and merging moved to
    "DENSE",
    "KEY_FIELDS",
    "META_FIELDS",
    "ROW_FIELDS",
    "RUNS_FILE",
    "SPEC_FILE",
    "EvalSpec",
    "Group",
    "RowHook",
    "RunKey",
    "SampleUnit",
    "answer",
    "check_context_fits",
    "check_folder",
    "check_meta",
    "eos_ids",
    "is_eval_folder",
    "key_of",
    "load_eval",
    "make_row",
    "merge_evals",
    "parse_rows",
    "prompt_sha256",
    "read_meta",
    "read_rows",
    "run_eval",
    "run_sample",
    "sample_of",
]


def check_context_fits(model, spec: EvalSpec) -> None:
    limit = max_positions(model)
    for context in spec.contexts:
        longest = max(spec.answer_budget(t) for t in spec.tasks)
        if limit is not None and context + longest > limit:
            raise SparseDecodeError(
                f"context {context} + {longest} answer tokens exceeds the model's {limit} positions; use a shorter "
                "--context or fewer --answer-tokens"
            )


RowHook = Callable[[dict, int, int], None]


def run_eval(
    spec: EvalSpec,
    directory: Path,
    *,
    shard: Shard | None = None,
    loaded: tuple | None = None,
    progress: Progress | None = None,
    on_row: RowHook | None = None,
    on_start: Callable[[int, int], None] | None = None,
    execute: Executor | None = None,
) -> SweepOutcome:
    """Run (or resume) ``spec`` into ``directory``; ``loaded`` is an already loaded ``(model, tokenizer)``. With
    ``execute`` the pending samples run as units elsewhere (:class:`SampleUnit`, see :mod:`.work`) and only this
    process writes their rows."""
    directory = Path(directory)
    shard = shard or Shard()
    corpus = corpus_sha256(spec.corpus)
    meta = stored_meta = read_meta(directory)
    if meta is not None:
        spec = adopt_stored(spec, meta, directory)  # its file selectors as the folder names them
        check_meta(directory, meta, spec, corpus, shard)  # before the model loads; again under the lock
    if loaded is None:
        from ..models.catalog import load_model

        loaded = load_model(spec.model, dtype=spec.dtype)
    model, tokenizer = loaded
    check_context_fits(model, spec)
    runs = directory / RUNS_FILE
    groups = shard.groups(spec)
    samples = _first_samples(spec, tokenizer, groups, {key_of(row) for row in read_rows(runs)})

    with locked(directory):
        meta, extended = _session_meta(directory, spec, corpus, shard, model, execute)
        recorded = False

        def record() -> None:
            """Write eval.json with this session, once: before the session's first run is kept, or at its end. A
            refusal before any run (another dense answer, say) so leaves the folder as it was."""
            nonlocal recorded
            if not recorded:
                write_json_atomic(directory / SPEC_FILE, meta)
                recorded = True

        rows = read_rows(runs, repair=True)
        if stored_meta is not None:  # a run listed twice, or outside the stored grid, would count wrongly
            check_eval_keys(runs, rows, stored_meta)
        stored = {key_of(row): row for row in rows}
        total = sum(len(spec.group_keys(g)) for g in groups)
        done_before = sum(key in stored for g in groups for key in spec.group_keys(g))
        outcome = SweepOutcome(directory, total, done_before, 0, rows, extended)
        if on_start:
            on_start(done_before, total)
        configs = {(cfg.selector_name, cfg.support): cfg for cfg in spec.configs()}

        def store_row(row: dict) -> None:
            record()
            append_row(runs, row)
            stored[key_of(row)] = row
            rows.append(row)
            outcome.ran += 1
            if on_row:
                on_row(row, outcome.done_before + outcome.ran, total)

        if execute is not None:
            _run_elsewhere(execute, spec, tokenizer, groups, samples, stored, configs, store_row)
        else:
            _run_here(model, tokenizer, spec, groups, samples, stored, configs, store_row, progress)
        record()
    return outcome


def _session_meta(directory: Path, spec: EvalSpec, corpus: str, shard: Shard, model, execute) -> tuple[dict, list]:
    """Under the lock: ``eval.json`` as it will be written with this session added (the spec grown where the run only
    adds to its grid; a changed selector file refused), and one line per grown grid field."""
    meta = read_meta(directory)
    extended: list[str] = []
    if meta is None:
        meta = {
            "spec": spec.to_dict(),
            "corpus_sha256": corpus,
            "generator_version": GENERATOR_VERSION,
            "shard": str(shard),
            "sessions": [],
        }
    else:
        extended = check_meta(directory, meta, spec, corpus, shard)
        if extended:
            meta["spec"] = spec.to_dict()
    check_weights_alike(directory, meta, weights_sha256(model), "evaluated")
    record_selector_files(directory, meta, spec)  # a changed file is refused
    session = session_record(shard, environment(model))
    if extended:
        session["extended"] = extended
    if execute is not None:
        session["backend"] = execute.description
    meta["sessions"] = [*meta.get("sessions", []), session]
    return meta, extended


def _run_here(model, tokenizer, spec, groups, samples, stored, configs, store_row, progress) -> None:
    """The pending runs of every sample in this process, one sample at a time."""
    for number, group in enumerate(groups, start=1):
        pending = [key for key in spec.group_keys(group) if key not in stored]
        if pending:
            sample = samples.pop(group, None) or sample_of(spec, tokenizer, group)
            dense_row = stored.get((*group, DENSE, None))
            run_sample(model, tokenizer, sample, pending, configs, stored_dense=dense_row, on_row=store_row)
        if progress:
            progress("samples", number, len(groups))


@dataclass(eq=False)
class SampleUnit:
    """The pending runs of one sample as a :class:`~.work.Unit`: the sample is built by the process that writes the
    rows (a worker needs only the model); ``stored_dense`` is the sample's dense row if one is stored (today's dense
    answer must equal it)."""

    group: Group
    sample: Sample
    keys: list[RunKey]
    configs: dict[tuple[str, int], SparseConfig]
    stored_dense: dict | None = None

    def __str__(self) -> str:
        task, context, index = self.group
        return f"{task}, context {context}, sample {index}"

    def run(self, model, tokenizer, *, progress: Progress | None = None, on_row=None) -> list[dict]:
        return run_sample(
            model, tokenizer, self.sample, self.keys, self.configs, stored_dense=self.stored_dense, on_row=on_row
        )


def _run_elsewhere(execute, spec, tokenizer, groups, samples, stored, configs, store_row) -> None:
    """The pending samples as units on ``execute``, built as workers free up; rows already stored are dropped."""
    todo = [(group, [key for key in spec.group_keys(group) if key not in stored]) for group in groups]
    todo = [(group, keys) for group, keys in todo if keys]
    units = (
        SampleUnit(
            group,
            samples.pop(group, None) or sample_of(spec, tokenizer, group),
            keys,
            configs,
            stored.get((*group, DENSE, None)),
        )
        for group, keys in todo
    )
    for _, made in execute.run(units, len(todo)):
        for row in made:
            if key_of(row) not in stored:
                store_row(row)


def _first_samples(spec: EvalSpec, tokenizer, groups: list[Group], done: set) -> dict[Group, Sample]:
    """Every pending sample built before anything is written, so that one a task cannot be fitted to is refused up
    front, not after hours of runs (found by probing: fwe's sample 4 at 1024 tokens of SmolLM2 fits no haystack
    size, and was reached only after the other samples had run). Returns the first pending sample of every (task,
    context); the others are built again as they run (a large grid's prompts all held at once would take memory)."""
    first: dict[tuple[str, int], tuple[Group, Sample]] = {}
    for group in groups:
        if any(key not in done for key in spec.group_keys(group)):
            try:
                sample = sample_of(spec, tokenizer, group)
            except SparseDecodeError as error:
                task, context, index = group
                raise SparseDecodeError(f"{task}, context {context}, sample {index}: {error}") from None
            first.setdefault(group[:2], (group, sample))
    return dict(first.values())
