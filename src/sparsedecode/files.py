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
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import naming

__all__ = ["LOCK_FILE", "atomic_path", "write_json_atomic", "write_target", "write_text_atomic"]

LOCK_FILE = ".lock"
"""The file a results folder's one writer holds locked (:func:`sparsedecode.experiments.sweep_folder.locked`);
named here, where the command line's checks read it without importing torch."""


def write_target(path: Path) -> Path:
    """The file a write to ``path`` replaces: a symbolic link's target (the link stays a link), else ``path``."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


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
            os.chmod(tmp, 0o644)
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
