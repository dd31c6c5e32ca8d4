"""Twilight's hierarchical top-p pruning (Lin et al., "Twilight: Adaptive Attention Sparsity with Hierarchical
Top-p Pruning", arXiv 2502.02770), ported from ``tsinghua-ideal/Twilight`` at commit
``843ebcc61c23021f451364f199cc50368c3cff01``.

The official Python implementation, ``twilight/pyimpl/attention.py`` ``attention_forward``, runs at a decode step
(the prefill is dense, line 157; layers 0 and 1 are dense when ``skip_first_two_layers``, the default, line 195 and
400, and in every config of ``benchmark/configs/``), after ``repeat_kv`` (lines 125-126), so per query head:

1. **Select** (lines 207-213): a base selector's candidate mask. In the Twilight configs it is Quest
   (``config_quest_twi.json``: ``token_budget 8192, chunk_size 16``) through Twilight's own
   ``twilight/pyimpl/quest.py`` ``quest_selector``: the bound of Quest's ``evaluation/quest_attention.py`` per query
   head over pages ``[j B, (j + 1) B)`` from position 0, keeping ``min(ceil(T / B), n_pages)`` pages (at least 1;
   unlike Quest's own code, no minimum of three and no ``min(N, T)``, so ``N <= T`` keeps every page) and forcing
   nothing. :func:`twilight_quest_candidates`.
2. **Estimate** (lines 247-255): keys quantised per token (over the head dimension) to ``quant_bit = 4`` bits by
   ``twilight/pyimpl/quantize.py`` ``min_max_per_token_quant_kv`` (scale ``(max - min).clamp(min=1e-9) / 15``,
   zero ``-min``, round half to even, clamp to ``[0, 15]``, dequantised), ``q . k~ / sqrt(d)`` in the model's dtype,
   non-candidates set to ``finfo(dtype).min``. :func:`min_max_quantise`.
3. **Prune** (lines 274-281; ``twilight/pyimpl/top_p.py`` ``top_p_unnormalized``): float32 softmax over the row (the
   non-candidates get exactly 0), then the CUDA kernel ``TopPReturnMaskKernel`` (``csrc/include/sampling.cuh``
   lines 119-231, called through ``twilight/kernel/cuda/sampling.py`` ``top_p_fp32_return_mask``) with
   ``threshold = 0.85``; the final mask is ``candidates & pruned``. :func:`top_p_kernel_mask`.

The kernel is a float32 bisection for a threshold ``low``: it starts from ``low = 0`` and ``high = probs[0]``, the
**attention sink's own probability** (line 159), keeps halving while tracking the smallest value above ``low`` and
the largest at most ``high``, stops when these are within ``eps = 1e-5`` (an absolute tolerance), and keeps every
position with ``prob > low``. So: the fewest top positions whose mass reaches ``p`` (ties at the cut kept, and
values within about ``1e-5`` below the cut possibly kept too), but never a threshold above ``probs[0]``:
**position 0 and every position at least as likely are always kept**. If position 0 is not a candidate (its
probability is 0), the threshold is 0 and **every candidate is kept** (no pruning).

The selection is per query head; the number kept varies per head and step (Twilight's adaptive budget), so a
selector following it reports the support read. ``use_estimated_weights_in_attn`` is false in every config: the
attention over the kept positions uses the exact keys.

Our layout: :func:`twilight_supports` takes the candidates as any per-query-head positions, e.g. those of
:func:`~.quest_official.quest_on_our_layout` (anchor + window + Quest blocks), whose anchor is position 0, always a
candidate. Twilight forces nothing else: top-p may drop window positions, the current token included.
"""

from __future__ import annotations

import math

import torch

from .common import group_size, mask_to_positions, per_query_head, positions_to_mask, top_indices
from .quest_official import page_bounds


