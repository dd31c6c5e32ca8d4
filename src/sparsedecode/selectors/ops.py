"""Tensor operations selectors are built from (docs/definitions.md, section 1); pure functions, usable on their own.

A selector's scores are turned into a support by the library with :func:`top_blocks` (the project's tie rule:
highest score first, ties to the lowest index). The rest are the pieces the built-in selectors score with: group-mean
queries, block means (the reference the incremental statistics of :mod:`sparsedecode.selectors.statistics` reproduce),
true attention (the oracles, H2O's history). Scores are float32 whatever the cache dtype.
"""

from __future__ import annotations

import math

import torch

from ..errors import SparseDecodeError
from ..layout import BlockLayout
from ..validate import check_scores


def group_mean_queries(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Mean query of each GQA group: ``(query_heads, d) -> (kv_heads, d)`` in float32.

    Query heads ``h * G .. (h + 1) * G - 1`` share KV head ``h`` (the layout of ``repeat_kv`` in transformers).
    """
    query_heads, d = queries.shape
    if query_heads % kv_heads:
        raise SparseDecodeError(f"{query_heads} query heads cannot share {kv_heads} KV heads evenly")
    return queries.float().view(kv_heads, query_heads // kv_heads, d).mean(dim=1)


def block_centroids(keys: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Mean key of every distant block, recomputed from the keys: ``(kv_heads, N, d) -> (kv_heads, n_blocks, d)``.

    This is the reference the incremental centroid cache must reproduce; float32 whatever the key dtype.
    """
    kv_heads, _, d = keys.shape
    block = layout.block_size
    full = keys[:, 1 : 1 + layout.n_full * block].float().reshape(kv_heads, layout.n_full, block, d).mean(dim=2)
    if layout.n_blocks == layout.n_full:
        return full
    tail = keys[:, 1 + layout.n_full * block : layout.distant_end].float().mean(dim=1, keepdim=True)
    return torch.cat([full, tail], dim=1)


def mean_pooled_scores(query_means: torch.Tensor, centroids: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``s_j = <q_h, c_j> / sqrt(d)`` (times ``scale`` instead, where given): ``(kv_heads, d), (kv_heads, n_blocks,
    d) -> (kv_heads, n_blocks)``."""
    d = query_means.shape[-1]
    # (kv, 1, d) @ (kv, d, n_blocks): a row-vector product, fast when the centroids are stored transposed
    factor = 1 / math.sqrt(d) if scale is None else scale
    return torch.bmm(query_means.unsqueeze(1), centroids.transpose(1, 2)).squeeze(1).mul_(factor)


def top_blocks(scores: torch.Tensor, b: int) -> torch.Tensor:
    """Indices of the ``b`` best blocks per row, ties towards the lowest index, returned in ascending order.

    ``topk`` finds the b-th best score; every block above it is kept and the ties at it are taken in index
    order, so no full sort is needed (``O(n_blocks)`` per row). Non-finite scores raise :class:`SparseDecodeError`
    (whenever a choice is made, i.e. ``0 < b < n_blocks``).
    """
    rows, n_blocks = scores.shape
    if b >= n_blocks:
        return torch.arange(n_blocks, device=scores.device).expand(rows, -1)
    if b == 0:
        return torch.zeros(rows, 0, dtype=torch.long, device=scores.device)
    check_scores(scores)  # NaN compares false with everything: it would silently pick blocks in index order
    best = scores.topk(b + 1, dim=-1)
    if not bool((best.values[:, b - 1] == best.values[:, b]).any()):  # no tie at the cut: topk's set is the answer
        return best.indices[:, :b].sort(dim=-1).values
    kth = best.values[:, b - 1 : b]
    above = scores > kth
    tied = scores == kth
    needed = b - above.sum(dim=-1, keepdim=True)
    take = above | (tied & (tied.cumsum(dim=-1) <= needed))
    return take.nonzero()[:, 1].view(rows, b)


def quest_scores(query_means: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """Quest's bound ``sum_i max(q_i * min_i, q_i * max_i) >= q . k`` for every key of the block.

    ``(kv, d), (kv, n_blocks, d), (kv, n_blocks, d) -> (kv, n_blocks)`` (Quest, arXiv 2406.10774).
    """
    q = query_means.unsqueeze(1)
    return torch.maximum(q * mins, q * maxs).sum(dim=-1)


def group_attention(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """True attention probabilities of each query head over all ``N`` keys, summed over each GQA group.

    ``(query_heads, d), (kv, N, d) -> (kv, N)`` float32. This reads every key: the oracles (and H2O's history at
    steps that are dense anyway).
    """
    kv_heads, _, d = keys.shape
    qg = queries.float().view(kv_heads, -1, d)
    return torch.softmax(torch.bmm(qg, keys.float().transpose(1, 2)) * scale, dim=-1).sum(dim=1)


CAUSAL_CHUNK_ELEMENTS = 1 << 24
"""Attention probabilities held at once by :func:`causal_attention_received` (64 MiB of float32)."""


def causal_attention_received(queries: torch.Tensor, keys: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Attention each key receives from a run of consecutive queries, summed over the queries and each GQA group.

    ``queries`` ``(query_heads, q, d)`` sit at positions ``start .. start + q - 1``; ``keys`` ``(kv, N, d)`` with
    ``N = start + q``; query ``i`` sees keys ``0 .. start + i`` (causal). Returns ``(kv, N)`` float32: H2O's
    accumulated attention for a prefill (or any multi-token forward). Queries are taken in chunks so that at most
    :data:`CAUSAL_CHUNK_ELEMENTS` probabilities exist at a time, whatever the length.
    """
    query_heads, q_len, d = queries.shape
    kv_heads, n, _ = keys.shape
    group = query_heads // kv_heads
    keys_t = keys.float().transpose(1, 2)
    received = torch.zeros(kv_heads, n, dtype=torch.float32, device=keys.device)
    rows = max(1, CAUSAL_CHUNK_ELEMENTS // max(query_heads * n, 1))
    columns = torch.arange(n, device=keys.device)
    for first in range(0, q_len, rows):
        last = min(first + rows, q_len)
        chunk = queries[:, first:last].float().reshape(kv_heads, group * (last - first), d)
        logits = torch.bmm(chunk, keys_t).mul_(scale).view(kv_heads, group, last - first, n)
        positions = torch.arange(start + first, start + last, device=keys.device)
        logits.masked_fill_(columns > positions.unsqueeze(1), float("-inf"))
        received += torch.softmax(logits, dim=-1).sum(dim=(1, 2))
    return received


def block_masses(weights: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Sum of per-position weights ``(kv, N)`` over each distant block: ``(kv, n_blocks)``."""
    distant = weights[:, 1 : layout.distant_end]
    pad = layout.n_blocks * layout.block_size - distant.shape[1]
    return torch.nn.functional.pad(distant, (0, pad)).view(weights.shape[0], layout.n_blocks, -1).sum(dim=-1)


def top_positions(weights: torch.Tensor, layout: BlockLayout, count: int) -> torch.Tensor:
    """The ``count`` distant positions with the largest weight per KV head, ascending (ties: lowest first)."""
    return top_blocks(weights[:, 1 : layout.distant_end], count) + 1


def token_index(distant: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Anchor, the given distant positions and the window: ``(kv, 1 + m + W)``."""
    kv_heads = distant.shape[0]
    window = torch.arange(layout.distant_end, layout.n, device=distant.device).expand(kv_heads, -1)
    return torch.cat([distant.new_zeros(kv_heads, 1), distant, window], dim=1)
