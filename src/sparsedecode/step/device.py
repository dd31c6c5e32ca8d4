"""The capturable step without host work: every decision a tensor operation of fixed shape, so a CUDA graph can
replay it (:mod:`sparsedecode.compiled.op` runs it inside its custom op on CUDA; tests run it on the CPU).

What it serves: the library's block selectors with a fixed budget that read block statistics (mean-pooled, Quest).
A user's selector of that kind takes the op's general step instead, where the library hands it copies and checks
the scores it returns (shape, device, kind, finite): traced into a graph, a wrong device or shape would end in the
compiler's traceback rather than one line naming the selector. Shapes never depend on the context
length ``n``, which stays a tensor: the selector scores every slot of the statistics storage (``capacity`` blocks)
against a layout of the whole cache, and the scores of slots past the context's distant blocks are masked to
``-inf``; the top ``b`` come from a stable sort (ties to the lowest index, the project's rule); the support is
the anchor, the ``b`` chosen blocks and ``W`` window slots, each position valid or masked. While the context fits the
support every distant block is chosen, so the same formula is dense attention over ``[0, n)``.

Block statistics: a block's statistic depends only on its keys, so each call recomputes the block holding the
newest key (over the positions written so far: exact once the block is complete), and a multi-token forward
(prefill, outside any graph) computes every block it wrote (:func:`fill_statistics`). The short last distant block
is reduced from its keys at every step, as in the session's step.
"""

from __future__ import annotations

import torch

from ..layout import BlockLayout
from ..selectors.calls import trusted
from ..selectors.statistics import reduce_blocks
from . import schedule


def serves(cfg) -> bool:
    """Whether the device step serves ``cfg`` (see the module): the library's scoring only, on torch operations (no
    ``kernel`` insisted on: ``auto`` or ``torch``)."""
    selector = cfg.selector
    fixed = not selector.token_level and bool(selector.statistics) and not selector.adaptive
    own = cfg.kernel in ("auto", "torch")
    return own and fixed and not selector.per_query_head and trusted(selector, selector.score_blocks)


