"""Which implementation serves a sparse step: the one place that decides (``SparseConfig.kernel``, see KERNELS).

``torch`` always serves (torch operations, any device, dtype and head dims). ``auto`` takes the Triton kernels
for a cache on a CUDA device and the C kernel for one on the CPU, each only where every assumption its code makes
holds (:func:`sparsedecode.kernels.cpu.refusal`, :func:`sparsedecode.kernels.triton.attention.refusal`), and
torch otherwise. ``c`` and ``triton`` insist: a kernel that cannot serve raises a one-line
:class:`~sparsedecode.errors.SparseDecodeError` naming the reason. Malformed inputs (shapes that do not fit
together, tensors on several devices) raise whatever the kernel (:func:`check_inputs`).

Selection has one exception: past :data:`~sparsedecode.kernels.triton.attention.MAX_TRITON_BLOCKS` distant blocks
it stays with torch's top-k even under ``kernel="triton"`` (the attention still runs Triton).
"""

from __future__ import annotations

import torch

from ..errors import SparseDecodeError
from ..layout import BlockLayout
from . import cpu
from .common import check_inputs
from .triton import attention as triton_attention

NAMES = ("triton", "c")
"""The kernels besides torch, in the order ``auto`` tries them."""


def needs_gradient(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a computation on ``tensors``: gradients are enabled and one of them requires one (a
    model whose parameters require gradients, outside ``torch.no_grad``)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _refusal(name: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None, layout: BlockLayout):
    if values is not None and needs_gradient(q, keys, values):  # a kernel's output would be cut from the graph
        return "it computes no gradient, and autograd needs one here (decode under torch.no_grad() for the kernels)"
    if name == "c":
        return cpu.refusal(q, keys, values)
    return triton_attention.refusal(q, keys, values, layout)


def _auto_candidates(keys: torch.Tensor) -> tuple[str, ...]:
    """The kernels ``auto`` considers for a cache: Triton on CUDA only (never its CPU interpreter), C on the CPU."""
    return ("triton",) if keys.is_cuda else ("c",)


def _choose(kernel, q, keys, values, layout, skip=()) -> str:
    if kernel == "torch":
        return "torch"
    candidates = _auto_candidates(keys) if kernel == "auto" else (kernel,)
    for name in candidates:
        if name in skip:
            continue
        reason = _refusal(name, q, keys, values, layout)
        if reason is None:
            return name
        if kernel != "auto":
            raise SparseDecodeError(f"kernel={kernel!r} cannot run this step: {reason}; use kernel='auto' or 'torch'")
    return "torch"


def attention_kernel(
    kernel: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: BlockLayout
) -> str:
    """``"triton"``, ``"c"`` or ``"torch"``: what computes attention over a block support for ``SparseConfig.kernel
    == kernel``. ``q (H, d)``, ``keys (kv, >= n, d)``, ``values (kv, >= n, dv)``."""
    check_inputs(q, keys, values, layout)
    return _choose(kernel, q, keys, values, layout)


def selection_kernel(kernel: str, q: torch.Tensor, keys: torch.Tensor, layout: BlockLayout) -> str:
    """``"triton"``, ``"c"`` or ``"torch"``: what scores and picks mean-pooled blocks for ``kernel``."""
    check_inputs(q, keys, None, layout)
    too_many = ("triton",) if layout.n_blocks > triton_attention.MAX_TRITON_BLOCKS else ()
    return _choose(kernel, q, keys, None, layout, skip=too_many)


def refusals(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None, layout: BlockLayout
) -> dict[str, str | None]:
    """Why each kernel could not serve these tensors (``None``: it could); ``values=None`` for selection alone."""
    check_inputs(q, keys, values, layout)
    return {name: _refusal(name, q, keys, values, layout) for name in NAMES}


def attend(
    name: str,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    layout: BlockLayout,
    scale: float,
) -> torch.Tensor:
    """Attention over anchor + ``blocks`` + window by the kernel :func:`attention_kernel` named: ``(H, d)`` float32."""
    run = {"c": cpu.run_attention, "triton": triton_attention.run_attention}[name]
    return run(q, keys, values, blocks, layout, scale)


def select_mean_pooled(
    name: str, q: torch.Tensor, keys: torch.Tensor, centroids: torch.Tensor, layout: BlockLayout, b: int
) -> torch.Tensor:
    """The ``b`` mean-pooled blocks per KV head by the kernel :func:`selection_kernel` named: ``(kv, b)`` int64
    (C: ascending; Triton: the same set, best first)."""
    run = {"c": cpu.run_selection, "triton": triton_attention.run_selection}[name]
    return run(q, keys, centroids, layout, b)
