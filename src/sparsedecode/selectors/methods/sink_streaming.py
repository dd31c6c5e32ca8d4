"""StreamingLLM with several attention sinks (Xiao et al., "Efficient Streaming Language Models with Attention
Sinks", arXiv 2309.17453, whose default is 4 sink tokens).

Written on the public protocol only, as a user would. The first ``sinks`` positions (the anchor, position 0, is one
of them) and the most recent positions fill the support: positions ``1 .. sinks - 1`` outrank every other distant
position, the rest rank by recency. ``sinks = 1`` is the ``streaming`` selector.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SparseDecodeError
from ..base import TokenSelector


@dataclass(frozen=True)
class SinkStreaming(TokenSelector):
    """The first ``sinks`` positions and the last ``S - sinks`` (arXiv 2309.17453)."""

    name = "sink-streaming"
    reselects_every_step = True
    sinks: int = 4
    reads = "nothing: the first sinks positions + the last S - sinks"

    def key_fraction(self, head_dim: int) -> float:
        return 0.0

    def __post_init__(self) -> None:
        if isinstance(self.sinks, bool) or not isinstance(self.sinks, int) or self.sinks < 1:
            raise SparseDecodeError(f"sink-streaming: sinks must be an integer >= 1, got {self.sinks!r}")

    def score_positions(self, queries, keys, layout):
        import torch

        n = layout.n
        scores = torch.arange(n, dtype=torch.int64, device=keys.device)  # integers: float32 ties past 2**24
        scores[1 : min(self.sinks, n)] = n  # above every recency score
        return scores.expand(keys.shape[0], -1)
