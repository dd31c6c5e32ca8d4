"""From a selector's scores to a step's support: the library's half of the protocol, the same for every selector.

:func:`choose_blocks` and :func:`choose_positions` hand a selector what it declared it reads (keys, incrementally kept
block statistics, or H2O's history), check what it returns (shape, finite values; one line naming the selector
otherwise), and pick with the project's tie rule (:func:`~sparsedecode.selectors.ops.top_blocks`). An adaptive block
selector's budget keeps the first ``k_h <= b`` of the chosen blocks in score order. :func:`select_support` is the
public one-call form.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .. import kernels
from ..errors import SparseDecodeError
from ..layout import BlockLayout, budget_blocks, check_budget, check_seed, support_positions
from ..validate import check_count, check_finite
from .base import BlockSelector, Selector, TokenSelector
from .calls import call_selector, checked_scores, scores_from, support_rows
from .ops import token_index, top_blocks, top_positions
from .registry import resolve_selector
from .statistics import BlockStatistics, reduce_blocks


@dataclass
class BlockChoice:
    """The blocks a step reads per KV head, ascending ``(kv, b)``; ``budget_mask`` ``(kv, b)`` marks those an adaptive
    budget kept (``None``: all of them)."""

    blocks: torch.Tensor
    budget_mask: torch.Tensor | None = None


def block_statistics(cache: BlockStatistics, keys: torch.Tensor, layout: BlockLayout) -> dict[str, torch.Tensor]:
    """Every distant block's statistics ``(kv, n_blocks, d)``: the cached full blocks (extended by any completed since
    the last call) and the short last block reduced on the fly."""
    stats = cache.update_all(keys, layout.n_full)
    if layout.n_blocks == layout.n_full:
        return stats
    tail = keys[:, 1 + layout.n_full * layout.block_size : layout.distant_end].float().unsqueeze(1)
    return {kind: torch.cat([stats[kind], reduce_blocks(tail, kind)], dim=1) for kind in cache.kinds}


def block_scores(selector: BlockSelector, cache: BlockStatistics, queries, keys, layout: BlockLayout) -> torch.Tensor:
    """The selector's checked float32 scores ``(kv, n_blocks)``."""
    reads = block_statistics(cache, keys, layout) if selector.statistics else keys[:, : layout.n]
    return scores_from(selector, queries, reads, layout, keys.shape[0], keys.device)


def blocks_from(selector: BlockSelector, budget: int, scores: torch.Tensor, layout: BlockLayout) -> BlockChoice:
    """The ``budget`` top-scored blocks per row, ascending, with the tie rule, and an adaptive budget's mask."""
    blocks = top_blocks(scores, budget)
    return BlockChoice(blocks, _budget(selector, scores, blocks, layout) if selector.adaptive else None)


def _whole_counts(selector: BlockSelector, counts: torch.Tensor) -> torch.Tensor:
    """A budget's counts as integers: whole, finite and not negative, or one line naming the selector (a cast would
    turn -3 and NaN into 0 blocks and 1.9 into 1 without a word)."""
    if counts.dtype == torch.bool or counts.is_complex():
        raise SparseDecodeError(f"selector {selector.spec()}: budget returned {counts.dtype} counts, not integers")
    whole = counts.to(torch.int64) if not counts.is_floating_point() else counts.double()  # int32's clamp overflows
    if counts.is_floating_point() and not bool((torch.isfinite(whole) & (whole == whole.round())).all()):
        raise SparseDecodeError(
            f"selector {selector.spec()}: budget returned counts that are not whole numbers "
            f"({counts.tolist()}): return how many blocks each KV head keeps"
        )
    if bool((whole < 0).any()):
        raise SparseDecodeError(f"selector {selector.spec()}: budget returned negative counts ({counts.tolist()})")
    return whole.clamp(max=2**62).to(torch.long)  # capped at b by the caller; 2**63 and more would cast negative


