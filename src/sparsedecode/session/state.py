"""Per-layer state of a sparse session: what a step read (:class:`StepView`), where the keys it was derived from live
(:class:`KeyMark`), and the layer's selection, block statistics, H2O history and reads (:class:`LayerState`), with the
argument why that state is never stale."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from ..layout import BlockLayout
from ..selectors.statistics import BlockStatistics
from ..step import schedule
from .kv_cache import VIEW_ROOT


@dataclass
class StepView:
    """What one sparse decode step of one layer read; handed to a session's observers (e.g. the audit).

    ``query`` is ``(query_heads, d)``, ``keys``/``values`` ``(kv_heads, N, d)`` (the whole cache, read-only),
    ``index``/``valid`` ``(kv_heads, S)`` the support (see :func:`~sparsedecode.layout.support_positions`; its
    blocks, like ``blocks``, ascending except from the Triton kernel, which gives the same set best first),
    ``output`` ``(query_heads, dv)`` the sparse attention output in float32.
    """

    layer: int
    step: int
    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor
    output: torch.Tensor
    scaling: float
    layout: BlockLayout
    blocks: torch.Tensor | None
    sequence: int = 0
    """Which sequence of a batch the step belongs to (0 for batch 1); positions are the sequence's own."""


def _with_columns(
    table: torch.Tensor | None, rows: int, columns: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``table`` with at least ``columns`` columns: zero-filled, growing by doubling and keeping its contents."""
    have = 0 if table is None else table.shape[1]
    if table is not None and columns <= have:
        return table
    grown = torch.zeros(rows, max(columns, 2 * have), dtype=dtype, device=device)
    if have:
        grown[:, :have] = table
    return grown


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place write to it or to any view of its memory), or None
    for tensors made under ``torch.inference_mode``, which carry none."""
    return None if tensor.is_inference() else tensor._version


def _root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor owning ``tensor``'s memory: its ``_base``; under ``torch.inference_mode``, whose views keep none, the
    buffer a :class:`~sparsedecode.session.kv_cache.GrowingLayer` view names (else the tensor itself)."""
    if tensor._base is not None:
        return tensor._base
    return getattr(tensor, VIEW_ROOT, tensor)


@dataclass
class KeyMark:
    """Where the keys a layer's state was last derived from live, so that a later look can prove them unchanged.

    ``root`` is a weak reference to the tensor owning that memory (the key tensor, or the base it is a view of):
    while it lives no other tensor can own the same memory. ``tensor`` refers to the very key tensor object.
    """

    root: weakref.ref
    tensor: weakref.ref
    offset: int
    stride: tuple[int, ...]
    outer: tuple[int, ...]
    length: int
    version: int | None

    @classmethod
    def of(cls, keys: torch.Tensor, length: int) -> KeyMark:
        """Mark the first ``length`` positions of ``keys`` ``(batch, kv_heads, >= length, d)``."""
        outer = (*keys.shape[:-2], keys.shape[-1])
        root = weakref.ref(_root(keys))
        return cls(root, weakref.ref(keys), keys.storage_offset(), keys.stride(), outer, length, _version(keys))

    def unchanged_prefix(self, keys: torch.Tensor) -> int:
        """How many leading positions of ``keys`` are provably the marked ones, unwritten since (0: none).

        ``keys`` must live in the marked memory (same owner, offset, strides and non-sequence shape), so its
        position ``p < min(len, length)`` is the same memory as the marked position ``p``; and no write may have
        touched that memory since (the version counter is shared by a tensor and all its views). Tensors without
        a version counter (``torch.inference_mode``) must be the very tensor object marked, or a view of the same
        named buffer (a ``GrowingCache`` cropped, as lossless drafting crops every round), taken as unwritten by the
        class's assumption for that mode.
        """
        root = self.root()
        if root is None or _root(keys) is not root or keys.storage_offset() != self.offset:
            return 0
        if keys.stride() != self.stride or (*keys.shape[:-2], keys.shape[-1]) != self.outer:
            return 0
        version = _version(keys)
        if version is None and self.version is None:
            if keys is not self.tensor() and getattr(keys, VIEW_ROOT, None) is None:
                return 0
        elif version is None or self.version is None:
            if keys is not self.tensor():
                return 0
        elif version != self.version:
            return 0
        return min(keys.shape[-2], self.length)


@dataclass
class LayerState:
    """Per-layer state of one session: the selection being reused, block statistics, H2O history, reads.

    ``blocks`` (block selectors) or ``positions`` (token-level selectors) is the current selection, made at
    decode step ``step`` of the current chain of sparse decode steps (its reuse counter). ``history`` holds, per
    KV head and position, the attention that position received from every earlier query of the sequence that the
    session computed, summed over the group's query heads (H2O's accumulated attention; ``h2o`` sessions only).
    ``reads`` marks the distant positions each KV head has read (``track_reads``).

    **Why this state is never stale** is the schedule's argument (:mod:`sparsedecode.step.schedule`): a call keeps
    what was derived from positions ``[0, intact)`` and the reuse chain only where it continues it. What the session
    adds is the proof of ``intact``, since it does not see every write to the cache: after every call the state
    marks the key tensor it was given (:class:`KeyMark`: its memory, layout and version counter), and every forward
    through the attention module first runs a pre-hook (:meth:`look`) that finds the layer's key tensor in the cache
    *before* the cache appends, and asks how many leading positions are provably the marked ones, unwritten since:
    ``unchanged``. The cache appends at ``start = N - q`` and leaves ``[0, start)`` alone, so ``intact = min(
    unchanged, start, seen)`` positions are those the state was derived from (:meth:`begin`).

    DynamicCache replaces its tensors on every append (``torch.cat``) and crops by slicing (a view of the same
    memory); :class:`~sparsedecode.session.kv_cache.GrowingCache` writes in place (the version counter moves with each
    append); a StaticCache keeps one buffer. All three are recognised. What the argument assumes: a cache's
    ``update`` appends at ``start`` without touching ``[0, start)``; memory is written by ordinary torch
    operations (not through ``.data`` or foreign pointers); and, under ``torch.inference_mode`` (no version
    counters), nobody writes into a cache tensor in place between forwards.

    H2O across a crop: the history of the remaining positions keeps the attention that removed tokens paid them
    (undoing it would mean storing every step's attention). A forward the session did not see (a prefill outside
    the session) leaves H2O without history for those positions: ``history_complete`` turns false and an ``h2o``
    sparse step refuses to run (:meth:`SparseSession.adopt_history` supplies one).

    Cost per layer and decode step: the pre-hook and this bookkeeping are O(1) (a weak-reference lookup and a
    comparison of the tensor's offset, strides, shape and version counter; no key is read). After a change only
    what lies past ``intact`` is recomputed: the statistics of the blocks past it, at the next sparse step.
    """

    layer: int
    centroids: BlockStatistics
    step: int = 0
    blocks: torch.Tensor | None = None
    budget_mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    history: torch.Tensor | None = None
    history_complete: bool = True
    reads: torch.Tensor | None = None
    seen: int = 0
    mark: KeyMark | None = None
    unchanged: int = 0
    rows: list[LayerState] | None = None
    pads: tuple[int, ...] | None = None
    rebuilt: bool = False
    """The cache holds keys of another shape than the attention is handed (multi-head latent attention caches a
    latent and rebuilds the keys at every step): nothing derived from them survives a step."""
    grows: bool = False
    """The forward's cache layer holds exactly the positions written so far (a full-attention ``DynamicLayer``, such
    as a :class:`~sparsedecode.session.kv_cache.GrowingCache`'s): its key tensor's length is the context N, whatever
    the position ids say (restarted or shifted positions, multimodal RoPE); a fixed-size cache needs them."""

    def blocks_out(self, kv_heads: int, b: int) -> torch.Tensor:
        """A fresh ``(kv, b)`` int64 selection the C call writes into (see :mod:`sparsedecode.step.rows`)."""
        self.blocks, self.budget_mask = torch.empty(kv_heads, b, dtype=torch.int64), None
        return self.blocks

    def look(self, cache: object) -> None:
        """Pre-hook half: how much of what this state describes ``cache`` still holds, before it appends."""
        self.unchanged, self.rebuilt = 0, False
        layers = getattr(cache, "layers", None)
        self.grows = layers is not None and self.layer < len(layers) and _grows(layers[self.layer])
        if self.mark is None or layers is None or self.layer >= len(layers):
            return
        keys = getattr(layers[self.layer], "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() == 4:
            self.unchanged = self.mark.unchanged_prefix(keys)
            self.rebuilt = (*keys.shape[:-2], keys.shape[-1]) != self.mark.outer

    def unseen_forward(self, cache: object) -> None:
        """A forward this state's session does not see runs on ``cache``: where it holds the marked keys, its writes
        may go unproven (no version counter under ``torch.inference_mode``), so nothing is taken as proven. A forward
        on another cache (a library call's own) leaves the state alone."""
        layers = getattr(cache, "layers", None)
        if self.mark is None or layers is None or self.layer >= len(layers):
            return
        keys = getattr(layers[self.layer], "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() == 4 and self.mark.unchanged_prefix(keys):
            self.mark = None

    def begin(self, start: int, q_len: int) -> int:
        """A forward of ``q_len`` tokens at positions ``start ..`` begins: drop what may be stale (the schedule's
        :func:`~sparsedecode.step.schedule.after_write`, with ``intact`` proved as the class says).

        Returns ``intact``, the number of leading positions whose derived state survives."""
        intact = min(self.unchanged, start, self.seen)
        self.unchanged = 0
        count, self.step, _ = schedule.after_write(
            self.centroids.count, self.step, self.seen, start, start + q_len, intact, self.centroids.block_size
        )
        if intact < self.seen:
            self.forget_from(intact)
        self.centroids.truncate(count)
        if start == 0:
            self.history_complete = True
        elif intact < start:  # positions [intact, start) were written by forwards this session did not see
            self.history_complete = False
        if self.step == 0:  # no chain to continue: no selection to reuse
            self.blocks, self.budget_mask, self.positions = None, None, None
        self.seen = intact
        return intact

    def end(self, keys: torch.Tensor, n: int) -> None:
        """The call is over: the state now describes the first ``n`` positions of ``keys`` ``(batch, kv, >= n, d)``."""
        self.mark, self.seen = KeyMark.of(keys, n), n

    def end_row(self, n: int) -> None:
        """A row's call is over: it describes its sequence's first ``n`` positions. A row of a padded batch has no
        mark of its own (no pre-hook looks at it): the layer's state proves what is unchanged and hands each row its
        share (``unchanged - pad``)."""
        self.seen = n

    def forget_from(self, intact: int) -> None:
        """Drop everything derived from positions ``>= intact``."""
        self.centroids.truncate(schedule.kept_blocks(self.centroids.count, intact, self.centroids.block_size))
        if intact == 0:
            self.history, self.reads = None, None
        else:
            if self.history is not None:
                self.history[:, intact:] = 0
            if self.reads is not None:
                self.reads[:, intact:] = False
        self.seen = min(self.seen, intact)

    def forget(self) -> None:
        """Drop all state (the next forward starts from nothing)."""
        self.forget_from(0)
        self.step, self.blocks, self.budget_mask, self.positions = 0, None, None, None
        self.mark, self.seen, self.unchanged = None, 0, 0
        self.history_complete = True
        self.rows, self.pads = None, None

    def rows_for(self, pads: tuple[int, ...]) -> list[LayerState]:
        """The states of a forward's sequences: this state itself for one unpadded sequence (a batch of one), else
        :meth:`batch_rows`."""
        if pads == (0,):
            self.rows, self.pads = None, None  # after a batch: its rows described other sequences
            return [self]
        return self.batch_rows(pads)

    def batch_rows(self, pads: tuple[int, ...]) -> list[LayerState]:
        """One state per sequence of a left-padded batch (row ``i`` starts at cache position ``pads[i]``).

        Each row state lives in its sequence's own coordinates (position 0 is its first real token) and holds what
        a batch-1 state holds: its own selection, reuse counter, centroids, H2O history and reads. Another batch
        size or other paddings mean other sequences: the rows start afresh.
        """
        if self.rows is None or self.pads != pads:
            kinds = self.centroids.kinds
            self.rows = [LayerState(self.layer, BlockStatistics(self.centroids.block_size, kinds)) for _ in pads]
            self.pads = pads
        return self.rows

    def add_attention(self, received: torch.Tensor) -> None:
        """Add attention received by positions ``[0, m)`` ``(kv, m)`` to the H2O history (its values only: a history
        ranks positions, so it keeps no autograd graph of the forwards it came from)."""
        m = received.shape[1]
        self.history = _with_columns(self.history, received.shape[0], m, torch.float32, received.device)
        self.history[:, :m] += received.detach()

    def add_attention_at(self, index: torch.Tensor, weights: torch.Tensor, n: int) -> None:
        """Add attention ``weights`` ``(kv, S)`` received by positions ``index`` ``(kv, S)``, all ``< n``, to the H2O
        history."""
        self.history = _with_columns(self.history, index.shape[0], n, torch.float32, index.device)
        self.history.scatter_add_(1, index, weights.detach().float())

    def history_until(self, n: int, kv_heads: int, device: torch.device | str) -> torch.Tensor:
        """The H2O history over positions ``[0, n)``: ``(kv, n)`` float32 (zeros where nothing was received)."""
        self.history = _with_columns(self.history, kv_heads, n, torch.float32, device)
        return self.history[:, :n]

    def note_positions(
        self, index: torch.Tensor, layout: BlockLayout, valid: torch.Tensor | None = None, kv_heads: int | None = None
    ) -> None:
        """Remember which distant positions each KV head read: ``index`` ``(rows, S)`` (``valid`` masks it), a row per
        KV head, or per query head (``kv_heads`` given: row ``h`` reads KV head ``h // G``)."""
        kv_heads = kv_heads or index.shape[0]
        self.reads = _with_columns(self.reads, kv_heads, layout.n, torch.bool, index.device)
        distant = (index >= 1) & (index < layout.distant_end)
        if valid is not None:
            distant &= valid
        if index.shape[0] == kv_heads:
            self.reads.scatter_(1, index.masked_fill(~distant, 0), True)
        else:
            owner = (torch.arange(index.shape[0], device=index.device) // (index.shape[0] // kv_heads)).unsqueeze(1)
            self.reads[owner.expand_as(index)[distant], index[distant]] = True
        self.reads[:, 0] = False

    def note_all_distant(self, kv_heads: int, layout: BlockLayout, device: torch.device | str) -> None:
        """A dense step read every distant position ``[1, N - W)``."""
        self.reads = _with_columns(self.reads, kv_heads, layout.n, torch.bool, device)
        self.reads[:, 1 : layout.distant_end] = True


def _grows(layer: object) -> bool:
    """A cache layer whose key tensor holds exactly the positions written (see :attr:`LayerState.grows`)."""
    return isinstance(layer, DynamicLayer) and not getattr(layer, "is_sliding", False)
