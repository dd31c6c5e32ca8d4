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
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import kernels
from .centroids import BlockCentroids
from .config import SparseConfig
from .errors import SparseDecodeError
from .layout import BlockLayout, support_positions
from .selectors import (
    STAT_KINDS,
    group_attention,
    select_blocks,
    select_positions,
    streaming_index,
    token_index,
)
from .validate import check_config, check_model, config_from_overrides

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


@dataclass
class LayerState:
    """Per-layer state of one session: block-statistics cache, reuse bookkeeping, H2O history, reads.

    ``blocks`` (block selectors) or ``positions`` (token-level selectors) is the current selection.
    """

    layer: int
    centroids: BlockCentroids
    step: int = 0
    last_n: int = -1
    blocks: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    accumulated: torch.Tensor | None = None
    read_lengths: torch.Tensor | None = None
    read_positions: torch.Tensor | None = None

    def note_positions(self, index: torch.Tensor, layout: BlockLayout) -> None:
        """Remember which distant positions each KV head read (token-level selectors)."""
        self.read_positions = _with_columns(self.read_positions, index.shape[0], layout.n, torch.bool, index.device)
        distant = (index >= 1) & (index < layout.distant_end)
        self.read_positions.scatter_(1, index.masked_fill(~distant, 0), True)
        self.read_positions[:, 0] = False

    def accumulate(self, weights: torch.Tensor) -> torch.Tensor:
        """Add this step's attention ``(kv, n)`` to the H2O history and return the history over ``[0, n)``."""
        n = weights.shape[1]
        self.accumulated = _with_columns(self.accumulated, weights.shape[0], n, torch.float32, weights.device)
        self.accumulated[:, :n] += weights
        return self.accumulated[:, :n]

    def note_reads(self, blocks: torch.Tensor, lengths: torch.Tensor) -> None:
        """Remember the longest extent of each distant block read so far, per KV head."""
        need = int(blocks.max()) + 1 if blocks.numel() else 0
        self.read_lengths = _with_columns(self.read_lengths, blocks.shape[0], need, torch.long)
        self.read_lengths.scatter_reduce_(1, blocks.cpu(), lengths.cpu(), reduce="amax")


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

    def layer_state(self, module: torch.nn.Module) -> LayerState:
        layer = int(getattr(module, "layer_idx", 0) or 0)
        state = self.layers.get(layer)
        if state is None:
            kinds = STAT_KINDS.get(self.config.selector, ("mean",))
            state = self.layers[layer] = LayerState(layer, BlockCentroids(self.config.block_size, kinds))
        return state

    def unique_distant_positions(self) -> torch.Tensor:
        """Distinct distant positions read so far, per (layer, KV head): ``(layers, kv_heads)`` long."""
        rows = [
            (s.read_lengths.sum(dim=1) if s.read_lengths is not None else 0)
            + (s.read_positions.sum(dim=1) if s.read_positions is not None else 0)
            for _, s in sorted(self.layers.items())
            if s.read_lengths is not None or s.read_positions is not None
        ]
        return torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.long)

    def centroid_bytes(self) -> int:
        """Bytes held by the block-centroid caches of all layers."""
        return sum(s.centroids.nbytes for s in self.layers.values())

    def reset(self) -> None:
        """Forget all per-generation state (centroids, reuse, read counts)."""
        self.layers.clear()


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
    if entry is not None and query.shape[2] != 1:
        entry[1].last_n = -1  # a multi-token forward (prefill, verification) breaks the chain of decode steps
        if query.shape[0] == 1 and query.shape[2] <= SHORT_FORWARD and kwargs.get("sliding_window") is None:
            return dense_short_forward(query, key, value, _context_length(key, kwargs), scaling), None
    if entry is None or query.shape[2] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    session, state = entry
    if query.shape[0] != 1:
        raise SparseDecodeError(f"sparse decoding supports batch size 1 only (got batch {query.shape[0]})")
    if kwargs.get("softcap") is not None:
        raise SparseDecodeError("sparse decoding does not support attention logit soft-capping yet")
    n = _context_length(key, kwargs)
    cfg = session.config
    sliding = kwargs.get("sliding_window")
    if n <= cfg.effective_support or (sliding is not None and n > sliding):
        session.dense_steps += 1
        layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size)
        if session.track_reads and layout.n_blocks:
            every = torch.arange(layout.n_blocks).expand(key.shape[1], -1)
            state.note_reads(every, layout.block_lengths(every))
        state.last_n = n
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    session.sparse_steps += 1
    return sparse_decode_step(session, state, query, key, value, n, scaling), None


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


