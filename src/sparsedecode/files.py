"""Writing files so that a reader never sees half of one and a failure names the file.

Every write goes to a temporary file beside its target (same suffix, so writers that pick a format by it still do)
and is renamed onto the target when complete; a failure removes the temporary file, and an ``OSError`` raised
without a file name (a full disk) is given the target's (:func:`~sparsedecode.errors.naming`). A target that is a
symbolic link is written through: the file it points to is replaced, and the link stays a link.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import naming

__all__ = [
    "LOCK_FILE",
    "atomic_path",
    "open_modes",
    "remove_path",
    "write_json_atomic",
    "write_target",
    "write_text_atomic",
]

LOCK_FILE = ".lock"
"""The file a results folder's one writer holds locked (:func:`sparsedecode.experiments.sweep_folder.locked`);
named here, where the command line's checks read it without importing torch."""


def write_target(path: Path) -> Path:
    """The file a write to ``path`` replaces: a symbolic link's target (the link stays a link), else ``path``."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def remove_path(path: Path) -> None:
    """Remove a file or folder tree if it exists (a symbolic link itself, not what it points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def open_modes(path: Path) -> None:
    """Give ``path``, and everything in it if it is a folder, the permissions a plain ``open`` or ``mkdir`` gives
    under the process's umask: ``mkstemp``, ``mkdtemp`` and safetensors' writer make them the owner's alone, which
    other readers of a shared cache (``SPARSEDECODE_CACHE``) or results folder could not open."""
    mask = os.umask(0o22)
    os.umask(mask)
    for item in [path, *(sorted(path.rglob("*")) if path.is_dir() else [])]:
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to: renamed onto ``path`` when the block ends without an error,
    removed when it raises. A symbolic link is written through: its target is replaced, the link kept."""
    path = write_target(path)
    with naming(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
        os.close(handle)
        tmp = Path(name)
        try:
            yield tmp
            open_modes(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` in UTF-8 (as every reader reads it, whatever the locale) through
    :func:`atomic_path`, flushed to disk before the rename."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def write_json_atomic(path: Path, data: object) -> None:
    """JSON with one-space indents and a final newline, through :func:`write_text_atomic`."""
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")
