"""SparQ Attention's approximate scores (Ribar et al., "SparQ Attention: Bandwidth-Efficient LLM Inference",
arXiv 2312.04985), as a token selector.

As the official code selects (``graphcore-research/llm-inference-research``, ``llminference/methods/
ann_attention.py``: ``SparseQ.forward`` and ``AnnAttention.forward``), per KV head (``grouping="group-sum"``, the
default): the ``r`` channels with the largest ``sum over the group's query heads of |q_i|``; each query head's
logits over those channels, its query divided by ``sqrt(d * coverage_h)`` (``coverage_h`` the share of its ``|q|``
on those channels); the logits summed over the group; the best ``S - 1 - W`` distant positions kept (the official
code forces its local positions, our window, and keeps ``k + 1`` positions: ``k + 1 = S``, ``local_k = W - 1``;
position 0, our anchor, is always read here). ``grouping="mean-query"`` is the variant this project ran before: the
``r`` largest channels of the group's mean ``|q|``, its unscaled dot product (every row recorded as ``sparq`` before
then is ``sparq:grouping=mean-query``). A step reads ``r / d`` of every key for the selection (SparQ's saving is
bandwidth, not a sublinear read), then the support in full. SparQ also rescales the output by the estimated kept
mass and adds a mean-value term; neither is a selection, so neither is here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import SparseDecodeError
from ..base import TokenSelector

if TYPE_CHECKING:
    import torch


def position_dots(keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """``(kv, N, r), (kv, r) -> (kv, N)``: each position's dot product with its row's query, computed alike for every
    position, so equal keys score equally and rank by the tie rule (a matrix product rounds some positions otherwise:
    its tiles at the end of ``N`` sum in another order)."""
    return (keys * query.unsqueeze(1)).sum(dim=-1)


def top_channel_scores(query_means: torch.Tensor, keys: torch.Tensor, rank: int) -> torch.Tensor:
    """``(kv, d), (kv, N, d) -> (kv, N)``: dot products over each row's ``rank`` largest ``|q|`` channels (ties: the
    lowest channel first)."""
    import torch

    rank = min(rank, query_means.shape[-1])
    magnitude = query_means.abs()
    order = torch.sort(magnitude, dim=-1, descending=True, stable=True).indices[:, :rank]
    q = query_means.gather(1, order)  # (kv, r)
    k = keys.float().gather(2, order.unsqueeze(1).expand(-1, keys.shape[1], -1))  # (kv, N, r)
    return position_dots(k, q)


def group_sum_scores(queries: torch.Tensor, keys: torch.Tensor, rank: int) -> torch.Tensor:
    """SparQ's group rule, ``(H, d), (kv, N, d) -> (kv, N)`` float32: each group's channels by its summed ``|q|``,
    each query head's logits over them with its query scaled by ``1 / sqrt(d * coverage)``, summed over the group."""
    import torch

    heads, d = queries.shape
    kv_heads, n, _ = keys.shape
    group = heads // kv_heads
    rank = min(rank, d)
    q = queries.float()
    summed = q.abs().view(kv_heads, group, d).sum(dim=1)  # (kv, d)
    channels = torch.sort(summed, dim=-1, descending=True, stable=True).indices[:, :rank]  # (kv, r)
    per_head = channels.repeat_interleave(group, dim=0)  # (H, r)
    q_part = q.gather(1, per_head)  # (H, r)
    coverage = q_part.abs().sum(dim=-1) / q.abs().sum(dim=-1)
    # a head whose chosen channels are all zero (a zero query among them) scores every position 0, as its logits are
    scaled = q_part / (coverage * d).sqrt().unsqueeze(-1)
    q_part = torch.where((coverage > 0).unsqueeze(-1), scaled, torch.zeros_like(q_part))
    k_part = keys.float().gather(2, channels.unsqueeze(1).expand(-1, n, -1))  # (kv, N, r): the group's channels
    q_part = q_part.view(kv_heads, group, rank)
    scores = position_dots(k_part, q_part[:, 0])  # each query head's logits, summed over the group
    for member in range(1, group):
        scores += position_dots(k_part, q_part[:, member])
    return scores


GROUPINGS = ("group-sum", "mean-query")


@dataclass(frozen=True)
class SparQ(TokenSelector):
    """Positions by SparQ's approximate logits over the group's ``rank`` largest query channels (arXiv 2312.04985)."""

    name = "sparq"
    rank: int = 8
    grouping: str = "group-sum"
    reads = "rank/d channels of every key (SparQ's approximate scores)"

    def key_fraction(self, head_dim: int) -> float:
        return min(self.rank, head_dim) / head_dim

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise SparseDecodeError(f"sparq: rank must be an integer >= 1, got {self.rank!r}")
        if self.grouping not in GROUPINGS:
            raise SparseDecodeError(f"sparq: grouping must be one of {', '.join(GROUPINGS)}, got {self.grouping!r}")

    def score_positions(self, queries, keys, layout):
        if self.grouping == "group-sum":
            return group_sum_scores(queries, keys, self.rank)
        from ..ops import group_mean_queries

        return top_channel_scores(group_mean_queries(queries, keys.shape[0]), keys, self.rank)
