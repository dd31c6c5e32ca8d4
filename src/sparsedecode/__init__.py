"""sparsedecode: sparse decoding for Hugging Face causal LMs, measured against dense decoding.

Library layer only: nothing here imports the CLI, reports, plotting or ``datasets``.

The public names are imported on first use (PEP 562), so ``import sparsedecode`` (and the command line's
``--help``) does not pay for importing torch and transformers.
"""

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from .config import SparseConfig
    from .decoding.generate import generate
    from .errors import SparseDecodeError
    from .models.catalog import DEFAULT_MODEL, list_models, load_model, load_tokenizer
    from .protocol.paired import compare, dense_reference
    from .protocol.results import CompareResult, DenseReference
    from .selectors import BlockSelector, TokenSelector, register_selector, select_support
    from .session import SparseSession, sparse_decoding

_EXPORTS = {
    "BlockSelector": "selectors",
    "DEFAULT_MODEL": "models.catalog",
    "CompareResult": "protocol.results",
    "DenseReference": "protocol.results",
    "SparseConfig": "config",
    "SparseDecodeError": "errors",
    "SparseSession": "session",
    "compare": "protocol.paired",
    "dense_reference": "protocol.paired",
    "generate": "decoding.generate",
    "list_models": "models.catalog",
    "load_model": "models.catalog",
    "load_tokenizer": "models.catalog",
    "register_selector": "selectors",
    "select_support": "selectors",
    "sparse_decoding": "session",
    "TokenSelector": "selectors",
}

__all__ = [
    "BlockSelector",
    "DEFAULT_MODEL",
    "CompareResult",
    "DenseReference",
    "SparseConfig",
    "SparseDecodeError",
    "SparseSession",
    "compare",
    "dense_reference",
    "generate",
    "list_models",
    "load_model",
    "load_tokenizer",
    "register_selector",
    "select_support",
    "sparse_decoding",
    "TokenSelector",
]

__version__ = "0.1.0"


from . import moved as _moved  # noqa: E402, F401  (old module paths, e.g. sparsedecode.decoding.generate, keep importing)


def __getattr__(name: str) -> object:
    """Import a public name's module on first use and keep the name here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
