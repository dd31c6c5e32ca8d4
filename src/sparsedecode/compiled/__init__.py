"""Compiled decoding: the whole decode step taken by ``torch.compile(..., fullgraph=True)`` over a static KV cache.

:mod:`.decoder` (:class:`~.decoder.CompiledDecoder`, ``generate(..., compile=True)``), :mod:`.op` (the sparse step
as one custom op per layer, over state in preallocated tensors), :mod:`.prepared` (the op's common case as one
prepared C call), :mod:`.cpu` (the CPU's compile choices: row products, freezing, autotuning), :mod:`.guards` (what
a compiled step assumes of the model, checked once per install). The step's rules are :mod:`sparsedecode.step`'s.
"""

import importlib as _importlib

_EXPORTS = {
    "CompiledDecoder": "decoder",
    "DEFAULT_BACKEND": "decoder",
    "check_compilable": "decoder",
    "decoder_for": "decoder",
    "generate_compiled": "decoder",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_importlib.import_module(f".{module}", __name__), name)
