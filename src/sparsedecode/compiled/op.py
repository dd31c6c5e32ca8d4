"""A capturable sparse decode step: the step as one torch custom op over state in preallocated tensors, for a
static (preallocated) KV cache, so that ``torch.compile(..., fullgraph=True)`` can take a whole decode step.

The session's step (:mod:`~sparsedecode.session.forward`) decides in Python, per layer and step, from state kept
in Python objects and found through a context variable: nothing a compiler can trace. Here every attention module
of the model carries a :class:`StepBuffers` (attribute :data:`STATE`), whose tensors hold what the session's
:class:`~sparsedecode.session.LayerState` holds for one sequence of a batch without padding:

* ``stats (kinds, batch, kv, d, capacity)`` float32: the block statistics the selector reads, the storage of a
  :class:`~sparsedecode.selectors.statistics.BlockStatistics` (the C kernel reads it in place); ``count (batch,)`` how
  many blocks hold values;
* ``blocks`` / ``budget_mask (batch, kv, b)``: the block selection being reused (``budget_mask``: what an adaptive
  budget kept), ``positions (batch, kv, distant)`` a token selector's; ``step (batch,)``: sparse steps of the current
  chain (the reuse counter); ``last (batch,)``: the context length of the layer's last call;
* ``tally (4,)`` int64: sparse row-steps, dense row-steps, positions read by sparse steps (summed over KV heads),
  KV heads of the sparse row-steps.

:func:`sparse_step` (``torch.ops.sparsedecode.sparse_step``) is one layer's decode step of every row: it reads the
context length from the position ids inside the op (a host read the compiler never sees), then runs the library's
selection and kernels (:func:`~sparsedecode.selectors.select.choose_planned_blocks`,
:func:`~sparsedecode.kernels.reference.attend_blocks_on`): the same blocks and outputs as the session's step. Its
fake implementation only says the output's shape, so the compiled graph holds one call per layer and no Python.

Why the state is never stale is the schedule's argument (:mod:`sparsedecode.step.schedule`); every write into the
static cache goes through this attention function, so a call writing ``[start, n)`` vouches for ``[0, start)``
(:func:`_after_write`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..config import SparseConfig
from ..errors import SparseDecodeError
from ..layout import BlockLayout
from ..selectors.calls import support_rows
from ..step import schedule
from ..step.device import device_step, fill_statistics, serves
from ..step.plan import plan_step
from ..step.rows import TensorRow, attend_row, one_call, reads_per_kv_head, select_row
from ..validate import check_attention_arguments
from .prepared import PREPARED, centroids_of, prepare, prepared_host, signature_of

STATIC_ATTENTION = "sparsedecode-static"
"""The attention implementation name the capturable step registers under."""
STATE = "_sparsedecode_static"
"""The attribute of an attention module that holds its :class:`StepBuffers`."""

FORMS = ("prepared", "general", "device", "traced")
"""How a layer's compiled step runs (a :class:`StepBuffers`'s ``form``, chosen by :func:`step_form`):

* ``"prepared"``: the custom op on the host; its first sparse call takes the general path and prepares the C call
  that serves every later one where it can (:mod:`~sparsedecode.compiled.prepared`): the CPU's default;
* ``"general"``: the custom op on the host, never prepared (tests compare the two);
* ``"device"``: the custom op running the host-free step (:mod:`~sparsedecode.step.device`), what a
  CUDA graph replays: CUDA's default where that step serves the selector;
