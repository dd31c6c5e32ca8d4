"""The sparse step's kernels: a C kernel for the CPU (:mod:`.cpu`, source in ``csrc/``), Triton kernels for CUDA
(:mod:`.triton.attention`), and the one place that decides which serves a call (:mod:`.dispatch`).

This package depends on :mod:`sparsedecode.layout` (where the support lies) and :mod:`sparsedecode.errors`
only, never on the selectors or the attention step, which call into it.
"""

from . import cpu
from .common import check_inputs
from .cpu import batch as cpu_batch
from .dispatch import attend, attention_kernel, needs_gradient, refusals, select_mean_pooled, selection_kernel
from .triton import attention as triton_attention

__all__ = [
    "attend",
    "attention_kernel",
    "check_inputs",
    "cpu",
    "cpu_batch",
    "needs_gradient",
    "refusals",
    "select_mean_pooled",
    "selection_kernel",
    "triton_attention",
]
