"""Support selection for one decode step (DESIGN.md section 1).

The support of a decode step with N cached positions (the current token included) is

* the anchor, position 0;
* the local window, the last ``W`` positions ``[N - W, N)``;
* the top-``b`` distant blocks: the distant region ``[1, N - W)`` cut into blocks of ``B`` consecutive
  positions starting at position 1 (the last block may be shorter).

The mean-pooled block selector scores block ``j`` for KV head ``h`` by ``<q_h, c_j> / sqrt(d)``, with ``q_h``
the mean of the post-RoPE queries of the heads sharing KV head ``h`` and ``c_j`` the mean key of the block.
Ties are broken towards the lowest block index. Scores are computed in float32 whatever the cache dtype.

Everything here is a pure function on tensors so it can be tested on its own; the attention step in
:mod:`sparsedecode.attention` calls the same functions with incrementally cached block centroids. The layout
(:class:`BlockLayout`, :func:`support_positions`) lives in :mod:`sparsedecode.layout`; which kernel scores the
blocks is decided by :mod:`sparsedecode.kernels`.
"""

from __future__ import annotations

import math

import torch

from . import kernels
from .centroids import BlockCentroids, reduce_blocks
from .config import SparseConfig
from .errors import SparseDecodeError
from .layout import BlockLayout, support_positions  # defined there; importable from here as before
from .validate import check_finite, check_scores


