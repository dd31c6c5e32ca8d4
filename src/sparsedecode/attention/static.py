"""A capturable sparse decode step: the step as one torch custom op over state in preallocated tensors, for a
static (preallocated) KV cache, so that ``torch.compile(..., fullgraph=True)`` can take a whole decode step.

The session's step (:mod:`~sparsedecode.attention.forward`) decides in Python, per layer and step, from state kept
in Python objects and found through a context variable: nothing a compiler can trace. Here every attention module
of the model carries a :class:`StaticLayer` (attribute :data:`STATE`), whose tensors hold what the session's
:class:`~sparsedecode.attention.LayerState` holds for one sequence of a batch without padding:

* ``stats (kinds, batch, kv, d, capacity)`` float32: the block statistics the selector reads, the storage of a
  :class:`~sparsedecode.centroids.BlockCentroids` (the C kernel reads it in place); ``count (batch,)`` how many
  blocks hold values;
* ``blocks`` / ``keep (batch, kv, b)``: the block selection being reused (``keep``: what an adaptive budget kept),
  ``positions (batch, kv, distant)`` a token selector's; ``step (batch,)``: sparse steps of the current chain (the
  reuse counter); ``last (batch,)``: the context length of the layer's last call;
* ``tally (4,)`` int64: sparse row-steps, dense row-steps, positions read by sparse steps (summed over KV heads),
  KV heads of the sparse row-steps.

:func:`sparse_step` (``torch.ops.sparsedecode.sparse_step``) is one layer's decode step of every row: it reads the
context length from the position ids inside the op (a host read the compiler never sees), then runs the library's
selection and kernels (:func:`~sparsedecode.selectors.select.choose_planned_blocks`,
:func:`~sparsedecode.attention.attend.attend_blocks_on`): the same blocks and outputs as the session's step. Its
fake implementation only says the output's shape, so the compiled graph holds one call per layer and no Python.

Why the state is never stale: every write into the cache goes through the attention function, and each call
writes positions ``[start, n)`` and drops what was derived from them (:func:`_truncate`): block statistics of blocks
reaching ``start``, and the reuse chain unless the call continues it (a decode step at ``start == last``). A new
prompt (a forward from position 0), a crop or a rollback thus keep only what still describes the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .. import env, kernels
from ..config import SparseConfig
from ..errors import SparseDecodeError
from ..layout import BlockLayout
from ..selectors import choose_positions, token_index
from ..selectors.select import BlockChoice, choose_planned_blocks, support_of
from .attend import attend_blocks_on, attend_positions
from .prepared import PREPARED, block_reads, centroids_of, prepare, signature_of
from .static_device import device_step, fill_statistics, serves
from .step import plan_step

STATIC_ATTENTION = "sparsedecode-static"
"""The attention implementation name the capturable step registers under."""
STATE = "_sparsedecode_static"
"""The attribute of an attention module that holds its :class:`StaticLayer`."""

FUSE = env.flag("SPARSEDECODE_FUSE_STEP", False)
"""Where the host-free step serves the selector, trace it into the compiled graph (the compiler fuses it with the
layer) instead of calling the custom op: ``SPARSEDECODE_FUSE_STEP=1``. Off by default: on the 2-core development
CPU it compiled several times slower (minutes for SmolLM2's 30 layers) and decoded no faster than the op."""
DEVICE_STEP_ON_CPU = False
"""Run the host-free step (:mod:`~sparsedecode.attention.static_device`, what CUDA runs) on the CPU too: tests turn
it on to check it against the host step."""

FAST = True
"""Serve the common step (every row's selection scored and attended in one C call) by a call prepared once per
layer state (:mod:`~sparsedecode.attention.prepared`); ``False`` takes the general path for it too (tests compare
the two)."""

_CONFIGS: dict[str, SparseConfig] = {}
_PLANS: dict[str, dict] = {}
_SUPPORTS: dict[str, int] = {}  # each config's effective support, read at every call
_KEYS: dict[tuple, str] = {}  # a configuration's identity -> its key


def config_key(cfg: SparseConfig) -> str:
    """The string the op is handed for ``cfg`` (custom ops take strings, not objects): one per configuration as
    :meth:`~sparsedecode.config.SparseConfig.identity` tells them apart (two selectors whose reprs match, say two
    classes ``Sel`` from two files, get two keys)."""
    key = _KEYS.setdefault(cfg.identity(), f"{len(_KEYS)}|{cfg!r}")
    _CONFIGS.setdefault(key, cfg)
    _PLANS.setdefault(key, {})
    _SUPPORTS.setdefault(key, cfg.effective_support)
    return key


@dataclass
class StaticLayer:
    """One attention layer's state for the capturable step (see the module); built by :func:`allocate`."""

    layer: int
    config: str
    cfg: SparseConfig
    host_free: bool
    """The step is the host-free one (:mod:`~sparsedecode.attention.static_device`): traced into the compiled graph
    (:data:`FUSE`), or run inside the op on CUDA; its statistics are filled by every multi-token forward."""
    kinds: tuple[str, ...]
    stats: torch.Tensor
    count: torch.Tensor
    blocks: torch.Tensor
    keep: torch.Tensor
    positions: torch.Tensor
    step: torch.Tensor
    last: torch.Tensor
    tally: torch.Tensor

    def reset(self) -> None:
        """Nothing derived from any key: the state of a new cache."""
        for tensor in (self.count, self.step, self.last, self.tally):
            tensor.zero_()


def allocate(cfg: SparseConfig, layer: int, batch: int, kv_heads: int, head_dim: int, max_len: int, device):
    """A :class:`StaticLayer` for a cache of ``max_len`` positions: every tensor at its final size."""
    kinds = cfg.selector.cached_statistics()
    capacity = max(max_len // cfg.block_size + 1, 1)
    b = max(cfg.blocks, 1)
    distant = max(cfg.distant_positions, 1) if cfg.selector.token_level else 1
    long = dict(dtype=torch.int64, device=device)
    state = StaticLayer(
        layer=layer,
        config=config_key(cfg),
        cfg=cfg,
        host_free=serves(cfg) and (FUSE or torch.device(device).type == "cuda" or DEVICE_STEP_ON_CPU),
        kinds=kinds,
        stats=torch.zeros(len(kinds), batch, kv_heads, head_dim, capacity, dtype=torch.float32, device=device),
        count=torch.zeros(batch, **long),
        blocks=torch.zeros(batch, kv_heads, b, **long),
        keep=torch.ones(batch, kv_heads, b, dtype=torch.bool, device=device),
        positions=torch.zeros(batch, kv_heads, distant, **long),
        step=torch.zeros(batch, **long),
        last=torch.zeros(batch, **long),
        tally=torch.zeros(4, **long),
    )
    for name in ("stats", "count", "blocks", "keep", "positions", "step", "last", "tally"):
        torch._dynamo.mark_static_address(getattr(state, name))  # mutated in place: CUDA graphs keep their memory
    return state


def _truncate(count: torch.Tensor, step: torch.Tensor, last: torch.Tensor, start: int, n: int, block: int) -> None:
    """A call writes positions ``[start, n)``: keep the statistics of the blocks wholly before ``start`` (block
    ``j`` covers ``[1 + j B, 1 + (j + 1) B)``) and the reuse chain only for a decode step that continues it."""
    count.clamp_(max=max((start - 1) // block, 0))
    if not (n - start == 1 and bool((last == start).all())):
        step.zero_()
    last.fill_(n)


def _row(cfg, plan, layout, q, keys, values, cache, blocks, keep, positions, fresh):
    """One row's sparse step outside the one C call: select when ``fresh`` (into the row's state tensors), then
    attend. Returns the output ``(H, dv)`` and the support positions read (summed over KV heads)."""
    selector = cfg.selector
    if selector.token_level:
        if fresh:
            positions.copy_(choose_positions(selector, cfg.distant_positions, q, keys, layout))
        index = token_index(positions, layout)
        return attend_positions(q, keys, values, index, layout.scale), index.numel()
    if fresh:
        choice = choose_planned_blocks(selector, cfg.blocks, cache, q, keys, layout, plan.select)
        blocks.copy_(choice.blocks)
        keep.copy_(choice.keep) if choice.keep is not None else keep.fill_(True)
    if selector.adaptive:
        index, valid = support_of(BlockChoice(blocks, keep), layout)
        return attend_positions(q, keys, values, index, layout.scale, valid=valid), int(valid.sum())
    return attend_blocks_on(plan.attend, q, keys, values, blocks, layout, layout.scale), block_reads(blocks, layout)


def _one_call(cfg, plan, layout, q, key, value, out, caches, blocks, fresh) -> None:
    """Every row's step in one C call, as the session's step makes it: mean-dot selection inside the call where a
    row selects afresh and the C kernel scores the selector, other selectors choosing per row first; ``out (batch,
    H, dv)`` float32."""
    rows = []
    for i, cache in enumerate(caches):
        inside = fresh[i] and plan.select == "c"
        if inside:
            if cache.count < layout.n_full:  # the blocks completed since the last call
                cache.update(key[i], layout.n_full)
        elif fresh[i]:
            choice = choose_planned_blocks(cfg.selector, cfg.blocks, cache, q[i], key[i], layout, plan.select)
            blocks[i].copy_(choice.blocks)
        rows.append((i, 0, layout.n, cache.storage() if inside else None, blocks[i], inside))
    kernels.cpu_batch.run_step_batch(q, key, value, out, rows, cfg.window, cfg.block_size, layout.scale)


def sparse_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position: torch.Tensor,
    stats: torch.Tensor,
    count: torch.Tensor,
    blocks: torch.Tensor,
    keep: torch.Tensor,
    positions: torch.Tensor,
    step: torch.Tensor,
    last: torch.Tensor,
    tally: torch.Tensor,
    config: str,
    layer: int,
    scale: float,
    host_free: bool,
) -> torch.Tensor:
    """One layer's decode step of every row of a batch without padding: ``query (batch, H, 1, d)``, ``key`` /
    ``value (batch, kv, L, d)`` (a static cache, the current token written), ``position (batch, 1)`` the current
    token's position; returns ``(batch, 1, H, dv)`` in the query dtype. Dense over ``[0, n)`` while the context
    fits the support; otherwise each row reuses or refreshes its selection (reuse ``R``) and attends over it."""
    cfg = _CONFIGS[config]
    if host_free:  # the state's flag (StaticLayer.host_free): CUDA, or the CPU where tests ask
        kinds = cfg.selector.statistics
        return device_step(cfg, kinds, layer, scale, query, key, value, position, stats, blocks, step, last, tally)
    n = int(position.reshape(-1)[-1]) + 1  # the host read the compiled graph leaves to the op
    if n > key.shape[2]:
        raise SparseDecodeError(f"sparse_step: position {n - 1} lies past the cache's {key.shape[2]} positions")
    batch, heads = query.shape[0], query.shape[1]
    support = _SUPPORTS[config]
    if FAST and n > support:
        signature = signature_of(config, layer, scale, query, key, value, stats, count, blocks, step, last, tally)
        prepared = PREPARED.get(signature)
        if prepared is not None:
            out = query.new_empty(batch, 1, heads, value.shape[-1], dtype=torch.float32)
            prepared(query, key, stats, out, n)
            return out.to(query.dtype)
    _truncate(count, step, last, n - 1, n, cfg.block_size)
    if n <= support:
        tally[1] += batch
        keys, values = key[:, :, :n], value[:, :, :n]
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size, layer=layer, scale=scale, seed=cfg.seed)
    q = query[:, :, 0, :]
    plan = plan_step(cfg, q[0], key[0], value[0], layout, _PLANS[config])
    if FAST:  # the next calls on these tensors take the prepared call
        prepare(signature, cfg, plan, q, key, value, stats, count, blocks, step, last, tally, scale)
    kinds = cfg.selector.cached_statistics()
    fresh = [bool(f) or cfg.selector.reselects_every_step for f in ((step % cfg.reuse) == 0).tolist()]
    caches = [centroids_of(stats[:, i], kinds, c, cfg.block_size) for i, c in enumerate(count.tolist())]
    if plan.one_call:
        q = q.contiguous()
        direct = query.dtype == torch.float32
        out = torch.empty(q.shape, dtype=torch.float32) if not direct else query.new_empty(q.shape)
        _one_call(cfg, plan, layout, q, key, value, out, caches, blocks, fresh)
        read = block_reads(blocks, layout)
        out = out.view(batch, 1, heads, -1).to(query.dtype)
    else:
        out = query.new_empty(batch, 1, heads, value.shape[-1])
        read = 0
        for i in range(batch):
            out[i, 0], row_read = _row(
                cfg, plan, layout, q[i], key[i], value[i], caches[i], blocks[i], keep[i], positions[i], fresh[i]
            )
            read += row_read
    count.copy_(torch.tensor([cache.count for cache in caches]))
    step += 1
    tally.add_(torch.tensor([batch, 0, read, batch * key.shape[1]]))
    return out


def _fake(query, key, value, *state_and_settings):
    return query.new_empty(query.shape[0], 1, query.shape[1], value.shape[-1])


_LIBRARY = torch.library.Library("sparsedecode", "DEF")
_LIBRARY.define(
    "sparse_step(Tensor query, Tensor key, Tensor value, Tensor position, Tensor(a!) stats, Tensor(b!) count, "
    "Tensor(c!) blocks, Tensor(d!) keep, Tensor(e!) positions, Tensor(f!) step, Tensor(g!) last, Tensor(h!) tally, "
    "str config, int layer, float scale, bool host_free) -> Tensor"
)
# defined with torch.library's schema API rather than the custom_op decorator: its dispatch costs about 8 us a
# call, the decorator's wrappers about 130 us (30 layers: 4 ms a token)
_LIBRARY.impl("sparse_step", sparse_step, "CompositeExplicitAutograd")
torch.library.register_fake("sparsedecode::sparse_step", _fake, lib=_LIBRARY)


def _written(key, value, mask, position):
    """A multi-token forward (a prefill chunk, eager) over the static cache: its keys, values and mask cut to the
    positions written so far, which are all the mask lets through (SDPA over the whole cache read every masked
    position: SmolLM2 8K bfloat16 prefill 45 s against 35 s over a growing cache)."""
    if position is None or mask is None or mask.shape[-1] != key.shape[2] or torch.compiler.is_compiling():
        return key, value, mask
    n = int(position.max()) + 1
    return key[:, :, :n], value[:, :, :n], mask[..., :n]


def static_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function of the capturable step: multi-token forwards dense (SDPA with the mask),
    decode steps :func:`sparse_step` on the module's :class:`StaticLayer`; a module without one, or a
    sliding-window layer, dense."""
    state = getattr(module, STATE, None)
    position = kwargs.get("position_ids")
    if state is not None and position is None:
        raise SparseDecodeError(
            f"compiled sparse decoding needs the position ids in {type(module).__name__}'s attention call, which "
            "this model does not pass; decode without compile"
        )
    if state is not None and tuple(key.shape[1:4:2]) != tuple(state.stats.shape[2:4]):  # a shape: checked when traced
        raise SparseDecodeError(
            f"compiled sparse decoding: {type(module).__name__} has {key.shape[1]} KV heads of {key.shape[3]} where "
            f"the model's config gives {state.stats.shape[2]} of {state.stats.shape[3]}; decode without compile"
        )
    if query.shape[2] > 1 and kwargs.get("sliding_window") is None:
        key, value, attention_mask = _written(key, value, attention_mask, position)
    if state is None and query.shape[2] == 1 and kwargs.get("sliding_window") is None and not dropout:
        # dense decoding over the static cache: grouped heads read their KV head in place (transformers' SDPA path
        # repeats every key and value per query head when a mask is given: a copy of the whole cache per layer)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    if state is None or kwargs.get("sliding_window") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1:
        cfg = state.cfg
        if FUSE and state.host_free:  # traced into the graph, fused with the layer by the compiler
            out = device_step(
                cfg, state.kinds, state.layer, float(scale), query, key, value, position, state.stats,
                state.blocks, state.step, state.last, state.tally,
            )  # fmt: skip
            return out, None
        out = torch.ops.sparsedecode.sparse_step(
            query, key, value, position, state.stats, state.count, state.blocks, state.keep, state.positions,
            state.step, state.last, state.tally, state.config, state.layer, float(scale), state.host_free,
        )  # fmt: skip
        return out, None
    n, cfg = int(position.reshape(-1)[-1]) + 1, _CONFIGS[state.config]
    start = n - query.shape[2]
    _truncate(state.count, state.step, state.last, start, n, cfg.block_size)
    if state.host_free:
        fill_statistics(state.stats, state.kinds, key, start, n, cfg.block_size)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
