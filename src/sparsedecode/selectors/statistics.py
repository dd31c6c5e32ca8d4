"""Incremental per-block key statistics (docs/definitions.md, section 1, "Centroid cache").

Keys never change once cached, so a statistic of a completed distant block (its mean key, the centroid; or its
per-channel minimum and maximum, for Quest) can be computed once and kept. Selection then reads ``N / B`` block
statistics instead of ``N`` keys. One :class:`BlockStatistics` serves one layer of one generation: it is built
lazily at the first sparse decode step after prefill (reading the prefix keys once) and extended by one block
every ``B`` tokens afterwards.

The cache itself cannot tell whether the keys it summarised are still the keys in the KV cache: a new prompt, a
crop or a rollback changes them behind its back. Validity is decided by its owner, the session's layer state
(:class:`~sparsedecode.session.LayerState`), which proves how many leading cache positions are unchanged since it
last looked and calls :meth:`BlockStatistics.truncate` before every update; see that class for the argument.
"""

from __future__ import annotations

import math

import torch

from .base import STATISTICS

SPAN_FLOATS = 1 << 21
"""Float32 values of half-precision keys that :func:`store_statistics` converts at a time (8 MB), into one buffer.
One copy of a whole prompt's keys is freshly mapped memory whose page faults cost more than the reduction: SmolLM2's
8K prompt at batch 8 in bfloat16, 507 blocks x 3 KV heads x 8 rows, 17.5 -> 1.8 ms a layer on the AMD EPYC (2.6
with a fresh copy per piece), the same bits."""