* ``"traced"``: the host-free step traced into the compiled graph, fused with the layer by the compiler (on the
  2-core development CPU it compiled several times slower and decoded no faster than the op)."""


def step_form(cfg: SparseConfig, device, form: str | None = None) -> str:
    """The form of a compiled step for ``cfg`` on ``device`` (``form``, where given, insisted on)."""
    host_free = serves(cfg)
    if form is None:
        return "device" if host_free and torch.device(device).type == "cuda" else "prepared"
    if form not in FORMS:
        raise SparseDecodeError(f"unknown compiled step form {form!r}; choose one of: {', '.join(FORMS)}")
    if form in ("device", "traced") and not host_free:
        raise SparseDecodeError(
            "the host-free compiled step serves block selectors with a fixed budget and one support per KV head "
            f"that read block statistics, on torch operations; {cfg.selector.spec()}, kernel={cfg.kernel!r} is not one"
        )
    return form


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
class StepBuffers:
    """One attention layer's state for the capturable step (see the module); built by :func:`allocate`."""

    layer: int
    config: str
    cfg: SparseConfig
    form: str
    """How the step runs (:data:`FORMS`); the host-free forms' statistics are filled by every multi-token forward."""
    kinds: tuple[str, ...]
    stats: torch.Tensor
    count: torch.Tensor
    blocks: torch.Tensor
    budget_mask: torch.Tensor
    positions: torch.Tensor
    step: torch.Tensor
    last: torch.Tensor
    tally: torch.Tensor

    def reset(self) -> None:
        """Nothing derived from any key: the state of a new cache."""
        for tensor in (self.count, self.step, self.last, self.tally):
            tensor.zero_()

    @property
    def host_free(self) -> bool:
        return self.form in ("device", "traced")


def allocate(
    cfg: SparseConfig,
    layer: int,
    batch: int,
    kv_heads: int,
    head_dim: int,
    max_len: int,
    device,
    form: str,
    query_heads: int | None = None,
) -> StepBuffers:
    """A :class:`StepBuffers` for a cache of ``max_len`` positions: every tensor at its final size; ``form`` from
    :func:`step_form`. A selection has a row per KV head, or per query head (``query_heads``) for a selector with a
    support per query head."""
    kinds = cfg.selector.cached_statistics()
    capacity = max(max_len // cfg.block_size + 1, cfg.blocks)  # the host-free step ranks b of its slots
    b = cfg.blocks  # 0 where the support holds no whole block: the C call reads b from these tensors' width
    distant = cfg.distant_positions if cfg.selector.token_level else 1
    rows = support_rows(cfg.selector, query_heads or kv_heads, kv_heads)
    long = dict(dtype=torch.int64, device=device)
    state = StepBuffers(
        layer=layer,
        config=config_key(cfg),
        cfg=cfg,
        form=form,
        kinds=kinds,
        stats=torch.zeros(len(kinds), batch, kv_heads, head_dim, capacity, dtype=torch.float32, device=device),
        count=torch.zeros(batch, **long),
        blocks=torch.zeros(batch, rows, b, **long),
        budget_mask=torch.ones(
            batch, rows, distant if cfg.selector.token_level else b, dtype=torch.bool, device=device
        ),
        positions=torch.zeros(batch, rows, distant, **long),
        step=torch.zeros(batch, **long),
        last=torch.zeros(batch, **long),
        tally=torch.zeros(4, **long),
    )
    for name in ("stats", "count", "blocks", "budget_mask", "positions", "step", "last", "tally"):
        torch._dynamo.mark_static_address(getattr(state, name))  # mutated in place: CUDA graphs keep their memory
    return state


def _after_write(count: torch.Tensor, step: torch.Tensor, last: torch.Tensor, start: int, n: int, block: int):
    """A call writes positions ``[start, n)`` of every row: the schedule's ``after_write``, in place (the op sees
    every write to its static cache, so the positions before ``start`` are as its state saw them)."""
    kept, chained, _ = schedule.after_write(count, step, last, start, n, start, block)
    count.copy_(kept)
    step.copy_(chained)
    last.fill_(n)


def sparse_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position: torch.Tensor,
    stats: torch.Tensor,
    count: torch.Tensor,
    blocks: torch.Tensor,
    budget_mask: torch.Tensor,
    positions: torch.Tensor,
    step: torch.Tensor,
    last: torch.Tensor,
    tally: torch.Tensor,
    config: str,
    layer: int,
    scale: float,
    form: str,
) -> torch.Tensor:
    """One layer's decode step of every row of a batch without padding: ``query (batch, H, 1, d)``, ``key`` /
    ``value (batch, kv, L, d)`` (a static cache, the current token written), ``position (batch, 1)`` the current
    token's position; returns ``(batch, 1, H, dv)`` in the query dtype. Dense over ``[0, n)`` while the context
    fits the support; otherwise each row reuses or refreshes its selection (reuse ``R``) and attends over it."""
    cfg = _CONFIGS[config]
    if form == "device":
        kinds = cfg.selector.statistics
        return device_step(cfg, kinds, layer, scale, query, key, value, position, stats, blocks, step, last, tally)
    n = int(position.reshape(-1)[-1]) + 1  # the host read the compiled graph leaves to the op
    if n > key.shape[2]:
        raise SparseDecodeError(f"sparse_step: position {n - 1} lies past the cache's {key.shape[2]} positions")
    batch, heads, kv_heads = query.shape[0], query.shape[1], key.shape[1]
    sparse = n > _SUPPORTS[config]
    if form == "prepared" and sparse:
        signature = signature_of(config, layer, scale, query, key, value, stats, count, blocks, step, last, tally)
        prepared = PREPARED.get(signature)
        if prepared is not None:
            out = query.new_empty(batch, 1, heads, value.shape[-1], dtype=torch.float32)
            prepared(query, key, stats, out, n)
            return out.to(query.dtype)
    _after_write(count, step, last, n - 1, n, cfg.block_size)
    fresh, after = schedule.decode_step(step, sparse, cfg.reuse, cfg.selector.reselects_every_step)
    if not sparse:
        step.copy_(after)
        schedule.count_step(tally, 0, batch, 0, kv_heads)
        return _dense_step(query, key, value, n, scale)
    layout = BlockLayout(
        n=n, window=cfg.window, block_size=cfg.block_size, layer=layer, scale=scale, seed=cfg.seed,
        distant=cfg.distant_positions,
    )  # fmt: skip
    q = query[:, :, 0, :]
    plan = plan_step(cfg, q[0], key[0], value[0], layout, _PLANS[config])
    if form == "prepared":  # the next calls on these tensors take the prepared call
        prepare(signature, cfg, plan, q, key, value, stats, count, blocks, step, last, tally, scale)
    kinds = cfg.selector.cached_statistics()
    adaptive = cfg.selector.adaptive
    rows = [
        TensorRow(
            centroids_of(stats[:, i], kinds, c, cfg.block_size), blocks[i], budget_mask[i], positions[i], adaptive
        )
        for i, c in enumerate(count.tolist())
    ]
    fresh = fresh.tolist()
    if plan.one_call:
        q = q.contiguous()
        direct = query.dtype == torch.float32
        out = torch.empty(q.shape, dtype=torch.float32) if not direct else query.new_empty(q.shape)
        one_call(cfg, plan, [(i, 0, layout, row) for i, row in enumerate(rows)], fresh, q, key, value, out, scale)
        out = out.view(batch, 1, heads, -1).to(query.dtype)
    else:
        out = query.new_empty(batch, 1, heads, value.shape[-1])
        for i, row in enumerate(rows):
            if fresh[i]:
                select_row(cfg, plan, row, q[i], key[i], layout)
            out[i, 0] = attend_row(cfg, plan, row, q[i], key[i], value[i], layout)
    read = sum(int(reads_per_kv_head(cfg, row, layout, kv_heads).sum()) for row in rows)
    count.copy_(torch.tensor([row.centroids.count for row in rows]))
    step.copy_(after)
    schedule.count_step(tally, batch, 0, read, kv_heads)
    return out


