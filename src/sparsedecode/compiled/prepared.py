"""The capturable step's common case made ready once per layer state: every row's selection scored and attended in
one call of the C kernel (:func:`~sparsedecode.compiled.op.sparse_step` looks it up by :func:`signature_of`).

What the op's general path checks and builds at every call (the plan, the row table with its bounds checks, the
argument list) depends only on tensors that a static cache and a :class:`~sparsedecode.compiled.op.StepBuffers`
keep from call to call, so :func:`prepare` does it at the first call on them; a later call is one C call
(``prepared_step`` in ``sparse_step.c``) that also keeps the state's integers (the truncation, which rows select
afresh, the reuse counters, the tally) in place, as the general path keeps them: Python work between the compiled
graph's kernels runs cache-cold, about 90 us a layer call at batch 8 when it was done here (SmolLM2 8K bfloat16,
batch 8 28.2 -> 26.2 ms a step, batch 1 about 22.2 -> 21.2 ms, side by side). Only the statistics of newly
completed blocks are computed here, when the C call asks for them.

Where the C++ operators build (:mod:`sparsedecode.kernels.cpu.native`), a prepared call is also handed to the op's
C++ kernel (:meth:`Prepared.offer`), which makes the later calls itself with no Python between the compiled step and
the C call (SmolLM2 at 8K, one thread: about 140 us a layer call in Python around an 87 us C call); it comes back here
only for the statistics of completed blocks and for errors (:func:`prepared_host`).
"""

from __future__ import annotations

import array
import itertools

import numpy as np
import torch

from ..kernels import cpu
from ..kernels.cpu import NEEDS_STATISTICS, native
from ..layout import BlockLayout
from ..selectors.statistics import BlockStatistics, store_statistics

SPLIT_WORK = 1 << 20
"""Centroid floats a prepared call scores (rows x KV heads x blocks x d) from which it splits over torch's threads;
:data:`SPLIT_WORK_SHARED` where the kernel shares torch's OpenMP threads (:data:`sparsedecode.kernels.cpu.OPENMP`).
With workers of its own, a worker woken for a small call waits for a core that the compiled graph's OpenMP workers
spin on after each kernel (SmolLM2 at 8K: 120 us a call on two threads, 74 us on one); torch's own threads are
awake when the call comes (SmolLM2 at 8K, bfloat16, compiled: batch 1 21.9 -> 20.4 ms a step, batch 8 42 -> 34 ms
on two threads)."""
SPLIT_WORK_SHARED = 1 << 16

PREPARED: dict[tuple, Prepared | None] = {}
"""Prepared calls by :func:`signature_of` (``None``: the general path serves those tensors)."""
_BY_ID: dict[int, Prepared] = {}
"""The prepared calls handed to the C++ kernel, by the id it names them by (kept alive while it may call them)."""
_IDENTS = itertools.count()


def centroids_of(state_stats: torch.Tensor, kinds: tuple[str, ...], count: int, block: int) -> BlockStatistics:
    """A :class:`BlockStatistics` over one row's preallocated storage ``(kinds, kv, d, capacity)``."""
    cache = BlockStatistics(block, kinds)
    cache._stats = {kind: state_stats[k] for k, kind in enumerate(kinds)}
    cache.count = count
    return cache


class Prepared:
    """One layer state's C call, checked and built once (see the module); calling it runs one decode step of every
    row at context length ``n``: the same output and state changes as the op's general path. Serves selectors
    scored inside the C call (mean-dot, a fixed budget)."""

    def __init__(self, cfg, plan, q, key, value, stats, count, blocks, step, last, tally, scale):
        from ..kernels.cpu import batch as cpu_batch

        self.cfg = cfg
        batch, heads, d = q.shape
        self.batch, self.kv_heads = batch, key.shape[1]
        # checked once at the longest context the cache holds: every call's n is at most that. Only addresses are
        # kept: the NumPy views below keep the state's integer tensors alive, so no later state can have their
        # addresses, and a signature naming them names this state
        rows = [(i, 0, key.shape[2], stats[0, i], blocks[i], True) for i in range(batch)]
        self.fields = array.array("q", cpu_batch.row_table(q, key, value, rows, cfg.window, cfg.block_size))
        self.function, self.check = cpu.library().prepared_step, cpu.check_status
        self.arguments = [
            key.data_ptr(), key.stride(1), key.stride(2), value.data_ptr(), value.stride(1), value.stride(2),
        ]  # fmt: skip
        self.tail = [batch, self.kv_heads, heads // self.kv_heads, d, cfg.window, cfg.block_size, scale]
        self.code = cpu.dtype_code(q, key, value)
        # the state's integers, which the C call updates in place; the NumPy views keep them and the blocks (named
        # in the row table) alive
        self.count, self.step, *self._alive = (t.numpy() for t in (count, step, last, tally, blocks))
        self.state = [t.data_ptr() for t in (count, step, last, tally)]
        self.table = self.fields.buffer_info()[0]
        self.kinds = cfg.selector.cached_statistics()
        self.every_step = bool(cfg.selector.reselects_every_step)
        split = SPLIT_WORK_SHARED if cpu.OPENMP else SPLIT_WORK
        self.settings = [cfg.reuse, 1 if self.every_step else 0, split]
        # what the C++ kernel needs to make the same call (F_* in torch_ops.cpp)
        self.ident = next(_IDENTS)
        self.native = array.array(
            "q", [self.ident, self.table, *self.tail[:6], self.code, *self.settings, *self.state, cfg.effective_support]
        )

    def __call__(self, query, key, stats, out, n: int) -> None:
        """One step at context length ``n``: ``query (batch, H, 1, d)``, ``out (batch, 1, H, dv)`` float32. The C
        call keeps the state's integers (``prepared_step`` in ``sparse_step.c``); where rows selecting afresh lack
        the statistics of blocks completed since, it returns before attending, they are completed here, and it is
        called again."""
        self.offer()  # the C++ kernel, where loaded, makes the next calls (it had none for these tensors)
        arguments = [query.data_ptr(), *self.arguments, out.data_ptr(), self.table, *self.tail]
        arguments += [torch.get_num_threads(), self.code, n, *self.settings, *self.state]
        status = self.function(*arguments, 0)
        if status == NEEDS_STATISTICS:
            self.complete_statistics(key, stats, n)
            status = self.function(*arguments, 1)
        self.check(status)

    def offer(self) -> None:
        """Hand this call to the op's C++ kernel, for the call in progress (nothing where it is not loaded); it calls
        back by :attr:`ident` at later calls only."""
        if native.offer_step(self.native.buffer_info()[0]):
            _BY_ID[self.ident] = self

    def complete_statistics(self, key, stats, n: int) -> None:
        """The statistics of the blocks completed since the last call, of the rows selecting afresh now."""
        cfg, count = self.cfg, self.count
        n_full = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size).n_full
        fresh = np.ones(self.batch, dtype=bool) if self.every_step else self.step % cfg.reuse == 0
        complete_rows(key, stats, self.kinds, count, np.flatnonzero(fresh & (count < n_full)), n_full, cfg.block_size)


