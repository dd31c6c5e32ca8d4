"""SparQ Attention's selection (Ribar et al., "SparQ Attention: Bandwidth-Efficient LLM Inference", arXiv
2312.04985), ported from ``graphcore-research/llm-inference-research`` at commit
``ead9b6a70e3304e4666ae887cd2c6f506525fea2``, file ``llminference/methods/ann_attention.py``: ``SparseQ.forward``
(the approximate scores) and ``AnnAttention.forward`` (the choice).

What the official code selects at a decode step (``LlamaAttentionWithANN._attn`` runs it only when the query length
is 1, in every layer; the prefill is dense):

1. Per KV group, the ``rank`` channels with the largest ``sum over the group's query heads of |q_i|`` (line 95;
   ``torch.topk``, ties unspecified: here the lowest channel first). One channel set per KV head.
2. Each query head ``h`` scores every position with its own query over those channels, scaled by
   ``1 / sqrt(d * coverage_h)``, ``coverage_h = sum_{i in channels} |q_hi| / sum_i |q_hi|`` (lines 106-114; the
   query is divided before the product). Computed in the model's dtype, then float32 (line 234).
3. The local positions, the current token and the ``local_k`` before it (causal index ``0 .. local_k``, i.e.
   ``[N - 1 - local_k, N)``), get ``finfo(float32).max`` in every head; the scores are **summed over the group**
   (lines 237-241; a local position's sum overflows to ``inf`` once ``G >= 2``, so the local positions stay on top).
4. The ``min(k + 1, N)`` largest sums are kept (line 243-245: ``+ 1`` for the current token, "for free"):
   **one support per KV head**, shared by its query heads. Position 0 is not forced. Ties: ``torch.topk``
   (unspecified; here the lowest position first).

``reallocate_to_mean_value`` (lines 261-266) rescales the output by the approximate mass of the kept positions and
adds the mean value for the rest; it changes the output, not the selection, and is not ported.

Our layout: ``local_k + 1`` local positions are our window ``W`` (both hold the current token), so
``local_k = W - 1``; the official code has no anchor. ``keep_first=True`` (not in the official code) also forces
position 0, our anchor, so that with ``k + 1 = S`` and ``local_k = W - 1`` the port keeps what a selector following
our layout (anchor + window + ``S - 1 - W`` best distant positions) must keep. The repository's example setting
(``scripts/Eval.ipynb``) is ``k = 64, local_k = 16, rank = 16``.
"""

from __future__ import annotations

import torch

from .common import group_size, top_indices


def sparq_channels(queries: torch.Tensor, kv_heads: int, rank: int) -> torch.Tensor:
    """``(KV, rank)``: each group's channels by ``sum_g |q_g|``, largest first (ties: the lowest channel first)."""
    heads, d = queries.shape
    if not 1 <= rank <= d:
        raise ValueError(f"rank must be in [1, {d}], got {rank} (the official topk fails beyond the head size)")
    magnitude = queries.abs().view(kv_heads, heads // kv_heads, d).sum(dim=1)
    return torch.sort(magnitude, dim=-1, descending=True, stable=True).indices[:, :rank]


def sparq_head_scores(queries: torch.Tensor, keys: torch.Tensor, rank: int) -> torch.Tensor:
    """Each query head's approximate logits ``(H, N)`` in float32: its query over its group's channels, divided by
    ``sqrt(d * coverage_h)`` (step 2 of the module)."""
    group = group_size(queries, keys)
    heads, d = queries.shape
    channels = sparq_channels(queries, keys.shape[0], rank).repeat_interleave(group, dim=0)  # (H, rank)
    q_part = queries.gather(1, channels)  # (H, rank), the model's dtype
    k_part = keys.repeat_interleave(group, dim=0).gather(2, channels.unsqueeze(1).expand(-1, keys.shape[1], -1))
    coverage = q_part.abs().sum(-1) / queries.abs().sum(-1)
    scale = (coverage * d).sqrt().unsqueeze(-1)
    return torch.bmm(k_part, (q_part / scale).unsqueeze(-1)).squeeze(-1).float()


def sparq_group_scores(queries: torch.Tensor, keys: torch.Tensor, rank: int, local_k: int, keep_first: bool = False):
    """``(KV, N)`` float32: the group sums of :func:`sparq_head_scores` with the local positions (and position 0
    when ``keep_first``) at ``finfo.max`` in every head before the sum (steps 3 of the module)."""
    group = group_size(queries, keys)
    n = keys.shape[1]
    scores = sparq_head_scores(queries, keys, rank)
    forced = torch.arange(n) >= n - 1 - local_k
    if keep_first:
        forced[0] = True
    scores = scores.masked_fill(forced, torch.finfo(torch.float32).max)
    return scores.view(keys.shape[0], group, n).sum(dim=1)


def sparq_official_supports(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    k: int,
    local_k: int,
    rank: int,
    keep_first: bool = False,
) -> list[torch.Tensor]:
    """What ``AnnAttention.forward`` attends to at one decode step, per query head (each query head of a group gets
    its group's ``min(k + 1, N)`` positions; see the module). ``keep_first`` is the mapping onto our layout, not an
    official option."""
    if k < local_k + keep_first:
        raise ValueError(f"k = {k} cannot hold the {local_k + 1 + keep_first} forced positions (ties then undefined)")
    group = group_size(queries, keys)
    chosen = top_indices(sparq_group_scores(queries, keys, rank, local_k, keep_first), k + 1)
    return [chosen[h // group] for h in range(queries.shape[0])]
