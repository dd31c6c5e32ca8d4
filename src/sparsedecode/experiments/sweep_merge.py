"""Merging sweep folders (:func:`merge_sweeps`): shards of one sweep into one folder, and folders whose specs differ
only in the grid into their union, by :func:`.folder_merge.merge_folders` (what it shares with evaluation folders)."""

from __future__ import annotations

from pathlib import Path

from .folder_merge import FolderKind, merge_folders
from .merging import MergeOutcome
from .specs import SweepSpec
from .sweep_folder import SPEC_FILE, read_meta
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
    return merge_folders(SWEEPS, sources, directory)


SWEEPS = FolderKind(
    label="sweep directory", runs_of="its sweep spec", spec_file=SPEC_FILE, read_meta=read_meta,
    spec_from=SweepSpec.from_dict, read_rows=read_rows, write_rows=write_rows, key_of=key_of,
    dense_of=lambda key, row: ((row["context"], row["prompt_index"]), row["dense_tokens"]),
    dense_differ=lambda group: f"their runs of context {group[0]}, prompt {group[1]} were paired with different "
    "dense references",
)  # fmt: skip
