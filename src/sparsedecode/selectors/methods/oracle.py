"""Oracles: the blocks or positions of largest true attention mass (summed over each GQA group).

They read every key at every selection, so they bound what a selector could reach at a support; they are
references, not methods one could deploy (``reads_every_key``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import BlockSelector, TokenSelector


@dataclass(frozen=True)
class OracleBlocks(BlockSelector):
    """The blocks of largest true attention mass under the step's own queries (a reference)."""

    name = "oracle-blocks"
    reads_every_key = True
    reads = "every key (true block attention mass): an upper reference"

    def score_blocks(self, queries, keys, layout):
        from ..ops import block_masses, group_attention

        return block_masses(group_attention(queries, keys, layout.scale or keys.shape[-1] ** -0.5), layout)


@dataclass(frozen=True)
class OracleTokens(TokenSelector):
    """The distant positions of largest true attention under the step's own queries (a reference)."""

    name = "oracle-tokens"
    reads_every_key = True
    reads = "every key (true per-position attention): an upper reference"

    def score_positions(self, queries, keys, layout):
        from ..ops import group_attention

        return group_attention(queries, keys, layout.scale or keys.shape[-1] ** -0.5)