def reduce_blocks(blocks: torch.Tensor, kind: str, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``(..., blocks, B, d) -> (..., blocks, d)`` float32 mean / min / max over each block: the one definition of a
    block statistic, for the session's statistics and the host-free step alike. ``valid (..., blocks, B)`` marks the
    positions a block holds where some are missing (the host-free step's newest block, over the positions written so
    far; at least one valid where the result is used); without it every position counts."""
    if valid is None:
        if kind == "mean":
            return blocks.mean(dim=-2)
        return blocks.amin(dim=-2) if kind == "min" else blocks.amax(dim=-2)
    mask = valid.unsqueeze(-1)
    if kind == "mean":
        return (blocks * mask).sum(dim=-2) / valid.sum(dim=-1, keepdim=True).clamp(min=1)
    filled = blocks.masked_fill(~mask, float("inf") if kind == "min" else float("-inf"))
    return filled.amin(dim=-2) if kind == "min" else filled.amax(dim=-2)


def block_span(keys: torch.Tensor, first: int, stop: int, block: int) -> torch.Tensor:
    """Blocks ``first .. stop - 1`` of ``keys (..., N, d)`` (block ``j`` holds positions ``1 + jB .. (j + 1)B``) as
    float32 ``(..., stop - first, B, d)``, what :func:`reduce_blocks` reduces; any leading dimensions (KV heads, or
    rows and KV heads) give each row the numbers it gets alone."""
    lead, d = keys.shape[:-2], keys.shape[-1]
    return keys[..., 1 + first * block : 1 + stop * block, :].float().reshape(*lead, stop - first, block, d)


def store_statistics(keys: torch.Tensor, first: int, stop: int, block: int, targets: dict[str, torch.Tensor]) -> None:
    """Write the statistics of blocks ``first .. stop - 1`` of ``keys (..., N, d)`` into ``targets[kind][..., :,
    first:stop]`` (storage laid out ``(..., d, blocks)``): :func:`reduce_blocks` of :func:`block_span`, a few blocks
    at a time where the keys need a float32 copy (:data:`SPAN_FLOATS`); each block is reduced alone, so the numbers
    do not depend on how the span is cut. Values only: statistics rank blocks, so they keep no autograd graph of the
    keys (which would keep a whole forward's activations alive as long as the session)."""
    if stop <= first:
        return
    keys = keys.detach()
    lead, d = keys.shape[:-2], keys.shape[-1]
    per_block = math.prod(lead) * block * d
    step, buffer = stop - first, None
    if keys.dtype != torch.float32:  # one float32 buffer for every piece: no fresh pages per piece
        step = min(step, max(1, SPAN_FLOATS // per_block))
        buffer = torch.empty(step * per_block, dtype=torch.float32, device=keys.device)
    for start in range(first, stop, step):
        end = min(stop, start + step)
        if buffer is None:
            span = block_span(keys, start, end, block)
        else:
            span = buffer[: (end - start) * per_block].view(*lead, (end - start) * block, d)
            span.copy_(keys[..., 1 + start * block : 1 + end * block, :])
            span = span.view(*lead, end - start, block, d)
        for kind, target in targets.items():
            target[..., start:end] = reduce_blocks(span, kind).transpose(-1, -2)


class BlockStatistics:
    """Float32 statistics of the completed distant blocks of one layer's keys, per KV head.

    ``kinds`` names the statistics kept (``("mean",)`` by default: the centroids). Memory per statistic:
    ``kv_heads * capacity * d`` float32 values, about ``1/B`` of a float32 key cache (``2/B`` of a
    half-precision one). Capacity grows by doubling, so appends are amortised O(d) per token. The owner must call
    :meth:`truncate` whenever keys may have changed; the cache trusts every stored block otherwise.
    """

    def __init__(self, block_size: int, kinds: tuple[str, ...] = ("mean",)) -> None:
        unknown = set(kinds) - set(STATISTICS)
        if unknown:
            raise ValueError(f"unknown block statistics {sorted(unknown)}")
        self.block_size = block_size
        self.kinds = kinds
        self.count = 0
        self.computed = 0  # block statistics computed from keys so far (each block once, unless truncated)
        self._stats: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nelement() * 4 for t in self._stats.values())

    @property
    def capacity(self) -> int:
        return next(iter(self._stats.values())).shape[2] if self._stats else 0

    def truncate(self, count: int) -> None:
        """Keep only the statistics of blocks ``0 .. count - 1`` (the owner vouches for their keys)."""
        self.count = max(0, min(self.count, count))

    def _reserve(self, keys: torch.Tensor, n: int) -> None:
        kv_heads, _, d = keys.shape
        capacity = self.capacity
        if n <= capacity and next(iter(self._stats.values())).shape[:2] == (kv_heads, d):
            return
        if capacity and next(iter(self._stats.values())).shape[:2] != (kv_heads, d):
            self.count = 0  # keys of another shape: nothing stored describes them
        new_capacity = max(n, 2 * capacity, 64)
        stats = {
            kind: torch.empty(kv_heads, d, new_capacity, dtype=torch.float32, device=keys.device) for kind in self.kinds
        }
        if self.count:
            for kind, old in self._stats.items():
                stats[kind][:, :, : self.count] = old[:, :, : self.count]
        self._stats = stats

    def update_all(self, keys: torch.Tensor, n_full: int) -> dict[str, torch.Tensor]:
        """Statistics of blocks ``0 .. n_full - 1`` for ``keys`` of shape ``(kv_heads, N, d)``.

        Returns ``(kv_heads, n_full, d)`` float32 views into the cache (valid until the next update), one per
        kind. The storage is ``(kv_heads, d, capacity)``, so a query against all blocks reads contiguous rows.
        Blocks already stored are trusted (see :meth:`truncate`), also those past ``n_full`` (kept for when the
        context grows back); only blocks ``count .. n_full - 1`` read keys.
        """
        if self.count < n_full:
            self._reserve(keys, n_full)
            store_statistics(keys, self.count, n_full, self.block_size, self._stats)
            self.computed += n_full - self.count
            self.count = n_full
        if not self._stats:
            empty = keys.new_zeros(keys.shape[0], 0, keys.shape[2], dtype=torch.float32)
            return {kind: empty for kind in self.kinds}
        return {kind: stored[:, :, :n_full].transpose(1, 2) for kind, stored in self._stats.items()}

    def storage(self, kind: str = "mean") -> torch.Tensor | None:
        """The raw ``(kv_heads, d, capacity)`` float32 storage of statistic ``kind`` (blocks ``0 .. count - 1``
        hold values; the block stride is 1), or ``None`` before anything was stored. For kernels that read the
        statistics in place; valid until the next update."""
        return self._stats.get(kind)

    def update(self, keys: torch.Tensor, n_full: int) -> torch.Tensor:
        """The first statistic (the centroids, by default) of blocks ``0 .. n_full - 1``; see :meth:`update_all`."""
        return self.update_all(keys, n_full)[self.kinds[0]]


BlockCentroids = BlockStatistics
"""The old name (it holds the blocks' minimum and maximum too, not only their centroids)."""