def _budget(selector: Selector, scores: torch.Tensor, blocks: torch.Tensor, layout) -> torch.Tensor | None:
    """Which of the chosen ``blocks (rows, b)`` (block indices, or positions for a token selector: indices into
    ``scores``) an adaptive budget keeps: its first ``k_r`` in score order, ``(rows, b)`` bool."""
    counts = call_selector(selector, selector.budget, scores, layout=layout)
    if counts is None:
        return None
    rows, b = blocks.shape
    if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != (rows,):
        got = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise SparseDecodeError(f"selector {selector.spec()}: budget returned {got}, expected ({rows},) counts")
    if counts.device != scores.device:
        raise SparseDecodeError(
            f"selector {selector.spec()}: budget returned counts on device {counts.device}, expected {scores.device}"
        )
    counts = _whole_counts(selector, counts).clamp(max=b)
    picked = scores.gather(1, blocks)  # (kv, b): each chosen block's score
    # rank among the chosen: higher score first, ties to the lower index (blocks are ascending)
    ahead = (picked.unsqueeze(1) > picked.unsqueeze(2)) | (
        (picked.unsqueeze(1) == picked.unsqueeze(2)) & (blocks.unsqueeze(1) < blocks.unsqueeze(2))
    )
    return ahead.sum(dim=2) < counts.unsqueeze(1)


def choose_blocks(
    selector: BlockSelector, budget: int, cache: BlockStatistics, queries, keys, layout: BlockLayout, kernel="auto"
) -> BlockChoice:
    """The ``budget`` blocks ``selector`` keeps, per KV head, ascending (see the module).

    A selector whose scoring the kernels implement (``kernel_scoring``) and a fixed budget runs on the kernel
    :func:`sparsedecode.kernels.selection_kernel` picks for ``kernel``: Triton (CUDA) scores and picks without a
    host synchronisation (the same set, best first), the C kernel in one call (the same blocks, ascending); neither
    is asked to check the scores' finiteness the torch path checks, except the C kernel, which does.
    """
    chosen = "torch"
    if selector.kernel_scored:
        chosen = kernels.selection_kernel(kernel, queries, keys, layout)
    return choose_planned_blocks(selector, budget, cache, queries, keys, layout, chosen)


def choose_planned_blocks(
    selector: BlockSelector, budget: int, cache: BlockStatistics, queries, keys, layout: BlockLayout, chosen: str
) -> BlockChoice:
    """:func:`choose_blocks` with the selection kernel already chosen (``"c"``, ``"triton"``; ``"torch"``, the only
    one for a selector the kernels do not score): what a planned step calls."""
    if chosen != "torch" and selector.kernel_scored:
        centroids = cache.update_all(keys, layout.n_full)["mean"]
        return BlockChoice(kernels.select_mean_pooled(chosen, queries, keys, centroids, layout, budget))
    return blocks_from(selector, budget, block_scores(selector, cache, queries, keys, layout), layout)


def choose_positions(
    selector: TokenSelector, count: int, queries, keys, layout: BlockLayout, *, history=None
) -> torch.Tensor:
    """The ``count`` distant positions ``selector`` keeps per row (KV head, or query head for a selector with a
    support per query head), ascending ``(rows, count)``; an adaptive budget's dropped positions included (see
    :func:`choose_position_set`)."""
    return choose_position_set(selector, count, queries, keys, layout, history=history).blocks


