"""Sparse decode attention, hooked into transformers through its front door.

This is the one module that knows about transformers' attention plumbing (DESIGN.md section 7). We register
one attention function under the name ``"sparsedecode"`` with ``AttentionInterface`` (and transformers'
SDPA mask builder under the same name with ``AttentionMaskInterface``, without which prefill that continues
a cache and padding masks silently break). The function is dense SDPA unless a :class:`SparseSession` that
owns the calling module is active in the current context (a ``contextvars.ContextVar``, so threads and
asyncio tasks do not see each other's sessions). Inside a session:

* prefill and any multi-token forward stay dense (SDPA);
* a decode step (one query token) with ``N <= effective support`` is dense SDPA, bit for bit;
* a longer decode step selects blocks from cached block centroids, gathers the kept keys and values
  (anchor + chosen blocks + window) and attends over those alone, in float32.

A session keeps per-layer state between calls (the selection being reused, the block-centroid cache, H2O's
attention history, the positions read). :class:`LayerState` says why that state can never describe keys that are
no longer in the cache, at a cost of O(1) per layer and step.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, Cache, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import kernels
from .centroids import BlockCentroids
from .config import SparseConfig
from .errors import SparseDecodeError
from .layout import BlockLayout, support_positions
from .selectors import causal_attention_received, choose_blocks, choose_positions, group_attention, token_index
from .selectors.h2o import H2O
from .selectors.select import BlockChoice, support_of
from .validate import check_config, check_model, check_sparse_attention, config_from_overrides

ATTENTION_NAME = "sparsedecode"

_ACTIVE: contextvars.ContextVar[dict[int, tuple[SparseSession, LayerState]] | None] = contextvars.ContextVar(
    "sparsedecode_active", default=None
)
_REGISTERED = False
_SWITCH_LOCK = threading.Lock()
_MODEL_USERS: dict[int, tuple[int, str]] = {}


@dataclass
class StepView:
    """What one sparse decode step of one layer read; handed to a session's observers (e.g. the audit).

    ``query`` is ``(query_heads, d)``, ``keys``/``values`` ``(kv_heads, N, d)`` (the whole cache, read-only),
    ``index``/``valid`` ``(kv_heads, S)`` the support (see :func:`~sparsedecode.layout.support_positions`),
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
    return tensor._base if tensor._base is not None else tensor


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
        a version counter (``torch.inference_mode``) must be the very tensor object marked.
        """
        root = self.root()
        if root is None or _root(keys) is not root or keys.storage_offset() != self.offset:
            return 0
        if keys.stride() != self.stride or (*keys.shape[:-2], keys.shape[-1]) != self.outer:
            return 0
        version = _version(keys)
        if version is None or self.version is None:
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

    **Why this state is never stale.** All of it is derived from the layer's cached keys at positions
    ``[0, seen)``. After every call the state marks the key tensor it was given (:class:`KeyMark`: its memory,
    layout and version counter). Every forward pass through the attention module first runs a pre-hook
    (:meth:`look`) that finds the same layer's key tensor in the cache *before* the cache appends the new tokens,
    and asks how many of its leading positions are provably the marked ones, unwritten since:
    ``unchanged``. The cache then appends the forward's tokens at ``start = N - q`` and leaves ``[0, start)``
    alone (the contract of every cache ``update``). So at the call, the keys at ``[0, keep)``, ``keep = min(
    unchanged, start, seen)``, are exactly those the state was derived from, and by induction over calls every
    statistic of a block inside ``[0, keep)``, every history or read entry below ``keep`` is right; everything at
    or past ``keep`` is dropped (:meth:`begin`). The reused selection is kept only by a decode step that continues
    the chain exactly: the previous call on this layer was a sparse decode step of this cache, ending at
    ``start`` (``keep == start == seen``). Hence:

    * a new prompt (a new cache, a reset cache, or a prefill from position 0) keeps nothing;
    * a crop or rollback (``DynamicCache.crop``, speculative decoding) keeps ``[0, start)`` and restarts the
      reuse chain;
    * dense steps (``N <= S``) end the chain: the first sparse step after them selects afresh;
    * the same cache continued without a crop keeps everything, with no key re-read.

    DynamicCache replaces its tensors on every append (``torch.cat``) and crops by slicing (a view of the same
    memory); :class:`~sparsedecode.cache.GrowingCache` writes in place (the version counter moves with each
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
    what lies past ``keep`` is recomputed: the statistics of the blocks past it, at the next sparse step.
    """

    layer: int
    centroids: BlockCentroids
    step: int = 0
    blocks: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    history: torch.Tensor | None = None
    history_complete: bool = True
    reads: torch.Tensor | None = None
    seen: int = 0
    chained: bool = False
    mark: KeyMark | None = None
    unchanged: int = 0
    rows: list[LayerState] | None = None
    pads: tuple[int, ...] | None = None
    rebuilt: bool = False
    """The cache holds keys of another shape than the attention is handed (multi-head latent attention caches a
    latent and rebuilds the keys at every step): nothing derived from them survives a step."""

    def look(self, cache: object) -> None:
        """Pre-hook half: how much of what this state describes ``cache`` still holds, before it appends."""
        self.unchanged, self.rebuilt = 0, False
        layers = getattr(cache, "layers", None)
        if self.mark is None or layers is None or self.layer >= len(layers):
            return
        keys = getattr(layers[self.layer], "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() == 4:
            self.unchanged = self.mark.unchanged_prefix(keys)
            self.rebuilt = (*keys.shape[:-2], keys.shape[-1]) != self.mark.outer

    def begin(self, start: int, q_len: int) -> int:
        """A forward of ``q_len`` tokens at positions ``start ..`` begins: drop what may be stale (see the class).

        Returns ``keep``, the number of leading positions whose derived state survives."""
        keep = min(self.unchanged, start, self.seen)
        self.unchanged = 0
        continues = q_len == 1 and self.chained and keep == start == self.seen
        if keep < self.seen:
            self.forget_from(keep)
        if start == 0:
            self.history_complete = True
        elif keep < start:  # positions [keep, start) were written by forwards this session did not see
            self.history_complete = False
        if not continues:
            self.step, self.blocks, self.keep, self.positions = 0, None, None, None
        self.seen, self.chained = keep, False
        return keep

    def end(self, keys: torch.Tensor, n: int, *, chained: bool = False) -> None:
        """The call is over: the state now describes the first ``n`` positions of ``keys`` ``(1, kv, >= n, d)``."""
        self.mark, self.seen, self.chained = KeyMark.of(keys, n), n, chained

    def end_row(self, n: int, *, chained: bool = False) -> None:
        """A batch row's call is over: as :meth:`end`, without a mark of its own. No pre-hook looks at a row: the
        batch's state proves what is unchanged and hands each row its share (``unchanged - pad``)."""
        self.seen, self.chained = n, chained

    def forget_from(self, keep: int) -> None:
        """Drop everything derived from positions ``>= keep``."""
        self.centroids.truncate((keep - 1) // self.centroids.block_size)
        if keep == 0:
            self.history, self.reads = None, None
        else:
            if self.history is not None:
                self.history[:, keep:] = 0
            if self.reads is not None:
                self.reads[:, keep:] = False
        self.seen = min(self.seen, keep)

    def forget(self) -> None:
        """Drop all state (the next forward starts from nothing)."""
        self.forget_from(0)
        self.step, self.blocks, self.keep, self.positions = 0, None, None, None
        self.mark, self.seen, self.chained, self.unchanged = None, 0, False, 0
        self.history_complete = True
        self.rows, self.pads = None, None

    def batch_rows(self, pads: tuple[int, ...]) -> list[LayerState]:
        """One state per sequence of a left-padded batch (row ``i`` starts at cache position ``pads[i]``).

        Each row state lives in its sequence's own coordinates (position 0 is its first real token) and holds what
        a batch-1 state holds: its own selection, reuse counter, centroids, H2O history and reads. Another batch
        size or other paddings mean other sequences: the rows start afresh.
        """
        if self.rows is None or self.pads != pads:
            kinds = self.centroids.kinds
            self.rows = [LayerState(self.layer, BlockCentroids(self.centroids.block_size, kinds)) for _ in pads]
            self.pads = pads
        return self.rows

    def add_attention(self, received: torch.Tensor) -> None:
        """Add attention received by positions ``[0, m)`` ``(kv, m)`` to the H2O history."""
        m = received.shape[1]
        self.history = _with_columns(self.history, received.shape[0], m, torch.float32, received.device)
        self.history[:, :m] += received

    def add_attention_at(self, index: torch.Tensor, weights: torch.Tensor, n: int) -> None:
        """Add attention ``weights`` ``(kv, S)`` received by positions ``index`` ``(kv, S)``, all ``< n``, to the H2O
        history."""
        self.history = _with_columns(self.history, index.shape[0], n, torch.float32, index.device)
        self.history.scatter_add_(1, index, weights.float())

    def history_until(self, n: int, kv_heads: int, device: torch.device | str) -> torch.Tensor:
        """The H2O history over positions ``[0, n)``: ``(kv, n)`` float32 (zeros where nothing was received)."""
        self.history = _with_columns(self.history, kv_heads, n, torch.float32, device)
        return self.history[:, :n]

    def note_positions(self, index: torch.Tensor, layout: BlockLayout, valid: torch.Tensor | None = None) -> None:
        """Remember which distant positions each KV head read: ``index`` ``(kv, S)`` (``valid`` masks it)."""
        self.reads = _with_columns(self.reads, index.shape[0], layout.n, torch.bool, index.device)
        distant = (index >= 1) & (index < layout.distant_end)
        if valid is not None:
            distant &= valid
        self.reads.scatter_(1, index.masked_fill(~distant, 0), True)
        self.reads[:, 0] = False

    def note_reads(self, blocks: torch.Tensor, layout: BlockLayout) -> None:
        """Remember the distant positions of the chosen ``blocks`` ``(kv, b)`` as read."""
        index, valid = support_positions(blocks, layout)
        self.note_positions(index, layout, valid)

    def note_all_distant(self, kv_heads: int, layout: BlockLayout, device: torch.device | str) -> None:
        """A dense step read every distant position ``[1, N - W)``."""
        self.reads = _with_columns(self.reads, kv_heads, layout.n, torch.bool, device)
        self.reads[:, 1 : layout.distant_end] = True


_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


def _cache_argument(args: tuple, kwargs: dict) -> object | None:
    for name in _CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return next((arg for arg in args if isinstance(arg, Cache)), None)


@dataclass
class SparseSession:
    """One activation of sparse decoding on one model; see :func:`sparse_decoding`.

    Attributes:
        config: the settings in force.
        sparse_steps / dense_steps: decode-step layer calls that ran sparse, or dense because
            ``N <= effective support`` (or the layer is a sliding-window layer).
        track_reads: record which distant positions each layer and KV head read (for
            :meth:`unique_distant_positions`); off by default to keep the decode step lean.
        observers: callables receiving a :class:`StepView` after every sparse step (the audit uses this;
            with none registered nothing beyond the support is ever read).
    """

    config: SparseConfig
    model: torch.nn.Module
    sparse_steps: int = 0
    dense_steps: int = 0
    track_reads: bool = False
    observers: list[Callable[[StepView], None]] = field(default_factory=list)
    layers: dict[int, LayerState] = field(default_factory=dict)
    sequence_steps: dict[int, list[int]] = field(default_factory=dict)
    """Per sequence of a batch: ``[sparse_steps, dense_steps]`` (the totals above count every sequence)."""
    extents: tuple | None = field(default=None, repr=False)
    sequence: int = field(default=0, repr=False)

    support_reads: dict[int, list] = field(default_factory=dict)
    """Per sequence: ``[total, count, min, max]`` of the positions each KV head read at a sparse step (recorded with
    ``track_reads``); an adaptive budget makes them vary."""

    def note_support(self, sequence: int, sizes: torch.Tensor) -> None:
        """Positions read by each KV head ``(kv,)`` at one sparse step of one layer of ``sequence``."""
        total, count, low, high = self.support_reads.get(sequence, (0, 0, None, None))
        values = [int(v) for v in sizes.tolist()]
        low = min(values) if low is None else min(low, *values)
        high = max(values) if high is None else max(high, *values)
        self.support_reads[sequence] = [total + sum(values), count + len(values), low, high]

    def support_read(self, sequence: int = 0) -> dict:
        """``support_read_mean / min / max``: positions a KV head read per sparse step (``None`` without any)."""
        total, count, low, high = self.support_reads.get(sequence, (0, 0, None, None))
        return {
            "support_read_mean": total / count if count else None,
            "support_read_min": low,
            "support_read_max": high,
        }

    def layer_state(self, module: torch.nn.Module) -> LayerState:
        layer = int(getattr(module, "layer_idx", 0) or 0)
        state = self.layers.get(layer)
        if state is None:
            kinds = self.config.selector.statistics or ("mean",)
            state = self.layers[layer] = LayerState(layer, BlockCentroids(self.config.block_size, kinds))
        return state

    def look(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of every attention module the session owns (see :meth:`LayerState.look`)."""
        active = _ACTIVE.get()
        entry = active.get(id(module)) if active else None
        if entry is not None and entry[0] is self:
            entry[1].look(_cache_argument(args, kwargs))

    def _states(self, sequence: int | None) -> list[LayerState]:
        states = [s for _, s in sorted(self.layers.items())]
        if sequence is None:
            return states
        return [s.rows[sequence] if s.rows is not None and sequence < len(s.rows) else s for s in states]

    def unique_distant_positions(self, sequence: int | None = None) -> torch.Tensor:
        """Distinct distant positions of the current sequence read so far, per (layer, KV head): ``(layers, kv)``.

        A position read at several steps (dense or sparse) counts once, so no entry exceeds ``N - W - 1``. In a
        batch, ``sequence`` names the sequence (its own positions).
        """
        rows = [s.reads.sum(dim=1).cpu() for s in self._states(sequence) if s.reads is not None]
        return torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.long)

    def centroid_bytes(self, sequence: int | None = None) -> int:
        """Bytes held by the block-centroid caches of all layers (of one sequence of a batch with ``sequence``;
        of every sequence without it)."""
        if sequence is not None:
            return sum(s.centroids.nbytes for s in self._states(sequence))
        return sum(s.centroids.nbytes + sum(r.centroids.nbytes for r in s.rows or ()) for s in self.layers.values())

    def attention_history(self) -> dict[int, torch.Tensor]:
        """H2O's history per layer ``(kv, N)``: what the session's forwards so far (a prefill) paid each position."""
        return {
            layer: s.history[:, : s.seen].clone()
            for layer, s in self.layers.items()
            if s.history is not None and s.history_complete
        }

    def adopt_history(self, cache: Cache, history: dict[int, torch.Tensor]) -> None:
        """Take ``history`` (from :meth:`attention_history` of a session that ran the same prefill) as H2O's history
        of the sequence ``cache`` holds now; the caller vouches that it holds that prefill. Other state is dropped.
        """
        for layer, received in history.items():
            state = self.layers.get(layer)
            length = cache.get_seq_length(layer)
            if state is None:
                continue
            if received.shape[1] != length:
                raise SparseDecodeError(
                    f"layer {layer}: the history covers {received.shape[1]} positions, the cache holds {length}"
                )
            keys = cache.layers[layer].keys
            state.forget()
            state.history = received.to(device=keys.device, dtype=torch.float32).clone()
            state.end(keys, length)

    def adopt_batch_history(self, cache: Cache, histories: list[dict[int, torch.Tensor]], pads: list[int]) -> None:
        """:meth:`adopt_history` for a left-padded batch: ``histories[i]`` is sequence ``i``'s (its own positions,
        from :func:`prefill_history` of its prompt alone), ``pads[i]`` where it starts in the cache."""
        pads = tuple(int(p) for p in pads)
        if len(pads) == 1 and pads[0] == 0:  # a batch of one runs the batch-1 path
            self.adopt_history(cache, histories[0])
            return
        for layer, state in self.layers.items():
            if not all(layer in h for h in histories):
                continue
            keys = cache.layers[layer].keys
            length = cache.get_seq_length(layer)
            state.forget()
            rows = state.batch_rows(pads)
            for i, (row, pad) in enumerate(zip(rows, pads)):
                received = histories[i][layer]
                if received.shape[1] != length - pad:
                    raise SparseDecodeError(
                        f"layer {layer}, sequence {i}: the history covers {received.shape[1]} positions, the cache "
                        f"holds {length - pad}"
                    )
                row.history = received.to(device=keys.device, dtype=torch.float32).clone()
                row.end_row(length - pad)
            state.end(keys, length)

    def reset(self) -> None:
        """Forget all per-generation state (selections, centroids, history, read counts)."""
        for state in self.layers.values():
            state.forget()


SHORT_FORWARD = 32
"""Multi-token forwards up to this many tokens inside a session (speculative verification) use
:func:`dense_short_forward`."""


def dense_short_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n: int, scaling: float | None
) -> torch.Tensor:
    """Exact causal dense attention of ``q`` new tokens over a cache of ``n`` positions, without ``repeat_kv``.

    transformers' SDPA path expands the keys and values of every KV head to all its query heads when a mask is
    present (any multi-token forward over a cache), copying the whole cache per layer; here the query heads of a
    group are stacked against their one KV head instead. Returns ``(1, q, query_heads, dv)`` in the query dtype
    (``dv`` the value head dim).
    """
    _, query_heads, q_len, d = query.shape
    kv_heads = key.shape[1]
    group = query_heads // kv_heads
    scale = scaling if scaling is not None else d**-0.5
    keys, values = key[0, :, :n].float(), value[0, :, :n].float()
    q = query[0].float().reshape(kv_heads, group * q_len, d)
    logits = torch.bmm(q, keys.transpose(1, 2)).mul_(scale).view(kv_heads, group, q_len, n)
    positions = torch.arange(n, device=key.device)
    future = positions > positions[n - q_len :].unsqueeze(1)  # key j is after query i's position
    logits.masked_fill_(future, float("-inf"))
    probs = torch.softmax(logits, dim=-1).view(kv_heads, group * q_len, n)
    out = torch.bmm(probs, values).view(query_heads, q_len, values.shape[-1])
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype)


def _context_length(key: torch.Tensor, kwargs: dict) -> int:
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.numel():
        return int(position_ids.reshape(-1)[-1]) + 1
    return key.shape[2]


UNSUPPORTED_ARGUMENTS = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
    "indices": "the model's own sparse-attention indices",
    "block_indices": "the model's own block-sparse indices",
}
"""Arguments some models pass to their attention function that change its result and that SDPA (the session's
dense forwards) and the sparse step would leave out: refused at the first attention call of a session."""


def sparse_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: dense SDPA, or sparse decode inside an active session."""
    active = _ACTIVE.get()
    entry = active.get(id(module)) if active else None
    if entry is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    session, state = entry
    for argument, meaning in UNSUPPORTED_ARGUMENTS.items():
        if kwargs.get(argument) is not None:
            raise SparseDecodeError(
                f"sparse decoding does not support {meaning} ({argument} in the attention call) yet"
            )
    q_len = query.shape[2]
    if query.shape[0] != 1 or (
        attention_mask is not None and _extents(session, attention_mask, key, q_len, kwargs)[1][0] > 0
    ):  # a batch, or one left-padded sequence: each sequence in its own coordinates, padding never read
        return _batch_forward(session, state, module, query, key, value, attention_mask, dropout, scaling, kwargs)
    if state.rows is not None:  # batch 1 after a batch: the rows described other sequences
        state.rows, state.pads = None, None
    n = _context_length(key, kwargs)
    sliding = kwargs.get("sliding_window")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    state.begin(n - q_len, q_len)
    h2o = session.config.selector.uses_history
    if q_len != 1:  # prefill, chunked prefill, speculative verification: dense
        if q_len <= SHORT_FORWARD and sliding is None:
            out = dense_short_forward(query, key, value, n, scaling)
        else:
            out = sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )[0]
        if h2o:
            _remember_attention(
                state, key, n, lambda: causal_attention_received(query[0], key[0, :, :n], n - q_len, scale)
            )
        state.end(key, n)
        return out, None
    cfg = session.config
    if n <= cfg.effective_support or (sliding is not None and n > sliding):
        session.dense_steps += 1
        if session.track_reads:
            state.note_all_distant(
                key.shape[1], BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size), key.device
            )
        if h2o:
            _remember_attention(state, key, n, lambda: group_attention(query[0, :, 0], key[0, :, :n], scale))
        state.end(key, n)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    session.sparse_steps += 1
    out = sparse_decode_step(session, state, query, key, value, n, scaling)
    state.end(key, n, chained=True)
    return out, None


