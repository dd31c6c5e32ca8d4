"""Twilight's hierarchical top-p pruning (Lin et al., "Twilight: Adaptive Attention Sparsity with Hierarchical Top-p
Pruning", arXiv 2502.02770), as its official code selects (``tsinghua-ideal/Twilight``, ``twilight/pyimpl/
attention.py``), per query head:

1. **candidates**: a base block selector's support on this project's layout (Quest per query head by default, any
   block selector by ``base=``, a spec as the command line names it: ``mean-pooled``, ``quest:grouping=mean-query``,
   a registered name; its scores rank the blocks, a budget it has is not used): the anchor, its blocks (the
   support's ``b``) and the window;
2. **estimate**: each candidate's logit under the query head from its key quantised per token to ``bits`` bits
   (min-max over the head dimension, 15 levels at 4 bits), scaled as the attention is; a softmax over the candidates;
3. **prune**: top-p with ``p = 0.85`` by default, as Twilight's kernel finds it: a float32 bisection for a threshold
   between 0 and position 0's own probability, stopped when the values around it are within ``1e-5``; every
   candidate above the threshold is kept (the fewest most likely candidates reaching ``p``, never fewer than those at
   least as likely as position 0).

What differs from the official code, by this project's layout: the anchor and the window are always read (Twilight
forces only position 0, through its threshold, and may prune window positions, the current token included); its
probabilities still count them, as the official softmax does. The base selector's blocks start at position 1 and
number the support's ``b`` (Twilight's own Quest: pages from position 0, a budget of its own). The count read varies
per head and step: rows report the support read (mean, min, max). This implementation reduces the base selector's
block statistics from the keys at every step (the library caches statistics for block selectors only), so its
timings are not Twilight's. Twilight's evaluations keep the first two layers dense (``SparseConfig.dense_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from ...errors import SparseDecodeError
from ..base import TokenSelector, parse_spec
from .mean_pooled import MeanPooled
from .oracle import OracleBlocks
from .quest import Quest
from .random_blocks import RandomBlocks

if TYPE_CHECKING:
    import torch

BASES = {cls.name: cls for cls in (Quest, MeanPooled, OracleBlocks, RandomBlocks)}
"""Built-in block selectors a Twilight step takes its candidates from by name (Quest's defaults are per query head,
as Twilight's configurations use it); ``base=`` takes any block selector's spec (:func:`base_of`)."""


def base_of(spec: str):
    """The block selector a Twilight ``base=`` spec names (a name of :data:`BASES` even before the registry is
    imported), or one line saying why there is none."""
    try:
        base = parse_spec(spec)
    except SparseDecodeError as error:
        raise SparseDecodeError(f"twilight: base {spec!r}: {error}") from None
    if base is None:  # the registry not imported yet: the built-in bases only
        if spec not in BASES:
            raise SparseDecodeError(f"twilight: base must be one of {', '.join(BASES)}, got {spec!r}")
        base = BASES[spec]()
    if base.level != "block":
        raise SparseDecodeError(
            f"twilight: base must be a block selector (quest, mean-pooled, ...), got {spec!r}, which selects "
            f"{base.level}s"
        )
    return base


def canonical_base(spec: str, base) -> str:
    """``base``'s spec as its own ``spec()`` writes it (``quest:grouping=per-head`` is ``quest``,
    ``block-top-p:p=0.90`` is ``block-top-p:p=0.9``), so that one Twilight is one selector in every row, folder and
    merge; ``spec`` as given where that spec does not name the same selector again."""
    written = base.spec()
    if written == spec:
        return spec
    try:
        again = base_of(written)
    except SparseDecodeError:  # a spec no twilight spec can carry (a base of several parameters), kept as given
        return spec
    return written if again.identity() == base.identity() else spec


EPS = 1e-5
"""The bisection's stopping width, absolute, as in Twilight's kernel."""


def quantised(keys: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-token asymmetric min-max quantisation over the last dimension, dequantised: ``2**bits - 1`` steps between
    each token's smallest and largest channel (a step of at least ``1e-9``), codes rounded half to even."""
    import torch

    top, bottom = keys.amax(dim=-1, keepdim=True), keys.amin(dim=-1, keepdim=True)
    levels = 2**bits - 1
    step = (top - bottom).clamp(min=1e-9) / levels
    return torch.round((keys - bottom) / step).clamp(0, levels) * step + bottom