def fill_statistics(stats: torch.Tensor, kinds, key: torch.Tensor, start: int, n: int, block: int) -> None:
    """Statistics of every block a forward writing ``[start, n)`` touched, from ``key (batch, kv, L, d)`` (eager:
    prefill and multi-token forwards); complete blocks exactly, the last one over its positions below ``n``."""
    first, stop = max((start - 1) // block, 0), (n - 1 + block - 1) // block  # blocks holding positions [start, n)
    if n <= 1 or stop <= first:
        return
    lo, hi = 1 + first * block, min(1 + stop * block, n)
    keys = key[:, :, lo:hi].float()
    padded = torch.nn.functional.pad(keys, (0, 0, 0, (stop - first) * block - (hi - lo)))
    blocks = padded.reshape(*keys.shape[:2], stop - first, block, keys.shape[-1])
    valid = torch.arange((stop - first) * block, device=key.device).reshape(stop - first, block) < hi - lo
    for k, kind in enumerate(kinds):
        stats[k, :, :, :, first:stop] = reduce_blocks(blocks, kind, valid).transpose(-1, -2)


def _newest_block(stats, kinds, key, n, block) -> None:
    """Recompute, per row, the block holding position ``n - 1`` (``n (batch,)``) over its positions below ``n``."""
    batch, kv, _, d = key.shape
    j = ((n - 2).clamp(min=0) // block).clamp(max=stats.shape[-1] - 1)  # (batch,)
    offsets = torch.arange(block, device=key.device)
    index = 1 + j[:, None] * block + offsets  # (batch, B)
    valid = index < n[:, None]
    index = index.clamp(max=key.shape[2] - 1)
    keys = key.gather(2, index[:, None, :, None].expand(batch, kv, block, d)).float()
    slot = j[:, None, None, None].expand(batch, kv, d, 1)
    for k, kind in enumerate(kinds):
        value = reduce_blocks(keys, kind, valid[:, None, :]).unsqueeze(-1)  # (batch, kv, d, 1)
        stats[k].scatter_(3, slot, value)


def _tail(key, kinds, n_full, distant_end, block) -> dict[str, torch.Tensor]:
    """The short last distant block's statistics per row ``(batch, kv, d)`` (any value where there is none)."""
    batch, kv, _, d = key.shape
    index = 1 + n_full[:, None] * block + torch.arange(block, device=key.device)
    valid = index < distant_end[:, None]
    keys = key.gather(2, index.clamp(max=key.shape[2] - 1)[:, None, :, None].expand(batch, kv, block, d)).float()
    return {kind: reduce_blocks(keys, kind, valid[:, None, :]) for kind in kinds}


def _choose(cfg, q, stats, kinds, key, n, layer, scale) -> torch.Tensor:
    """Every row's top ``b`` blocks ``(batch, kv, b)``, ascending, over the distant blocks of a context of ``n``."""
    block, capacity = cfg.block_size, stats.shape[-1]
    distant_end = (n - cfg.window).clamp(min=1)
    n_full = (distant_end - 1) // block
    n_blocks = (distant_end - 1 + block - 1) // block
    tail = _tail(key, kinds, n_full, distant_end, block)
    slots = torch.arange(capacity, device=key.device)
    layout = BlockLayout(n=1 + cfg.window + capacity * block, window=cfg.window, block_size=block, layer=layer,
                         scale=scale, seed=cfg.seed)  # fmt: skip
    chosen = []
    for i in range(q.shape[0]):  # rows: a Python loop of fixed length, unrolled into the graph
        is_tail = (slots == n_full[i])[None, :, None]
        reads = {
            kind: torch.where(is_tail, tail[kind][i][:, None, :], stats[k, i].transpose(-1, -2))
            for k, kind in enumerate(kinds)
        }
        scores = cfg.selector.score_blocks(q[i], reads, layout).float()
        scores = scores.masked_fill(slots[None, :] >= n_blocks[i], float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : cfg.blocks]
        chosen.append(order.sort(dim=-1).values)
    return torch.stack(chosen)


def _attend(cfg, query, key, value, blocks, n, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every row over its support: ``(batch, 1, H, dv)`` in the query dtype and positions read."""
    batch, heads, _, d = query.shape
    kv, block = key.shape[1], cfg.block_size
    distant_end = (n - cfg.window).clamp(min=1)
    offsets = torch.arange(block, device=key.device)
    distant = (1 + blocks[..., None] * block + offsets).reshape(batch, kv, blocks.shape[-1] * block)  # b may be 0
    window = distant_end[:, None] + torch.arange(cfg.window, device=key.device)  # (batch, W)
    index = torch.cat(
        [torch.zeros(batch, kv, 1, dtype=torch.long, device=key.device), distant, window[:, None].expand(-1, kv, -1)],
        dim=-1,
    )
    valid = torch.cat(
        [
            torch.ones(batch, kv, 1, dtype=torch.bool, device=key.device),
            distant < distant_end[:, None, None],
            (window < n[:, None])[:, None].expand(-1, kv, -1),
        ],
        dim=-1,
    )
    index = torch.where(valid, index, 0)
    keys = key.gather(2, index[..., None].expand(-1, -1, -1, d)).float()
    values = value.gather(2, index[..., None].expand(-1, -1, -1, value.shape[-1])).float()
    q = query[:, :, 0].float().reshape(batch, kv, heads // kv, d)
    logits = torch.einsum("bkgd,bksd->bkgs", q, keys) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    out = torch.einsum("bkgs,bksd->bkgd", logits.softmax(dim=-1), values)
    return out.reshape(batch, 1, heads, -1).to(query.dtype), valid.sum(dim=(1, 2))


def device_step(cfg, kinds, layer, scale, query, key, value, position, stats, blocks, step, last, tally):
    """The step of :func:`~sparsedecode.compiled.op.sparse_step` in tensor operations only (see the module)."""
    n = position.reshape(position.shape[0], -1)[:, -1] + 1  # (batch,)
    _newest_block(stats, kinds, key, n, cfg.block_size)  # the statistics are recomputed, not kept: no count
    _, chained, _ = schedule.after_write(0, step, last, n - 1, n, n - 1, cfg.block_size)
    sparse = n > cfg.effective_support
    fresh, after = schedule.decode_step(chained, sparse, cfg.reuse, cfg.selector.reselects_every_step)
    chosen = _choose(cfg, query[:, :, 0].float(), stats, kinds, key, n, layer, scale)
    blocks.copy_(torch.where((fresh | ~sparse)[:, None, None], chosen, blocks))  # a dense step reads every block
    out, read = _attend(cfg, query, key, value, blocks, n, scale)
    step.copy_(after)
    last.copy_(n)
    schedule.count_step(tally, sparse.sum(), (~sparse).sum(), torch.where(sparse, read, 0).sum(), key.shape[1])
    return out
