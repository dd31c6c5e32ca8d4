"""Where a decode step's support lies (docs/definitions.md, section 1): the block layout and the positions it reads.

With ``N`` cached positions (the current token included) the support is the anchor (position 0), the local window
``[N - W, N)`` and the chosen distant blocks: the distant region ``[1, N - W)`` cut into blocks of ``B``
consecutive positions starting at position 1, the last one possibly shorter. Pure functions of the layout, shared
by the selectors (:mod:`sparsedecode.selectors`), the attention step and the kernels (:mod:`sparsedecode.kernels`),
which depend on this module and never on the selectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import SparseDecodeError

if TYPE_CHECKING:  # the checks below import no torch: naming a configuration stays cheap
    import torch


MAX_BLOCK_SIZE = 2**31
"""The largest block size: a block's positions are counted in int64 tensor shapes and strides (``blocks * B * d``),
which a block of some 2**62 positions overflows even where no block is kept (``b = 0``)."""


def check_budget(support: object, window: object, block_size: object) -> None:
    """A support of ``support`` positions with a window of ``window`` and blocks of ``block_size``: integers, a window
    holding at least the current token, blocks of at least one position, room for the anchor and the window
    (:class:`~sparsedecode.errors.SparseDecodeError` naming what is wrong otherwise)."""
    for name, value in (("support", support), ("window", window), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise SparseDecodeError(f"{name} must be an integer, got {value!r}")
    if window < 1:
        raise SparseDecodeError(
            f"window must be >= 1, got {window}: the window holds the current token, which every step reads"
        )
    if block_size < 1:
        raise SparseDecodeError(f"block_size must be >= 1, got {block_size}")
    if block_size > MAX_BLOCK_SIZE:
        raise SparseDecodeError(
            f"block_size must be at most 2**31 positions (more than any cache holds), got {block_size}"
        )
    if support < 1 + window:
        raise SparseDecodeError(
            f"support {support} is smaller than anchor + window = {1 + window}; "
            f"use support >= {1 + window} or a smaller window"
        )


def check_seed(seed: object) -> None:
    """A session's seed (what :attr:`BlockLayout.seed` carries to the selectors): an integer in ``[0, 2**63)``."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise SparseDecodeError(f"seed must be an integer in [0, 2**63), got {seed!r}")


def budget_blocks(support: int, window: int, block_size: int) -> int:
    """The distant blocks a block selector keeps, ``b = (S - 1 - W) // B`` (a support is floored to whole blocks)."""
    return (support - 1 - window) // block_size


@dataclass(frozen=True)
class BlockLayout:
    """Where the distant blocks lie for a context of ``n`` positions.

    ``distant_end`` is the first window position; the distant region is ``[1, distant_end)``. ``n_blocks``
    counts all distant blocks, ``n_full`` those with all ``block_size`` positions inside the region.
    """

    n: int
    window: int
    block_size: int
    layer: int = 0
    """The layer the step belongs to (selectors that draw, such as random-blocks, salt their seed with it)."""
    scale: float | None = None
    """The attention's scale (``1/sqrt(d)`` unless the model says otherwise), for selectors that reproduce attention."""
    seed: int = 0
    """The session's seed (:attr:`~sparsedecode.config.SparseConfig.seed`)."""
    distant: int = 0
    """The distant positions the support may read, ``S - 1 - W`` (``b * B`` for block selectors); 0 where the
    caller did not say. For selectors whose candidates come from a budget of their own (Twilight's base selector)."""

    @property
    def distant_end(self) -> int:
        return max(self.n - self.window, 1)

    @property
    def n_blocks(self) -> int:
        return -(-(self.distant_end - 1) // self.block_size)

    @property
    def n_full(self) -> int:
        return (self.distant_end - 1) // self.block_size

    def block_lengths(self, blocks: torch.Tensor) -> torch.Tensor:
        """Number of distant positions in each block index of ``blocks`` (same shape)."""
        starts = 1 + blocks * self.block_size
        return (self.distant_end - starts).clamp(max=self.block_size)


def support_positions(blocks: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions read per KV head: anchor, the chosen blocks (ascending), then the window.

    Returns ``(index, valid)`` of shape ``(kv_heads, 1 + b*B + W)``. Positions of a chosen short last block
    that fall past the distant region are marked invalid (and point at the anchor so a gather stays in
    bounds); callers mask them out.
    """
    import torch

    kv_heads, b = blocks.shape
    block, device = layout.block_size, blocks.device
    offsets = torch.arange(block, device=device)
    distant = (1 + blocks.unsqueeze(-1) * block + offsets).reshape(kv_heads, b * block)
    valid_distant = distant < layout.distant_end
    anchor = torch.zeros(kv_heads, 1, dtype=torch.long, device=device)
    window = torch.arange(layout.distant_end, layout.n, device=device).expand(kv_heads, -1)
    index = torch.cat([anchor, distant.masked_fill(~valid_distant, 0), window], dim=1)
    ones = torch.ones(kv_heads, 1, dtype=torch.bool, device=device)
    valid = torch.cat([ones, valid_distant, ones.expand(kv_heads, window.shape[1])], dim=1)
    return index, valid
