"""A sparse step's rows: each row selects when its schedule says so (:mod:`.schedule`), then attends over its
support, one row at a time or every row in one C call (:func:`one_call`). The session's rows
(:class:`~sparsedecode.session.state.LayerState`) and the compiled op's (:class:`TensorRow`, views of its
preallocated state) are handed here alike. A row has:

* ``centroids``: its block statistics (a :class:`~sparsedecode.selectors.statistics.BlockStatistics`);
* ``blocks`` ``(kv, b)`` and ``budget_mask`` (an adaptive budget's ``(kv, b)`` mask, ``None`` for a fixed budget): its
  block selection; ``positions`` ``(kv, distant)``: a token selector's;
* ``blocks_out(kv_heads, b)``: the ``(kv, b)`` int64 contiguous tensor the C call writes a fresh selection into, which
  is then the row's ``blocks``.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..kernels.reference import attend_blocks_on, attend_positions
from ..layout import BlockLayout
from ..selectors import token_index
from ..selectors.select import BlockChoice, choose_planned_blocks, choose_position_set, support_of, token_support
from . import schedule
from .plan import StepPlan


class TensorRow:
    """One row of the compiled op's preallocated state ``blocks``/``budget_mask (kv, b)``, ``positions (kv, distant)``:
    a selection assigned to it is copied into those tensors (their addresses stay, as a captured graph needs)."""

    def __init__(
        self, centroids, blocks: torch.Tensor, budget_mask: torch.Tensor, positions: torch.Tensor, adaptive: bool
    ):
        self.centroids, self._blocks, self._budget_mask, self._positions = centroids, blocks, budget_mask, positions
        self._adaptive = adaptive

    @property
    def blocks(self) -> torch.Tensor:
        return self._blocks

    @blocks.setter
    def blocks(self, value: torch.Tensor) -> None:
        self._blocks.copy_(value)

    @property
    def budget_mask(self) -> torch.Tensor | None:
        return self._budget_mask if self._adaptive else None

    @budget_mask.setter
    def budget_mask(self, value: torch.Tensor | None) -> None:
        self._budget_mask.fill_(True) if value is None else self._budget_mask.copy_(value)

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    @positions.setter
    def positions(self, value: torch.Tensor) -> None:
        self._positions.copy_(value)

    def blocks_out(self, kv_heads: int, b: int) -> torch.Tensor:
        self.budget_mask = None
        return self._blocks


def select_row(cfg, plan: StepPlan, row, q, keys, layout: BlockLayout, history=None) -> None:
    """A row's fresh selection at this step (``q (H, d)``, ``keys (kv, >= n, d)`` in the row's own coordinates),
    into ``row``: a token selector's positions (``history``: H2O's, over the earlier queries), or a block selector's
    blocks and, for an adaptive budget, what it keeps."""
    if cfg.selector.token_level:
        choice = choose_position_set(cfg.selector, cfg.distant_positions, q, keys, layout, history=history)
        row.positions, row.budget_mask = choice.blocks, choice.budget_mask
        return
    choice = choose_planned_blocks(cfg.selector, cfg.blocks, row.centroids, q, keys, layout, plan.select)
    row.blocks, row.budget_mask = choice.blocks, choice.budget_mask


def support(cfg, row, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, valid)`` ``(kv, S)``: the positions the row's selection reads (see
    :func:`~sparsedecode.layout.support_positions`)."""
    if cfg.selector.token_level:  # reused distant positions, the window slides
        return token_support(BlockChoice(row.positions, row.budget_mask), layout)
    return support_of(BlockChoice(row.blocks, row.budget_mask), layout)


def attend_row(cfg, plan: StepPlan, row, q, keys, values, layout: BlockLayout, *, weights: bool = False):
    """Attention of one row over its selection (outside the one C call): ``(H, dv)`` float32; with ``weights`` (a
    token selector's, for H2O's history) also the attention each read position received and which positions its
    budget kept, ``(out, index, received, valid)``."""
    if cfg.selector.token_level:
        index = token_index(row.positions, layout)  # reused distant positions, the window slides
        valid = None
        if row.budget_mask is not None:  # an adaptive budget's dropped positions masked
            _, valid = token_support(BlockChoice(row.positions, row.budget_mask), layout)
        if weights:
            out, received = attend_positions(q, keys, values, index, layout.scale, weights=True, valid=valid)
            return out, index, received, torch.ones_like(index, dtype=torch.bool) if valid is None else valid
        return attend_positions(q, keys, values, index, layout.scale, valid=valid)
    if row.budget_mask is not None:  # an adaptive budget: its support by position, the dropped blocks masked
        index, valid = support_of(BlockChoice(row.blocks, row.budget_mask), layout)
        return attend_positions(q, keys, values, index, layout.scale, valid=valid)
    return attend_blocks_on(plan.attend, q, keys, values, row.blocks, layout, layout.scale)


def one_call(cfg, plan: StepPlan, rows, fresh, q, key, value, out, scale: float) -> None:
    """Every row's step in one C call, written into ``out (batch, H, d)`` float32 (whatever the dtype of ``q (batch,
    H, d)``, ``key`` and ``value``, which the call reads as they are): mean-dot selection inside the call where a row
    selects afresh and the C kernel scores the selector, other block selectors selecting per row first. ``rows``:
    ``(sequence, pad, layout, row)``, sequence ``sequence`` at cache positions ``[pad, pad + layout.n)``. The call
    scores and attends with the code of the C kernel's single-sequence calls: the same blocks and outputs."""
    inside = plan.select == "c"
    calls = []
    for (i, pad, layout, row), f in zip(rows, fresh):
        storage = None
        if f and inside:
            if row.centroids.count < layout.n_full:  # the blocks completed since the last step
                row.centroids.update(key[i, :, pad:], layout.n_full)
            storage = row.centroids.storage()
            row.blocks_out(key.shape[1], cfg.blocks)
        elif f:
            select_row(cfg, plan, row, q[i], key[i, :, pad:], layout)
        if row.blocks.dtype != torch.int64 or not row.blocks.is_contiguous():
            row.blocks = row.blocks.to(torch.int64).contiguous()  # as the call takes them
        calls.append((i, pad, layout.n, storage, row.blocks, f and inside))
    kernels.cpu_batch.run_step_batch(q, key, value, out, calls, cfg.window, cfg.block_size, scale)


def union_sizes(index: torch.Tensor, valid: torch.Tensor, kv_heads: int, n: int) -> torch.Tensor:
    """Distinct positions each KV head's memory serves at a step, ``(kv,)``: the union of its rows' supports
    (``index``/``valid (rows, S)``, a row per KV head or per query head, head ``h`` reading KV head ``h // G``)."""
    rows = index.shape[0]
    read = torch.zeros(kv_heads, n, dtype=torch.bool, device=index.device)
    owner = (torch.arange(rows, device=index.device) // (rows // kv_heads)).unsqueeze(1).expand_as(index)
    read[owner[valid], index[valid]] = True
    return read.sum(dim=1)


def reads_per_kv_head(cfg, row, layout: BlockLayout, kv_heads: int) -> torch.Tensor:
    """Positions a row's step read per KV head, ``(kv,)``: a KV group's query heads reading the same position count
    it once (what the step costs in bytes)."""
    if not cfg.selector.token_level and row.blocks.shape[0] == kv_heads:
        return schedule.support_reads(row.blocks, layout, row.budget_mask)
    index, valid = support(cfg, row, layout)
    return union_sizes(index, valid, kv_heads, layout.n)
