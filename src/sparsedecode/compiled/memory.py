"""Where a CPU decoder's own memory lies: its layers' block statistics (the centroids every sparse step streams) in
one buffer, and its static KV cache in another, both on huge pages (:mod:`sparsedecode.models.arena`), so that a
step's selection and attention read them with few TLB misses. Measured beside the weights' own buffer (SmolLM2 8K,
Q4_1, native step, one thread, Zen 2): 11.0-11.2 ms a token before, 10.4-10.8 after; the first step's block means
of the prompt read the cache faster too. ``SPARSEDECODE_HUGE_PAGES=0`` leaves both where torch puts them.

The statistics are moved right after :func:`~sparsedecode.compiled.op.allocate` made them (zeros, as fresh memory
is); the cache's layers are given their tensors before any write, sized by what the attention modules' own
projections write, for the families of :data:`~sparsedecode.compiled.native_check.FAMILIES`: elsewhere transformers
allocates them at the first write, as before."""

from __future__ import annotations

import torch

from ..models import arena
from .native_check import FAMILIES

__all__ = ["place_statistics", "static_cache"]


def _on_huge_pages(device: torch.device) -> bool:
    return arena.ENABLED and torch.device(device).type == "cpu"


def place_statistics(states: dict, device) -> None:
    """Every state's ``stats`` (fresh zeros) moved into one huge-page buffer, in layer order."""
    if not states or not _on_huge_pages(device):
        return
    ordered = sorted(states.values(), key=lambda state: state.layer)
    for state, tensor in zip(ordered, arena.carve([(s.stats.shape, s.stats.dtype) for s in ordered])):
        torch._dynamo.mark_static_address(tensor)  # as allocate marks what it makes
        state.stats = tensor


def _written_shape(model) -> tuple[int, int] | None:
    """``(kv heads, head dim)`` of the keys and values every attention module writes, from its own projections (not
    the config, which may misstate them: the step refuses that later, in one line); None where they differ."""
    shapes = set()
    for layer in model.model.layers:
        attention = layer.self_attn
        d = getattr(attention, "head_dim", None)
        widths = (attention.k_proj.out_features, attention.v_proj.out_features)
        if not d or widths[0] != widths[1] or widths[0] % d:
            return None
        shapes.add((widths[0] // d, d))
    return shapes.pop() if len(shapes) == 1 else None


def static_cache(model, max_len: int, batch: int, device):
    """transformers' ``StaticCache`` for ``model``, its layers' keys and values already on huge pages where
    :func:`_on_huge_pages` and the model's family say so (module docstring)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    if not _on_huge_pages(device) or type(model).__name__ not in FAMILIES:
        return cache
    shape = _written_shape(model)
    if shape is None or len(cache.layers) != len(model.model.layers):
        return cache
    if any(getattr(layer, "max_cache_len", None) != max_len for layer in cache.layers):
        return cache  # a sliding window's layer: transformers' own allocation
    kv, d = shape
    dtype = model.dtype
    tensors = arena.carve([((batch, kv, max_len, d), dtype)] * (2 * len(cache.layers)))
    empty = torch.empty(batch, kv, 0, d, dtype=dtype)
    for index, layer in enumerate(cache.layers):
        layer.lazy_initialization(empty, empty)  # its sizes and flags, then our tensors for its own zeros
        layer.keys, layer.values = tensors[2 * index], tensors[2 * index + 1]
        torch._dynamo.mark_static_address(layer.keys)
        torch._dynamo.mark_static_address(layer.values)
    return cache
