"""The session's sparse decode step of one layer over a batch of rows: every sequence of a forward that decodes
sparsely, each in its own coordinates (a sequence alone is a batch of one row), over the session's
:class:`~sparsedecode.session.state.LayerState` rows. The step itself is :mod:`sparsedecode.step`'s, the same for
the compiled op:

1. :func:`~sparsedecode.step.plan.plan_step` decides, once per session and kind of tensors (once per layer call on
   CUDA), what serves the rows (``session.plan``, where set, serves every step instead: tests compare the routes so);
2. each row selects afresh when its schedule says so (:func:`~sparsedecode.step.schedule.decode_step`), or reuses
   its selection, the window still sliding;
3. attention over each row's support (:func:`~sparsedecode.step.rows.one_call` for all rows, or per row);
4. the session's bookkeeping per row: reads, support sizes, H2O's history, observers, step counts.
"""

from __future__ import annotations

import torch

from ..config import SparseConfig
from ..errors import SparseDecodeError
from ..layout import BlockLayout
from ..step import schedule
from ..step.plan import StepPlan, plan_step
from ..step.rows import attend_row, one_call, select_row, support, union_sizes
from .session import SparseSession
from .state import LayerState, StepView

Row = tuple[int, LayerState, int, int]
"""A sparse row of a forward: ``(sequence, state, pad, n)``, sequence ``sequence`` of the batch at cache positions
``[pad, pad + n)``, its state in its own coordinates."""

__all__ = ["Row", "StepPlan", "plan_step", "sparse_decode_step", "sparse_rows"]


def _check_history(selector, state: LayerState) -> None:
    if state.history_complete:
        return
    needs = f"{selector.spec()} needs the attention every position received since the prompt began, but "
    if state.rebuilt:
        raise SparseDecodeError(
            needs + "this model's attention is handed keys rebuilt from its cache at every step (multi-head latent "
            "attention), so no history survives a step; use a block selector"
        )
    raise SparseDecodeError(
        needs + "this session did not see the forwards that filled part of the cache, or the cache was reordered "
        "(beam search reorders it at every step, a history it cannot follow), or a sliding-window layer shifted a "
        "padded batch's cache (decode its prompts one at a time): run the prefill inside the "
        "sparse_decoding session, or give the session its history with session.adopt_history(cache, history); "
        "beam search needs another selector"
    )


def _fresh(cfg: SparseConfig, state: LayerState) -> bool:
    """Whether a row selects afresh at this sparse step, which it counts (the schedule's ``decode_step``)."""
    fresh, state.step = schedule.decode_step(state.step, True, cfg.reuse, cfg.selector.reselects_every_step)
    return fresh


def _row(cfg, plan, state, q, keys, values, layout, fresh):
    """One row's step outside the one C call: ``(out, index, valid)`` (``index`` None for a block support, derived
    only where someone reads it). H2O accumulates the attention the step computed, over its support."""
    h2o = cfg.selector.uses_history
    if fresh:
        history = state.history_until(layout.n, keys.shape[0], keys.device) if h2o else None  # earlier queries only
        select_row(cfg, plan, state, q, keys, layout, history)
    if h2o:
        out, index, received, valid = attend_row(cfg, plan, state, q, keys, values, layout, weights=True)
        state.add_attention_at(index, received, layout.n)
        return out, index, valid
    return attend_row(cfg, plan, state, q, keys, values, layout), None, None


def sparse_rows(
    session: SparseSession,
    rows: list[Row],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """The sparse decode step of ``rows`` (:data:`Row`) of one layer call, each written to ``out[sequence]``.

    ``query (batch, H, 1, d)``, ``key``/``value (batch, kv, >= pad + n, d)``, ``out (batch, 1, H, dv)`` in the
    query dtype. Every state must describe its row's keys (the attention function sees to that, see
    :class:`LayerState`).
    """
    cfg = session.config.for_layer(rows[0][1].layer)  # a layer's rows: one layer's configuration
    selector = cfg.selector
    q = query[:, :, 0, :]  # (batch, H, d)
    layouts = {
        i: BlockLayout(
            n=m,
            window=cfg.window,
            block_size=cfg.block_size,
            layer=state.layer,
            scale=scale,
            seed=cfg.seed,
            distant=cfg.distant_positions,
        )  # fmt: skip
        for i, state, _, m in rows
    }
    i, _, pad, _ = max(rows, key=lambda r: r[3]) if len(rows) > 1 else rows[0]
    plan = session.plan or plan_step(cfg, q[i], key[i, :, pad:], value[i, :, pad:], layouts[i], session.plans)
    if selector.uses_history:
        for _, state, _, _ in rows:
            _check_history(selector, state)
    fresh = [_fresh(cfg, state) for _, state, _, _ in rows]
    if plan.one_call:
        if not q.is_contiguous():
            q = q.contiguous()
        # the C call writes float32: into ``out`` itself when it is float32, else into a buffer copied row by row
        direct = out.dtype == torch.float32
        written = out.view(q.shape) if direct else torch.empty(q.shape, dtype=torch.float32)
        one_call(cfg, plan, [(i, pad, layouts[i], state) for i, state, pad, _ in rows], fresh, q, key, value, written,
                 scale)  # fmt: skip
    for (i, state, pad, m), f in zip(rows, fresh):
        keys, values, layout = key[i, :, pad:], value[i, :, pad:], layouts[i]
        if plan.one_call:
            row_out, index = written[i], None
        else:
            row_out, index, valid = _row(cfg, plan, state, q[i], keys, values, layout, f)
        if index is None and (session.track_reads or session.observers):
            index, valid = support(cfg, state, layout)
        if session.track_reads:
            kv_heads = key.shape[1]
            state.note_positions(index, layout, valid, kv_heads)
            per_kv = valid.sum(dim=1) if index.shape[0] == kv_heads else union_sizes(index, valid, kv_heads, layout.n)
            session.note_support(i, per_kv)
        if session.observers:
            blocks = None if selector.token_level else state.blocks
            view = StepView(state.layer, state.step, q[i], keys, values, index, valid, row_out, scale, layout, blocks)
            view.sequence = i
            for observe in session.observers:
                observe(view)
        if not (plan.one_call and direct):
            out[i, 0] = row_out
        session.sparse_steps += 1
        session.sequence_steps.setdefault(i, [0, 0])[0] += 1
        state.end_row(m)


def sparse_decode_step(
    session: SparseSession,
    state: LayerState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    n: int,
    scaling: float | None,
) -> torch.Tensor:
    """One sequence's sparse decode step of one layer (a batch of one row, :func:`sparse_rows`): ``query (1, H, 1,
    d)``, ``key/value (1, KVH, >= n, d)``; returns ``(1, 1, H, dv)`` in the query dtype."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = query.new_empty(1, 1, query.shape[1], value.shape[-1])
    sparse_rows(session, [(0, state, 0, n)], query, key, value, out, scale)
    return out
