"""H2O's heavy hitters (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", arXiv 2306.14048).

Distant positions rank by the attention they received from every earlier query of the sequence (the prefill's and
each decode step's, over what that step read), summed over the group's query heads. The session keeps that history
(``uses_history``); selection reads no key.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import TokenSelector


@dataclass(frozen=True)
class H2O(TokenSelector):
    """Positions by the attention they have received so far (arXiv 2306.14048)."""

    name = "h2o"
    uses_history = True
    reads = "its history, N floats (attention received, prefill included): H2O's heavy hitters + window"

    def score_positions(self, queries, history, layout):
        return history