def row_extents(attention_mask: torch.Tensor | None, key: torch.Tensor, kwargs: dict) -> tuple[int, tuple[int, ...]]:
    """Where each sequence of a batch lies in the cache: ``(n, pads)``, sequence ``i`` at positions ``[pads[i], n)``.

    Read from the attention mask's last query row (it sees every real key of its sequence): each sequence must
    attend to one contiguous run of positions ending at the current token, i.e. the batch is left-padded. Without
    a mask (no padding) every sequence starts at 0.
    """
    batch = key.shape[0]
    if attention_mask is None:
        return _context_length(key, kwargs), (0,) * batch
    last = attention_mask[..., -1, :] if attention_mask.dim() == 4 else attention_mask
    last = last.reshape(last.shape[0], -1)[:, -key.shape[2] :] if last.dim() > 2 else last
    valid = last if last.dtype == torch.bool else last == 0  # additive float masks: 0 where attended
    valid = valid.expand(batch, -1) if valid.shape[0] == 1 else valid
    counts = valid.sum(dim=-1)
    if bool((counts == 0).any()):
        raise SparseDecodeError("sparse decoding: a sequence of the batch attends to no position at all")
    columns = valid.shape[-1]
    first = valid.int().argmax(dim=-1)
    end = columns - valid.flip(-1).int().argmax(dim=-1)
    if not bool((end == end[0]).all()) or not bool((end - first == counts).all()):
        raise SparseDecodeError(
            "sparse decoding of a batch needs left padding: every sequence must attend to one contiguous run of "
            "positions ending at the current token"
        )
    return int(end[0]), tuple(int(p) for p in first.tolist())


