"""vLLM's paged KV cache as the sparse step reads it: positions through a sequence's block table, and block statistics
kept per physical page. Pure torch (no vLLM import), so the tests build pages by hand.

**The cache.** One layer's cache is ``(pages, kv_heads, P, 2 d)``, ``P`` positions a page. In the layout of vLLM's
CPU kernels for the ``vec`` instruction sets (the one :mod:`.backend` asks for), a page holds per KV head its keys
transposed, ``(d, P)``, then its values, ``(P, d)``. Position ``p`` of a sequence lies in page ``table[p // P]`` at
offset ``p % P``; a step gathers its support's rows from there and copies nothing else.

**Block statistics per page.** Block ``j`` covers positions ``[1 + jB, 1 + (j + 1)B)`` (the anchor is position 0), so
with ``P`` a multiple of ``B`` it is the *piece* ``[jB + 1, (j + 1)B)`` of the page-aligned chunk ``[jB, (j + 1)B)``
plus the first position of the next chunk, which may lie in another page. A page keeps each of its chunks' piece
statistics (sum, minimum, maximum over ``B - 1`` keys) and its first key; a block's statistic combines its piece with
the next chunk's first key, found through the sequence's own table. Every kept number is thus a function of one page's
own keys: a page another sequence shares through vLLM's prefix cache carries the same keys at the same positions, and a
page vLLM frees and hands to another sequence has each piece recomputed when its last position is written again
(:meth:`PageStatistics.refresh`, after every write). A block is only ever chosen once complete (it ends before the
window), when every position of its piece has been written by this sequence and its piece recomputed: no selection reads
statistics of another sequence's keys. The piece's sum plus one key, divided by ``B``, is the block's mean in another
order of additions than :func:`~sparsedecode.selectors.statistics.reduce_blocks`'s (the last bits may differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import SparseDecodeError
from ...kernels.cpu.paged import paged_refusal
from ...layout import BlockLayout
from ...selectors.statistics import reduce_blocks

FEW = 256
"""Slot mappings up to this long (decode steps) are filtered on the host, where a few tensor operations cost more."""


@dataclass(frozen=True)
class PagedCache:
    """One layer's cache viewed as keys ``(pages, kv, d, P)`` and values ``(pages, kv, P, d)`` (no copy)."""

    keys: torch.Tensor
    values: torch.Tensor
    raw: torch.Tensor | None = None
    """The cache tensor itself, for the C kernel (``None``: torch reads the views)."""

    @classmethod
    def of(cls, kv_cache: torch.Tensor, kernel: bool = True) -> PagedCache:
        pages, kv_heads, page, width = kv_cache.shape
        d = width // 2
        flat = kv_cache.view(pages, kv_heads, page * width)
        keys = flat[:, :, : page * d].view(pages, kv_heads, d, page)
        values = flat[:, :, page * d :].view(pages, kv_heads, page, d)
        return cls(keys, values, kv_cache if kernel else None)

    @classmethod
    def of_split(cls, key_cache: torch.Tensor, value_cache: torch.Tensor) -> PagedCache:
        """The cache of vLLM's CUDA backends, keys and values apart, each ``(pages, P, kv, d)`` (views, no copy; the
        C kernel does not read this layout)."""
        return cls(key_cache.permute(0, 2, 3, 1), value_cache.permute(0, 2, 1, 3))

    @property
    def page_size(self) -> int:
        return self.keys.shape[-1]

    def kernel_serves(self, queries: torch.Tensor) -> bool:
        """Whether the C kernel reads these pages in place (``kernels/cpu/csrc/paged.h``) for ``queries``."""
        return self.raw is not None and paged_refusal(queries, self.raw) is None

    def slots(self, table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page, offset)`` of ``positions`` (any shape) of the sequence whose block table is ``table``; or, with
        tables ``(R, width)``, of positions ``(R, ...)``, row ``r`` through table ``r``."""
        page = self.page_size
        if table.dim() == 1:
            return table[positions // page].long(), positions % page
        return table.long().gather(1, (positions // page).flatten(1)).view_as(positions), positions % page

    def gather(self, table: torch.Tensor, index: torch.Tensor, heads: torch.Tensor):
        """Keys and values at positions ``index (rows, S)``, row ``r`` from KV head ``heads[r]``: two ``(rows, S,
        d)`` tensors, only the positions read copied; with tables ``(R, width)``, ``index (R, rows, S)`` and ``(R,
        rows, S, d)``."""
        page, offset = self.slots(table, index)
        head = heads.unsqueeze(-1)
        return self.keys[page, head, :, offset], self.values[page, head, offset]

    def positions(self, table: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Keys of positions ``[start, stop)`` of every KV head, ``(kv, stop - start, d)`` (a copy: for selectors that
        read keys, and the short last block)."""
        page, offset = self.slots(table, torch.arange(start, stop, device=table.device))
        return self.keys[page, :, :, offset].permute(1, 0, 2)