def choose_position_set(
    selector: TokenSelector, count: int, queries, keys, layout: BlockLayout, *, history=None
) -> BlockChoice:
    """:func:`choose_positions` with an adaptive budget's mask: ``BlockChoice(positions (rows, count), budget_mask
    (rows, count) or None)``.

    A selector with ``uses_history`` is handed ``history`` ``(kv, >= N)``: the attention each position received from
    the queries *before* this one (the session keeps it)."""
    rows = support_rows(selector, queries.shape[0], keys.shape[0])
    if selector.uses_history:
        if history is None:
            raise SparseDecodeError(
                f"{selector.spec()} ranks positions by the attention they received at earlier steps; pass that "
                "history (history=) or decode inside a sparse_decoding session that saw the prefill"
            )
        reads = history[:, : layout.n]
    else:
        reads = keys[:, : layout.n]
    scores = call_selector(selector, selector.score_positions, queries, reads, layout=layout)
    scores = checked_scores(selector, scores, (rows, layout.n), "score_positions", keys.device)
    positions = top_positions(scores, layout, count)
    return BlockChoice(positions, _budget(selector, scores, positions, layout) if selector.adaptive else None)


def support_of(choice: BlockChoice, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, valid)`` ``(kv, S)`` of a block choice: :func:`~sparsedecode.layout.support_positions`, with the
    blocks an adaptive budget dropped marked invalid."""
    index, valid = support_positions(choice.blocks, layout)
    if choice.budget_mask is not None:
        b, block = choice.blocks.shape[1], layout.block_size
        valid = valid.clone()
        valid[:, 1 : 1 + b * block] &= choice.budget_mask.repeat_interleave(block, dim=1)
    return index, valid


def token_support(choice: BlockChoice, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index, valid)`` ``(rows, 1 + count + W)`` of a token choice: the anchor, its positions, the window; the
    positions an adaptive budget dropped marked invalid."""
    index = token_index(choice.blocks, layout)
    valid = torch.ones_like(index, dtype=torch.bool)
    if choice.budget_mask is not None:
        valid[:, 1 : 1 + choice.blocks.shape[1]] = choice.budget_mask
    return index, valid


def select_support(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    support: int,
    window: int = 64,
    block_size: int = 16,
    method: str | Selector = "mean-pooled",
    seed: int = 0,
    history: torch.Tensor | None = None,
    scale: float | None = None,
    layer: int = 0,
) -> list[torch.Tensor]:
    """Positions each KV head (each query head, for a selector with a support per query head) reads at one decode
    step.

    Args:
        queries: ``(query_heads, d)`` post-RoPE queries of the current token.
        keys: ``(kv_heads, N, d)`` post-RoPE cached keys, the current token's included.
        support: nominal support size; floored to ``1 + window + b * block_size`` for block selectors (see
            :attr:`SparseConfig.effective_support`).
        window, block_size: ``W`` and ``B``.
        method: a registered selector name, a spec string (``"block-top-p:p=0.8"``, ``"path.py:Class"``) or a selector
            instance (``"mean-pooled"`` by default).
        seed: the session's seed (random-blocks draws with it).
        history: ``(kv_heads, N)`` attention each position received at earlier steps; ``h2o`` needs it.
        scale: the attention's scale for selectors that score with it (``1/sqrt(d)`` when None); a model that scales
            otherwise (Gemma 3's ``query_pre_attn_scalar``, Granite's multiplier) needs its own to reproduce a
            session's choice (the attention module's ``scaling``).
        layer: the layer index a session's step would salt its draws with (random-blocks), 0 by default.

    Returns:
        One sorted 1-D ``LongTensor`` per KV head (per query head for a selector with a support per query head):
        the anchor, the chosen blocks and the window, or all ``N`` positions when ``N <= effective support``. A
        chosen short last block, or an adaptive budget, makes a list shorter. Token-level selectors return exactly
        ``support`` positions, fewer with an adaptive budget.

    Raises:
        SparseDecodeError: tensors of the wrong kind or shape, NaN or infinite queries or keys, settings
            :class:`~sparsedecode.config.SparseConfig` refuses, or a selector that fails or returns scores of the wrong
            shape.
    """
    check_budget(support, window, block_size)
    check_seed(seed)
    _check_scale_and_layer(scale, layer)
    selector = resolve_selector(method)
    check_finite(queries, "queries")
    check_finite(keys, "keys")
    shapes_ok = queries.dim() == 2 and keys.dim() == 3 and queries.shape[-1] == keys.shape[-1]
    if not shapes_ok or 0 in keys.shape or 0 in queries.shape or queries.shape[0] % keys.shape[0]:
        raise SparseDecodeError(
            f"expected queries (query_heads, d) and keys (kv_heads, N, d), none of them 0, with query_heads a "
            f"multiple of kv_heads; got {tuple(queries.shape)} and {tuple(keys.shape)}"
        )
    kv_heads, n, d = keys.shape
    if history is not None:
        check_finite(history, "history")
        if tuple(history.shape) != (kv_heads, n):
            raise SparseDecodeError(
                f"history must be (kv_heads, N) = {(kv_heads, n)}, the attention each cached position received; "
                f"got {tuple(history.shape)}"
            )
    blocks = budget_blocks(support, window, block_size)
    rows = support_rows(selector, queries.shape[0], kv_heads)
    if n <= (support if selector.token_level else 1 + window + blocks * block_size):
        return [torch.arange(n, device=keys.device) for _ in range(rows)]
    distant = support - 1 - window if selector.token_level else blocks * block_size
    scale = d**-0.5 if scale is None else float(scale)
    layout = BlockLayout(
        n=n, window=window, block_size=block_size, layer=layer, scale=scale, seed=seed, distant=distant
    )
    if selector.token_level:
        choice = choose_position_set(selector, support - 1 - window, queries, keys, layout, history=history)
        index, valid = token_support(choice, layout)
    else:
        cache = BlockStatistics(block_size, selector.cached_statistics())
        index, valid = support_of(choose_blocks(selector, blocks, cache, queries, keys, layout), layout)
    return [index[h][valid[h]].sort().values for h in range(rows)]  # Triton's blocks come best first


