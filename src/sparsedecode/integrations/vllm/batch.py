"""Every sparse row's mean-dot selection at once over vLLM's pages: the scoring the kernels implement themselves
(``kernel_scoring = "mean-dot"``: ``<group-mean query, block mean key> / sqrt(d)``,
:func:`~sparsedecode.selectors.ops.mean_pooled_scores`) and the library's tie rule
(:func:`~sparsedecode.selectors.ops.top_blocks`), over rows of different lengths padded to the longest. A few dozen
tensor operations per layer call whatever the batch, where a row-by-row selection costs that per row. The same blocks
as :func:`~.step.row_support` (a test compares them): a padded block scores the lowest float32 and, past every real
block, loses every tie.
"""

from __future__ import annotations

import torch

from ...config import SparseConfig
from ...kernels.cpu.paged import paged_refusal, select_paged
from ...selectors.ops import group_mean_queries, mean_pooled_scores, top_blocks
from .pages import PageStatistics


def block_means(stats: PageStatistics, tables: torch.Tensor, lengths: torch.Tensor, window: int):
    """Every row's distant block means ``(R, kv, blocks, d)`` (rows padded to the most blocks) and how many blocks
    each row has, ``(R,)``."""
    cache, block = stats.cache, stats.block
    page = cache.page_size
    distant_end = lengths - window
    n_full = (distant_end - 1) // block
    n_blocks = -(-(distant_end - 1) // block)
    most = int(n_full.max())
    starts = torch.arange(most + 1, device=tables.device) * block  # chunk j starts at jB; one more for the tail
    tables = tables.long()
    last = tables.shape[1] - 1
    chunk_page = tables.gather(1, (starts // page).clamp(max=last).expand(len(lengths), -1))  # (R, most + 1)
    next_page = tables.gather(1, ((starts + block) // page).clamp(max=last).expand(len(lengths), -1))
    piece = stats.pieces["mean"][chunk_page, :, (starts % page) // block]  # (R, most + 1, kv, d)
    nxt = stats.firsts[next_page, :, ((starts + block) % page) // block]
    means = ((piece + nxt) / block).transpose(1, 2)  # (R, kv, most + 1, d)
    # the short last block of each row, from its keys: positions [1 + n_full B, distant_end)
    offsets = torch.arange(block, device=tables.device)
    tail = 1 + n_full.unsqueeze(1) * block + offsets  # (R, B)
    held = tail < distant_end.unsqueeze(1)
    tail = tail.masked_fill(~held, 0)
    keys = cache.keys[tables.gather(1, tail // page), :, :, tail % page].float()  # (R, B, kv, d)
    weight = held.unsqueeze(-1).unsqueeze(-1)
    tail_mean = (keys * weight).sum(dim=1) / held.sum(dim=1).clamp(min=1).view(-1, 1, 1)
    rows = torch.arange(len(lengths), device=tables.device)
    short = n_blocks > n_full
    means[rows[short], :, n_full[short]] = tail_mean[short]
    return means, n_blocks


def mean_dot_blocks(cfg: SparseConfig, stats: PageStatistics, queries, tables, lengths) -> torch.Tensor:
    """Every row's chosen blocks ``(R, kv, b)``, ascending: the C kernel's selection through the pages where it can
    serve (``kernels/cpu/csrc/paged.h``), else torch's over :func:`block_means`."""
    cache = stats.cache
    if cache.raw is not None and paged_refusal(queries, cache.raw) is None:
        return select_paged(queries, cache.raw, stats.pieces["mean"], stats.firsts, tables, lengths,
                            block=cfg.block_size, window=cfg.window, b=cfg.blocks)  # fmt: skip
    rows_q, query_heads, d = queries.shape
    kv_heads = cache.keys.shape[1]
    means, n_blocks = block_means(stats, tables, lengths, cfg.window)
    width = means.shape[2]
    q = group_mean_queries(queries.reshape(rows_q * query_heads, d), rows_q * kv_heads)  # (R kv, d)
    scores = mean_pooled_scores(q, means.reshape(rows_q * kv_heads, width, d))
    real = torch.arange(width) < n_blocks.repeat_interleave(kv_heads).unsqueeze(1)
    scores = scores.masked_fill(~real, torch.finfo(torch.float32).min)
    return top_blocks(scores, cfg.blocks).view(rows_q, kv_heads, -1)  # ascending, the tie rule


def mean_dot_supports(cfg: SparseConfig, stats: PageStatistics, queries, tables, lengths, scale: float):
    """``(index, valid)`` ``(R, kv, S)`` of every row's mean-dot selection (``lengths`` the rows' ``N``s)."""
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    return block_supports(cfg, mean_dot_blocks(cfg, stats, queries, tables, lengths), lengths)


def block_supports(cfg: SparseConfig, blocks: torch.Tensor, lengths: torch.Tensor):
    """``(index, valid)`` ``(R, kv, S)`` of chosen ``blocks (R, kv, b)`` (``-1``: none) of rows of ``lengths``:
    :func:`~sparsedecode.layout.support_positions` for every row at once."""
    rows_q, kv_heads = blocks.shape[:2]
    block, window = cfg.block_size, cfg.window
    distant_end = (lengths - window).view(rows_q, 1, 1)
    positions = (1 + blocks.unsqueeze(-1) * block + torch.arange(block)).flatten(2)  # (R, kv, b B)
    held = (positions < distant_end) & (positions > 0)
    window_positions = (distant_end + torch.arange(window)).expand(-1, kv_heads, -1)
    anchor = torch.zeros(rows_q, kv_heads, 1, dtype=torch.long)
    index = torch.cat([anchor, positions.masked_fill(~held, 0), window_positions], dim=2)
    ones = torch.ones_like(anchor, dtype=torch.bool)
    return index, torch.cat([ones, held, ones.expand_as(window_positions)], dim=2)
