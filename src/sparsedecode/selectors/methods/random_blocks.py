"""Uniformly random blocks: the floor any selector must beat.

Each KV head draws ``b`` distinct blocks uniformly, with a generator seeded by the session's seed, the layer and
``N``, so a run is reproducible and every layer and step draws afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base import BlockSelector

if TYPE_CHECKING:
    import torch


def random_ranks(kv_heads: int, n_blocks: int, seed: int) -> torch.Tensor:
    """Scores ``(kv, n_blocks)`` that rank the blocks by one seeded random permutation per KV head: the top ``b``
    are the first ``b`` drawn."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    scores = torch.empty(kv_heads, n_blocks)
    for h in range(kv_heads):
        scores[h, torch.randperm(n_blocks, generator=generator)] = torch.arange(n_blocks, 0, -1, dtype=torch.float32)
    return scores


@dataclass(frozen=True)
class RandomBlocks(BlockSelector):
    """Uniformly random distant blocks (a floor, not a method)."""

    name = "random-blocks"
    reads = "nothing: b blocks drawn with a fixed seed (the floor)"

    def key_fraction(self, head_dim: int) -> float:
        return 0.0

    def score_blocks(self, queries, keys, layout):
        seed = (layout.seed * 1_000_003 + layout.layer * 65_537 + layout.n) % 2**63  # what manual_seed takes
        return random_ranks(keys.shape[0], layout.n_blocks, seed).to(keys.device)
