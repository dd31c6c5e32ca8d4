"""Selectors: which distant positions a decode step reads (docs/definitions.md, sections 1 and 8).

One module per method in :mod:`.methods` (the project's own ``mean-pooled`` and ``block-top-p``, the references,
and methods from the literature written on the public protocol: ``quest``, ``sparq``, ``twilight``, ``h2o``,
``streaming``, ``sink-streaming``); the block statistics a session caches in :mod:`.statistics`; the protocol in
:mod:`.base`, names and files in :mod:`.registry`, the library's half of a selection (scores to support) in
:mod:`.select`, tensor operations to build scores from in :mod:`.ops`.
"""

import importlib as _importlib

_EXPORTS = {
    "BlockSelector": "base",
    "Selector": "base",
    "TokenSelector": "base",
    "block_centroids": "ops",
    "block_masses": "ops",
    "causal_attention_received": "ops",
    "group_attention": "ops",
    "group_mean_queries": "ops",
    "mean_pooled_scores": "ops",
    "quest_scores": "ops",
    "token_index": "ops",
    "top_blocks": "ops",
    "top_positions": "ops",
    "parse_selector": "registry",
    "register_selector": "registry",
    "resolve_selector": "registry",
    "selector_class": "registry",
    "selector_names": "registry",
    "split_selector_list": "registry",
    "BlockChoice": "select",
    "choose_blocks": "select",
    "choose_positions": "select",
    "select_blocks": "select",
    "select_positions": "select",
    "select_support": "select",
}
"""Names importable from here; loaded on first use, so naming a selector (the protocol, the registry) imports no
torch, and the tensor operations do when first asked for."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
