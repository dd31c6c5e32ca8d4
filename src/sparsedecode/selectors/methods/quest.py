"""Quest's query-aware block selector (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", arXiv 2406.10774).

Each block keeps its per-channel minimum and maximum key; block ``j`` scores the upper bound
``sum_i max(q_i * min_ji, q_i * max_ji) >= q . k`` for every key ``k`` of the block.

As the official code selects (``mit-han-lab/Quest``, ``evaluation/quest_attention.py``: the keys are repeated per
query head before the pages are scored), **every query head** scores the blocks with its own query and reads its own
``b`` blocks (``grouping="per-head"``, the default); the statistics are its KV head's. ``grouping="mean-query"`` is
the variant this project ran before: one block set per KV head from the group's mean query (every row recorded as
``quest`` before then is ``quest:grouping=mean-query``). Where our layout differs from the official one (blocks from
position 1 after the anchor, the anchor and the window always read, a budget of whole blocks) is in
docs/selectors.md; Quest's evaluations keep the first two layers dense (``SparseConfig.dense_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import SparseDecodeError
from ..base import BlockSelector

GROUPINGS = ("per-head", "mean-query")


@dataclass(frozen=True)
class Quest(BlockSelector):
    """Blocks by the largest logit any of their keys could reach, per query head (arXiv 2406.10774)."""

    name = "quest"
    statistics = ("min", "max")
    reads = "2N/B float32 per-channel min/max (cached) + the tail block's keys"
    grouping: str = "per-head"

    def __post_init__(self) -> None:
        if self.grouping not in GROUPINGS:
            raise SparseDecodeError(f"quest: grouping must be one of {', '.join(GROUPINGS)}, got {self.grouping!r}")

    @property
    def per_query_head(self) -> bool:
        return self.grouping == "per-head"

    def score_blocks(self, queries, keys, layout):
        from ..ops import group_mean_queries, quest_scores

        mins, maxs = keys["min"], keys["max"]
        if not self.per_query_head:
            return quest_scores(group_mean_queries(queries, mins.shape[0]), mins, maxs)
        group = queries.shape[0] // mins.shape[0]  # query head h reads KV head h // G
        return quest_scores(queries.float(), mins.repeat_interleave(group, 0), maxs.repeat_interleave(group, 0))
