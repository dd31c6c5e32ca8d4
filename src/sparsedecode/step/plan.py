"""Which kernels serve one layer call's sparse rows, decided once for all of them (:func:`plan_step`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..config import SparseConfig


@dataclass(frozen=True)
class StepPlan:
    """What serves one layer call's sparse rows, decided once for all of them.

    ``attend``: the kernel attending over a block support (``"c"``, ``"triton"`` or ``"torch"``; token-level
    selectors and adaptive budgets gather by position in torch); ``select``: the kernel scoring a selector whose
    scoring the kernels implement (``kernel_scoring``, fixed budget), ``"torch"`` for any other; ``one_call``: the C
    kernel takes every row at once, selecting inside the call where ``select`` is the C kernel too (every fixed-budget
    block step the C kernel attends is one call: its rows are never attended one by one)."""

    attend: str
    select: str
    one_call: bool


def _signature(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple | None:
    """What the kernels' choice depends on for CPU tensors (dtypes, head counts and dims, row strides, whether autograd
    records the step), or ``None`` where it also depends on the step (CUDA: Triton's limits grow with the cache)."""
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
        kernels.needs_gradient(q, keys, values),
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
    if selector.token_level:  # gathered by position
        return StepPlan("torch", "torch", False)
    attend = kernels.attention_kernel(cfg.kernel, q, keys, values, layout)
    if selector.per_query_head:  # scored in torch; the kernel attends once per member of a KV group (reference.py)
        return StepPlan("torch" if selector.adaptive else attend, "torch", False)
    select = "torch"
    if selector.kernel_scored:
        # the C kernel attending serves these tensors, so it serves their selection (which needs less of them)
        select = "c" if attend == "c" else kernels.selection_kernel(cfg.kernel, q, keys, layout)
    return StepPlan(attend, select, attend == "c" and not selector.adaptive)
