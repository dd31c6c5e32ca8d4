"""The quantized products' C++ implementation (``csrc/torch_ops.cpp``): torch operators whose CPU kernel calls the C
library's products without going through Python (about 1 us a call instead of about 10: the compiled step makes
about 210 a token).

Built at first use with the system C++ compiler (``$CXX``, else ``c++`` or ``g++``) against torch's stable C++
headers (``torch/csrc/stable``, torch 2.10 and later), into ``$SPARSEDECODE_CACHE/kernels`` keyed by the source,
the compiler, the flags and torch's version, then loaded into torch's operator registry. :func:`load` answers
whether it serves; where it cannot be built (no C++ compiler, an older torch) or loaded, :data:`BUILD_ERROR` says
why and the Python implementation of :mod:`.qlinear` serves the same operators.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

from .. import cpu
from .compiling import compile_library

SOURCE = Path(__file__).with_name("csrc") / "torch_ops.cpp"
_TEXT = SOURCE.read_bytes()  # read once, at import, as the C library's sources are
FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC")
BUILD_ERROR: str | None = None
_LOADED: bool | None = None


def _torch_paths() -> tuple[Path, Path]:
    root = Path(torch.__file__).parent
    return root / "include", root / "lib"


def _command(compiler: str, source: Path, target: Path) -> list[str]:
    include, lib = _torch_paths()
    links = [f"-L{lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    return [compiler, *FLAGS, f"-I{include}", str(source), "-o", str(target), *links]


def _target(compiler: str) -> Path:
    key = b"\0".join([_TEXT, compiler.encode(), " ".join(FLAGS).encode(), torch.__version__.encode()])
    key += str(_torch_paths()[0]).encode()
    return cpu.cache_dir() / f"torch_ops-{hashlib.sha256(key).hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    if not (_torch_paths()[0] / "torch" / "csrc" / "stable" / "library.h").exists():
        raise OSError(f"torch {torch.__version__} has no stable C++ headers (torch 2.10 or later has them)")
    error = compile_library(
        {SOURCE.name: _TEXT}, lambda scratch, built: _command(compiler, scratch / SOURCE.name, built), target, 300
    )
    if error is not None:
        raise OSError(error)


def load(library: ctypes.CDLL) -> bool:
    """Build (once) and load the C++ operators, handing them the C ``library``'s products; whether they serve."""
    global _LOADED, BUILD_ERROR
    if _LOADED is None:
        _LOADED = False
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        try:
            if compiler is None:
                raise OSError("no C++ compiler found (set CXX)")
            target = _target(compiler)
            if not target.exists():
                _build(compiler, target)
            shim = ctypes.CDLL(str(target))
            shim.sparsedecode_set_products.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            shim.sparsedecode_set_products(ctypes.cast(library.q4_linear, ctypes.c_void_p),
                                           ctypes.cast(library.q8_linear, ctypes.c_void_p))  # fmt: skip
            torch.ops.load_library(str(target))  # registers the CPU kernels
            _LOADED = True
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            BUILD_ERROR = str(error)
    return _LOADED