def min_max_quantise(keys: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Per-token (last dimension) asymmetric min-max quantisation to ``bits`` bits, dequantised, in the keys'
    dtype (step 2 of the module)."""
    top = keys.amax(dim=-1, keepdim=True)
    bottom = keys.amin(dim=-1, keepdim=True)
    levels = 2**bits - 1
    step = (top - bottom).clamp(min=1e-9) / levels
    codes = torch.round((keys - bottom) / step).clamp(0, levels)
    return codes * step + bottom


def top_p_kernel_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """One row of ``TopPReturnMaskKernel``: ``probs`` ``(N,)`` float32 -> ``(N,)`` booleans ``probs > low``, with
    ``low`` found by the kernel's bisection in float32 (see the module)."""
    probs = probs.float()
    f32 = torch.float32
    target = torch.tensor(p, dtype=f32)
    eps = torch.tensor(1e-5, dtype=f32)
    low, high = torch.tensor(0.0, dtype=f32), probs[0].clone()
    for _ in range(10_000):  # the kernel has no cap; a float32 bisection ends in far fewer rounds
        mid = (low + high) / 2
        mass = probs[probs > mid].sum()
        above_low = probs[probs > low]
        min_gt_low = torch.minimum(high, above_low.min()) if above_low.numel() else high
        below_high = probs[probs <= high]
        max_le_high = torch.maximum(low, below_high.max()) if below_high.numel() else low
        if mass >= target:
            low = mid
        else:
            high = torch.minimum(mid, max_le_high)
        if not bool(max_le_high - min_gt_low > eps):
            return probs > low
    raise RuntimeError("the top-p bisection did not end")


def twilight_quest_candidates(
    queries: torch.Tensor, keys: torch.Tensor, *, chunk_size: int = 16, token_budget: int = 8192
) -> torch.Tensor:
    """``twilight/pyimpl/quest.py`` ``quest_selector``: ``(H, N)`` candidate mask, per query head (step 1)."""
    n = keys.shape[1]
    scores = page_bounds(queries, keys, 0, chunk_size, n)
    count = max(1, token_budget // chunk_size) + (token_budget % chunk_size != 0)
    chosen = top_indices(scores, min(count, scores.shape[1]))
    offsets = torch.arange(chunk_size)
    mask = torch.zeros(queries.shape[0], n, dtype=torch.bool)
    for row, pages in zip(mask, chosen):
        index = (pages.unsqueeze(-1) * chunk_size + offsets).flatten()
        row[index[index < n]] = True
    return mask


def twilight_estimated_probs(queries: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, bits: int = 4):
    """``(H, N)`` float32: the softmax over each row of ``q . quantised k / sqrt(d)``, non-candidates at
    ``finfo.min`` (so probability 0), in the inputs' dtype up to the softmax (step 2 and the softmax of step 3)."""
    group = group_size(queries, keys)
    d = queries.shape[-1]
    quantised = per_query_head(min_max_quantise(keys, bits), group)  # (H, N, d)
    weights = torch.bmm(quantised, queries.unsqueeze(-1)).squeeze(-1) / math.sqrt(d)
    weights = weights.masked_fill(~candidates, torch.finfo(weights.dtype).min)
    return torch.softmax(weights, dim=-1, dtype=torch.float32)


def twilight_prune(
    queries: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, *, p: float = 0.85, quant_bit: int = 4
) -> torch.Tensor:
    """``(H, N)`` booleans: the candidates each query head keeps after Twilight's estimate and top-p (steps 2-3)."""
    probs = twilight_estimated_probs(queries, keys, candidates, quant_bit)
    pruned = torch.stack([top_p_kernel_mask(row, p) for row in probs])
    return candidates & pruned


def twilight_supports(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    candidates: list[torch.Tensor] | torch.Tensor | None = None,
    p: float = 0.85,
    quant_bit: int = 4,
    chunk_size: int = 16,
    token_budget: int = 8192,
) -> list[torch.Tensor]:
    """What Twilight attends to at one decode step, per query head: ``candidates`` (per-query-head positions or an
    ``(H, N)`` mask; Twilight's Quest, :func:`twilight_quest_candidates`, when ``None``) pruned by
    :func:`twilight_prune`."""
    n = keys.shape[1]
    if candidates is None:
        mask = twilight_quest_candidates(queries, keys, chunk_size=chunk_size, token_budget=token_budget)
    elif isinstance(candidates, torch.Tensor):
        mask = candidates.bool()
    else:
        mask = positions_to_mask(candidates, n)
    return mask_to_positions(twilight_prune(queries, keys, mask, p=p, quant_bit=quant_bit))
