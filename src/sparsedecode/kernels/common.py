"""What every implementation of the sparse step needs of its inputs (torch, C or Triton alike)."""

from __future__ import annotations

import torch

from ..errors import SparseDecodeError
from ..layout import BlockLayout


def check_inputs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None, layout: BlockLayout) -> None:
    """Raise :class:`SparseDecodeError` unless ``q (H, d)``, ``keys (kv, >= n, d)`` and ``values (kv, >= n, dv)``
    (``None``: selection alone) fit together and cover the layout's ``n`` positions, on one device.

    A value head dim ``dv`` other than ``d`` is fine here (the torch path handles it; the kernels refuse it).
    """
    if layout.n < 1 or layout.window < 1 or layout.block_size < 1:
        raise SparseDecodeError(
            f"a step needs at least one position, a window of at least one and blocks of at least one; got n = "
            f"{layout.n}, window {layout.window}, block_size {layout.block_size}"
        )
    q_shape, k_shape = q.shape, keys.shape
    v_shape = None if values is None else values.shape
    if len(q_shape) != 2 or len(k_shape) != 3 or (v_shape is not None and len(v_shape) != 3):
        shapes = f"query {tuple(q_shape)}, keys {tuple(k_shape)}" + ("" if v_shape is None else f", values {v_shape}")
        raise SparseDecodeError(f"expected query (heads, d) and keys/values (kv_heads, positions, d); got {shapes}")
    kv_heads, positions, d = k_shape
    if kv_heads == 0 or q_shape[0] % kv_heads:
        raise SparseDecodeError(f"{q_shape[0]} query heads cannot share {kv_heads} KV heads evenly")
    if q_shape[1] != d:
        raise SparseDecodeError(f"the query head dim {q_shape[1]} differs from the key head dim {d}")
    if positions < layout.n:
        raise SparseDecodeError(f"the key cache holds {positions} positions, fewer than the step's {layout.n}")
    device = keys.device
    if v_shape is not None:
        if v_shape[0] != kv_heads or v_shape[1] < layout.n:
            raise SparseDecodeError(
                f"values {tuple(v_shape)} do not match keys {tuple(k_shape)} over {layout.n} positions"
            )
        if values.device != device:
            raise SparseDecodeError(f"keys on {device} and values on {values.device}: they must share a device")
    if q.device != device:
        raise SparseDecodeError(f"the query on {q.device} and the cache on {device}: they must share a device")


def largest_offset(tensor: torch.Tensor) -> int:
    """The largest element offset from ``tensor``'s first element that indexing it can reach."""
    return sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)
