"""Quest's query-aware block selector (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv 2406.10774).

Each block keeps its per-channel minimum and maximum key; block ``j`` scores the upper bound
``sum_i max(q_i * min_ji, q_i * max_ji) >= q . k`` for every key ``k`` of the block, with ``q`` the group-mean query.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import BlockSelector


@dataclass(frozen=True)
class Quest(BlockSelector):
    """Blocks by the largest logit any of their keys could reach (arXiv 2406.10774)."""

    name = "quest"
    statistics = ("min", "max")
    reads = "2N/B float32 per-channel min/max (cached) + the tail block's keys"

    def score_blocks(self, queries, keys, layout):
        from ..ops import group_mean_queries, quest_scores

        return quest_scores(group_mean_queries(queries, keys["min"].shape[0]), keys["min"], keys["max"])
