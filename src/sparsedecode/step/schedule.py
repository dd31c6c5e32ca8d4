"""The schedule of a sparse decode step, written once: what of a row's state survives a call, when a row selects
afresh, how its reuse counter moves, and what a step reads and tallies. Every route of a step follows these rules
through these functions: the session's rows (:mod:`sparsedecode.session.rows`), the compiled op's general path
(:mod:`sparsedecode.compiled.op`) and the host-free device step (:mod:`sparsedecode.step.device`).
The C kernel's ``prepared_step`` (``kernels/cpu/csrc/sparse_step.c``) is their one declared mirror, checked against
them by a property test (``tests/test_schedule.py``).

The functions are elementwise: an argument is a Python ``int``/``bool`` (one row, the session's) or an integer or
boolean tensor with one entry per row (the op's batch; the traced device step, which must not read a tensor on the
host), and so is the result.

A row's schedule state, whatever holds it:

* ``count``: how many distant blocks have statistics (blocks ``0 .. count - 1``; block ``j`` covers positions
  ``[1 + j B, 1 + (j + 1) B)``);
* ``step``: the sparse decode steps of the current chain, the reuse counter; 0 means no chain (the next sparse
  step selects afresh);
* ``last``: the context length the row's state describes (the end of the row's last call).

**Why the state is never stale.** Everything a row keeps is derived from its cached keys at positions ``[0,
last)``. A call writes positions ``[start, n)`` (a prefill chunk, a verification, a decode step) and leaves ``[0,
start)`` alone (the contract of every cache's ``update``). Before the call, the route establishes ``intact``: how many
leading positions are provably the ones its state was derived from. The compiled op sees every write to its static
cache, so ``intact = start``; the session cannot, so it proves ``intact`` from the key tensor's memory, layout and
version counter (:class:`~sparsedecode.session.state.KeyMark`). :func:`after_write` then keeps the statistics of
the blocks wholly inside ``[0, intact)`` only, and the reuse chain only when the call continues it: one token, right
where the row's last call ended, nothing before it changed. By induction over calls, every kept statistic and every
reused selection describes the keys now cached. Hence a new prompt (a forward from position 0) keeps nothing, a crop
or a rollback keeps ``[0, start)`` and restarts the chain, and a dense decode step (``N <= S``) ends the chain
(:func:`decode_step`), so the first sparse step after it selects afresh.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

TALLY = ("sparse_steps", "dense_steps", "positions_read", "kv_head_steps")
"""What a route counts, in this order: sparse row-steps, dense row-steps, positions read by sparse steps (summed
over KV heads), KV heads of the sparse row-steps."""


_DENSE_FORWARDS = contextvars.ContextVar("sparsedecode_dense_forwards", default=False)


@contextlib.contextmanager
def dense_forwards():
    """Inside, every forward is dense, one of a single token too: a prefill (whose last chunk may be one token), a
    verification, a re-fed prefix. Without it a one-token forward in a sparse session or decoder is a decode step."""
    token = _DENSE_FORWARDS.set(True)
    try:
        yield
    finally:
        _DENSE_FORWARDS.reset(token)


def is_decode_step(q_len: int) -> bool:
    """Whether a forward of ``q_len`` tokens is a sparse decode step: one token, outside :func:`dense_forwards` (a
    traced step is one: the flag is read only eagerly, so a compiled step neither reads nor guards it)."""
    return q_len == 1 and (torch.compiler.is_compiling() or not _DENSE_FORWARDS.get())


def _where(condition, yes, no):
    """``yes`` where ``condition`` else ``no``, elementwise: a tensor if any of the three is one."""
    if any(isinstance(value, torch.Tensor) for value in (condition, yes, no)):
        return torch.where(torch.as_tensor(condition), yes, no)
    return yes if condition else no


def _minimum(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return min(a, b)


def _at_least_zero(value):
    return value.clamp(min=0) if isinstance(value, torch.Tensor) else max(value, 0)


def kept_blocks(count, intact, block: int):
    """The statistics that survive when positions ``[0, intact)`` are all a row still holds as it was: those of the
    blocks wholly inside (block ``j`` ends at ``1 + (j + 1) B``), at most ``count``."""
    return _minimum(count, _at_least_zero((intact - 1) // block))


def continues(q_len, last, start, intact):
    """Whether a call of ``q_len`` tokens at ``start`` continues its row's chain of sparse steps: one token, where the
    row's last call ended, and nothing before it changed."""
    return (q_len == 1) & (last == start) & (intact >= start)


def after_write(count, step, last, start, n, intact, block: int):
    """A call writes positions ``[start, n)`` of a row whose first ``intact`` positions are as its state saw them:
    ``(count, step, last)`` after it (see the module). The step itself (:func:`decode_step`) moves ``step`` on."""
    chained = continues(n - start, last, start, intact)
    return kept_blocks(count, intact, block), _where(chained, step, 0), n


def decode_step(step, sparse, reuse: int, every_step: bool):
    """A decode step of a row, after :func:`after_write`: ``(fresh, step)``. A sparse step selects afresh at the start
    of a chain and every ``reuse`` steps after it (every step for a selector that reselects every step) and counts
    itself; a dense step (the context fits the support) ends the chain."""
    fresh = (step % reuse == 0) | every_step
    return fresh & sparse, _where(sparse, step + 1, 0)


def support_reads(blocks, layout, budget_mask=None):
    """Positions a block support reads per KV head: ``blocks (..., kv, b)`` (a tensor or a NumPy array), the anchor,
    the window and the chosen blocks, a chosen short last block only over its distant positions; ``budget_mask (..., kv,
    b)``, an adaptive budget's, leaves out the blocks it dropped. Returns ``(..., kv)``."""
    block, n_full = layout.block_size, layout.n_full
    sizes = block - (blocks == n_full) * (block - (layout.distant_end - 1 - n_full * block))
    if budget_mask is not None:
        sizes = sizes * budget_mask
    return 1 + layout.n - layout.distant_end + sizes.sum(-1)


def count_step(tally, sparse_rows, dense_rows, positions_read, kv_heads: int) -> None:
    """Add one layer call's rows to a ``tally (4,)`` int64 tensor (:data:`TALLY`), in place."""
    tally[0] += sparse_rows
    tally[1] += dense_rows
    tally[2] += positions_read
    tally[3] += sparse_rows * kv_heads
