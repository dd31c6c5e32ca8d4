"""H2O's heavy hitters (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", arXiv 2306.14048), ported from ``FMInference/H2O`` at commit ``ac75c2a8a9e76832b2a4139b9363373b56336bfb``,
file ``h2o_hf/utils_real_drop/modify_llama.py``: ``H2OKVCache_LayerWise`` (``__call__``, ``_update_hh_score``) and
``H2OLlamaAttention.forward``.

The official code evicts; it does not select afresh. Every forward (the prefill, then each decode token) attends
densely over what the cache holds plus the new token(s), adds the attention each cached position received, summed
over the forward's queries, to that position's score (``_update_hh_score``, lines 317-326; per query head, float
probabilities cast to the model's dtype), then, if the cache holds more than ``hh_size + recent_size`` positions,
keeps the ``recent_size`` latest and the ``hh_size`` best-scored of the others (``torch.topk``, ties unspecified:
here the lowest position first), and drops the rest with their scores for good (``__call__``, lines 258-287).
So at a decode step with ``N`` positions (the current token included) a head attends to:

* everything, while ``N - 1 <= hh_size + recent_size``;
* else the ``recent_size + 1`` latest positions ``[N - 1 - recent_size, N)`` and ``hh_size`` heavy hitters from
  ``[0, N - 1 - recent_size)``.

Because a kept position's score only grows and an evicted one's is frozen, every kept heavy hitter outscores every
evicted position at all times, so the heavy hitters are the ``hh_size`` best of ``[0, N - 1 - recent_size)`` by the
accumulated scores: :func:`h2o_step_supports` (the rule in one step) equals :func:`h2o_decode` (the eviction
process) given the scores that process accumulated (tested, ties aside). Position 0 is not forced.

Grouped-query attention: the official code is multi-head only. Scores are kept per query head (after
``repeat_kv``), and line 282 indexes the KV cache, ``(KV, N, d)``, with a per-query-head mask ``(H, N)``, which fails
when ``G > 1``; there is no official group rule, so these ports require ``G = 1``. The evaluations
(``run_summarization.py``) use ``hh_size = recent_size = 1024``, others ratios of the prompt length (0.1 each); all
layers are sparse.

Our layout: the window ``W = recent_size + 1`` (both hold the current token) and the ``hh_size`` heavy hitters come
from ``[0, N - W)``; ours force the anchor (position 0) and take ``S - 1 - W`` from ``[1, N - W)``. With
``S = hh_size + W`` the two agree whenever position 0 is among the official heavy hitters (an attention sink).
Our history is the attention each position received from every earlier query over what that query read, summed
over the group: at ``G = 1`` the official score.
"""

from __future__ import annotations

import torch

from .common import top_indices


def h2o_step_supports(scores: torch.Tensor, *, hh_size: int, recent_size: int) -> list[torch.Tensor]:
    """The positions each head attends to at a decode step of ``N`` positions (the current token included), given
    ``scores`` ``(H, N)``: the attention each position received from the earlier queries (see the module)."""
    heads, n = scores.shape
    if n - 1 <= hh_size + recent_size:
        return [torch.arange(n) for _ in range(heads)]
    start = n - 1 - recent_size
    heavy = top_indices(scores[:, :start].float(), hh_size)
    recent = torch.arange(start, n)
    return [torch.cat([row, recent]) for row in heavy]


def h2o_decode(
    prefill_queries: torch.Tensor,
    step_queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    hh_size: int,
    recent_size: int,
) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """The official eviction process over a whole sequence, multi-head (``G = 1``).

    ``prefill_queries`` ``(H, P, d)`` at positions ``0 .. P - 1``, ``step_queries`` ``(H, T, d)`` at ``P .. P + T -
    1``, ``keys`` ``(H, P + T, d)``. Returns, for each decode step, the positions each head attended to, and the
    scores ``(H, N)`` each step saw before it (evicted positions keep their frozen scores), for
    :func:`h2o_step_supports`.
    """
    heads, prefill, d = prefill_queries.shape
    if keys.shape[0] != heads:
        raise ValueError("H2O's official code is multi-head only (G = 1): its KV cache is indexed per query head")
    scale = d**-0.5
    logits = torch.einsum("hqd,hkd->hqk", prefill_queries.float(), keys[:, :prefill].float()) * scale
    causal = torch.ones(prefill, prefill, dtype=torch.bool).tril()
    received = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1).sum(dim=1)  # (H, P)
    kept = torch.arange(prefill).expand(heads, -1).clone()  # absolute positions the cache holds, per head
    frozen = torch.zeros(heads, keys.shape[1])  # every position's score, absolute, kept or evicted
    frozen[:, :prefill] = received
    kept, received = _evict(kept, received, hh_size, recent_size)
    supports, seen = [], []
    for step in range(step_queries.shape[1]):
        position = prefill + step
        seen.append(frozen[:, : position + 1].clone())
        attended = torch.cat([kept, torch.full((heads, 1), position)], dim=1)
        supports.append(list(attended))
        k = keys.float().gather(1, attended.unsqueeze(-1).expand(-1, -1, d))
        weights = torch.softmax(torch.einsum("hd,hkd->hk", step_queries[:, step].float(), k) * scale, dim=-1)
        received = torch.cat([received, torch.zeros(heads, 1)], dim=1) + weights
        frozen.scatter_(1, attended, received)
        kept, received = _evict(attended, received, hh_size, recent_size)
    return supports, seen


def _evict(kept: torch.Tensor, scores: torch.Tensor, hh_size: int, recent_size: int):
    """``H2OKVCache_LayerWise.__call__``: past ``hh_size + recent_size`` entries, keep the latest ``recent_size``
    and the ``hh_size`` best-scored of the others (both tensors ``(H, L)``, in cache order)."""
    length = kept.shape[1]
    if length <= hh_size + recent_size:
        return kept, scores
    heavy = top_indices(scores[:, : length - recent_size], hh_size)
    index = torch.cat([heavy, torch.arange(length - recent_size, length).expand(kept.shape[0], -1)], dim=1)
    return kept.gather(1, index), scores.gather(1, index)
