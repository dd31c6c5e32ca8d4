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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import SparseConfig
from ..decoding.loop import Progress, decode_tokens, prefill
from ..errors import SparseDecodeError
from ..files import write_json_atomic
from ..session import prefill_history, sparse_decoding
from ..session.kv_cache import crop_cache
from .environment import environment
from .eval_spec import DENSE, KEY_FIELDS, EvalSpec, Group, RunKey
from .fields import FLAG, INTEGER, INTEGERS, NUMBER, STRING, Fields, check_rows, integer, json_kind, or_null, strings
from .merging import MergeOutcome, SelectorVersions, merge_run, merged_provenance, read_once, source_metas
from .ruler import GENERATOR_VERSION, Sample, build_sample, score
from .specs import adopt_stored, record_selector_files
from .sweep import (
    RUNS_FILE,
    Shard,
    SweepOutcome,
    _session,
    append_row,
    check_growth,
    corpus_sha256,
    locked,
    parse_rows,
    union_spec,
    write_rows,
)
from .sweep import SPEC_FILE as SWEEP_FILE
from .work import Executor

SPEC_FILE = "eval.json"


def key_of(row: dict) -> RunKey:
    return tuple(row[name] for name in KEY_FIELDS)  # type: ignore[return-value]


def sample_of(spec: EvalSpec, tokenizer, group: Group) -> Sample:
    task, context, index = group
    return build_sample(
        tokenizer,
        task,
        context,
        index,
        seed=spec.seed,
        corpus=spec.corpus,
        template=spec.template,
        max_new_tokens=spec.answer_budget(task),
    )


def prompt_sha256(sample: Sample) -> str:
    return hashlib.sha256(json.dumps(sample.ids).encode()).hexdigest()


# --- one sample ---------------------------------------------------------------------------------------------------


def eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end an answer: the generation config's end-of-sequence ids and the tokenizer's."""
    ids: set[int] = set()
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return ids


@torch.no_grad()
def answer(model, tokenizer, sample: Sample, cache, cfg: SparseConfig | None, *, stop: set[int], history=None) -> dict:
    """Feed the question tail token by token and decode the answer greedily, densely (``cfg=None``) or sparsely.

    ``cache`` holds exactly ``sample.ids[:question_start]`` and is cropped back to it afterwards; ``history`` is the
    attention history of that prefill (:func:`~sparsedecode.session.prefill_history`), which a selector with
    ``uses_history`` (H2O) needs.
    """
    question = list(sample.ids[sample.question_start :])
    started = time.perf_counter()
    with sparse_decoding(model, cfg) if cfg is not None else contextlib.nullcontext() as session:
        if cfg is not None and cfg.selector.uses_history:
            session.adopt_history(cache, history)
        steps = len(question) - 1 + sample.max_new_tokens  # feed the question, then decode the answer
        (out,), _ = decode_tokens(model, cache, question[:1], steps, teacher=[question], stop=stop)
    generated = out[len(question) - 1 :]
    reason = "eos" if generated and generated[-1] in stop else "length"
    if reason == "eos":
        generated = generated[:-1]
    decode_s = time.perf_counter() - started
    crop_cache(cache, sample.question_start)
    output = tokenizer.decode(generated, skip_special_tokens=True)
    return {
        "output": output,
        "output_ids": generated,
        "stop": reason,
        "score": score(output, sample.answers),
        "sparse_steps": 0 if session is None else session.sparse_steps,
        "dense_fallback_steps": 0 if session is None else session.dense_steps,
        "decode_s": decode_s,
    }


def make_row(key: RunKey, sample: Sample, cfg: SparseConfig | None, result: dict, **extra) -> dict:
    """One ``runs.jsonl`` row: the key, the settings, the sample's shape and answers, the output and its score."""
    task, context, index, selector, support = key
    return {
        "task": task,
        "context": context,
        "sample": index,
        "selector": selector,
        "support": support,
        "effective_support": None if cfg is None else cfg.effective_support,
        "window": None if cfg is None else cfg.window,
        "block_size": None if cfg is None else cfg.block_size,
        "reuse": None if cfg is None else cfg.reuse,
        **({} if cfg is None else {k: v for k, v in cfg.selector.record().items() if k != "selector"}),
        "prompt_tokens": sample.tokens,
        "prefill_tokens": sample.question_start,
        "question_tokens": sample.question_tokens,
        "prompt_format": sample.prompt_format,
        "prompt_sha256": prompt_sha256(sample),
        "answers": list(sample.answers),
        **{name: result[name] for name in ("output", "output_ids", "stop", "score")},
        "correct": result["score"] == 1.0,
        **extra,
        "sparse_steps": result["sparse_steps"],
        "dense_fallback_steps": result["dense_fallback_steps"],
        "decode_s": result["decode_s"],
    }