def _extents(session, attention_mask, key, q_len, kwargs) -> tuple[int, tuple[int, ...]]:
    """:func:`row_extents`, computed once per forward: every layer sees the same mask and position ids (held in
    ``session.extents``, so no other object takes their ids); without a mask n comes from the position ids, which a
    fixed-size cache needs to tell steps apart."""
    position_ids, extents = kwargs.get("position_ids"), session.extents
    shape = (key.shape[2], q_len)
    if extents is not None and extents[0] == shape and extents[1] is attention_mask and extents[2] is position_ids:
        return extents[3]
    found = row_extents(attention_mask, key, kwargs)
    session.extents = (shape, attention_mask, position_ids, found)
    return found


def _batch_forward(session, state, module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """A forward of a batch: each sequence is handled as it would be alone, in its own coordinates.

    Sequence ``i`` occupies cache positions ``[pads[i], n)`` (:func:`row_extents`); its state is
    ``state.rows[i]`` (:meth:`LayerState.batch_rows`), whose position 0 is the sequence's first real token. The
    batch state proves what is unchanged (as for batch 1) and each row keeps what lies inside its own run. Multi-
    token forwards and decode steps where every sequence is dense run as one batched SDPA call with the mask
    (dense batched decoding, exactly); otherwise each sequence runs its own dense or sparse step over its own
    slice of the cache, so padding is never selected nor attended.
    """
    batch, _, q_len, _ = query.shape
    n, pads = _extents(session, attention_mask, key, q_len, kwargs)
    start = n - q_len
    keep = state.begin(start, q_len)
    rows = state.batch_rows(pads)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cfg = session.config
    sliding = kwargs.get("sliding_window")
    h2o = cfg.selector.uses_history

    def dense_all():
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )[0]

    if q_len != 1:
        out = dense_all()
        for i, (row, pad) in enumerate(zip(rows, pads)):
            row_start = max(start - pad, 0)
            row_q = n - pad - row_start
            if row_q <= 0:
                row.forget()
                continue
            row.unchanged = max(keep - pad, 0)
            row.begin(row_start, row_q)
            keys_i = key[i : i + 1, :, pad:]
            if h2o:
                q_i = query[i, :, q_len - row_q :]
                _remember_attention(
                    row,
                    keys_i,
                    n - pad,
                    functools.partial(causal_attention_received, q_i, keys_i[0, :, : n - pad], row_start, scale),
                )
            row.end_row(n - pad)
        state.end(key, n)
        return out, None
    lengths = [n - pad for pad in pads]
    dense_rows = [m <= cfg.effective_support or (sliding is not None and m > sliding) for m in lengths]
    all_dense = all(dense_rows)
    out = dense_all() if all_dense else query.new_empty(batch, 1, query.shape[1], value.shape[-1])
    sparse = []
    for i, (row, pad, m) in enumerate(zip(rows, pads, lengths)):
        row.unchanged = max(keep - pad, 0)
        row.begin(m - 1, 1)
        if not dense_rows[i]:
            sparse.append((i, row, pad, m))
            continue
        q_i, k_i, v_i = query[i : i + 1], key[i : i + 1, :, pad:], value[i : i + 1, :, pad:]
        session.dense_steps += 1
        session.sequence_steps.setdefault(i, [0, 0])[1] += 1
        if session.track_reads:
            row.note_all_distant(
                key.shape[1], BlockLayout(n=m, window=cfg.window, block_size=cfg.block_size), key.device
            )
        if h2o:
            _remember_attention(row, k_i, m, functools.partial(group_attention, q_i[0, :, 0], k_i[0, :, :m], scale))
        if not all_dense:
            out[i : i + 1] = sdpa_attention_forward(
                module, q_i, k_i[:, :, :m], v_i[:, :, :m], None, dropout=dropout, scaling=scaling, **kwargs
            )[0]
        row.end_row(m)
    if sparse and not _sparse_rows_in_one_call(session, sparse, query, key, value, out, scale):
        for i, row, pad, m in sparse:  # one sparse step per sequence, over its own slice of the cache
            k_i = key[i : i + 1, :, pad:]
            session.sparse_steps += 1
            session.sequence_steps.setdefault(i, [0, 0])[0] += 1
            session.sequence = i
            try:
                out[i : i + 1] = sparse_decode_step(
                    session, row, query[i : i + 1], k_i, value[i : i + 1, :, pad:], m, scaling
                )
            finally:
                session.sequence = 0
            row.end_row(m, chained=True)
    state.end(key, n)
    return out, None


