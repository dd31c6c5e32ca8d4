"""The sparse decode step of one layer over vLLM's pages, for the rows of a forward that decode sparsely: each row
(a sequence, ``N`` positions cached, the current token's included) selects with the library's own rules
(:func:`~sparsedecode.selectors.select.scores_from`, :func:`~sparsedecode.selectors.select.blocks_from`,
:func:`~sparsedecode.selectors.select.choose_position_set`; supports by
:func:`~sparsedecode.selectors.select.support_of` / :func:`~sparsedecode.selectors.select.token_support`), then every
row attends at once over its support, gathered through its block table. Pure torch: :mod:`.backend` calls it from
inside vLLM, the tests call it on pages built by hand.

What a selection reads: a block selector with ``statistics`` reads the pages' block statistics
(:class:`~.pages.PageStatistics`), ``N / B`` of them; a selector handed the keys (SparQ, Twilight, the oracles, a
user's that declares no statistics) is handed the sequence's keys gathered from the pages, which is what such a
method reads anyway. Selectors that rank by the attention positions received (H2O) need a history vLLM's pages do
not keep: :func:`check_servable` refuses them at start-up.
"""

from __future__ import annotations

import torch

from ...config import SparseConfig
from ...errors import SparseDecodeError
from ...kernels.cpu.paged import attend_paged, attend_paged_blocks, paged_refusal
from ...layout import BlockLayout
from ...selectors.select import blocks_from, choose_position_set, scores_from, support_of, token_support
from .batch import block_supports, mean_dot_blocks
from .pages import PagedCache, PageStatistics, attend_rows


def check_servable(cfg: SparseConfig) -> None:
    """One line naming what the vLLM step cannot serve for ``cfg`` (nothing for what it can)."""
    spec = cfg.selector.spec()
    if cfg.selector.uses_history:
        raise SparseDecodeError(
            f"selector {spec} ranks positions by the attention they received at earlier steps, a history vLLM's "
            "paged cache does not keep; choose a selector that reads keys or block statistics"
        )
    if cfg.reuse != 1:
        raise SparseDecodeError(
            f"reuse {cfg.reuse}: the vLLM backend selects afresh at every step (a reused selection would need "
            "per-request state across vLLM's scheduler steps, which an attention backend does not see); use reuse 1"
        )


def row_layout(cfg: SparseConfig, n: int, layer: int, scale: float) -> BlockLayout:
    """The step's layout of a row of ``n`` positions (as the session's :func:`sparse_rows` builds it)."""
    return BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size, layer=layer, scale=scale, seed=cfg.seed,
                       distant=cfg.distant_positions)  # fmt: skip


def row_support(cfg: SparseConfig, cache: PagedCache, stats, q: torch.Tensor, table, layout: BlockLayout):
    """One row's fresh selection: ``(index, valid)`` ``(rows, S)`` positions in the sequence's own coordinates."""
    selector, kv_heads = cfg.selector, cache.keys.shape[1]
    if selector.token_level:
        keys = cache.positions(table, 0, layout.n)
        choice = choose_position_set(selector, cfg.distant_positions, q, keys, layout)
        return token_support(choice, layout)
    if selector.statistics:
        reads = stats.blocks(table, layout)
    else:
        reads = cache.positions(table, 0, layout.n)
    scores = scores_from(selector, q, reads, layout, kv_heads, q.device)
    return support_of(blocks_from(selector, cfg.blocks, scores, layout), layout)


def sparse_rows(cfg: SparseConfig, cache: PagedCache, stats: PageStatistics | None, queries, tables, lengths, *,
                layer: int, scale: float) -> torch.Tensor:  # fmt: skip
    """The sparse step of rows ``queries (R, H, d)`` (post-RoPE, the current tokens'), ``tables (R, >= pages)`` their
    block tables and ``lengths`` their ``N``s (each larger than the effective support): ``(R, H, dv)`` float32."""
    if batched(cfg):
        lengths = torch.as_tensor(lengths, dtype=torch.long)
        blocks = mean_dot_blocks(cfg, stats, queries, tables, lengths)
        if cache.raw is not None and paged_refusal(queries, cache.raw) is None:  # the C kernel makes the supports
            return attend_paged_blocks(queries, cache.raw, tables, blocks, lengths, window=cfg.window,
                                       block=cfg.block_size, scale=scale)  # fmt: skip
        index, valid = block_supports(cfg, blocks, lengths)
    else:
        supports = [row_support(cfg, cache, stats, queries[r], tables[r], row_layout(cfg, int(n), layer, scale))
                    for r, n in enumerate(lengths)]  # fmt: skip
        index = torch.stack([i for i, _ in supports])
        valid = torch.stack([v for _, v in supports])
    return attend_supports(cache, queries, tables, index, valid, scale)


def batched(cfg: SparseConfig) -> bool:
    """Whether every row's selection can be made at once: the scoring the kernels implement themselves (``mean-dot``,
    the mean-pooled selector's), a fixed budget, one support per KV head."""
    selector = cfg.selector
    return (selector.kernel_scoring == "mean-dot" and not selector.adaptive and not selector.per_query_head
            and not selector.token_level)  # fmt: skip


def attend_supports(cache: PagedCache, queries, tables, index, valid, scale: float) -> torch.Tensor:
    """Every row's attention over its support ``index``/``valid (R, rows, S)``, gathered through ``tables``: ``(R, H,
    dv)`` float32. The C kernel reads the pages in place where it can (``kernels/cpu/csrc/paged.h``); else one torch
    indexing gathers every row's support."""
    if cache.raw is not None and paged_refusal(queries, cache.raw) is None:
        return attend_paged(queries, cache.raw, tables, index, None if bool(valid.all()) else valid, scale)
    rows_q, query_heads, d = queries.shape
    rows, kv_heads = index.shape[1], cache.keys.shape[1]
    group = query_heads // kv_heads
    per_head = rows == query_heads and group > 1
    heads = (torch.arange(rows, device=index.device) // (group if per_head else 1)).view(1, rows, 1)
    page = tables.long().gather(1, (index // cache.page_size).view(rows_q, -1)).view_as(index)
    offset = index % cache.page_size
    keys, values = cache.keys[page, heads, :, offset], cache.values[page, heads, offset]
    q = queries.view(rows_q, rows, 1 if per_head else group, d)
    return attend_rows(q, keys, values, None if bool(valid.all()) else valid, scale)


def statistics_for(cfg: SparseConfig, cache: PagedCache) -> PageStatistics | None:
    """The page statistics ``cfg``'s selector reads, or ``None`` for a selector that reads none."""
    selector = cfg.selector
    if selector.token_level or not selector.statistics:
        return None
    return PageStatistics(cache, cfg.block_size, tuple(selector.statistics))