def top_p_threshold(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Per row of ``probs (rows, N)`` float32 (0 off the candidates, position 0 in column 0): the threshold
    ``low (rows, 1)`` of Twilight's bisection, keeping ``probs > low`` (see the module)."""
    import torch

    target, eps = torch.tensor(p, dtype=torch.float32), torch.tensor(EPS, dtype=torch.float32)
    low = torch.zeros(probs.shape[0], 1, dtype=torch.float32, device=probs.device)
    high = probs[:, :1].clone()
    done = torch.zeros_like(low, dtype=torch.bool)
    inf = torch.tensor(float("inf"), device=probs.device)
    while not bool(done.all()):
        mid = (low + high) / 2
        mass = torch.where(probs > mid, probs, 0.0).sum(dim=-1, keepdim=True)
        min_above_low = torch.minimum(high, torch.where(probs > low, probs, inf).amin(dim=-1, keepdim=True))
        max_below_high = torch.maximum(low, torch.where(probs <= high, probs, -inf).amax(dim=-1, keepdim=True))
        low = torch.where(done | (mass < target), low, mid)
        high = torch.where(done | (mass >= target), high, torch.minimum(mid, max_below_high))
        done |= ~(max_below_high - min_above_low > eps)
    return low


@dataclass(frozen=True)
class Twilight(TokenSelector):
    """A base block selector's candidates pruned per query head by top-p over 4-bit estimated attention
    (arXiv 2502.02770)."""

    name = "twilight"
    p: float = 0.85
    base: str = "quest"
    bits: int = 4
    reads = "every key (the base's block statistics, reduced here), then its candidates' keys at 4 bits"

    def __post_init__(self) -> None:
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise SparseDecodeError(f"twilight: p must be a number in (0, 1], got {self.p!r}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 16:
            raise SparseDecodeError(f"twilight: bits must be an integer in [1, 16], got {self.bits!r}")
        if not isinstance(self.base, str):
            raise SparseDecodeError(f"twilight: base is a block selector's spec (a name), got {self.base!r}")
        base = base_of(self.base)  # a base that is no block selector is refused when the selector is made
        object.__setattr__(self, "base", canonical_base(self.base, base))

    @cached_property
    def base_selector(self):
        return base_of(self.base)

    def identity(self) -> tuple:
        """Its own identity and its base's: a base named by a file is the class the file held when this selector
        was made (an edited file is another base, whose compiled decoders are not this one's)."""
        return (*super().identity(), self.base_selector.identity())

    def record(self) -> dict:
        """Its record; a base from a file adds the file's sha256 (``base_sha256``), so a folder notices an edit."""
        out = super().record()
        if self.base_selector.source:
            out["base_sha256"] = self.base_selector.source[1]
        return out

    @property
    def per_query_head(self) -> bool:
        return True

    def candidates(self, queries: torch.Tensor, keys: torch.Tensor, layout) -> torch.Tensor:
        """``(H, N)`` bool: the anchor, the base selector's blocks for each query head, and the window."""
        import torch

        from ..calls import scores_from
        from ..ops import top_blocks
        from ..statistics import block_span, reduce_blocks

        heads, n = queries.shape[0], keys.shape[1]
        mask = torch.zeros(heads, n, dtype=torch.bool, device=keys.device)
        mask[:, 0] = True
        mask[:, layout.distant_end :] = True
        base, block = self.base_selector, layout.block_size
        if layout.distant < block:  # a support of no distant block: the anchor and the window
            return mask
        if base.statistics:
            padded = torch.nn.functional.pad(keys[:, : layout.distant_end], (0, 0, 0, layout.n_blocks * block + 1))
            spans = block_span(padded, 0, layout.n_blocks, block)  # (kv, n_blocks, B, d), the short block padded
            valid = torch.arange(layout.n_blocks * block, device=keys.device).view(-1, block) < layout.distant_end - 1
            reads = {kind: reduce_blocks(spans, kind, valid) for kind in base.statistics}
        else:
            reads = keys
        # checked as every selector's scores are, and ranked as they are (float64 and integer scores at their own
        # precision and range: a cast to float32 ties or overflows them); a user's base handed copies
        scores = scores_from(base, queries, reads, layout, keys.shape[0], keys.device)
        chosen = top_blocks(scores, layout.distant // block)
        chosen = chosen if chosen.shape[0] == heads else chosen.repeat_interleave(heads // chosen.shape[0], dim=0)
        positions = 1 + chosen.unsqueeze(-1) * block + torch.arange(block, device=keys.device)
        positions = positions.flatten(1)
        inside = positions < layout.distant_end  # a chosen short last block's padding is no candidate
        rows = torch.arange(heads, device=keys.device).unsqueeze(1).expand_as(positions)
        mask[rows[inside], positions[inside]] = True
        return mask

    def score_positions(self, queries, keys, layout):
        """Each candidate's estimated probability (the softmax over the query head's candidates), -1 elsewhere: the
        library ranks the distant candidates by it and :meth:`budget` keeps those above the top-p threshold."""
        import torch

        heads = queries.shape[0]
        group = heads // keys.shape[0]
        mask = self.candidates(queries, keys, layout)
        estimate = quantised(keys.float(), self.bits).repeat_interleave(group, dim=0)  # (H, N, d)
        logits = torch.bmm(estimate, queries.float().unsqueeze(-1)).squeeze(-1) * layout.scale
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
        return torch.where(mask, probs, -1.0)

    def budget(self, scores, layout):
        probs = scores.clamp(min=0)
        low = top_p_threshold(probs, float(self.p))
        return ((probs > low)[:, 1 : layout.distant_end]).sum(dim=-1)
