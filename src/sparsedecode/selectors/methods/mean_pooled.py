"""The mean-pooled block selector (docs/definitions.md, section 1): the project's reference method.

Block ``j`` of KV head ``h`` scores ``<q_h, c_j> / sqrt(d)``, with ``q_h`` the mean of the post-RoPE queries of the
heads sharing KV head ``h`` and ``c_j`` the block's mean key (kept incrementally by the session). The C and Triton
kernels implement this scoring themselves (``kernel_scoring = "mean-dot"``). Reference: "Attention-Mass
Condensation for Sparse Decoding", arXiv 2602.06317.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import BlockSelector


@dataclass(frozen=True)
class MeanPooled(BlockSelector):
    """Blocks by the group-mean query against the block mean key (arXiv 2602.06317)."""

    name = "mean-pooled"
    statistics = ("mean",)
    kernel_scoring = "mean-dot"
    reads = "N/B float32 centroids (cached) + the tail block's keys"

    def score_blocks(self, queries, keys, layout):
        from ..ops import group_mean_queries, mean_pooled_scores

        means = keys["mean"]
        return mean_pooled_scores(group_mean_queries(queries, means.shape[0]), means)
