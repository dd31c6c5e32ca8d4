"""Attention over a chosen support, and exact dense attention of a few tokens: the torch reference every kernel is
tested against (gather the kept keys and values, attend over those alone, in float32)."""

from __future__ import annotations

import torch

from .. import kernels
from ..layout import BlockLayout, support_positions

SHORT_FORWARD = 32
"""Multi-token forwards up to this many tokens inside a session (speculative verification) use
:func:`dense_short_forward`."""


def dense_short_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n: int, scaling: float | None
) -> torch.Tensor:
    """Exact causal dense attention of ``q`` new tokens over a cache of ``n`` positions, without ``repeat_kv``.

    transformers' SDPA path expands the keys and values of every KV head to all its query heads when a mask is
    present (any multi-token forward over a cache), copying the whole cache per layer; here the query heads of a
    group are stacked against their one KV head instead. Returns ``(1, q, query_heads, dv)`` in the query dtype
    (``dv`` the value head dim).
    """
    _, query_heads, q_len, d = query.shape
    kv_heads = key.shape[1]
    group = query_heads // kv_heads
    scale = scaling if scaling is not None else d**-0.5
    keys, values = key[0, :, :n].float(), value[0, :, :n].float()
    q = query[0].float().reshape(kv_heads, group * q_len, d)
    logits = torch.bmm(q, keys.transpose(1, 2)).mul_(scale).view(kv_heads, group, q_len, n)
    positions = torch.arange(n, device=key.device)
    future = positions > positions[n - q_len :].unsqueeze(1)  # key j is after query i's position
    logits.masked_fill_(future, float("-inf"))
    probs = torch.softmax(logits, dim=-1).view(kv_heads, group * q_len, n)
    out = torch.bmm(probs, values).view(query_heads, q_len, values.shape[-1])
    return out.transpose(0, 1).unsqueeze(0).to(query.dtype).contiguous()  # as SDPA's: a model may .view() it


