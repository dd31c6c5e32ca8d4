"""Merging sweep folders (:func:`merge_sweeps`): shards of one sweep into one folder, and folders whose specs differ
only in the grid into their union; what merging shares with evaluation folders is :mod:`.merging`."""

from __future__ import annotations

from pathlib import Path

from ..errors import SparseDecodeError
from ..files import write_json_atomic
from .merging import MergeOutcome, SelectorVersions, merge_run, merged_provenance, read_once, source_metas
from .specs import Group, RunKey, SweepSpec
from .sweep_folder import RUNS_FILE, SPEC_FILE, locked, read_meta, union_spec
from .sweep_rows import key_of, read_rows, write_rows


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