def group_mean_queries(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Mean query of each GQA group: ``(query_heads, d) -> (kv_heads, d)`` in float32.

    Query heads ``h * G .. (h + 1) * G - 1`` share KV head ``h`` (the layout of ``repeat_kv`` in transformers).
    """
    query_heads, d = queries.shape
    if query_heads % kv_heads:
        raise SparseDecodeError(f"{query_heads} query heads cannot share {kv_heads} KV heads evenly")
    return queries.float().view(kv_heads, query_heads // kv_heads, d).mean(dim=1)


def block_centroids(keys: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Mean key of every distant block, recomputed from the keys: ``(kv_heads, N, d) -> (kv_heads, n_blocks, d)``.

    This is the reference the incremental centroid cache must reproduce; float32 whatever the key dtype.
    """
    kv_heads, _, d = keys.shape
    block = layout.block_size
    full = keys[:, 1 : 1 + layout.n_full * block].float().reshape(kv_heads, layout.n_full, block, d).mean(dim=2)
    if layout.n_blocks == layout.n_full:
        return full
    tail = keys[:, 1 + layout.n_full * block : layout.distant_end].float().mean(dim=1, keepdim=True)
    return torch.cat([full, tail], dim=1)


def mean_pooled_scores(query_means: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``s_j = <q_h, c_j> / sqrt(d)``: ``(kv_heads, d), (kv_heads, n_blocks, d) -> (kv_heads, n_blocks)``."""
    d = query_means.shape[-1]
    # (kv, 1, d) @ (kv, d, n_blocks): a row-vector product, fast when the centroids are stored transposed
    return torch.bmm(query_means.unsqueeze(1), centroids.transpose(1, 2)).squeeze(1).mul_(1 / math.sqrt(d))


def top_blocks(scores: torch.Tensor, b: int) -> torch.Tensor:
    """Indices of the ``b`` best blocks per row, ties towards the lowest index, returned in ascending order.

    ``topk`` finds the b-th best score; every block above it is kept and the ties at it are taken in index
    order, so no full sort is needed (``O(n_blocks)`` per row). Non-finite scores raise :class:`SparseDecodeError`
    (whenever a choice is made, i.e. ``0 < b < n_blocks``).
    """
    rows, n_blocks = scores.shape
    if b >= n_blocks:
        return torch.arange(n_blocks, device=scores.device).expand(rows, -1)
    if b == 0:
        return torch.zeros(rows, 0, dtype=torch.long, device=scores.device)
    check_scores(scores)  # NaN compares false with everything: it would silently pick blocks in index order
    best = scores.topk(b + 1, dim=-1)
    if not bool((best.values[:, b - 1] == best.values[:, b]).any()):  # no tie at the cut: topk's set is the answer
        return best.indices[:, :b].sort(dim=-1).values
    kth = best.values[:, b - 1 : b]
    above = scores > kth
    tied = scores == kth
    needed = b - above.sum(dim=-1, keepdim=True)
    take = above | (tied & (tied.cumsum(dim=-1) <= needed))
    return take.nonzero()[:, 1].view(rows, b)


def quest_scores(query_means: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """Quest's bound ``sum_i max(q_i * min_i, q_i * max_i) >= q . k`` for every key of the block.

    ``(kv, d), (kv, n_blocks, d), (kv, n_blocks, d) -> (kv, n_blocks)`` (Quest, arXiv 2406.10774).
    """
    q = query_means.unsqueeze(1)
    return torch.maximum(q * mins, q * maxs).sum(dim=-1)


def group_attention(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """True attention probabilities of each query head over all ``N`` keys, summed over each GQA group.

    ``(query_heads, d), (kv, N, d) -> (kv, N)`` float32. This reads every key: the oracles (and H2O's history at
    steps that are dense anyway).
    """
    kv_heads, _, d = keys.shape
    qg = queries.float().view(kv_heads, -1, d)
    return torch.softmax(torch.bmm(qg, keys.float().transpose(1, 2)) * scale, dim=-1).sum(dim=1)


CAUSAL_CHUNK_ELEMENTS = 1 << 24
"""Attention probabilities held at once by :func:`causal_attention_received` (64 MiB of float32)."""


def causal_attention_received(queries: torch.Tensor, keys: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Attention each key receives from a run of consecutive queries, summed over the queries and each GQA group.

    ``queries`` ``(query_heads, q, d)`` sit at positions ``start .. start + q - 1``; ``keys`` ``(kv, N, d)`` with
    ``N = start + q``; query ``i`` sees keys ``0 .. start + i`` (causal). Returns ``(kv, N)`` float32: H2O's
    accumulated attention for a prefill (or any multi-token forward). Queries are taken in chunks so that at most
    :data:`CAUSAL_CHUNK_ELEMENTS` probabilities exist at a time, whatever the length.
    """
    query_heads, q_len, d = queries.shape
    kv_heads, n, _ = keys.shape
    group = query_heads // kv_heads
    keys_t = keys.float().transpose(1, 2)
    received = torch.zeros(kv_heads, n, dtype=torch.float32, device=keys.device)
    rows = max(1, CAUSAL_CHUNK_ELEMENTS // max(query_heads * n, 1))
    columns = torch.arange(n, device=keys.device)
    for first in range(0, q_len, rows):
        last = min(first + rows, q_len)
        chunk = queries[:, first:last].float().reshape(kv_heads, group * (last - first), d)
        logits = torch.bmm(chunk, keys_t).mul_(scale).view(kv_heads, group, last - first, n)
        positions = torch.arange(start + first, start + last, device=keys.device)
        logits.masked_fill_(columns > positions.unsqueeze(1), float("-inf"))
        received += torch.softmax(logits, dim=-1).sum(dim=(1, 2))
    return received


def block_masses(weights: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Sum of per-position weights ``(kv, N)`` over each distant block: ``(kv, n_blocks)``."""
    distant = weights[:, 1 : layout.distant_end]
    pad = layout.n_blocks * layout.block_size - distant.shape[1]
    return torch.nn.functional.pad(distant, (0, pad)).view(weights.shape[0], layout.n_blocks, -1).sum(dim=-1)


def random_blocks(kv_heads: int, n_blocks: int, b: int, seed: int) -> torch.Tensor:
    """``b`` distinct blocks per KV head drawn uniformly with a seeded generator, ascending."""
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(n_blocks, generator=generator)[:b].sort().values for _ in range(kv_heads)]
    return torch.stack(rows)


def top_positions(weights: torch.Tensor, layout: BlockLayout, count: int) -> torch.Tensor:
    """The ``count`` distant positions with the largest weight per KV head, ascending (ties: lowest first)."""
    return top_blocks(weights[:, 1 : layout.distant_end], count) + 1


def token_index(distant: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Anchor, the given distant positions and the window: ``(kv, 1 + m + W)``."""
    kv_heads = distant.shape[0]
    window = torch.arange(layout.distant_end, layout.n, device=distant.device).expand(kv_heads, -1)
    return torch.cat([distant.new_zeros(kv_heads, 1), distant, window], dim=1)


def streaming_index(kv_heads: int, n: int, support: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """StreamingLLM at the same budget: the anchor and the last ``support - 1`` positions."""
    recent = torch.arange(n - support + 1, n, device=device)
    return torch.cat([recent.new_zeros(1), recent]).expand(kv_heads, -1)


STAT_KINDS = {"mean-pooled": ("mean",), "quest": ("min", "max")}


def _stat_scores(selector: str, query_means: torch.Tensor, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    if selector == "mean-pooled":
        return mean_pooled_scores(query_means, stats["mean"])
    return quest_scores(query_means, stats["min"], stats["max"])


def select_blocks(
    cfg: SparseConfig,
    cache: BlockCentroids,
    queries: torch.Tensor,
    keys: torch.Tensor,
    layout: BlockLayout,
    *,
    scale: float,
    salt: int = 0,
) -> torch.Tensor:
    """The ``cfg.blocks`` distant blocks a block selector keeps, per KV head, ascending: ``(kv, b)``.

    ``mean-pooled`` and ``quest`` read the cached block statistics of ``cache`` (extended by any block
    completed since the last call) and reduce the partial tail block on the fly: ``N / B`` statistics, never
    ``N`` keys. ``oracle-blocks`` reads every key (true block attention mass, summed over the group).
    ``random-blocks`` draws with a generator seeded by ``cfg.seed``, ``salt`` (the layer) and ``N``.
    The caller vouches that the blocks ``cache`` holds still describe ``keys`` (see :meth:`BlockCentroids.truncate`).
    ``mean-pooled`` runs on the kernel :func:`sparsedecode.kernels.selection_kernel` picks for ``cfg.kernel``:
    Triton (CUDA) scores and picks in two kernels without a host synchronisation (the same set, best first
    instead of ascending), the C kernel (float32 on the CPU) in one call (the same blocks, ascending).

    Non-finite scores raise :class:`SparseDecodeError` instead of picking blocks (NaN ranks nowhere): a NaN or
    infinite query or key makes a score non-finite. The C kernel scores internally and checks its scores there (one
    pass over each tile of scores while it is in L1). The Triton path checks nothing, to stay free of host
    synchronisation.
    """
    kv_heads = keys.shape[0]
    if cfg.selector == "mean-pooled":
        kernel = kernels.selection_kernel(cfg.kernel, queries, keys, layout)
        if kernel != "torch":
            centroids = cache.update_all(keys, layout.n_full)["mean"]
            return kernels.select_mean_pooled(kernel, queries, keys, centroids, layout, cfg.blocks)
    if cfg.selector in STAT_KINDS:
        query_means = group_mean_queries(queries, kv_heads)
        scores = _stat_scores(cfg.selector, query_means, cache.update_all(keys, layout.n_full))
        if layout.n_blocks > layout.n_full:
            tail = keys[:, 1 + layout.n_full * cfg.block_size : layout.distant_end].float().unsqueeze(1)
            tail_stats = {kind: reduce_blocks(tail, kind) for kind in cache.kinds}
            scores = torch.cat([scores, _stat_scores(cfg.selector, query_means, tail_stats)], dim=1)
        return top_blocks(scores, cfg.blocks)
    if cfg.selector == "oracle-blocks":
        masses = block_masses(group_attention(queries, keys[:, : layout.n], scale), layout)
        return top_blocks(masses, cfg.blocks)
    if cfg.selector == "random-blocks":
        seed = (cfg.seed * 1_000_003 + salt * 65_537 + layout.n) % 2**63  # what manual_seed takes
        return random_blocks(kv_heads, layout.n_blocks, cfg.blocks, seed).to(keys.device)
    raise SparseDecodeError(f"{cfg.selector!r} is not a block selector")


def select_positions(
    cfg: SparseConfig,
    queries: torch.Tensor,
    keys: torch.Tensor,
    layout: BlockLayout,
    *,
    scale: float,
    accumulated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positions a token-level selector reads, per KV head, ascending: ``(kv, S)`` (all valid).

    ``oracle-tokens`` keeps the ``S - 1 - W`` distant positions of largest true attention (summed over the
    group); ``h2o`` those of largest ``accumulated`` attention ``(kv, >= N - W)``: the attention each position
    received from the queries *before* this one, prefill included (H2O's heavy hitters; the session keeps that
    history, see :class:`~sparsedecode.attention.LayerState`); ``streaming`` the last ``S - 1``.
    """
    kv_heads = keys.shape[0]
    if cfg.selector == "streaming":
        return streaming_index(kv_heads, layout.n, cfg.support, device=keys.device)
    if cfg.selector == "oracle-tokens":
        weights = group_attention(queries, keys[:, : layout.n], scale)
    elif cfg.selector == "h2o":
        if accumulated is None:
            raise SparseDecodeError(
                "h2o ranks positions by the attention they received at earlier steps; pass that history "
                "(accumulated / history=) or decode inside a sparse_decoding session that saw the prefill"
            )
        weights = accumulated
    else:
        raise SparseDecodeError(f"{cfg.selector!r} is not a token-level selector")
    return token_index(top_positions(weights, layout, cfg.distant_positions), layout)


def select_support(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    support: int,
    window: int = 64,
    block_size: int = 16,
    method: str = "mean-pooled",
    seed: int = 0,
    history: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Positions each KV head reads at one decode step.

    Args:
        queries: ``(query_heads, d)`` post-RoPE queries of the current token.
        keys: ``(kv_heads, N, d)`` post-RoPE cached keys, the current token's included.
        support: nominal support size; floored to ``1 + window + b * block_size`` (see
            :attr:`SparseConfig.effective_support`).
        window, block_size: ``W`` and ``B``.
        method: a selector of :data:`~sparsedecode.config.SELECTORS` (``"mean-pooled"`` by default). The
            scale of attention-reading selectors is ``1/sqrt(d)``.
        seed: seeds ``random-blocks``.
        history: ``(kv_heads, N)`` attention each position received at earlier steps; ``h2o`` needs it.

    Returns:
        One sorted 1-D ``LongTensor`` per KV head: the anchor, the chosen blocks and the window, or all
        ``N`` positions when ``N <= effective support``. A chosen short last block makes a list shorter.
        Token-level selectors return exactly ``support`` positions.

    Raises:
        SparseDecodeError: tensors of the wrong kind or shape, NaN or infinite queries or keys, or settings
            :class:`SparseConfig` refuses.
    """
    cfg = SparseConfig(support=support, window=window, block_size=block_size, selector=method, seed=seed)
    check_finite(queries, "queries")
    check_finite(keys, "keys")
    shapes_ok = queries.dim() == 2 and keys.dim() == 3 and queries.shape[-1] == keys.shape[-1]
    if not shapes_ok or keys.shape[0] == 0 or keys.shape[1] == 0 or queries.shape[0] % keys.shape[0]:
        raise SparseDecodeError(
            f"expected queries (query_heads, d) and keys (kv_heads, N, d) with query_heads a multiple of "
            f"kv_heads; got {tuple(queries.shape)} "
            f"and {tuple(keys.shape)}"
        )
    kv_heads, n, d = keys.shape
    if history is not None:
        check_finite(history, "history")
        if tuple(history.shape) != (kv_heads, n):
            raise SparseDecodeError(
                f"history must be (kv_heads, N) = {(kv_heads, n)}, the attention each cached position received; "
                f"got {tuple(history.shape)}"
            )
    if n <= cfg.effective_support:
        return [torch.arange(n, device=keys.device) for _ in range(kv_heads)]
    layout = BlockLayout(n=n, window=window, block_size=block_size)
    scale = d**-0.5
    if cfg.token_level:
        index = select_positions(cfg, queries, keys, layout, scale=scale, accumulated=history)
        return [index[h] for h in range(kv_heads)]
    cache = BlockCentroids(block_size, STAT_KINDS.get(method, ("mean",)))
    blocks = select_blocks(cfg, cache, queries, keys, layout, scale=scale)
    index, valid = support_positions(blocks, layout)
    return [index[h][valid[h]] for h in range(kv_heads)]
