"""Helpers the ports share: the GQA head map, a top-k with a fixed tie rule, and masks turned into position lists."""

from __future__ import annotations

import torch


def group_size(queries: torch.Tensor, keys: torch.Tensor) -> int:
    """``G = H / KV`` for ``queries`` ``(H, d)`` and ``keys`` ``(KV, N, d)``, or a ValueError."""
    if queries.dim() != 2 or keys.dim() != 3 or queries.shape[-1] != keys.shape[-1]:
        raise ValueError(
            f"expected queries (H, d) and keys (KV, N, d); got {tuple(queries.shape)}, {tuple(keys.shape)}"
        )
    heads, kv_heads = queries.shape[0], keys.shape[0]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
    return heads // kv_heads


def per_query_head(keys: torch.Tensor, group: int) -> torch.Tensor:
    """``(KV, N, d) -> (H, N, d)``: each query head's KV head (``repeat_kv``: head ``h`` reads ``h // G``)."""
    return keys.repeat_interleave(group, dim=0)


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row of ``scores`` ``(rows, n)``, ascending; ties go to the lowest
    index (the official codes call ``torch.topk``, whose choice among equal values is not specified)."""
    k = max(0, min(k, scores.shape[-1]))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=-1).values


def mask_to_positions(mask: torch.Tensor) -> list[torch.Tensor]:
    """``(H, N)`` booleans -> one ascending LongTensor of the true positions per row."""
    return [row.nonzero().flatten() for row in mask]


def positions_to_mask(positions: list[torch.Tensor], n: int) -> torch.Tensor:
    """The inverse of :func:`mask_to_positions`: ``(len(positions), n)`` booleans."""
    mask = torch.zeros(len(positions), n, dtype=torch.bool)
    for row, index in zip(mask, positions):
        row[index] = True
    return mask


def page_spans(starts: torch.Tensor, end: int, size: int) -> list[torch.Tensor]:
    """The positions of pages starting at ``starts``, each ``size`` long and cut at ``end``."""
    return [torch.arange(int(s), min(int(s) + size, end)) for s in starts]
