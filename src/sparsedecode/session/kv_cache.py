"""A KV cache that appends in place.

transformers' ``DynamicLayer`` concatenates every new token onto the whole cache (``torch.cat``), so each decode
step copies all ``N`` cached keys and values of every layer: an ``O(N)`` cost per step that sparse attention cannot
remove. :class:`GrowingCache` keeps each layer's keys and values in a buffer that grows by doubling and hands out
views of its filled part; appends are amortised ``O(1)`` per token. Crops keep working (they shorten the view, and
later appends overwrite the dropped positions).

:func:`checkpoint` and :func:`rewind` take any cache back to an earlier length, including layers ``crop`` cannot
rewind: sliding-window layers past their window, and the convolution and recurrent states of hybrid models.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, StaticLayer

from ..errors import SparseDecodeError

VIEW_ROOT = "_sparsedecode_root"
"""The attribute a :class:`GrowingLayer`'s key and value views carry naming their buffer: under
``torch.inference_mode`` a view keeps no ``_base``, and a session proves a cropped view unchanged by its buffer
(:class:`~sparsedecode.session.state.KeyMark`)."""


def _name_root(layer: GrowingLayer) -> None:
    setattr(layer.keys, VIEW_ROOT, layer._keys_buffer)
    setattr(layer.values, VIEW_ROOT, layer._values_buffer)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views into buffers grown by doubling (minimum 256 positions)."""

    _keys_buffer: torch.Tensor | None = None
    _values_buffer: torch.Tensor | None = None

    def _owns_views(self) -> bool:
        return (
            self._keys_buffer is not None
            and self.keys.dim() == 4
            and self.keys.data_ptr() == self._keys_buffer.data_ptr()
            and self.values.data_ptr() == self._values_buffer.data_ptr()
        )

    def _grow(self, filled: int, needed: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        old = 0 if self._keys_buffer is None else self._keys_buffer.shape[-2]
        capacity = max(needed, 2 * old, 256)
        batch, heads, _, d = key_states.shape
        keys = key_states.new_empty(batch, heads, capacity, d)
        values = value_states.new_empty(batch, heads, capacity, value_states.shape[-1])
        if filled:
            keys[..., :filled, :] = self.keys
            values[..., :filled, :] = self.values
        self._keys_buffer, self._values_buffer = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._keys_buffer = self._values_buffer = None
        filled = int(self.get_seq_length())
        needed = filled + key_states.shape[-2]
        if (filled and not self._owns_views()) or self._keys_buffer is None or needed > self._keys_buffer.shape[-2]:
            self._grow(filled, needed, key_states, value_states)
        self._keys_buffer[..., filled:needed, :] = key_states
        self._values_buffer[..., filled:needed, :] = value_states
        self.keys = self._keys_buffer[..., :needed, :]
        self.values = self._values_buffer[..., :needed, :]
        _name_root(self)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.is_initialized and self._owns_views():
            _name_root(self)

    def reset(self) -> None:
        super().reset()
        self._keys_buffer = self._values_buffer = None


class GrowingCache(DynamicCache):
    """``DynamicCache`` with in-place appends for its full-attention layers (sliding layers are left as they are)."""

    def __init__(self, config=None) -> None:
        super().__init__(config=config)
        if config is None:
            self.layer_class_to_replicate = GrowingLayer
        else:
            self.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]


def growing_copy(cache: DynamicCache, config) -> GrowingCache:
    """A :class:`GrowingCache` holding what ``cache`` (built from the same ``config``) holds: plain layers copied into
    in-place buffers, the others deep-copied; checkpointed at its length (see :func:`checkpoint`)."""
    growing = GrowingCache(config=config)
    for index, layer in enumerate(cache.layers):
        if isinstance(growing.layers[index], GrowingLayer):  # where ``cache`` has a DynamicLayer
            growing.layers[index].update(layer.keys, layer.values)
        else:
            growing.layers[index] = copy.deepcopy(layer)
    checkpoint(growing)
    return growing


def seq_length(cache_or_layer, layer: int | None = None) -> int:
    """A cache's (or one layer's) length as a Python int. transformers 5.25's linear-attention layers return their
    running count itself, a 0-d tensor that later tokens increment in place: a length kept from it would move."""
    if layer is not None:
        return int(cache_or_layer.get_seq_length(layer))
    return int(cache_or_layer.get_seq_length())


def _plain(layer) -> bool:
    """A layer that keeps every position it was given and nothing else: ``crop`` rewinds it exactly."""
    return type(layer) in (DynamicLayer, GrowingLayer, StaticLayer)


def crop_rewinds(cache) -> bool:
    """Whether ``crop`` alone can take ``cache`` back to any earlier length (every layer plain)."""
    return all(_plain(layer) for layer in getattr(cache, "layers", None) or [])


@dataclass
class Snapshot:
    """A cache's length and copies of its layers that ``crop`` cannot rewind (:func:`snapshot`)."""

    length: int
    layers: dict[int, object]


def snapshot(cache) -> Snapshot:
    """Copies of the layers ``crop`` cannot take back, as they are now: a sliding-window layer holds at most its
    window, a convolution or recurrent layer a few states (so a copy costs the windows' size, not the context's),
    except a layer holding both states and full keys and values (Falcon-H1), which is copied whole. Plain layers are
    not copied (cropping them is exact), so a cache with only plain layers yields an empty snapshot."""
    layers = getattr(cache, "layers", None) or []
    kept = {i: copy.deepcopy(layer) for i, layer in enumerate(layers) if not _plain(layer)}
    return Snapshot(seq_length(cache), kept)


def restore(cache, saved: Snapshot) -> None:
    """Take ``cache`` back to the snapshot's length: plain layers cropped, the others copied back (the snapshot
    stays usable)."""
    for i, layer in enumerate(cache.layers):
        if i in saved.layers:
            cache.layers[i] = copy.deepcopy(saved.layers[i])
        elif seq_length(layer) > saved.length:
            layer.crop(saved.length - seq_length(layer))


def checkpoint(cache) -> None:
    """Make the cache's current length the one :func:`rewind` can come back to when ``crop`` cannot (see
    :func:`snapshot`); a new checkpoint replaces the previous one. :func:`~sparsedecode.decoding.loop.prefill` takes
    one at the prompt."""
    cache._sparsedecode_checkpoint = None if crop_rewinds(cache) else snapshot(cache)


def rewind(cache, length: int) -> None:
    """Drop cached positions past ``length``: by ``crop`` where every layer is plain, else from the checkpoint,
    which must be at ``length`` (:class:`~sparsedecode.errors.SparseDecodeError` otherwise)."""
    if seq_length(cache) <= length:
        return
    if crop_rewinds(cache):  # each layer to ``length``: a forward that failed part-way left layers of two lengths
        restore(cache, Snapshot(length, {}))
        return
    saved = getattr(cache, "_sparsedecode_checkpoint", None)
    if saved is None or saved.length != length:
        kinds = sorted({type(layer).__name__ for layer in cache.layers if not _plain(layer)})
        raise SparseDecodeError(
            f"cannot take this cache back to {length} positions: its {', '.join(kinds)} layers keep no past "
            "(sliding windows past their window, convolution or recurrent states) and no checkpoint was taken there"
        )
    restore(cache, saved)


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Drop cached positions past ``length`` (:func:`rewind`: crops, and restores the layers crop cannot
    rewind from the checkpoint :func:`~sparsedecode.decoding.loop.prefill` took)."""
    rewind(cache, length)
