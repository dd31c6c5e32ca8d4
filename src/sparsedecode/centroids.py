"""Incremental per-block key statistics (DESIGN.md section 1, "Centroid cache").

Keys never change once cached, so a statistic of a completed distant block (its mean key, the centroid; or its
per-channel minimum and maximum, for Quest) can be computed once and kept. Selection then reads ``N / B`` block
statistics instead of ``N`` keys. One :class:`BlockCentroids` serves one layer of one generation: it is built
lazily at the first sparse decode step after prefill (reading the prefix keys once) and extended by one block
every ``B`` tokens afterwards.

Staleness is detected rather than assumed away: every stored block carries a fingerprint (the float32 sum
of its last key). Because a key depends only on the tokens before it, a block whose last key still
matches is still valid; a new prompt, a cropped or rolled-back cache, or another sequence changes the
fingerprint of the last stored block, and the cache then drops every block from the first mismatch on.
"""

from __future__ import annotations

import torch

STATISTICS = ("mean", "min", "max")


def reduce_blocks(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """``(kv, blocks, B, d) -> (kv, blocks, d)`` float32 mean / min / max over each block."""
    if kind == "mean":
        return blocks.mean(dim=2)
    return blocks.amin(dim=2) if kind == "min" else blocks.amax(dim=2)


class BlockCentroids:
    """Float32 statistics of the completed distant blocks of one layer's keys, per KV head.

    ``kinds`` names the statistics kept (``("mean",)`` by default: the centroids). Memory per statistic:
    ``kv_heads * capacity * d`` float32 values, about ``1/B`` of a float32 key cache (``2/B`` of a
    half-precision one), plus one fingerprint per block. Capacity grows by doubling, so appends are amortised
    O(d) per token.
    """

    def __init__(self, block_size: int, kinds: tuple[str, ...] = ("mean",)) -> None:
        unknown = set(kinds) - set(STATISTICS)
        if unknown:
            raise ValueError(f"unknown block statistics {sorted(unknown)}")
        self.block_size = block_size
        self.kinds = kinds
        self.count = 0
        self._stats: dict[str, torch.Tensor] = {}
        self._prints: torch.Tensor | None = None
        self.rebuilds = 0

    @property
    def nbytes(self) -> int:
        if self._prints is None:
            return 0
        return sum(t.nelement() * 4 for t in self._stats.values()) + self._prints.nelement() * 4

    def _fingerprints(self, keys: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Float32 sum of the last key of blocks ``start .. stop - 1``: ``(kv_heads, stop - start)``."""
        block = self.block_size
        lasts = keys[:, block * (start + 1) : block * stop + 1 : block]
        return lasts.float().sum(dim=-1)

    def _drop_stale(self, keys: torch.Tensor, n_full: int) -> None:
        self.count = min(self.count, n_full)
        if self.count == 0:
            return
        last = self._fingerprints(keys, self.count - 1, self.count)
        if torch.equal(last, self._prints[:, self.count - 1 : self.count]):
            return
        same = (self._fingerprints(keys, 0, self.count) == self._prints[:, : self.count]).all(dim=0)
        mismatch = (~same).nonzero()
        self.count = int(mismatch[0]) if len(mismatch) else self.count
        self.rebuilds += 1

    def _reserve(self, keys: torch.Tensor, n: int) -> None:
        kv_heads, _, d = keys.shape
        capacity = 0 if self._prints is None else self._prints.shape[1]
        if n <= capacity and next(iter(self._stats.values())).shape[:2] == (kv_heads, d):
            return
        new_capacity = max(n, 2 * capacity, 64)
        prints = torch.empty(kv_heads, new_capacity, dtype=torch.float32, device=keys.device)
        stats = {
            kind: torch.empty(kv_heads, d, new_capacity, dtype=torch.float32, device=keys.device) for kind in self.kinds
        }
        if self.count:
            prints[:, : self.count] = self._prints[:, : self.count]
            for kind, old in self._stats.items():
                stats[kind][:, :, : self.count] = old[:, :, : self.count]
        self._stats, self._prints = stats, prints

    def update_all(self, keys: torch.Tensor, n_full: int, *, verify: bool = True) -> dict[str, torch.Tensor]:
        """Statistics of blocks ``0 .. n_full - 1`` for ``keys`` of shape ``(kv_heads, N, d)``.

        Returns ``(kv_heads, n_full, d)`` float32 views into the cache (valid until the next update), one per
        kind. The storage is ``(kv_heads, d, capacity)``, so a query against all blocks reads contiguous rows.
        ``verify=False`` skips the fingerprint check (for a step that directly follows the previous one).
        """
        if verify:
            self._drop_stale(keys, n_full)
        else:
            self.count = min(self.count, n_full)
        if self.count < n_full:
            self._reserve(keys, n_full)
            kv_heads, _, d = keys.shape
            block = self.block_size
            start, stop = 1 + self.count * block, 1 + n_full * block
            new = keys[:, start:stop].float().reshape(kv_heads, n_full - self.count, block, d)
            for kind, stored in self._stats.items():
                stored[:, :, self.count : n_full] = reduce_blocks(new, kind).transpose(1, 2)
            self._prints[:, self.count : n_full] = self._fingerprints(keys, self.count, n_full)
            self.count = n_full
        if self._prints is None:
            empty = keys.new_zeros(keys.shape[0], 0, keys.shape[2], dtype=torch.float32)
            return {kind: empty for kind in self.kinds}
        return {kind: stored[:, :, :n_full].transpose(1, 2) for kind, stored in self._stats.items()}

    def update(self, keys: torch.Tensor, n_full: int, *, verify: bool = True) -> torch.Tensor:
        """The first statistic (the centroids, by default) of blocks ``0 .. n_full - 1``; see :meth:`update_all`."""
        return self.update_all(keys, n_full, verify=verify)[self.kinds[0]]
