"""A forward inside a session: every sequence of the batch (one sequence alone is a batch of one) handled in its own
coordinates, as it would be alone. Multi-token forwards are dense; a decode step is dense for the sequences whose
context fits the support and one sparse step (:func:`~sparsedecode.session.rows.sparse_rows`) for the others."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..errors import SparseDecodeError
from ..kernels.reference import SHORT_FORWARD, dense_short_forward
from ..layout import BlockLayout
from ..selectors import causal_attention_received, group_attention
from ..step import schedule
from .rows import sparse_rows
from .state import LayerState


def _context_length(key: torch.Tensor, kwargs: dict, grows: bool) -> int:
    position_ids = kwargs.get("position_ids")
    if not grows and isinstance(position_ids, torch.Tensor) and position_ids.numel():
        return int(position_ids.reshape(-1)[-1]) + 1
    return key.shape[2]


def row_extents(
    attention_mask: torch.Tensor | None, key: torch.Tensor, kwargs: dict, grows: bool = False
) -> tuple[int, tuple[int, ...]]:
    """Where each sequence of a batch lies in the cache: ``(n, pads)``, sequence ``i`` at positions ``[pads[i], n)``.

    Read from the attention mask's last query row (it sees every real key of its sequence): each sequence must
    attend to one contiguous run of positions ending at the current token, i.e. the batch is left-padded. Without
    a mask (no padding) every sequence starts at 0 and ends at the key tensor's end where the cache ``grows``
    (:attr:`~sparsedecode.session.state.LayerState.grows`), else after the last position id (a fixed-size cache).
    """
    batch = key.shape[0]
    if attention_mask is None:
        return _context_length(key, kwargs, grows), (0,) * batch
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


def layer_window(session, state: LayerState, kwargs: dict) -> int | None:
    """The layer's sliding window: the attention call's ``sliding_window``, else the one the model's config gives
    the layer (:meth:`~sparsedecode.session.session.SparseSession.layer_window`; Qwen2-MoE and PhiMoE pass none)."""
    sliding = kwargs.get("sliding_window")
    return session.layer_window(state.layer) if sliding is None else sliding


def past_window(lengths: list[int], kwargs: dict, sliding: int | None) -> list[bool]:
    """Which sequences a sliding-window layer (window ``sliding``) sees through its window only, for which its step
    is dense: those longer than the window. Such a layer's cache and mask hold the window alone (``lengths``, read
    from the mask, stop at the window), so a sequence's length comes from its position ids; without them a sequence
    that fills the window counts as past it."""
    if sliding is None:
        return [False] * len(lengths)
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.numel():
        last = position_ids[..., -1]
        last = last.reshape(-1, last.shape[-1]).amax(dim=0) if last.dim() > 1 else last.reshape(-1)
        if last.numel() in (1, len(lengths)):
            whole = (last + 1).expand(len(lengths)).tolist()
            return [w > sliding or w > m for w, m in zip(whole, lengths)]
    return [m >= sliding for m in lengths]


def _extents(session, attention_mask, key, q_len, kwargs, grows: bool) -> tuple[int, tuple[int, ...]]:
    """:func:`row_extents`, computed once per forward: every layer sees the same mask and position ids (held in
    ``session.extents``, so no other object takes their ids); without a mask n comes from a growing cache's keys,
    else from the position ids, which a fixed-size cache needs to tell steps apart."""
    position_ids, extents = kwargs.get("position_ids"), session.extents
    shape = (key.shape[2], q_len, grows)
    if extents is not None and extents[0] == shape and extents[1] is attention_mask and extents[2] is position_ids:
        return extents[3]
    found = row_extents(attention_mask, key, kwargs, grows)
    session.extents = (shape, attention_mask, position_ids, found)
    return found


def _remember_attention(state: LayerState, key: torch.Tensor, n: int, received: Callable[[], torch.Tensor]) -> None:
    """Add a dense forward's attention to the H2O history where the key tensor holds every position."""
    if key.shape[2] >= n:
        state.add_attention(received())
    else:  # a sliding-window layer's cache keeps only its window: no history here
        state.history_complete = False


def _enter(state: LayerState, row: LayerState, intact: int, pad: int, start: int, q_len: int) -> None:
    """A row's part of a forward of ``q_len`` tokens at ``start ..`` begins: the batch's state proved ``[0, intact)``
    unchanged and the row keeps its share of it. A sequence alone is its layer's own state, already begun."""
    if row is not state:
        row.unchanged = max(intact - pad, 0)
        row.begin(start, q_len)


