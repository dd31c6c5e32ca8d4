"""Merging evaluation folders (:func:`merge_evals`), by the rules of :func:`.sweep_merge.merge_sweeps`; what merging
shares with sweep folders is :mod:`.merging`."""

from __future__ import annotations

from pathlib import Path

from ..errors import SparseDecodeError
from ..files import write_json_atomic
from .eval_folder import SPEC_FILE, key_of, read_meta, read_rows
from .eval_spec import DENSE, EvalSpec, Group, RunKey
from .merging import MergeOutcome, SelectorVersions, merge_run, merged_provenance, read_once, source_metas
from .sweep_folder import RUNS_FILE, locked, union_spec
from .sweep_rows import write_rows


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
