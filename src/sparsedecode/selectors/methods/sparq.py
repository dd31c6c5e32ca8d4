"""SparQ Attention's approximate scores (Ribar et al., "SparQ Attention: Bandwidth-Efficient LLM Inference",
arXiv 2312.04985), as a token selector.

Written on the public protocol only, as a user would. For each KV head, the ``r`` channels where the group-mean
query is largest in magnitude are taken; every distant position scores its key's dot product with the query over
those channels alone, and the best ``S - 1 - W`` positions are kept. A step reads ``r / d`` of every key for the
selection (SparQ's saving is bandwidth, not a sublinear read), then the support in full. SparQ also rescales the
output by the estimated kept mass and adds a mean-value term; neither is a selection, so neither is here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import SparseDecodeError
from ..base import TokenSelector

if TYPE_CHECKING:
    import torch


def top_channel_scores(query_means: torch.Tensor, keys: torch.Tensor, rank: int) -> torch.Tensor:
    """``(kv, d), (kv, N, d) -> (kv, N)``: dot products over each row's ``rank`` largest ``|q|`` channels (ties: the
    lowest channel first)."""
    import torch

    rank = min(rank, query_means.shape[-1])
    magnitude = query_means.abs()
    order = torch.sort(magnitude, dim=-1, descending=True, stable=True).indices[:, :rank]
    q = query_means.gather(1, order)  # (kv, r)
    k = keys.float().gather(2, order.unsqueeze(1).expand(-1, keys.shape[1], -1))  # (kv, N, r)
    return torch.bmm(k, q.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class SparQ(TokenSelector):
    """Positions by their logit over the query's ``rank`` largest channels (arXiv 2312.04985)."""

    name = "sparq"
    rank: int = 8
    reads = "rank/d channels of every key (SparQ's approximate scores)"

    def key_fraction(self, head_dim: int) -> float:
        return min(self.rank, head_dim) / head_dim

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise SparseDecodeError(f"sparq: rank must be an integer >= 1, got {self.rank!r}")

    def score_positions(self, queries, keys, layout):
        from ..ops import group_mean_queries

        return top_channel_scores(group_mean_queries(queries, keys.shape[0]), keys, self.rank)