def _dense_forward(state, rows, pads, query, key, n, intact, scale, h2o) -> None:
    """Each row's bookkeeping after a multi-token dense forward: what survives, H2O's history."""
    q_len = query.shape[2]
    start = n - q_len
    for i, (row, pad) in enumerate(zip(rows, pads)):
        row_start = max(start - pad, 0)
        row_q = n - pad - row_start
        if row_q <= 0:  # a left pad of this forward only: the row holds nothing yet
            row.forget()
            continue
        _enter(state, row, intact, pad, row_start, row_q)
        keys_i = key[i : i + 1, :, pad:]
        if h2o:
            q_i = query[i, :, q_len - row_q :]
            received = functools.partial(causal_attention_received, q_i, keys_i[0, :, : n - pad], row_start, scale)
            _remember_attention(row, keys_i, n - pad, received)
        row.end_row(n - pad)


def _decode(
    session, state, rows, pads, n, intact, scale, module, query, key, value, attention_mask, dropout, scaling, kwargs
):
    """A decode step of every row: one batched SDPA call where every row is dense (dense batched decoding,
    exactly), otherwise each dense row its own SDPA over its own slice and the sparse rows one sparse step."""
    cfg = session.config.for_layer(state.layer)
    h2o = cfg.selector.uses_history
    lengths = [n - pad for pad in pads]
    dense_layer = state.layer in cfg.dense_layers
    windowed = past_window(lengths, kwargs, layer_window(session, state, kwargs))
    dense_rows = [dense_layer or m <= cfg.effective_support or w for m, w in zip(lengths, windowed)]
    all_dense = all(dense_rows)
    if all_dense:
        out = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )[0]
    else:
        out = query.new_empty(query.shape[0], 1, query.shape[1], value.shape[-1])
    sparse = []
    for i, (row, pad, m) in enumerate(zip(rows, pads, lengths)):
        _enter(state, row, intact, pad, m - 1, 1)
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
        if h2o:  # past a sliding window the keys hold the window only: the history stops there
            whole = m + 1 if windowed[i] else m
            _remember_attention(row, k_i, whole, functools.partial(group_attention, q_i[0, :, 0], k_i[0, :, :m], scale))
        if not all_dense:
            out[i : i + 1] = sdpa_attention_forward(
                module, q_i, k_i[:, :, :m], v_i[:, :, :m], None, dropout=dropout, scaling=scaling, **kwargs
            )[0]
        _, row.step = schedule.decode_step(row.step, False, cfg.reuse, cfg.selector.reselects_every_step)
        row.end_row(m)
    if sparse:
        sparse_rows(session, sparse, query, key, value, out, scale)
    return out


def session_forward(session, state, module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """A forward of the session's layer ``state``: each sequence is handled as it would be alone, in its own
    coordinates.

    Sequence ``i`` occupies cache positions ``[pads[i], n)`` (:func:`row_extents`); its state is its own
    (:meth:`LayerState.rows_for`: the layer's state itself for one unpadded sequence, one row state per sequence of
    a padded batch, whose position 0 is the sequence's first real token). The layer's state proves what is unchanged
    and each row keeps what lies inside its own run. Multi-token forwards are dense (one SDPA call with the mask,
    or the exact short forward of one unpadded sequence), and so is a one-token forward inside
    :func:`~sparsedecode.step.schedule.dense_forwards`; a decode step is :func:`_decode`, so padding is never
    selected nor attended.
    """
    q_len = query.shape[2]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    n, pads = _extents(session, attention_mask, key, q_len, kwargs, state.grows)
    intact = state.begin(n - q_len, q_len)
    rows = state.rows_for(pads)
    if schedule.is_decode_step(q_len):
        out = _decode(
            session,
            state,
            rows,
            pads,
            n,
            intact,
            scale,
            module,
            query,
            key,
            value,
            attention_mask,
            dropout,
            scaling,
            kwargs,
        )
    else:
        if rows[0] is state and q_len <= SHORT_FORWARD and layer_window(session, state, kwargs) is None:
            out = dense_short_forward(query, key, value, n, scaling)
        else:
            out = sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )[0]
        _dense_forward(state, rows, pads, query, key, n, intact, scale, session.config.selector.uses_history)
    state.end(key, n)
    return out, None
