"""The C++ kernels of the compiled step's operators (``csrc/torch_ops.cpp``): the quantized products and the sparse
step's prepared call, whose CPU kernels call the C library without going through Python (a quantized product about
1 us a call instead of about 10, the compiled step making about 210 a token; a prepared sparse step about 50 us less
a layer).

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
_SHIM: ctypes.CDLL | None = None


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
    """Build (once) and load the C++ operators, handing them the C ``library``'s products and prepared step; whether
    they serve."""
    global _LOADED, BUILD_ERROR, _SHIM
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
            shim.sparsedecode_set_products.argtypes = [ctypes.c_void_p] * 4
            shim.sparsedecode_offer_step.argtypes = [ctypes.c_void_p]
            shim.sparsedecode_step_calls.restype = ctypes.c_int64
            functions = (library.q4_linear, library.q8_linear, library.prepared_step, library.q5_linear)
            shim.sparsedecode_set_products(*(ctypes.cast(f, ctypes.c_void_p) for f in functions))
            torch.ops.load_library(str(target))  # registers the CPU kernels
            _SHIM, _LOADED = shim, True
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            BUILD_ERROR = str(error)
    return _LOADED


def offer_step(fields: int) -> bool:
    """Hand the sparse step's C++ kernel a prepared call for the call in progress (``fields``: the address of its
    int64 fields, :meth:`~sparsedecode.compiled.prepared.Prepared.offer`); whether it was handed (the kernel loaded)."""
    if _SHIM is not None:
        _SHIM.sparsedecode_offer_step(fields)
    return _SHIM is not None


def forget_steps() -> None:
    """Make the sparse step's C++ kernel forget every prepared call it was handed."""
    if _SHIM is not None:
        _SHIM.sparsedecode_forget_steps()


def step_calls() -> int:
    """How many prepared sparse steps the C++ kernel has made in this process (0 where it is not loaded)."""
    return 0 if _SHIM is None else int(_SHIM.sparsedecode_step_calls())
