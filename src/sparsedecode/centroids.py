"""Incremental block-centroid cache (DESIGN.md section 1, "Centroid cache").

Keys never change once cached, so the mean key of a completed distant block can be computed once and kept.
Selection then reads ``N / B`` centroids instead of ``N`` keys. One :class:`BlockCentroids` serves one layer
of one generation: it is built lazily at the first sparse decode step after prefill (reading the prefix
keys once) and extended by one block every ``B`` tokens afterwards.

Staleness is detected rather than assumed away: every stored block carries a fingerprint (the float32 sum
of its last key). Because a key depends only on the tokens before it, a block whose last key still
matches is still valid; a new prompt, a cropped or rolled-back cache, or another sequence changes the
fingerprint of the last stored block, and the cache then drops every block from the first mismatch on.
"""

from __future__ import annotations

import torch


class BlockCentroids:
    """Float32 means of the completed distant blocks of one layer's keys, per KV head.

    Memory: ``kv_heads * capacity * (d + 1)`` float32 values, i.e. about ``1/B`` of a float32 key cache
    (``2/B`` of a half-precision one). Capacity grows by doubling, so appends are amortised O(d) per token.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.count = 0
        self._means_t: torch.Tensor | None = None
        self._prints: torch.Tensor | None = None
        self.rebuilds = 0

    @property
    def nbytes(self) -> int:
        if self._means_t is None:
            return 0
        return self._means_t.nelement() * 4 + self._prints.nelement() * 4

    def _fingerprints(self, keys: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Float32 sum of the last key of blocks ``start .. stop - 1``: ``(kv_heads, stop - start)``."""
        block = self.block_size
        lasts = keys[:, block * (start + 1) : block * stop + 1 : block]
        return lasts.float().sum(dim=-1)

    def _drop_stale(self, keys: torch.Tensor, n_full: int) -> None:
        self.count = min(self.count, n_full)
        if self.count == 0:
            return
        if torch.equal(
            self._fingerprints(keys, self.count - 1, self.count), self._prints[:, self.count - 1 : self.count]
        ):
            return
        same = (self._fingerprints(keys, 0, self.count) == self._prints[:, : self.count]).all(dim=0)
        mismatch = (~same).nonzero()
        self.count = int(mismatch[0]) if len(mismatch) else self.count
        self.rebuilds += 1

    def _reserve(self, keys: torch.Tensor, n: int) -> None:
        kv_heads, _, d = keys.shape
        capacity = 0 if self._means_t is None else self._means_t.shape[2]
        if n <= capacity and self._means_t.shape[:2] == (kv_heads, d):
            return
        new_capacity = max(n, 2 * capacity, 64)
        means_t = torch.empty(kv_heads, d, new_capacity, dtype=torch.float32, device=keys.device)
        prints = torch.empty(kv_heads, new_capacity, dtype=torch.float32, device=keys.device)
        if self.count:
            means_t[:, :, : self.count] = self._means_t[:, :, : self.count]
            prints[:, : self.count] = self._prints[:, : self.count]
        self._means_t, self._prints = means_t, prints

    def update(self, keys: torch.Tensor, n_full: int, *, verify: bool = True) -> torch.Tensor:
        """Centroids of blocks ``0 .. n_full - 1`` for ``keys`` of shape ``(kv_heads, N, d)``.

        Returns a ``(kv_heads, n_full, d)`` float32 view into the cache (valid until the next update). The
        storage is ``(kv_heads, d, capacity)``, so scoring a query against all centroids reads contiguous rows.
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
            self._means_t[:, :, self.count : n_full] = new.mean(dim=2).transpose(1, 2)
            self._prints[:, self.count : n_full] = self._fingerprints(keys, self.count, n_full)
            self.count = n_full
        if self._means_t is None:
            return keys.new_zeros(keys.shape[0], 0, keys.shape[2], dtype=torch.float32)
        return self._means_t[:, :, :n_full].transpose(1, 2)
