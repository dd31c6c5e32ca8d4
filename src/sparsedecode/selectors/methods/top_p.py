"""An adaptive budget: Twilight-style top-p over blocks (Lin et al., "Twilight: Adaptive Attention Sparsity with
Hierarchical Top-p Pruning", arXiv 2502.02770).

Written on the public protocol only, as a user would. Blocks are scored as the mean-pooled selector scores them,
``s_j = <q_h, c_j> / sqrt(d)``. Each block's share of the distant attention mass is estimated as if all its keys sat
at the block mean, ``len_j * exp(s_j)`` normalised over the blocks; each KV head keeps the fewest top-scored blocks
whose estimated shares reach ``p``, and never more than the support's ``b``. So a step may read less than the
support: rows report the support read per step (mean, min, max). Fixed budgets being suboptimal is the
sparse-frontier study's main decode finding (Nawrot et al., arXiv 2504.17768).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import SparseDecodeError
from ..base import BlockSelector

if TYPE_CHECKING:
    import torch


def blocks_for_mass(estimated: torch.Tensor, p: float) -> torch.Tensor:
    """Per row of ``estimated`` ``(kv, n_blocks)`` non-negative masses: the fewest largest entries whose sum reaches
    ``p`` of the row's total (at least one)."""
    shares = estimated / estimated.sum(dim=-1, keepdim=True)
    ordered = shares.sort(dim=-1, descending=True).values
    before = ordered.cumsum(dim=-1) - ordered  # mass of the blocks ranked above each one
    return (before < p).sum(dim=-1).clamp(min=1)


@dataclass(frozen=True)
class TopP(BlockSelector):
    """Mean-pooled scores, keeping the fewest blocks whose estimated attention share reaches ``p`` (arXiv 2502.02770).

    ``p`` in (0, 1]: 1 keeps the whole budget ``b`` at every step.
    """

    name = "top-p"
    statistics = ("mean",)
    p: float = 0.9
    reads = "N/B float32 centroids (cached) + the tail block's keys; at most b blocks, fewer when p is reached"

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise SparseDecodeError(f"top-p: p must be a number in (0, 1], got {self.p!r}")

    def score_blocks(self, queries, keys, layout):
        from ..ops import group_mean_queries, mean_pooled_scores

        means = keys["mean"]
        return mean_pooled_scores(group_mean_queries(queries, means.shape[0]), means)

    def budget(self, scores, layout):
        import torch

        lengths = layout.block_lengths(torch.arange(layout.n_blocks, device=scores.device)).to(scores.dtype)
        estimated = lengths * torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        return blocks_for_mass(estimated, float(self.p))
