"""What merging results folders shares (sweeps, :func:`.sweep.merge_sweeps`; evaluations,
:func:`.evaluate.merge_evals`): reading the folders, reading a folder listed twice, the provenance a merged folder
records, the rule for a run two folders hold, and one version per selector file.

A selector from a file is one method in every report, whatever its file held: rows of two versions of one file
(another sha256 under the same spec) merged into one folder would be pooled as one method. So a merge keeps one
version per selector, as a sweep or an evaluation folder refuses to add runs of a file that changed
(:func:`.specs.check_selector_files`): two versions are refused in one line naming both folders
(:class:`SelectorVersions`), and the merged folder records every selector file's sha256 and path, as the folders did.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import SparseDecodeError
from .fields import json_kind


def timing_fields(row: dict) -> list[str]:
    """Names of a row's timing fields (they end in ``_s``; everything else is deterministic)."""
    return [name for name in row if name.endswith("_s")]


def without_timings(row: dict) -> dict:
    return {name: value for name, value in row.items() if not name.endswith("_s")}


@dataclass
class MergeOutcome:
    directory: Path
    rows: int
    duplicates: int
    missing: int


def source_metas(
    sources: list[Path],
    what: str,
    read: Callable[[Path], dict | None],
    spec_file: str,
) -> list[tuple[Path, dict]]:
    """``(folder, meta)`` of each folder to merge, in order (``read`` reads a folder's ``spec_file``); refuses an
    empty list and a folder that is not a ``what``."""
    if not sources:
        raise SparseDecodeError(f"merge needs at least one {what}")
    metas = [(Path(s), read(Path(s))) for s in sources]
    for source, meta in metas:
        if meta is None:
            article = "an" if what[0] in "aeiou" else "a"
            raise SparseDecodeError(f"{source} is not {article} {what} (no {spec_file})")
    return metas


def read_once(entries: list[tuple], directory: Path, own: bool) -> list[tuple]:
    """The entries of a merge whose rows are read, in order: ``entries`` (each a ``((folder, meta), ...)`` or a
    ``(folder, meta)``), less the first listing of ``directory`` among the sources when its own rows, ``own``, come
    first (``merge A B --out A`` reads A once). Any other folder listed twice is read twice, so its rows count as
    duplicates, as those of two copies would."""
    if not own:
        return entries
    target, kept, skipped = Path(directory).resolve(), entries[:1], False
    for entry in entries[1:]:
        folder = entry[0][0] if isinstance(entry[0], tuple) else entry[0]
        if not skipped and Path(folder).resolve() == target:
            skipped = True
            continue
        kept.append(entry)
    return kept


def merged_provenance(metas: list[tuple[Path, dict]], directory: Path) -> dict:
    """The meta fields a merge writes besides its spec: no shard, the folders' sessions once each, in order, and the
    folders merged into ``directory`` (itself left out), as paths relative to ``directory``, so a committed result
    names no absolute path of the machine it was merged on."""
    sessions = [s for _, meta in metas for s in meta.get("sessions", [])]
    target = directory.resolve()
    return {
        "shard": None,
        "sessions": [s for i, s in enumerate(sessions) if s not in sessions[:i]],
        "merged_from": sorted(
            {os.path.relpath(source.resolve(), target) for source, _ in metas if source.resolve() != target}
        ),
    }


def merge_run(merged: dict, key, row: dict, source: Path, own_spec) -> int:
    """Add one source's ``row`` of run ``key`` to ``merged`` (key -> (row, source, spec)); 1 if the run was there
    already (a duplicate, dropped), 0 otherwise. A run held twice must have the same results unless both folders
    share one spec (then the first copy is kept, as a rerun's would be)."""
    if key not in merged:
        merged[key] = (row, source, own_spec)
        return 0
    kept, kept_source, kept_spec = merged[key]
    if kept_spec != own_spec and without_timings(kept) != without_timings(row):
        raise SparseDecodeError(
            f"cannot merge {source} with {kept_source}: both hold run {key} with other results; "
            "folders of different grids may only overlap in identical runs"
        )
    return 1


class SelectorVersions:
    """The one version (sha256) of each file selector a merge meets, in the folders' ``selector_files`` and in their
    rows' ``selector_sha256``, and where each file was (``selector_paths``); a second version is refused."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, Path]] = {}
        self.paths: dict[str, str] = {}

    def add(self, spec, digest, folder: Path) -> None:
        if not isinstance(spec, str) or not isinstance(digest, str):
            raise SparseDecodeError(f"{folder}: a selector file's sha256 should be a string, not {json_kind(digest)}")
        held, where = self.files.setdefault(spec, (digest, folder))
        if held != digest:
            raise SparseDecodeError(
                f"cannot merge {folder} with {where}: selector {spec} ran from two versions of its file (sha256 "
                f"{held[:12]}... and {digest[:12]}...), which every report would show as one method; merge the runs "
                "of one version, or rerun the other under a file of another name"
            )

    def add_meta(self, folder: Path, meta: dict) -> None:
        for name in ("selector_files", "selector_paths"):
            if not isinstance(meta.get(name, {}), dict):
                raise SparseDecodeError(f"{folder}: {name} should be a JSON object, not {json_kind(meta[name])}")
        for spec, digest in meta.get("selector_files", {}).items():
            self.add(spec, digest, folder)
        for spec, path in meta.get("selector_paths", {}).items():
            self.paths.setdefault(spec, path)

    def add_row(self, folder: Path, row: dict) -> None:
        if "selector_sha256" in row:
            self.add(row.get("selector"), row["selector_sha256"], folder)

    def record(self) -> dict:
        """The fields the merged folder's description keeps (none when no selector came from a file)."""
        files = {spec: digest for spec, (digest, _) in self.files.items()}
        paths = {spec: path for spec, path in self.paths.items() if spec in files}
        return {**({"selector_files": files} if files else {}), **({"selector_paths": paths} if paths else {})}