def check_page_size(page: int, block: int) -> None:
    """One line if vLLM's pages of ``page`` positions do not hold whole blocks of ``block``."""
    if page % block:
        raise SparseDecodeError(
            f"vLLM's pages hold {page} positions, not a multiple of the block size {block}: choose a block size "
            f"that divides {page} (or a --block-size for vLLM that is a multiple of {block})"
        )


class PageStatistics:
    """Per physical page and chunk, the statistics of each chunk's piece (see the module): ``(pages, kv, P / B, d)``
    float32 per kind, for one layer's cache."""

    def __init__(self, cache: PagedCache, block: int, kinds: tuple[str, ...]) -> None:
        pages, kv_heads, d, page = cache.keys.shape
        check_page_size(page, block)
        self.cache, self.block, self.kinds = cache, block, kinds
        self.pieces = {kind: cache.keys.new_zeros(pages, kv_heads, page // block, d, dtype=torch.float32)
                       for kind in kinds}  # fmt: skip
        self.firsts = cache.keys.new_zeros(pages, kv_heads, page // block, d, dtype=torch.float32)
        """Each chunk's first key, float32: the last key of the block before it (read where the pages are)."""

    def refresh(self, slots: torch.Tensor) -> None:
        """Keep the pages' numbers for the positions ``slots`` wrote (vLLM's slot mapping of a forward, ``page * P +
        offset``; negative entries are padding): a chunk's first key, copied when it is written, and a piece,
        recomputed from the page when its last position is written. A sequence writes its positions in order (prefill
        chunks, then one token a step), so by then every position of the piece holds this sequence's key; a piece
        never completed is never read (its block is not complete either)."""
        block, per_page = self.block, self.cache.page_size // self.block
        if slots.numel() <= FEW:  # decode steps: most write no chunk's first or last position
            few = [s for s in slots.tolist() if s >= 0 and s % block in (0, block - 1)]
            if not few:
                return
            slots = torch.tensor(few, dtype=torch.long)
        written = slots[slots >= 0].long()
        first = written[written % block == 0]
        if first.numel():
            pages, chunk = (first // block) // per_page, (first // block) % per_page
            self.firsts[pages, :, chunk] = self.cache.keys[pages, :, :, chunk * block].float()
        done = written[written % block == block - 1]
        if done.numel() == 0:
            return
        chunks = done // block  # global chunk ids: page * (P / B) + chunk
        pages, chunk = chunks // per_page, chunks % per_page
        offsets = chunk.unsqueeze(1) * block + torch.arange(1, block, device=slots.device)  # (chunks, B - 1)
        keys = self.cache.keys[pages.unsqueeze(1), :, :, offsets].float()  # (chunks, B - 1, kv, d)
        for kind in self.kinds:
            target = self.pieces[kind]
            if kind == "mean":
                target[pages, :, chunk] = keys.sum(dim=1)
            elif keys.shape[1] == 0:  # blocks of one key: the piece holds none, the block is its next key
                target[pages, :, chunk] = float("inf") if kind == "min" else float("-inf")
            else:
                target[pages, :, chunk] = keys.amin(dim=1) if kind == "min" else keys.amax(dim=1)

    def blocks(self, table: torch.Tensor, layout: BlockLayout) -> dict[str, torch.Tensor]:
        """Every distant block's statistics ``(kv, n_blocks, d)`` float32 for the sequence of ``table``: the complete
        blocks from their pieces and next keys, the short last block reduced from its keys."""
        block, full = self.block, layout.n_full
        starts = torch.arange(full, device=table.device) * block  # chunk j starts at jB
        page, offset = self.cache.slots(table, starts)
        chunk = offset // block
        nxt_page, nxt_offset = self.cache.slots(table, starts + block)
        nxt = self.firsts[nxt_page, :, nxt_offset // block].permute(1, 0, 2)  # (kv, full, d)
        out = {}
        for kind in self.kinds:
            piece = self.pieces[kind][page, :, chunk].permute(1, 0, 2)
            if kind == "mean":
                out[kind] = (piece + nxt) / block
            else:
                out[kind] = torch.minimum(piece, nxt) if kind == "min" else torch.maximum(piece, nxt)
        if layout.n_blocks > full:
            tail = self.cache.positions(table, 1 + full * block, layout.distant_end).float().unsqueeze(1)
            out = {kind: torch.cat([out[kind], reduce_blocks(tail, kind)], dim=1) for kind in self.kinds}
        return out


def attend_rows(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid, scale: float) -> torch.Tensor:
    """Attention of a batch of sparse rows over their gathered supports, float32: ``queries (R, rows, G, d)``,
    ``keys``/``values (R, rows, S, d)``, ``valid (R, rows, S)`` or ``None``; returns ``(R, rows * G, dv)``."""
    mask = None if valid is None else valid.unsqueeze(2)
    out = torch.nn.functional.scaled_dot_product_attention(
        queries.float(), keys.float(), values.float(), attn_mask=mask, scale=scale
    )
    return out.flatten(1, 2)
