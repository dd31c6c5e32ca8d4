"""Merging evaluation folders (:func:`merge_evals`), by the rules of :func:`.sweep_merge.merge_sweeps`; what merging
shares with sweep folders is :mod:`.folder_merge`."""

from __future__ import annotations

from pathlib import Path

from .eval_folder import SPEC_FILE, key_of, read_meta, read_rows
from .eval_spec import DENSE, EvalSpec
from .folder_merge import FolderKind, merge_folders
from .merging import MergeOutcome
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
    return merge_folders(EVALUATIONS, sources, directory)


EVALUATIONS = FolderKind(
    label="evaluation folder", runs_of="its evaluation", spec_file=SPEC_FILE, read_meta=read_meta,
    spec_from=EvalSpec.from_dict, read_rows=read_rows, write_rows=write_rows, key_of=key_of,
    dense_of=lambda key, row: (key[:3], row["output_ids"]) if key[3] == DENSE else None,
    dense_differ=lambda group: f"their dense answers to {group[0]}, context {group[1]}, sample {group[2]} differ",
    shared={"generator_version": "task generators"},
)  # fmt: skip