def _check_scale_and_layer(scale, layer) -> None:
    if scale is not None:
        ok = isinstance(scale, numbers.Real) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0
        if not ok:
            raise SparseDecodeError(f"scale must be a positive finite number or None; got {scale!r}")
    check_count(layer, "layer", 0)


def step_layout(cfg, layout: BlockLayout, scale=None, salt=None) -> BlockLayout:
    """``layout`` as a step of ``cfg`` sees it: the attention's ``scale`` and the layer ``salt`` where given, the
    configuration's seed and the distant positions its support may read."""
    return BlockLayout(
        n=layout.n,
        window=layout.window,
        block_size=layout.block_size,
        layer=salt if salt is not None else layout.layer,
        scale=scale if scale is not None else layout.scale,
        seed=cfg.seed,
        distant=cfg.distant_positions,
    )


def select_blocks(cfg, cache: BlockStatistics, queries, keys, layout: BlockLayout, *, scale=None, salt=None):
    """The blocks ``cfg``'s block selector keeps at one step, ascending ``(kv, b)`` (``cfg.kernel`` picks the kernel
    of a selector the kernels score; ``salt`` is the layer). An adaptive budget's dropped blocks are not removed:
    use :func:`choose_blocks` for them."""
    if cfg.selector.token_level:
        raise SparseDecodeError(f"{cfg.selector.spec()!r} is not a block selector")
    step = step_layout(cfg, layout, scale, salt)
    blocks = choose_blocks(cfg.selector, cfg.blocks, cache, queries, keys, step, cfg.kernel).blocks
    return blocks.sort(dim=-1).values  # Triton's come best first


def select_positions(cfg, queries, keys, layout: BlockLayout, *, scale=None, accumulated=None, salt=None):
    """The positions ``cfg``'s token selector reads at one step, ascending ``(kv, S)``: anchor, distant, window."""
    if not cfg.selector.token_level:
        raise SparseDecodeError(f"{cfg.selector.spec()!r} is not a token-level selector")
    step = step_layout(cfg, layout, scale, salt)
    distant = choose_positions(cfg.selector, cfg.distant_positions, queries, keys, step, history=accumulated)
    return token_index(distant, step)
