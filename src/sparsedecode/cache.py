"""A KV cache that appends in place.

transformers' ``DynamicLayer`` concatenates every new token onto the whole cache (``torch.cat``), so each decode
step copies all ``N`` cached keys and values of every layer: an ``O(N)`` cost per step that sparse attention cannot
remove. :class:`GrowingCache` keeps each layer's keys and values in a buffer that grows by doubling and hands out
views of its filled part; appends are amortised ``O(1)`` per token. Crops keep working (they shorten the view, and
later appends overwrite the dropped positions).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


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
        filled = self.get_seq_length()
        needed = filled + key_states.shape[-2]
        if (filled and not self._owns_views()) or self._keys_buffer is None or needed > self._keys_buffer.shape[-2]:
            self._grow(filled, needed, key_states, value_states)
        self._keys_buffer[..., filled:needed, :] = key_states
        self._values_buffer[..., filled:needed, :] = value_states
        self.keys = self._keys_buffer[..., :needed, :]
        self.values = self._values_buffer[..., :needed, :]
        return self.keys, self.values

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