def _gather_support(cache: torch.Tensor, blocks: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Anchor, chosen full blocks and window of one layer's keys or values: ``(kv_heads, S, d)``.

    The anchor and the window are slices; the blocks are one gather over a ``(kv, blocks, B, d)`` view.
    """
    kv_heads, _, d = cache.shape
    block = layout.block_size
    full = cache[:, 1 : 1 + layout.n_full * block].reshape(kv_heads, layout.n_full, block, d)  # a view for KV caches
    picked = full.gather(1, blocks[:, :, None, None].expand(-1, -1, block, d)).view(
        kv_heads, blocks.shape[1] * block, d
    )
    return torch.cat([cache[:, :1], picked, cache[:, layout.distant_end : layout.n]], dim=1)


def _rows(q: torch.Tensor, keys: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The queries grouped as the support's rows read them: ``(rows, G, d)`` float32, and for a support per query
    head (``index`` with a row per query head, ``G > 1``) the KV head each row reads, else ``None``."""
    query_heads, d = q.shape
    kv_heads = keys.shape[0]
    if index.shape[0] == query_heads and query_heads != kv_heads:
        return q.float().unsqueeze(1), torch.arange(query_heads, device=keys.device) // (query_heads // kv_heads)
    return q.float().view(kv_heads, query_heads // kv_heads, d), None


def attend_positions(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    scale: float,
    *,
    weights: bool = False,
    valid: torch.Tensor | None = None,
):
    """Attention over arbitrary positions ``index`` ``(rows, S)`` (token-level selectors, adaptive budgets, supports
    per query head); ``valid`` ``(rows, S)`` masks positions out. A row is a KV head (its group's query heads share
    it) or, with one row per query head, a query head reading its KV head.

    Returns the output ``(query_heads, dv)`` in float32, ``dv`` the value head dim (which may differ from the key
    head dim); with ``weights=True`` also the attention probabilities summed over each row's query heads, ``(rows,
    S)`` (what H2O accumulates).
    """
    query_heads = q.shape[0]
    qg, heads = _rows(q, keys, index)
    kept_keys, kept_values = _gather_positions(keys, index, heads), _gather_positions(values, index, heads)
    if not weights:
        mask = None if valid is None else valid.unsqueeze(1)
        out = torch.nn.functional.scaled_dot_product_attention(qg, kept_keys, kept_values, attn_mask=mask, scale=scale)
        return out.reshape(query_heads, -1)
    logits = torch.bmm(qg, kept_keys.transpose(1, 2)).mul_(scale)
    if valid is not None:  # a masked position is neither attended nor paid attention
        logits.masked_fill_(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.bmm(probs, kept_values).reshape(query_heads, -1), probs.sum(dim=1)


def _gather_positions(cache: torch.Tensor, index: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``index (rows, S)`` of ``cache (kv, N, d)``, row ``r`` from KV head ``r`` (or ``heads[r]``): ``(rows, S,
    d)`` in float32, only the positions read copied."""
    if heads is not None:
        return cache[heads.unsqueeze(1), index].float()
    return cache.gather(1, index.unsqueeze(-1).expand(-1, -1, cache.shape[-1])).float()


def attend_support(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    layout: BlockLayout,
    scale: float,
) -> torch.Tensor:
    """Attention half of a sparse step: gather anchor + blocks + window and attend over them alone (float32).

    Returns the output ``(query_heads, dv)`` in float32, ``dv`` the value head dim (which may differ from the key
    head dim). ``blocks`` has a row per KV head (all query heads of a GQA group share the positions of their KV head)
    or a row per query head (each reads its own). Positions are those of
    :func:`~sparsedecode.layout.support_positions`; ``blocks`` may come in any order (Triton's selection gives
    them best first).
    """
    query_heads = q.shape[0]
    kv_heads = keys.shape[0]
    per_head = blocks.shape[0] == query_heads != kv_heads
    short_tail = blocks.shape[1] > 0 and layout.n_blocks > layout.n_full and bool((blocks == layout.n_blocks - 1).any())
    if short_tail or per_head:  # gather by position (a short last block's padding masked)
        index, valid = support_positions(blocks, layout)
        return attend_positions(q, keys, values, index, scale, valid=valid if short_tail else None)
    qg = q.float().view(kv_heads, query_heads // kv_heads, q.shape[1])
    kept_keys, kept_values = _gather_support(keys, blocks, layout), _gather_support(values, blocks, layout)
    out = torch.nn.functional.scaled_dot_product_attention(qg, kept_keys.float(), kept_values.float(), scale=scale)
    return out.reshape(query_heads, -1)


def attend_blocks(cfg, q, keys, values, blocks, layout, scale) -> torch.Tensor:
    """Attention over a block selector's support by the kernel :func:`sparsedecode.kernels.attention_kernel` picks
    for ``cfg.kernel`` (the torch path where no kernel can serve under ``auto``; an insisted-on kernel that cannot
    raises)."""
    kernel = kernels.attention_kernel(cfg.kernel, q, keys, values, layout)
    return attend_blocks_on(kernel, q, keys, values, blocks, layout, scale)


def attend_blocks_on(kernel: str, q, keys, values, blocks, layout, scale) -> torch.Tensor:
    """Attention over anchor + ``blocks`` + window by ``kernel`` as already chosen (``"torch"``, ``"c"`` or
    ``"triton"``): what a planned step calls."""
    if kernel == "torch":
        return attend_support(q, keys, values, blocks, layout, scale)
    kv_heads, rows = keys.shape[0], blocks.shape[0]
    if rows == kv_heads:
        return kernels.attend(kernel, q, keys, values, blocks, layout, scale)
    # blocks per query head: the kernels read one support per KV head, so member g of every KV group is one call
    # of groups of one (the query heads kv * G + g, their blocks), G calls in all
    group = rows // kv_heads
    parts = [
        kernels.attend(
            kernel,
            q.view(kv_heads, group, -1)[:, g].contiguous(),
            keys,
            values,
            blocks.view(kv_heads, group, -1)[:, g].contiguous(),
            layout,
            scale,
        )
        for g in range(group)
    ]
    return torch.stack(parts, dim=1).reshape(rows, -1)
