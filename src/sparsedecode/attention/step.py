"""The sparse decode step of one layer over a batch of rows: every sequence of a forward that decodes sparsely, each
in its own coordinates (a sequence alone is a batch of one row). One path for every selector and kernel:

1. :func:`plan_step` decides, once per session and kind of tensors (once per layer call on CUDA), what serves the
   rows: which kernel attends (C, Triton or torch), which one scores a selector whose scoring the kernels implement,
   and whether the C kernel takes every row in one call;
2. each row selects afresh when its reuse schedule says so (or reuses its selection, the window still sliding);
3. attention over each row's support (one C call for all rows, or per row);
4. the same bookkeeping per row: reuse counter, reads, support sizes, H2O's history, observers, step counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..config import SparseConfig
from ..errors import SparseDecodeError
from ..layout import BlockLayout
from ..selectors import choose_positions, token_index
from ..selectors.select import BlockChoice, choose_planned_blocks, support_of
from .attend import attend_blocks_on, attend_positions
from .session import SparseSession
from .state import LayerState, StepView

ONE_CALL = True
"""Let the C kernel take every row of a layer call in one call where it serves them (tests turn it off to check the
per-row path against it: the same blocks and outputs)."""

Row = tuple[int, LayerState, int, int]
"""A sparse row of a forward: ``(sequence, state, pad, n)``, sequence ``sequence`` of the batch at cache positions
``[pad, pad + n)``, its state in its own coordinates."""


@dataclass(frozen=True)
class StepPlan:
    """What serves one layer call's sparse rows, decided once for all of them.

    ``attend``: the kernel attending over a block support (``"c"``, ``"triton"`` or ``"torch"``; token-level
    selectors and adaptive budgets gather by position in torch); ``select``: the kernel scoring a selector whose
    scoring the kernels implement (``kernel_scoring``, fixed budget), ``"torch"`` for any other; ``one_call``: the C
    kernel takes every row at once, selecting inside the call where ``select`` is the C kernel too."""

    attend: str
    select: str
    one_call: bool


def _signature(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple | None:
    """What the kernels' choice depends on for CPU tensors (dtypes, head counts and dims, row strides), or ``None``
    where it also depends on the step (CUDA: Triton's limits grow with the cache)."""
    if not keys.is_cpu:
        return None
    return (
        q.dtype,
        keys.dtype,
        values.dtype,
        q.device,
        keys.device,
        values.device,
        q.shape,
        keys.shape[0],
        keys.shape[-1],
        values.shape[-1],
        keys.stride(-1),
        values.stride(-1),
    )


def plan_step(
    cfg: SparseConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout, plans: dict | None = None
) -> StepPlan:
    """The :class:`StepPlan` for a layer call, from one row's ``q (H, d)``, ``keys``/``values (kv, >= n, d)`` and
    layout (the longest row's: the kernels' limits grow with ``n``). A kernel insisted on (``cfg.kernel``) that
    cannot serve raises here. ``plans`` (a session's) keeps the plans of CPU tensors by what they depend on, so a
    session plans once per kind of tensors, not once per call."""
    key = None if plans is None else _signature(q, keys, values)
    if key is not None and key in plans:
        return plans[key]
    plan = _plan(cfg, q, keys, values, layout)
    if key is not None:
        plans[key] = plan
    return plan


def _plan(cfg: SparseConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout) -> StepPlan:
    selector = cfg.selector
    if selector.token_level:
        return StepPlan("torch", "torch", False)
    attend = kernels.attention_kernel(cfg.kernel, q, keys, values, layout)
    select = "torch"
    if selector.kernel_scoring == "mean-dot" and not selector.adaptive:
        # the C kernel attending serves these tensors, so it serves their selection (which needs less of them)
        select = "c" if attend == "c" else kernels.selection_kernel(cfg.kernel, q, keys, layout)
    return StepPlan(attend, select, attend == "c" and not selector.adaptive)


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
        needs + "this session did not see the forwards that filled part of the cache: run the prefill inside the "
        "sparse_decoding session, or give the session its history with session.adopt_history(cache, history)"
    )


def _fresh(cfg: SparseConfig, state: LayerState) -> bool:
    """Whether a row selects afresh at this step (and count the step): the first of a chain of sparse steps, every
    ``reuse`` steps after it, or every step for a selector that reselects every step."""
    fresh = state.step % cfg.reuse == 0 or (state.blocks is None and state.positions is None)
    state.step += 1
    return fresh or cfg.selector.reselects_every_step


def _token_row(cfg, state, q, keys, values, layout, fresh):
    """A token-level selector's step of one row: ``(out, index, valid)``."""
    selector = cfg.selector
    h2o = selector.uses_history
    if fresh:
        history = state.history_until(layout.n, keys.shape[0], keys.device) if h2o else None  # earlier queries only
        state.positions = choose_positions(selector, cfg.distant_positions, q, keys, layout, history=history)
    index = token_index(state.positions, layout)  # reused distant positions, the window slides
    if h2o:  # H2O accumulates the attention the step computed: over its support, as with eviction
        out, received = attend_positions(q, keys, values, index, layout.scale, weights=True)
        state.add_attention_at(index, received, layout.n)
    else:
        out = attend_positions(q, keys, values, index, layout.scale)
    return out, index, torch.ones_like(index, dtype=torch.bool)