def _dense_step(query, key, value, n: int, scale: float) -> torch.Tensor:
    """The dense decoder's attention to the bit (full support is that path's dense decoding in every dtype): the
    whole static cache masked to the ``n`` positions written (over ``[0, n)`` alone bfloat16 rounds otherwise)."""
    written = (torch.arange(key.shape[2], device=key.device) < n).view(1, 1, 1, -1).expand(query.shape[0], 1, 1, -1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return sdpa(query, key, value, attn_mask=written, scale=scale, enable_gqa=True).transpose(1, 2).contiguous()


def _fake(query, key, value, *state_and_settings):
    return query.new_empty(query.shape[0], 1, query.shape[1], value.shape[-1])


_LIBRARY = torch.library.Library("sparsedecode", "DEF")
_LIBRARY.define(
    "sparse_step(Tensor query, Tensor key, Tensor value, Tensor position, Tensor(a!) stats, Tensor(b!) count, "
    "Tensor(c!) blocks, Tensor(d!) budget_mask, Tensor(e!) positions, Tensor(f!) step, Tensor(g!) last, "
    "Tensor(h!) tally, str config, int layer, float scale, str form) -> Tensor"
)
# defined with torch.library's schema API rather than the custom_op decorator: its dispatch costs about 8 us a
# call, the decorator's wrappers about 130 us (30 layers: 4 ms a token)
_LIBRARY.impl("sparse_step", sparse_step, "CompositeExplicitAutograd")
torch.library.register_fake("sparsedecode::sparse_step", _fake, lib=_LIBRARY)

# Where the C++ operators build (sparsedecode.kernels.cpu.native), sparse_step's CPU kernel is C++: it makes the
# prepared calls itself and calls these two for everything else. An error raised in them is kept and an empty result
# returned (a Python error crossing torch's C interface would become a RuntimeError of several lines); the kernel then
# fails with KEPT_ERROR, and raise_kept raises the kept error in its place.
KEPT_ERROR = "sparse_step: the step failed in Python"
_KEPT: list[BaseException] = []


def _sparse_step_host(query, *rest):
    try:
        return sparse_step(query, *rest)
    except BaseException as error:
        _KEPT[:] = [error]
        return query.new_empty(0)


def _prepared_host(key, stats, ident: int, n: int, status: int) -> bool:
    try:
        prepared_host(key, stats, ident, n, status)
        return True
    except BaseException as error:
        _KEPT[:] = [error]
        return False


def raise_kept(error: RuntimeError) -> None:
    """Raise the error kept from the Python part of the C++ kernel's call that failed with ``error``, if any."""
    if _KEPT and KEPT_ERROR in str(error):
        raise _KEPT.pop() from None


_LIBRARY.define(
    "sparse_step_host(Tensor query, Tensor key, Tensor value, Tensor position, Tensor(a!) stats, Tensor(b!) count, "
    "Tensor(c!) blocks, Tensor(d!) budget_mask, Tensor(e!) positions, Tensor(f!) step, Tensor(g!) last, "
    "Tensor(h!) tally, str config, int layer, float scale, str form) -> Tensor"
)
_LIBRARY.impl("sparse_step_host", _sparse_step_host, "CompositeExplicitAutograd")
_LIBRARY.define("prepared_host(Tensor key, Tensor(a!) stats, int ident, int n, int status) -> bool")
_LIBRARY.impl("prepared_host", _prepared_host, "CompositeExplicitAutograd")


def _step_op(*arguments) -> torch.Tensor:
    """``torch.ops.sparsedecode.sparse_step``; called eagerly, a kept error raised as itself (:func:`raise_kept`)."""
    if torch.compiler.is_compiling():
        return torch.ops.sparsedecode.sparse_step(*arguments)
    try:
        return torch.ops.sparsedecode.sparse_step(*arguments)
    except RuntimeError as error:
        raise_kept(error)
        raise


def _written(key, value, mask, position):
    """A dense forward (a prefill chunk, a verification: eager) over the static cache: its keys, values and mask cut
    to the positions written so far, which are all the mask lets through (SDPA over the whole cache read every
    masked position: SmolLM2 8K bfloat16 prefill 45 s against 35 s over a growing cache)."""
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
    decode steps :func:`sparse_step` on the module's :class:`StepBuffers`; a module without one, or a
    sliding-window layer, dense."""
    check_attention_arguments(kwargs, "compiled decoding")  # SDPA and the sparse step would leave them out
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
    decode = schedule.is_decode_step(query.shape[2])  # a one-token forward of extend() (a prefill chunk) is dense
    if not decode and kwargs.get("sliding_window") is None:
        key, value, attention_mask = _written(key, value, attention_mask, position)
    if state is None and decode and kwargs.get("sliding_window") is None and not dropout:
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
    if decode:
        cfg = state.cfg
        if state.form == "traced":  # traced into the graph, fused with the layer by the compiler
            out = device_step(
                cfg, state.kinds, state.layer, float(scale), query, key, value, position, state.stats,
                state.blocks, state.step, state.last, state.tally,
            )  # fmt: skip
            return out, None
        out = _step_op(
            query, key, value, position, state.stats, state.count, state.blocks, state.budget_mask, state.positions,
            state.step, state.last, state.tally, state.config, state.layer, float(scale), state.form,
        )  # fmt: skip
        return out, None
    n, cfg = int(position.reshape(-1)[-1]) + 1, _CONFIGS[state.config]
    start = n - query.shape[2]
    _after_write(state.count, state.step, state.last, start, n, cfg.block_size)
    if state.host_free:
        fill_statistics(state.stats, state.kinds, key, start, n, cfg.block_size)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
