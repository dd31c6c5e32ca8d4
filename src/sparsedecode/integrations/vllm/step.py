"""The sparse decode step of one layer over vLLM's pages, for the rows of a forward that decode sparsely: each row
(a sequence, ``N`` positions cached, the current token's included) selects with the library's own rules
(:func:`~sparsedecode.selectors.calls.scores_from`, :func:`~sparsedecode.selectors.select.blocks_from`,
:func:`~sparsedecode.selectors.select.choose_position_set`; supports by
:func:`~sparsedecode.selectors.select.support_of` / :func:`~sparsedecode.selectors.select.token_support`), then every
row attends at once over its support, gathered through its block table. The C kernel reads the pages in place where
it can be built (``kernels/cpu/csrc/paged.h``, every row's mean-dot selection at once too), Triton's page-list
kernel on CUDA (``kernels/triton/paged.py``, the attention; the selection in torch there); torch's path is their
reference. No vLLM import: :mod:`.backend` calls it from inside vLLM, the tests call it on pages built by hand.

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
from ...kernels.cpu.paged import attend_paged, attend_paged_blocks, select_paged
from ...layout import BlockLayout
from ...selectors.calls import scores_from
from ...selectors.select import blocks_from, choose_position_set, support_of, token_support
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
    if batched(cfg, stats) and cache.kernel_serves(queries):  # every row at once, in the C kernel
        blocks = mean_dot_blocks(cfg, stats, queries, tables, lengths)
        return attend_paged_blocks(queries, cache.raw, tables, blocks, lengths, window=cfg.window,
                                   block=cfg.block_size, scale=scale)  # fmt: skip
    supports = [row_support(cfg, cache, stats, queries[r], tables[r], row_layout(cfg, int(n), layer, scale))
                for r, n in enumerate(lengths)]  # fmt: skip
    index = torch.stack([i for i, _ in supports])
    valid = torch.stack([v for _, v in supports])
    return attend_supports(cache, queries, tables, index, valid, scale)


def batched(cfg: SparseConfig, stats: PageStatistics | None) -> bool:
    """Whether the C kernel can select for every row at once: the scoring the kernels implement themselves
    (``mean-dot``, the mean-pooled selector's, over the pages' mean statistics), a fixed budget, one support per KV
    head. The blocks are those of :func:`row_support` (a test compares them)."""
    selector = cfg.selector
    return selector.kernel_scored and not selector.token_level and stats is not None and "mean" in stats.pieces


def mean_dot_blocks(cfg: SparseConfig, stats: PageStatistics, queries, tables, lengths) -> torch.Tensor:
    """Every row's chosen blocks ``(R, kv, b)``, ascending, by the C kernel through the pages (``lengths`` the rows'
    ``N``s)."""
    return select_paged(queries, stats.cache.raw, stats.pieces["mean"], stats.firsts, tables, lengths,
                        block=cfg.block_size, window=cfg.window, b=cfg.blocks)  # fmt: skip


def attend_supports(cache: PagedCache, queries, tables, index, valid, scale: float) -> torch.Tensor:
    """Every row's attention over its support ``index``/``valid (R, rows, S)``, gathered through ``tables``: ``(R, H,
    dv)`` float32. The C kernel reads the pages in place where it can (``kernels/cpu/csrc/paged.h``), on CUDA the
    Triton page-list kernel (``kernels/triton/paged.py``); else one torch indexing gathers every row's support."""
    mask = None if bool(valid.all()) else valid
    if cache.kernel_serves(queries):
        return attend_paged(queries, cache.raw, tables, index, mask, scale)
    if queries.is_cuda and triton_serves(cache, queries):
        from ...kernels.triton.paged import paged_support_attention

        return paged_support_attention(queries, cache.keys.transpose(2, 3), cache.values, tables, index, mask, scale)
    rows_q, query_heads, d = queries.shape
    rows, kv_heads = index.shape[1], cache.keys.shape[1]
    group = query_heads // kv_heads
    per_head = rows == query_heads and group > 1
    heads = torch.arange(rows, device=index.device) // (group if per_head else 1)
    keys, values = cache.gather(tables, index, heads)
    q = queries.view(rows_q, rows, 1 if per_head else group, d)
    return attend_rows(q, keys, values, mask, scale)


def triton_serves(cache: PagedCache, queries: torch.Tensor) -> bool:
    """Whether the Triton page-list kernel (:mod:`sparsedecode.kernels.triton.paged`) reads these pages for
    ``queries``: Triton installed, and the tensors it takes."""
    from ...kernels.triton.attention import triton_installed

    if not triton_installed():
        return False
    from ...kernels.triton.paged import paged_refusal

    return paged_refusal(queries, cache.keys.transpose(2, 3), cache.values) is None


def statistics_for(cfg: SparseConfig, cache: PagedCache) -> PageStatistics | None:
    """The page statistics ``cfg``'s selector reads, or ``None`` for a selector that reads none."""
    selector = cfg.selector
    if selector.token_level or not selector.statistics:
        return None
    return PageStatistics(cache, cfg.block_size, tuple(selector.statistics))