def run_sample(
    model,
    tokenizer,
    sample: Sample,
    keys: list[RunKey],
    configs: dict[tuple[str, int], SparseConfig],
    *,
    stored_dense: dict | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """One dense prefill of ``sample``, then dense and every sparse key of ``keys`` from that cache.

    Dense always runs (the sparse rows are paired with it); its row is returned only if ``keys`` holds it.
    ``stored_dense`` is a dense row written earlier for this sample: its output must match today's.
    """
    started = time.perf_counter()
    cache_device = next(model.parameters()).device
    cache, _ = prefill(model, torch.tensor([sample.ids[: sample.question_start]], device=cache_device))
    prefill_s = time.perf_counter() - started
    stop = eos_ids(model, tokenizer)
    dense = answer(model, tokenizer, sample, cache, None, stop=stop)
    if stored_dense is not None and (
        stored_dense["output_ids"] != dense["output_ids"] or stored_dense["prompt_sha256"] != prompt_sha256(sample)
    ):
        raise SparseDecodeError(
            f"the dense answer of {sample.task}, context {sample.context}, sample {sample.index} differs from the one "
            "stored (another tokenizer, thread count, library version or machine?): rerun where the rows were made, "
            "or remove that sample's rows from runs.jsonl to redo it"
        )
    rows, history = [], None
    for key in keys:
        cfg = None if key[3] == DENSE else configs[(key[3], key[4])]
        if cfg is not None and cfg.selector.uses_history and history is None:
            history = prefill_history(model, torch.tensor([sample.ids[: sample.question_start]], device=cache_device))
        result = dense if cfg is None else answer(model, tokenizer, sample, cache, cfg, stop=stop, history=history)
        extra = (
            {}
            if cfg is None
            else {"dense_score": dense["score"], "same_as_dense": result["output_ids"] == dense["output_ids"]}
        )
        row = make_row(key, sample, cfg, result, **extra, prefill_s=prefill_s)
        row["run_s"] = row["decode_s"] + (prefill_s if not rows else 0.0)
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


# --- the folder ---------------------------------------------------------------------------------------------------


META_FIELDS = ("spec", "corpus_sha256", "generator_version", "shard", "sessions")
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
    is refused in one line naming the file and the run."""
    return check_rows(path, parse_rows(path, repair=repair), ROW_FIELDS)


def check_folder(directory: Path, spec: EvalSpec, shard: Shard | None) -> list[str]:
    """Everything :func:`run_eval` refuses about ``directory`` before it loads a model, checked before the command
    line loads one: another experiment's folder, a malformed ``eval.json`` or run, other settings (beyond a grid
    that grows) or another shard (the corpus text is compared by :func:`run_eval`). Returns one line per grid field
    ``spec`` adds to the stored one."""
    meta = read_meta(directory)
    grown = [] if meta is None else check_meta(directory, meta, spec, None, shard)
    read_rows(Path(directory) / RUNS_FILE)
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


def check_context_fits(model, spec: EvalSpec) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
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
    meta = read_meta(directory)
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
        record_selector_files(directory, meta, spec)  # a changed file is refused
        session = _session(shard, environment(model))
        if extended:
            session["extended"] = extended
        if execute is not None:
            session["backend"] = execute.description
        meta["sessions"] = [*meta.get("sessions", []), session]
        recorded = False

        def record() -> None:
            """Write eval.json with this session, once: before the session's first run is kept, or at its end. A
            refusal before any run (another dense answer, say) so leaves the folder as it was."""
            nonlocal recorded
            if not recorded:
                write_json_atomic(directory / SPEC_FILE, meta)
                recorded = True

        rows = read_rows(runs, repair=True)
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
            for number, group in enumerate(groups, start=1):
                pending = [key for key in spec.group_keys(group) if key not in stored]
                if pending:
                    sample = samples.pop(group, None) or sample_of(spec, tokenizer, group)
                    dense_row = stored.get((*group, DENSE, None))
                    run_sample(model, tokenizer, sample, pending, configs, stored_dense=dense_row, on_row=store_row)
                if progress:
                    progress("samples", number, len(groups))
        record()
    return outcome


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
    """The first pending sample of every (task, context), built before anything is written: a context a task
    cannot be fitted to is refused up front, not after hours of runs."""
    first: dict[tuple[str, int], Group] = {}
    for group in groups:
        if group[:2] not in first and any(key not in done for key in spec.group_keys(group)):
            first[group[:2]] = group
    return {group: sample_of(spec, tokenizer, group) for group in first.values()}


def load_eval(directory: Path) -> tuple[dict, list[dict]]:
    """``(meta, rows)`` of an evaluation folder (read-only: a torn last line is ignored, not cut)."""
    directory = Path(directory)
    meta = read_meta(directory)
    if meta is None:
        raise SparseDecodeError(f"{directory} is not an evaluation folder (no {SPEC_FILE})")
    return meta, read_rows(directory / RUNS_FILE)


def is_eval_folder(directory: Path) -> bool:
    return (Path(directory) / SPEC_FILE).exists()


def merge_evals(sources: list[Path], directory: Path) -> MergeOutcome:
    """Combine the rows of evaluation folders into ``directory`` (which may be one of them), by the rules of
    :func:`.sweep.merge_sweeps`.

    The folders' specs may differ only in the grid (:data:`.eval_spec.GRID_FIELDS`); the merged spec is their union
    (:func:`.sweep.union_spec`). Rows are de-duplicated by key (``directory``'s own rows first, then the sources in
    order; a folder listed twice counts its rows twice, as two copies of it would) and written in the order of an
    unsharded run of the merged spec. Refused: specs that differ outside the grid, other corpus texts or task
    generators, a row outside its own folder's spec, two folders holding the same run with other results (timings
    aside) when their specs differ, and two folders whose dense answers to the same sample differ.
    """
    directory = Path(directory)
    metas = source_metas(sources, "evaluation folder", read_meta, SPEC_FILE)
    with locked(directory):
        own = read_meta(directory)
        if own is not None:
            metas.insert(0, (directory, own))
        first_dir, first = metas[0]
        specs = [EvalSpec.from_dict(meta["spec"]) for _, meta in metas]
        corpus = next((meta["corpus_sha256"] for _, meta in metas if meta.get("corpus_sha256")), None)
        for (source, meta), other in zip(metas, specs):
            outside = specs[0].differences_outside_grid(other)
            if outside:
                raise SparseDecodeError(
                    f"cannot merge {source} with {first_dir}: their settings differ outside the grid "
                    f"({'; '.join(outside)}, {first_dir.name} vs {source.name})"
                )
            if meta.get("corpus_sha256") not in (None, corpus):
                raise SparseDecodeError(f"cannot merge {source} with {first_dir}: their corpus texts differ")
            if meta.get("generator_version") != first.get("generator_version"):
                raise SparseDecodeError(f"cannot merge {source} with {first_dir}: their task generators differ")
        spec = union_spec(specs)
        order = {key: i for i, key in enumerate(spec.keys())}
        merged: dict[RunKey, tuple[dict, Path, EvalSpec]] = {}
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
                    raise SparseDecodeError(f"{source} holds a run {key} that is not part of its evaluation")
                if key[3] == DENSE:
                    ids, where = dense.setdefault(key[:3], (row["output_ids"], source))
                    if ids != row["output_ids"]:
                        raise SparseDecodeError(
                            f"cannot merge {source} with {where}: their dense answers to {key[0]}, context {key[1]}, "
                            f"sample {key[2]} differ (another thread count, version or machine?)"
                        )
                duplicates += merge_run(merged, key, row, source, own_spec)
        meta = {
            "spec": spec.to_dict(),
            "corpus_sha256": corpus,
            "generator_version": first.get("generator_version"),
            **merged_provenance(metas, directory),
            **versions.record(),  # every selector file's one version and path, as the folders had them
        }
        rows = sorted((row for row, _, _ in merged.values()), key=lambda row: order[key_of(row)])
        write_json_atomic(directory / SPEC_FILE, meta)
        write_rows(directory / RUNS_FILE, rows)
    return MergeOutcome(directory, len(rows), duplicates, len(order) - len(rows))
