"""Output files and folders: refused before any computing when they cannot be written, then written atomically.

Every check here runs before a model is loaded, so a path that cannot take the results fails in a second, not
after the run. Every write goes to a temporary file beside the target and is renamed onto it, so a failure
leaves nothing half-written behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from ..errors import SparseDecodeError
from ..files import atomic_path, write_target
from ..files import write_json_atomic as write_json

__all__ = [
    "atomic_path",
    "MADE_FOLDERS",
    "inputs_of",
    "remove_empty_made_folders",
    "check_output_file",
    "check_output_folder",
    "check_replaced_alike",
    "check_writable_folder",
    "write_json",
]


def inputs_of(args) -> list[tuple[str, str]]:
    """The command's inputs that may be paths, as ``(option, path)`` pairs for :func:`check_output_file` and
    :func:`check_output_folder`: ``--model``, ``--corpus``, ``--haystack``, the ``--budget`` file and the files of
    ``--selector`` / ``--selectors`` (an output there replaced the budget or the selector's code with results)."""
    named = [(option, getattr(args, option[2:], None)) for option in ("--model", "--corpus", "--haystack")]
    named.append(("--budget", None if getattr(args, "budget_file", None) is None else str(args.budget_file)))
    for option in ("--selector", "--selectors"):
        specs = getattr(args, option[2:], None)
        for spec in (specs,) if isinstance(specs, str) else specs or ():
            named.append((option, _selector_file(spec)))
    return [(option, spec) for option, spec in named if isinstance(spec, str) and spec.strip()]


def _selector_file(spec: str) -> str | None:
    """The Python file a selector spec (``path/to/file.py:ClassName[:...]``) names, or ``None`` for a name."""
    from ..selectors.registry import file_cut

    cut = file_cut(spec)
    return None if cut is None else spec[:cut]


def check_output_file(
    path: Path | None, option: str, *, inputs: list[tuple[str, str]] | None = None, also: tuple[Path, ...] = ()
) -> None:
    """Refuse an output file (``--json``) that is a folder, not a regular file, a dangling link, in a folder that
    takes no files, or one of the command's ``inputs`` (or inside an input folder). ``also``: more files the command
    writes next to it, each refused likewise."""
    if path is None:
        return
    for target in (path, *also):
        what = f"{option} {path}" if target == path else f"{target}, written with {option} {path}"
        kind = _not_a_file(target, what)
        if kind:
            raise SparseDecodeError(f"{what} is {kind}; give a file name" if target == path else f"{what}, is {kind}")
        _check_not_input(target, what, inputs)
    check_writable_folder(write_target(path).parent, f"{option} {path}")  # a link is written through


RESULTS = {
    "sweep.json": "a sweep",
    "eval.json": "an evaluation",
    "selectors.json": "a selector comparison",
    "retrieval.json": "retrieval results",
    "mass.json": "an attention-mass probe",
    "export.json": "exported lm-eval tasks",
    "calibration.json": "a calibration",
}
"""The file that marks each kind of results folder, and what it holds (a sweep's and an evaluation's rows are both
``runs.jsonl``; their settings file tells them apart)."""

SHARE_A_FOLDER = {frozenset({"sweep.json", "retrieval.json"})}
"""Kinds of results (:data:`RESULTS` markers) that may share a folder: ``report`` renders a sweep and the retrieval
results beside it together. Every other kind goes in a folder of its own."""


def check_output_folder(
    path: Path,
    option: str = "--out",
    *,
    inputs: list[tuple[str, str]] | None = None,
    files: tuple[str, ...] = (),
    results: str | None = None,
) -> None:
    """Refuse an output folder (``--out``) that names an existing file, cannot be made or written to, is one of
    the command's ``inputs`` (or inside an input folder), or holds something other than a regular file under one
    of the ``files`` names the command writes there. With ``results`` (the :data:`RESULTS` marker of the command's
    kind), also one that holds another kind of results that may not share its folder (:data:`SHARE_A_FOLDER`): a
    report would show only one of them."""
    what = f"{option} {path}"
    if path.is_symlink() and not _exists(path, what):
        raise SparseDecodeError(f"{what} is a symbolic link to nothing (dangling, or a loop); give a folder")
    if _exists(path, what) and not path.is_dir():
        raise SparseDecodeError(f"{what} is an existing file, not a folder; give a folder")
    _check_not_input(path, what, inputs)
    if results is not None and path.is_dir():
        for marker, kind in RESULTS.items():
            shared = marker == results or frozenset({marker, results}) in SHARE_A_FOLDER
            if not shared and (path / marker).exists():
                raise SparseDecodeError(
                    f"{what} holds {kind} ({marker}); write {RESULTS[results]} into a folder of its own"
                )
    for name in files:
        target = path / name
        kind = _not_a_file(target, what)
        if kind:
            raise SparseDecodeError(f"cannot write {target} ({what}): it is {kind}")
        _check_not_input(target, f"{target} ({what})", inputs)
    check_writable_folder(path, what)


def _not_a_file(path: Path, what: str) -> str | None:
    """What ``path`` is when it exists as something other than a regular file (or a link to one), else ``None``."""
    if path.is_symlink() and not _exists(path, what):
        return "a symbolic link to nothing (dangling, or a loop)"
    if _exists(path, what) and not path.is_file():
        return "a folder" if path.is_dir() else "not a regular file"
    return None


def _check_not_input(path: Path, what: str, inputs: list[tuple[str, str]] | None) -> None:
    """Refuse an output that is an input file, or an input folder or inside one (it would change the input)."""
    try:
        target = path.expanduser().resolve()
    except (OSError, RuntimeError):
        return  # unresolvable: the writability check names the problem
    for option, spec in inputs or ():
        source = Path(spec).expanduser()
        try:
            if not source.exists():
                continue  # an alias or a hub id, not a path
            source = source.resolve()
        except OSError:
            continue
        if target == source or (source.is_dir() and source in target.parents):
            where = "is" if target == source else "is inside"
            raise SparseDecodeError(f"{what} {where} the input {option} {spec}: give an output path outside it")


MADE_FOLDERS: list[Path] = []
"""Folders an output check found missing (so the command may make them), deepest first: see
:func:`remove_empty_made_folders`."""


def _plain(value):
    """``value`` as its JSON file holds it (tuples as lists, paths as text), for comparing with what was read."""
    import json

    return json.loads(json.dumps(value, default=str))


VOLATILE = ("environment", "backend", "command", "weights_loaded")
"""Settings that describe the machine or how a run went, not what it computes: left out of comparisons."""


def check_replaced_alike(folder: Path, marker: str, settings: dict, *, key: str = "settings",
                         volatile: tuple[str, ...] = VOLATILE) -> None:  # fmt: skip
    """A command that cannot resume writes its results afresh; where ``folder`` holds results of its kind
    (``marker``) made with other settings (``key`` there; ``volatile`` entries, the machine and the like, aside),
    refuse, so that no earlier results are replaced unasked and no folder mixes two runs' files. A rerun with the
    same settings replaces them."""
    import json

    path = folder / marker
    if not path.is_file():
        return
    try:
        earlier = json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        earlier = None
    if not isinstance(earlier, dict):
        raise SparseDecodeError(
            f"--out {folder} holds a {marker} that cannot be read; give another folder, or remove it"
        )
    now = _plain(settings)
    differ = [name for name in sorted({*earlier, *now}) if name not in volatile and earlier.get(name) != now.get(name)]
    if differ:
        name = differ[0]
        raise SparseDecodeError(
            f"--out {folder} holds {RESULTS[marker]} of other settings ({name}: {earlier.get(name)!r} there, "
            f"{now.get(name)!r} now{', and more' if len(differ) > 1 else ''}); this command cannot add to it: give "
            f"another folder, or remove {marker} to replace it"
        )


def remove_empty_made_folders() -> None:
    """After a failed command: remove the folders it was to make that it left empty, deepest first, so a failure
    leaves no empty output folder behind (folders that hold anything are kept)."""
    for folder in sorted(set(MADE_FOLDERS), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only succeeds when empty
    MADE_FOLDERS.clear()


def check_writable_folder(folder: Path, what: str, hint: str = "") -> None:
    """``folder``, or its nearest existing ancestor when it is still to be made, takes a new file.

    Checked by creating and removing an empty temporary file there: permission bits do not tell (root ignores
    them, ``/proc`` and read-only mounts refuse anyway). The folders still to be made are noted for
    :func:`remove_empty_made_folders`.
    """
    existing = Path(folder)
    while not _exists(existing, what):
        MADE_FOLDERS.append(existing.absolute())
        existing = existing.parent
    if not existing.is_dir():
        raise SparseDecodeError(f"cannot write {what}: {existing} is a file, not a folder{hint}")
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".sparsedecode-check-")
    except OSError as error:
        reason = "refused" if error.errno == errno.ENOENT else error.strerror or type(error).__name__
        raise SparseDecodeError(f"cannot write {what}: cannot create files in {existing} ({reason}){hint}") from None
    os.close(handle)
    os.unlink(probe)


def _exists(path: Path, what: str) -> bool:
    try:
        return path.exists()
    except OSError as error:
        raise SparseDecodeError(f"cannot write {what}: {error.strerror or error} at {path}") from None
