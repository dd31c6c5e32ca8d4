"""Building a shared library from its sources at first use, the one way the C kernel (:mod:`sparsedecode.kernels.cpu`)
and its C++ operators (:mod:`.native`) are built."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


def compile_library(
    sources: dict[str, bytes], command: Callable[[Path, Path], list[str]], target: Path, timeout: float
) -> str | None:
    """Write ``sources`` (file name: text) into a scratch folder beside ``target``, run ``command(scratch, built)``
    and move the library it built to ``target`` in one step (concurrent builders each write their own scratch copy);
    None, or the compiler's message when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        folder = Path(scratch)
        for name, text in sources.items():
            (folder / name).write_bytes(text)
        built = folder / target.name
        done = subprocess.run(command(folder, built), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            return done.stderr.strip()[-500:] or f"exit status {done.returncode}"
        os.replace(built, target)
    return None