def _sparse_rows_in_one_call(session, sparse, query, key, value, out, scale) -> bool:
    """The sparse steps of a batch's ``sparse`` rows ``(i, row state, pad, length)`` in one C kernel call, each
    written to ``out[i]``; ``False`` (nothing done) where that call cannot serve them.

    It serves block selectors under the C kernel without observers (they need a :class:`StepView` per sequence):
    mean-pooled selection happens inside the call, other block selectors select per sequence in torch first. The
    bookkeeping is :func:`sparse_decode_step`'s, per sequence: fresh selection at the first step of a chain and
    every ``reuse`` steps, the centroid cache extended by the blocks completed since, the reads noted, the step
    counted, the state marked; and the call scores and attends with the code of the single-sequence C calls, so
    every sequence gets the very blocks and output :func:`sparse_decode_step` gives it. Per sequence and layer the
    call reads the support's keys and values, ``S x kv x d x 2`` elements, plus ``n_full x kv x d`` float32
    centroids and the tail block's keys at a fresh step (docs/benchmarks.md, "Batches").
    """
    cfg = session.config
    if session.observers or cfg.token_level or cfg.selector.adaptive:
        return False
    q = query[:, :, 0, :]  # (batch, H, d)
    first, m = sparse[0][0], sparse[0][3]  # what the kernel needs of the tensors, all sequences alike
    layout = BlockLayout(n=m, window=cfg.window, block_size=cfg.block_size)
    if kernels.attention_kernel(cfg.kernel, q[first], key[first], value[first], layout) != "c":
        return False
    window, block, reuse = cfg.window, cfg.block_size, cfg.reuse
    mean_pooled = cfg.selector.kernel_scoring == "mean-dot"
    fresh = [row.step % reuse == 0 or (row.blocks is None and row.positions is None) for _, row, _, _ in sparse]
    selecting = [i for (i, *_), f in zip(sparse, fresh) if f] if mean_pooled else []
    if selecting:  # a non-finite query or key makes a score non-finite: the C call finds it and raises
        # run_selection's cap, b <= n_blocks (a sequence past the support always has more than cfg.blocks)
        b = min(cfg.blocks, *(-(-(max(n - window, 1) - 1) // block) for (*_, n), f in zip(sparse, fresh) if f))
        chosen = torch.empty(len(selecting), key.shape[1], b, dtype=torch.int64)
    calls, j = [], 0
    for (i, row, pad, m), f in zip(sparse, fresh):
        storage = None
        if f and mean_pooled:
            n_full = (max(m - window, 1) - 1) // block
            if row.centroids.count < n_full:  # what select_blocks' centroid update does, without the views
                row.centroids.update(key[i, :, pad:], n_full)
            storage = row.centroids.storage()
            row.blocks, j = chosen[j], j + 1
            blocks = row.blocks
        else:
            if f:
                layout = BlockLayout(n=m, window=window, block_size=block, layer=row.layer, scale=scale, seed=cfg.seed)
                choice = choose_blocks(
                    cfg.selector, cfg.blocks, row.centroids, q[i], key[i, :, pad:], layout, cfg.kernel
                )
                row.blocks = choice.blocks
            blocks = row.blocks.to(torch.int64).contiguous()  # as run_attention takes them
        calls.append((i, pad, m, storage, blocks, f and mean_pooled))
        row.step += 1
    if not q.is_contiguous():
        q = q.contiguous()
    kernels.cpu.run_step_batch(q, key, value, out.view(q.shape), calls, window, block, scale)
    for i, row, _pad, m in sparse:
        if session.track_reads:
            index, valid = support_positions(row.blocks, BlockLayout(n=m, window=window, block_size=block))
            row.note_positions(index, BlockLayout(n=m, window=window, block_size=block), valid)
            session.note_support(i, valid.sum(dim=1))
        session.sparse_steps += 1
        session.sequence_steps.setdefault(i, [0, 0])[0] += 1
        row.end_row(m, chained=True)
    return True


def _remember_attention(state: LayerState, key: torch.Tensor, n: int, received: Callable[[], torch.Tensor]) -> None:
    """Add a dense forward's attention to the H2O history where the key tensor holds every position."""
    if key.shape[2] >= n:
        state.add_attention(received())
    else:  # a sliding-window layer's cache keeps only its window: no history here
        state.history_complete = False


def _gather_support(cache: torch.Tensor, blocks: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Anchor, chosen full blocks and window of one layer's keys or values: ``(kv_heads, S, d)``.

    The anchor and the window are slices; the blocks are one gather over a ``(kv, blocks, B, d)`` view.
    """
    kv_heads, _, d = cache.shape
    block = layout.block_size
    full = cache[:, 1 : 1 + layout.n_full * block].reshape(kv_heads, layout.n_full, block, d)  # a view for KV caches
    picked = full.gather(1, blocks[:, :, None, None].expand(-1, -1, block, d)).view(
        kv_heads, blocks.shape[1] * block, d
    )
    return torch.cat([cache[:, :1], picked, cache[:, layout.distant_end : layout.n]], dim=1)


def attend_positions(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    scale: float,
    *,
    weights: bool = False,
    valid: torch.Tensor | None = None,
):
    """Attention over arbitrary positions ``index`` ``(kv, S)`` of each KV head (token-level selectors, adaptive
    budgets); ``valid`` ``(kv, S)`` masks positions out.

    Returns the output ``(query_heads, dv)`` in float32, ``dv`` the value head dim (which may differ from the key
    head dim); with ``weights=True`` also the attention probabilities summed over each group's query heads,
    ``(kv, S)`` (what H2O accumulates).
    """
    query_heads, d = q.shape
    kv_heads = keys.shape[0]
    kept_keys, kept_values = _gather_positions(keys, index), _gather_positions(values, index)
    qg = q.float().view(kv_heads, query_heads // kv_heads, d)
    if not weights:
        mask = None if valid is None else valid.unsqueeze(1)
        out = torch.nn.functional.scaled_dot_product_attention(qg, kept_keys, kept_values, attn_mask=mask, scale=scale)
        return out.reshape(query_heads, -1)
    probs = torch.softmax(torch.bmm(qg, kept_keys.transpose(1, 2)).mul_(scale), dim=-1)
    return torch.bmm(probs, kept_values).reshape(query_heads, -1), probs.sum(dim=1)


def _gather_positions(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index (kv, S)`` of each KV head of ``cache (kv, N, d)``: ``(kv, S, d)`` in float32."""
    return cache.gather(1, index.unsqueeze(-1).expand(-1, -1, cache.shape[-1])).float()


def attend_support(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    layout: BlockLayout,
    scale: float,
) -> torch.Tensor:
    """Attention half of a sparse step: gather anchor + blocks + window and attend over them alone (float32).

    Returns the output ``(query_heads, dv)`` in float32, ``dv`` the value head dim (which may differ from the key
    head dim). All query heads of a GQA group share the positions of their KV head. Positions are those of
    :func:`~sparsedecode.layout.support_positions`; ``blocks`` may come in any order (Triton's selection gives
    them best first).
    """
    query_heads, d = q.shape
    kv_heads = keys.shape[0]
    qg = q.float().view(kv_heads, query_heads // kv_heads, d)
    short_tail = blocks.shape[1] > 0 and layout.n_blocks > layout.n_full and bool((blocks == layout.n_blocks - 1).any())
    if short_tail:  # a chosen block is the short last one: gather by position and mask the padding
        index, valid = support_positions(blocks, layout)
        kept_keys, kept_values = _gather_positions(keys, index), _gather_positions(values, index)
        mask = valid.unsqueeze(1)
    else:
        kept_keys, kept_values = _gather_support(keys, blocks, layout), _gather_support(values, blocks, layout)
        kept_keys, kept_values, mask = kept_keys.float(), kept_values.float(), None
    out = torch.nn.functional.scaled_dot_product_attention(qg, kept_keys, kept_values, attn_mask=mask, scale=scale)
    return out.reshape(query_heads, -1)


def _attend_blocks(cfg, q, keys, values, blocks, layout, scale) -> torch.Tensor:
    """Attention over a block selector's support by the kernel :func:`sparsedecode.kernels.attention_kernel` picks
    for ``cfg.kernel`` (the torch path where no kernel can serve under ``auto``; an insisted-on kernel that cannot
    raises)."""
    kernel = kernels.attention_kernel(cfg.kernel, q, keys, values, layout)
    if kernel == "torch":
        return attend_support(q, keys, values, blocks, layout, scale)
    return kernels.attend(kernel, q, keys, values, blocks, layout, scale)


def _block_step(session, state, q, keys, values, layout, scale, fresh) -> torch.Tensor:
    """Select (when ``fresh``) and attend for a block selector; the selection lands in ``state.blocks`` / ``keep``.

    The C kernel takes the whole step in one call where it serves (a fixed budget): selection inside it for a
    selector whose scoring it implements (``kernel_scoring``), the given blocks otherwise. Elsewhere the kernel
    :func:`sparsedecode.kernels.attention_kernel` picks attends; an adaptive budget's support is gathered by
    position with its dropped blocks masked."""
    cfg, selector = session.config, session.config.selector
    one_call = not selector.adaptive and kernels.attention_kernel(cfg.kernel, q, keys, values, layout) == "c"
    if one_call and fresh and selector.kernel_scoring == "mean-dot":
        if state.centroids.count < layout.n_full:  # the blocks completed since the last step
            state.centroids.update(keys, layout.n_full)
        out, state.blocks = kernels.cpu.run_step(
            q, keys, values, state.centroids.storage(), None, layout, cfg.blocks, scale
        )
        state.keep = None
        return out
    if fresh:
        choice = choose_blocks(selector, cfg.blocks, state.centroids, q, keys, layout, cfg.kernel)
        state.blocks, state.keep = choice.blocks, choice.keep
    if one_call:
        out, state.blocks = kernels.cpu.run_step(q, keys, values, None, state.blocks, layout, cfg.blocks, scale)
        return out
    if state.keep is not None:
        index, valid = support_of(BlockChoice(state.blocks, state.keep), layout)
        return attend_positions(q, keys, values, index, scale, valid=valid)
    return _attend_blocks(cfg, q, keys, values, state.blocks, layout, scale)


def sparse_decode_step(
    session: SparseSession,
    state: LayerState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    n: int,
    scaling: float | None,
) -> torch.Tensor:
    """One sparse decode step of one layer: ``query (1, H, 1, d)``, ``key/value (1, KVH, >= n, d)``.

    Selects afresh at the first step of a chain of sparse steps and every ``reuse`` steps after it; otherwise
    reuses ``state``'s selection (the window still slides). ``state`` must describe these keys (the attention
    function sees to that, see :class:`LayerState`).
    """
    cfg = session.config
    q = query[0, :, 0, :]
    keys, values = key[0], value[0]
    query_heads, d = q.shape
    scale = scaling if scaling is not None else d**-0.5
    layout = BlockLayout(
        n=n, window=cfg.window, block_size=cfg.block_size, layer=state.layer, scale=scale, seed=cfg.seed
    )
    selector = cfg.selector
    h2o = selector.uses_history
    if h2o and not state.history_complete:
        if state.rebuilt:
            raise SparseDecodeError(
                f"{selector.spec()} needs the attention every position received since the prompt began, but "
                "this model's attention is handed keys rebuilt from its cache at every step (multi-head latent "
                "attention), so no history survives a step; use a block selector"
            )
        raise SparseDecodeError(
            f"{selector.spec()} needs the attention every position received since the prompt began, but this "
            "session did not see the forwards that filled part of the cache: run the prefill inside the "
            "sparse_decoding session, or give the session its history with session.adopt_history(cache, history)"
        )

    fresh = state.step % cfg.reuse == 0 or (state.blocks is None and state.positions is None)
    fresh = fresh or selector.reselects_every_step
    state.step += 1
    if cfg.token_level:
        if fresh:
            history = state.history_until(n, keys.shape[0], keys.device) if h2o else None  # earlier queries only
            state.positions = choose_positions(selector, cfg.distant_positions, q, keys, layout, history=history)
        index = token_index(state.positions, layout)  # reused distant positions, the window slides
        if h2o:  # H2O accumulates the attention the step computed: over its support, as with eviction
            out, received = attend_positions(q, keys, values, index, scale, weights=True)
            state.add_attention_at(index, received, n)
        else:
            out = attend_positions(q, keys, values, index, scale)
        valid = torch.ones_like(index, dtype=torch.bool)
        if session.track_reads:
            state.note_positions(index, layout)
            session.note_support(session.sequence, valid.sum(dim=1))
        blocks = None
    else:
        out = _block_step(session, state, q, keys, values, layout, scale, fresh)
        blocks = state.blocks
        if session.track_reads or session.observers:
            index, valid = support_of(BlockChoice(blocks, state.keep), layout)
        if session.track_reads:
            state.note_positions(index, layout, valid)
            session.note_support(session.sequence, valid.sum(dim=1))
    if session.observers:
        view = StepView(
            state.layer, state.step, q, keys, values, index, valid, out, scale, layout, blocks, session.sequence
        )
        for observe in session.observers:
            observe(view)
    if out.dtype != query.dtype:
        out = out.to(query.dtype)
    return out.view(1, 1, query_heads, -1)  # -1: the value head dim


def register() -> None:
    """Register the sparse attention function and its mask builder with transformers (idempotent)."""
    global _REGISTERED
    if not _REGISTERED:
        AttentionInterface.register(ATTENTION_NAME, sparse_attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _REGISTERED = True


def _switch_on(model: torch.nn.Module) -> None:
    with _SWITCH_LOCK:
        users, previous = _MODEL_USERS.get(id(model), (0, model.config._attn_implementation))
        if users == 0 and previous != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
            if model.config._attn_implementation != ATTENTION_NAME:
                raise SparseDecodeError(
                    f"{type(model).__name__} does not use transformers' attention interface; "
                    "sparse decoding cannot hook into it"
                )
        _MODEL_USERS[id(model)] = (users + 1, previous)


def _switch_off(model: torch.nn.Module) -> None:
    with _SWITCH_LOCK:
        users, previous = _MODEL_USERS[id(model)]
        if users == 1:
            del _MODEL_USERS[id(model)]
            if previous != ATTENTION_NAME:
                model.set_attn_implementation(previous)
        else:
            _MODEL_USERS[id(model)] = (users - 1, previous)


@contextlib.contextmanager
def sparse_decoding(model: torch.nn.Module, config: SparseConfig | None = None, **overrides) -> Iterator[SparseSession]:
    """Decode with sparse attention inside the ``with`` block; restore the model afterwards.

    ``config`` (or keyword overrides of :class:`SparseConfig` fields) sets the support. Prefill stays dense.
    Works with ``model.generate`` and with manual loops over a ``DynamicCache`` (or any cache), across prompts,
    crops and rollbacks: a forward pre-hook on each attention module (removed on exit) lets the session check the
    cache before every append, so its state never outlives the keys it describes (see :class:`LayerState`).
    Sessions are per context (thread / asyncio task); nested sessions on different models are independent.

    Example::

        cfg = SparseConfig(support=193)
        with sparse_decoding(model, cfg) as session:
            out = model.generate(input_ids, max_new_tokens=64, do_sample=False)
    """
    check_model(model, "sparse_decoding", generates=False)  # a session only hooks the attention layers
    if config is None:
        config = config_from_overrides(overrides)
    elif overrides:
        raise SparseDecodeError("pass either a SparseConfig or keyword overrides, not both")
    check_config(config, "sparse_decoding")
    check_sparse_attention(model, "sparse_decoding")
    register()
    session = SparseSession(config=config, model=model)
    modules = [module for module in model.modules() if hasattr(module, "layer_idx") and hasattr(module, "config")]
    if not modules:
        raise SparseDecodeError(f"{type(model).__name__} has no attention layers with a layer_idx to hook into")
    owned = {id(module): (session, session.layer_state(module)) for module in modules}
    _switch_on(model)
    hooks = [module.register_forward_pre_hook(session.look, with_kwargs=True) for module in modules]
    active = _ACTIVE.get() or {}
    token = _ACTIVE.set({**active, **owned})
    try:
        yield session
    finally:
        _ACTIVE.reset(token)
        for hook in hooks:
            hook.remove()
        _switch_off(model)


@contextlib.contextmanager
def dense_attention(model: torch.nn.Module) -> Iterator[None]:
    """Dense attention for ``model`` inside the block, even within a :func:`sparse_decoding` session on it.

    The library's dense passes (dense references, ``generate(mode="dense")``) run under it, so a session the caller
    has open does not make them sparse. Sessions on other models, and sessions opened inside the block, are
    unaffected."""
    active = _ACTIVE.get()
    if not active:
        yield
        return
    own = {id(module) for module in model.modules()}
    token = _ACTIVE.set({key: entry for key, entry in active.items() if key not in own} or None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


PREFILL_CHUNK = 1024
"""Tokens per forward of :func:`prefill_history` (the chunk :func:`~sparsedecode.compare.prefill` uses)."""


@torch.no_grad()
def prefill_history(model: torch.nn.Module, prompt_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """H2O's history of a prompt: per layer ``(kv_heads, P)``, the attention each position received from the
    prompt's queries during a dense prefill, summed over each GQA group.

    Runs one more dense prefill (into a scratch cache), for a cache that was prefilled outside any session: give
    the result to :meth:`SparseSession.adopt_history`. Attention probabilities are taken in bounded chunks.
    """
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    with sparse_decoding(model, SparseConfig(selector=H2O())) as recorder:
        for start in range(0, prompt_ids.shape[1], PREFILL_CHUNK):
            chunk = prompt_ids[:, start : start + PREFILL_CHUNK].to(device)
            model(input_ids=chunk, cache=cache, use_cache=True, logits_to_keep=1)
    return recorder.attention_history()