def _block_row(cfg, plan, state, q, keys, values, layout, fresh) -> torch.Tensor:
    """A block selector's step of one row (outside the one C call): select when ``fresh``, then attend."""
    if fresh:
        choice = choose_planned_blocks(cfg.selector, cfg.blocks, state.centroids, q, keys, layout, plan.select)
        state.blocks, state.keep = choice.blocks, choice.keep
    if state.keep is not None:  # an adaptive budget: its support by position, the dropped blocks masked
        index, valid = support_of(BlockChoice(state.blocks, state.keep), layout)
        return attend_positions(q, keys, values, index, layout.scale, valid=valid)
    return attend_blocks_on(plan.attend, q, keys, values, state.blocks, layout, layout.scale)


def _one_call(cfg, plan, rows, layouts, fresh, q, key, value, out) -> None:
    """Every row's step in one C call, written into ``out (batch, H, d)`` float32 (whatever the dtype of ``q``, ``key``
    and ``value``, which the call reads as they are): mean-pooled selection inside the call where the row selects
    afresh (the C kernel's scoring), other block selectors selecting per row first. The call scores and attends with
    the code of the C kernel's single-sequence calls: the same blocks and outputs."""
    inside = plan.select == "c"
    selecting = [r for r, f in zip(rows, fresh) if f and inside]
    if selecting:  # run_selection's cap, b <= n_blocks (a row past the support always has more than cfg.blocks)
        b = min(cfg.blocks, *(layouts[r[0]].n_blocks for r in selecting))
        chosen = torch.empty(len(selecting), key.shape[1], b, dtype=torch.int64)
    calls, j = [], 0
    for (i, state, pad, m), f in zip(rows, fresh):
        storage, layout = None, layouts[i]
        if f and inside:
            if state.centroids.count < layout.n_full:  # the blocks completed since the last step
                state.centroids.update(key[i, :, pad:], layout.n_full)
            storage = state.centroids.storage()
            state.blocks, state.keep, j = chosen[j], None, j + 1
        elif f:
            choice = choose_planned_blocks(
                cfg.selector, cfg.blocks, state.centroids, q[i], key[i, :, pad:], layout, plan.select
            )
            state.blocks, state.keep = choice.blocks, None
        if state.blocks.dtype != torch.int64 or not state.blocks.is_contiguous():
            state.blocks = state.blocks.to(torch.int64).contiguous()  # as the call takes them
        calls.append((i, pad, m, storage, state.blocks, f and inside))
    kernels.cpu_batch.run_step_batch(q, key, value, out, calls, cfg.window, cfg.block_size, layouts[rows[0][0]].scale)


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
    query dtype. Each row selects afresh at the first step of a chain of sparse steps and every ``reuse`` steps after
    it; otherwise it reuses its state's selection (the window still slides). Every state must describe its row's keys
    (the attention function sees to that, see :class:`LayerState`).
    """
    cfg, selector = session.config, session.config.selector
    q = query[:, :, 0, :]  # (batch, H, d)
    layouts = {
        i: BlockLayout(n=m, window=cfg.window, block_size=cfg.block_size, layer=state.layer, scale=scale, seed=cfg.seed)
        for i, state, _, m in rows
    }
    i, _, pad, _ = max(rows, key=lambda r: r[3]) if len(rows) > 1 else rows[0]
    plan = plan_step(cfg, q[i], key[i, :, pad:], value[i, :, pad:], layouts[i], session.plans)
    one_call = plan.one_call and ONE_CALL
    if selector.uses_history:
        for _, state, _, _ in rows:
            _check_history(selector, state)
    fresh = [_fresh(cfg, state) for _, state, _, _ in rows]
    if one_call:
        if not q.is_contiguous():
            q = q.contiguous()
        # the C call writes float32: into ``out`` itself when it is float32, else into a buffer copied row by row
        direct = out.dtype == torch.float32
        written = out.view(q.shape) if direct else torch.empty(q.shape, dtype=torch.float32)
        _one_call(cfg, plan, rows, layouts, fresh, q, key, value, written)
    for (i, state, pad, m), f in zip(rows, fresh):
        keys, values, layout = key[i, :, pad:], value[i, :, pad:], layouts[i]
        blocks = None
        if one_call:
            row_out, blocks = written[i], state.blocks
        elif selector.token_level:
            row_out, index, valid = _token_row(cfg, state, q[i], keys, values, layout, f)
        else:
            row_out, blocks = _block_row(cfg, plan, state, q[i], keys, values, layout, f), state.blocks
        if blocks is not None and (session.track_reads or session.observers):
            index, valid = support_of(BlockChoice(blocks, state.keep), layout)
        if session.track_reads:
            state.note_positions(index, layout, valid)
            session.note_support(i, valid.sum(dim=1))
        if session.observers:
            view = StepView(state.layer, state.step, q[i], keys, values, index, valid, row_out, scale, layout, blocks)
            view.sequence = i
            for observe in session.observers:
                observe(view)
        if not (one_call and direct):
            out[i, 0] = row_out
        session.sparse_steps += 1
        session.sequence_steps.setdefault(i, [0, 0])[0] += 1
        state.end_row(m, chained=True)


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