def complete_rows(key, stats, kinds, count: np.ndarray, rows, n_full: int, block: int) -> None:
    """Blocks ``count[i] .. n_full - 1`` of each of ``rows`` into ``stats (kinds, batch, kv, d, capacity)`` from
    ``key (batch, kv, L, d)``, ``count`` (a NumPy view of the state's) moved on: an equal-length batch's in one pass,
    each row's numbers as its own BlockStatistics.update makes them (each block reduced alone: the same bits
    whenever and in whatever pieces they are computed)."""
    batch = len(count)
    if len(rows) == batch > 1 and (count == count[0]).all():
        store_statistics(key, int(count[0]), n_full, block, {kind: stats[k] for k, kind in enumerate(kinds)})
        count[:] = n_full
        return
    for i in rows:
        cache = centroids_of(stats[:, i], kinds, int(count[i]), block)
        cache.update(key[i], n_full)
        count[i] = cache.count


def prompt_statistics(state, key: torch.Tensor, n: int) -> None:
    """After a prefill (or a resume) of ``n`` positions: the statistics of every block of the distant part of a
    :class:`~sparsedecode.compiled.op.StepBuffers` whose step completes them itself (the host's forms), so that the
    first decode step reads them instead of computing the whole prompt's (SmolLM2 at 8K: about 12 ms of a 19 ms
    first step on two threads). A prompt within the support has none; a state on another device is left to its
    step."""
    if not state.kinds or state.count.device.type != "cpu":  # the state lies with its cache, on the decoder's device
        return
    count = state.count.numpy()
    n_full = BlockLayout(n=n, window=state.cfg.window, block_size=state.cfg.block_size).n_full
    complete_rows(key, state.stats, state.kinds, count, np.flatnonzero(count < n_full), n_full, state.cfg.block_size)


def signature_of(config, layer, scale, query, key, value, stats, count, blocks, step, last, tally) -> tuple:
    """What a :class:`Prepared` call depends on: the configuration, the layer, and every tensor's address and
    layout (a static cache and a :class:`StepBuffers` keep them from call to call)."""
    return (
        config, layer, scale, query.shape, query.stride(), query.dtype,
        key.data_ptr(), key.shape, key.stride(), key.dtype, value.data_ptr(), value.shape, value.stride(), value.dtype,
        stats.data_ptr(), stats.shape, count.data_ptr(), blocks.data_ptr(), blocks.shape, step.data_ptr(),
        last.data_ptr(), tally.data_ptr(),
    )  # fmt: skip


def serves(cfg, plan, q, *state) -> bool:
    """Whether a :class:`Prepared` call serves a layer call of ``plan`` (:func:`~sparsedecode.step.plan.plan_step`):
    mean-dot selection with a fixed budget in the C kernel, a contiguous query ``q`` and state tensors."""
    selector = cfg.selector
    return (
        plan.one_call
        and plan.select == "c"
        and not selector.adaptive
        and not selector.token_level
        and selector.cached_statistics()[0] == "mean"
        and q.is_contiguous()
        and all(t.is_contiguous() for t in state)
    )


def prepare(signature, cfg, plan, q, key, value, stats, count, blocks, step, last, tally, scale) -> None:
    """Make the :class:`Prepared` call for ``signature`` (or note that it does not serve these tensors)."""
    if signature not in PREPARED:
        serves_it = serves(cfg, plan, q, count, blocks, step, last, tally)
        if len(PREPARED) >= 1024:  # states of decoders long gone
            native.forget_steps()
            PREPARED.clear()
            _BY_ID.clear()
        if serves_it and cpu.library() is not None:
            native.load(cpu.library())  # the C++ kernel makes the later calls where it builds
        PREPARED[signature] = (
            Prepared(cfg, plan, q, key, value, stats, count, blocks, step, last, tally, scale) if serves_it else None
        )
        if PREPARED[signature] is not None:
            PREPARED[signature].offer()


def prepared_host(key: torch.Tensor, stats: torch.Tensor, ident: int, n: int, status: int) -> None:
    """The C++ kernel's call back for prepared call ``ident`` at context length ``n``: complete the statistics the C
    call asked for (``status`` NEEDS_STATISTICS), or raise the error of its ``status``."""
    if status == NEEDS_STATISTICS:
        _BY_ID[ident].complete_statistics(key, stats, n)
    else:
        cpu.check_status(status)
