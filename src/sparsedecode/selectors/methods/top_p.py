"""An adaptive budget over blocks (``block-top-p``): the fewest mean-pooled blocks whose estimated attention share
reaches ``p``.

This project's own adaptive budget, named ``top-p`` until issue #39. It is *not* Twilight's top-p (Lin et al.,
arXiv 2502.02770; that is :mod:`.twilight`): it keeps whole blocks, estimates a block's share from its mean key
alone (``len_j * exp(s_j)``, ``s_j`` the mean-pooled score, normalised over the distant blocks), has no base selector
and groups per KV head. On random keys it rarely prunes (it read what mean-pooled reads in the ports' comparison,
tests/ports/README.md), so "top-p decodes as mean-pooled" was a property of this estimate, not of Twilight's method.
Each KV head keeps the fewest top-scored blocks whose estimated shares reach ``p``, and never more than the
support's ``b``; rows report the support read per step (mean, min, max). Fixed budgets being suboptimal is the
sparse-frontier study's main decode finding (Nawrot et al., arXiv 2504.17768).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import SparseDecodeError
from ..base import BlockSelector

if TYPE_CHECKING:
    import torch


def blocks_for_mass(estimated: torch.Tensor, p: float, scores: torch.Tensor) -> torch.Tensor:
    """Per row of ``estimated`` ``(kv, n_blocks)`` non-negative masses: how many of the top-scored blocks (``scores``
    descending, ties to the lower index: the order in which the selection keeps them) it takes, in that order, for
    their masses to reach ``p`` of the row's total (at least one). Not the fewest largest masses: a short block (the
    distant region's last) can score first and hold little."""
    shares = estimated / estimated.sum(dim=-1, keepdim=True)
    ranked = scores.argsort(dim=-1, descending=True, stable=True)
    ordered = shares.gather(-1, ranked)
    before = ordered.cumsum(dim=-1) - ordered  # mass of the blocks ranked above each one
    if p >= 1:  # every block: a cumulative share rounding to 1 before the last would cut the whole budget short
        return before.new_ones(before.shape[:-1]).long() * before.shape[-1]
    return (before < p).sum(dim=-1).clamp(min=1)


@dataclass(frozen=True)
class TopP(BlockSelector):
    """Mean-pooled scores, keeping the fewest blocks whose estimated attention share reaches ``p``: an adaptive budget
    over blocks (this project's; not Twilight's token-level top-p).

    ``p`` in (0, 1]: 1 keeps the whole budget ``b`` at every step.
    """

    name = "block-top-p"
    statistics = ("mean",)
    p: float = 0.9
    reads = "N/B float32 centroids (cached) + the tail block's keys; at most b blocks, fewer when p is reached"

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise SparseDecodeError(f"block-top-p: p must be a number in (0, 1], got {self.p!r}")

    def score_blocks(self, queries, keys, layout):
        """Mean-pooled scores at the attention's own scale (``layout.scale``: a model's multiplier, such as Granite's
        or Gemma 2's, makes its logits sharper or flatter than ``1/sqrt(d)`` would), so that the estimated shares
        below are the attention's; ``1/sqrt(d)`` where the layout names no scale."""
        from ..ops import group_mean_queries, mean_pooled_scores

        means = keys["mean"]
        return mean_pooled_scores(group_mean_queries(queries, means.shape[0]), means, layout.scale)

    def budget(self, scores, layout):
        import torch

        lengths = layout.block_lengths(torch.arange(layout.n_blocks, device=scores.device)).to(scores.dtype)
        estimated = lengths * torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        return blocks_for_mass(estimated, float(self.p), scores)
