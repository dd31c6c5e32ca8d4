"""StreamingLLM at the same budget (Xiao et al., "Efficient Streaming Language Models with Attention Sinks",
arXiv 2309.17453): the anchor and the most recent positions.

Every distant position scores its own index, so the ``S - 1 - W`` kept are the latest before the window: with the
window, the anchor and the last ``S - 1`` positions. The choice depends on ``N`` alone and slides with every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base import TokenSelector

if TYPE_CHECKING:
    import torch


def recency(kv_heads: int, n: int, device) -> torch.Tensor:
    """Scores ``(kv, n)``: each position its own index (the latest rank highest), as integers: float32 indices tie
    past 2**24 positions, where the tie rule would keep an earlier position instead of a later one."""
    import torch

    return torch.arange(n, dtype=torch.int64, device=device).expand(kv_heads, -1)


@dataclass(frozen=True)
class Streaming(TokenSelector):
    """The anchor and the last ``S - 1`` positions (arXiv 2309.17453, one sink token)."""

    name = "streaming"
    reselects_every_step = True
    reads = "nothing: anchor + the last S - 1 positions"

    def key_fraction(self, head_dim: int) -> float:
        return 0.0

    def score_positions(self, queries, keys, layout):
        return recency(keys.shape[0], layout.n, keys.device)