def attend_positions(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, index: torch.Tensor, scale: float):
    """Attention over arbitrary positions ``index`` ``(kv, S)`` of each KV head (token-level selectors).

    Returns ``(query_heads, dv)`` float32, ``dv`` the value head dim (which may differ from the key head dim).
    """
    query_heads, d = q.shape
    kv_heads = keys.shape[0]
    kept_keys, kept_values = _gather_positions(keys, index), _gather_positions(values, index)
    qg = q.float().view(kv_heads, query_heads // kv_heads, d)
    return torch.nn.functional.scaled_dot_product_attention(qg, kept_keys, kept_values, scale=scale).reshape(
        query_heads, -1
    )


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


def sparse_decode_step(
    session: SparseSession,
    state: LayerState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    n: int,
    scaling: float | None,
) -> torch.Tensor:
    """One sparse decode step of one layer: ``query (1, H, 1, d)``, ``key/value (1, KVH, >= n, d)``."""
    cfg = session.config
    q = query[0, :, 0, :]
    keys, values = key[0], value[0]
    query_heads, d = q.shape
    scale = scaling if scaling is not None else d**-0.5
    layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size)

    follows = n == state.last_n + 1  # the previous call on this layer was the decode step at n - 1
    if not follows:
        state.step, state.blocks, state.positions, state.accumulated = 0, None, None, None
    fresh = state.step % cfg.reuse == 0 or (state.blocks is None and state.positions is None)
    if cfg.selector == "h2o":  # the history gathers every decode step's attention, reused or not
        history = state.accumulate(group_attention(q, keys[:, :n], scale))
    if fresh and cfg.token_level:
        index = select_positions(
            cfg, q, keys, layout, scale=scale, accumulated=history if cfg.selector == "h2o" else None
        )
        state.positions = index[:, 1 : 1 + cfg.distant_positions]
    elif fresh:
        state.blocks = select_blocks(
            cfg, state.centroids, q, keys, layout, scale=scale, salt=state.layer, verify=not follows
        )
    state.step += 1
    state.last_n = n

    blocks = state.blocks
    if cfg.selector == "streaming":
        index = streaming_index(keys.shape[0], n, cfg.support, device=keys.device)
    elif cfg.token_level:
        index = token_index(state.positions, layout)  # reused distant positions, the window slides
    if cfg.token_level:
        out = attend_positions(q, keys, values, index, scale)
        valid = torch.ones_like(index, dtype=torch.bool)
        if session.track_reads:
            state.note_positions(index, layout)
    else:
        out = _attend_blocks(cfg, q, keys, values, blocks, layout, scale)
        if session.track_reads:
            state.note_reads(blocks, layout.block_lengths(blocks))
    if session.observers:
        if blocks is not None:
            index, valid = support_positions(blocks, layout)
        view = StepView(state.layer, state.step, q, keys, values, index, valid, out, scale, layout, blocks)
        for observe in session.observers:
            observe(view)
    return out.to(query.dtype).view(1, 1, query_heads, -1)  # -1: the value head dim


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
    Works with ``model.generate`` and with manual loops over a ``DynamicCache``. Sessions are per context
    (thread / asyncio task); nested sessions on different models are independent.

    Example::

        cfg = SparseConfig(support=193)
        with sparse_decoding(model, cfg) as session:
            out = model.generate(input_ids, max_new_tokens=64, do_sample=False)
    """
    check_model(model, "sparse_decoding")
    if config is None:
        config = config_from_overrides(overrides)
    elif overrides:
        raise SparseDecodeError("pass either a SparseConfig or keyword overrides, not both")
    check_config(config, "sparse_decoding")
    register()
    session = SparseSession(config=config, model=model)
    owned = {
        id(module): (session, session.layer_state(module))
        for module in model.modules()
        if hasattr(module, "layer_idx") and hasattr(module, "config")
    }
    if not owned:
        raise SparseDecodeError(f"{type(model).__name__} has no attention layers with a layer_idx to hook into")
    _switch_on(model)
    active = _ACTIVE.get() or {}
    token = _ACTIVE.set({**active, **owned})
    try:
        yield session
    finally:
        _ACTIVE.reset(token)
        _switch_off(model)
