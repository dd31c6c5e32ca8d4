"""A C function of the built kernel with its argument types set at its first use: what the kernel's later parts
(pages, quantized products) call, each declaring its own argument list beside its wrapper."""

from __future__ import annotations

import ctypes

from . import library


def c_function(name: str, argtypes: list):
    """The built library's function ``name`` (returning a status ``int``), its argument types set once; the library
    must have been built (callers check :func:`~sparsedecode.kernels.cpu.library` first)."""
    function = getattr(library(), name)
    if function.argtypes is None:
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return function
