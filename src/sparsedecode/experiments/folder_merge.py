"""One merge for both kinds of results folder (sweeps, :func:`.sweep_merge.merge_sweeps`; evaluations,
:func:`.eval_merge.merge_evals`): a :class:`FolderKind` says how a kind reads and writes its folders and which
dense outputs its rows must share; :func:`merge_folders` applies the rules they have in common (:mod:`.merging`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SparseDecodeError
from ..files import write_json_atomic
from .fields import check_run_keys
from .merging import MergeOutcome, SelectorVersions, merge_run, merged_provenance, read_once, source_metas
from .sweep_folder import RUNS_FILE, locked, union_spec


@dataclass(frozen=True)
class FolderKind:
    """How merging reads one kind of results folder."""

    label: str  # "sweep directory": what a source must be
    runs_of: str  # "its sweep spec": what a row outside the folder's spec is outside of
    spec_file: str
    read_meta: Callable[[Path], dict | None]
    spec_from: Callable[[dict], object]  # the spec of a meta's "spec"
    read_rows: Callable[[Path], list[dict]]
    write_rows: Callable[[Path, list[dict]], None]
    key_of: Callable[[dict], tuple]
    dense_of: Callable[[tuple, dict], tuple | None]  # (group, dense output) a row must share with its group, or None
    dense_differ: Callable[[tuple], str]  # what the refusal says of a group whose dense outputs differ
    shared: dict[str, str] = field(default_factory=dict)  # meta fields every folder must share -> what they are


def merge_folders(kind: FolderKind, sources: list[Path], directory: Path) -> MergeOutcome:
    """Combine the rows of folders of ``kind`` into ``directory`` (which may be one of them); the rules are those of
    :func:`.sweep_merge.merge_sweeps`, each kind's dense outputs and shared fields checked as ``kind`` says."""
    directory = Path(directory)
    metas = source_metas(sources, kind.label, kind.read_meta, kind.spec_file)
    with locked(directory):
        own = kind.read_meta(directory)
        if own is not None:
            metas.insert(0, (directory, own))
        specs = [kind.spec_from(meta["spec"]) for _, meta in metas]
        corpus, weights = _check_sources(kind, metas, specs)
        spec = union_spec(specs)
        order = {key: i for i, key in enumerate(spec.keys())}
        merged: dict[tuple, tuple] = {}
        dense: dict[tuple, tuple] = {}
        duplicates, versions = 0, SelectorVersions()
        for source, meta in metas:
            versions.add_meta(source, meta)
        for (source, _), own_spec in read_once(list(zip(metas, specs)), directory, own is not None):
            rows = kind.read_rows(source / RUNS_FILE)
            check_run_keys(source / RUNS_FILE, rows, own_spec.keys(), kind.key_of, kind.runs_of)
            for row in rows:
                versions.add_row(source, row)
                key = kind.key_of(row)
                paired = kind.dense_of(key, row)
                if paired is not None:
                    group, output = paired
                    kept, where = dense.setdefault(group, (output, source))
                    if kept != output:
                        raise SparseDecodeError(f"cannot merge {source} with {where}: {kind.dense_differ(group)} "
                                                "(another thread count, version or machine?)")  # fmt: skip
                duplicates += merge_run(merged, key, row, source, own_spec)
        first = metas[0][1]
        meta = {"spec": spec.to_dict(), "corpus_sha256": corpus, "weights_sha256": weights,
                **{name: first.get(name) for name in kind.shared},
                **merged_provenance(metas, directory), **versions.record()}  # fmt: skip
        rows = sorted((row for row, _, _ in merged.values()), key=lambda row: order[kind.key_of(row)])
        write_json_atomic(directory / kind.spec_file, meta)
        kind.write_rows(directory / RUNS_FILE, rows)
    return MergeOutcome(directory, len(rows), duplicates, len(order) - len(rows))


def _check_sources(kind: FolderKind, metas: list[tuple[Path, dict]], specs: list) -> tuple[str | None, str | None]:
    """Refuse folders whose settings differ outside the grid, whose corpus texts or models' weights differ, or whose
    shared fields differ; returns the corpus text's sha256 and the weights' fingerprint (each ``None`` where no
    folder recorded one)."""
    first_dir, first = metas[0]
    corpus = next((meta["corpus_sha256"] for _, meta in metas if meta.get("corpus_sha256")), None)
    weights = next((meta["weights_sha256"] for _, meta in metas if meta.get("weights_sha256")), None)
    for (source, meta), other in zip(metas, specs):
        outside = specs[0].differences_outside_grid(other)
        if outside:
            raise SparseDecodeError(
                f"cannot merge {source} with {first_dir}: their settings differ outside the grid "
                f"({'; '.join(outside)}, {first_dir.name} vs {source.name})"
            )
        if meta.get("corpus_sha256") not in (None, corpus):
            raise SparseDecodeError(f"cannot merge {source} with {first_dir}: their corpus texts differ")
        if meta.get("weights_sha256") not in (None, weights):
            raise SparseDecodeError(f"cannot merge {source} with {first_dir}: their models' weights differ")
        for name, what in kind.shared.items():
            if meta.get(name) != first.get(name):
                raise SparseDecodeError(f"cannot merge {source} with {first_dir}: their {what} differ")
    return corpus, weights
