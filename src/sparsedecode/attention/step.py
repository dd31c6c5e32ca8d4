"""One sparse decode step of one layer: select when the reuse schedule says so, attend over the support, keep the
session's bookkeeping (reads, support sizes, H2O's history, observers)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import kernels
from ..errors import SparseDecodeError
from ..layout import BlockLayout
from ..selectors import choose_blocks, choose_positions, token_index
from ..selectors.select import BlockChoice, support_of
from .attend import _attend_blocks, attend_positions
from .session import SparseSession
from .state import LayerState, StepView


def _remember_attention(state: LayerState, key: torch.Tensor, n: int, received: Callable[[], torch.Tensor]) -> None:
    """Add a dense forward's attention to the H2O history where the key tensor holds every position."""
    if key.shape[2] >= n:
        state.add_attention(received())
    else:  # a sliding-window layer's cache keeps only its window: no history here
        state.history_complete = False


def _block_step(session, state, q, keys, values, layout, scale, fresh) -> torch.Tensor:
    """Select (when ``fresh``) and attend for a block selector; the selection lands in ``state.blocks`` / ``keep``.

    The C kernel takes the whole step in one call where it serves (a fixed budget): selection inside it for a
    selector whose scoring it implements (``kernel_scoring``), the given blocks otherwise. Elsewhere the kernel
    :func:`sparsedecode.kernels.attention_kernel` picks attends; an adaptive budget's support is gathered by
    position with its dropped blocks masked."""
    cfg, selector = session.config, session.config.selector
    one_call = not selector.adaptive and kernels.attention_kernel(cfg.kernel, q, keys, values, layout) == "c"
    if one_call and fresh and selector.kernel_scoring == "mean-dot":
        if state.centroids.count < layout.n_full:  # the blocks completed since the last step
            state.centroids.update(keys, layout.n_full)
        out, state.blocks = kernels.cpu.run_step(
            q, keys, values, state.centroids.storage(), None, layout, cfg.blocks, scale
        )
        state.keep = None
        return out
    if fresh:
        choice = choose_blocks(selector, cfg.blocks, state.centroids, q, keys, layout, cfg.kernel)
        state.blocks, state.keep = choice.blocks, choice.keep
    if one_call:
        out, state.blocks = kernels.cpu.run_step(q, keys, values, None, state.blocks, layout, cfg.blocks, scale)
        return out
    if state.keep is not None:
        index, valid = support_of(BlockChoice(state.blocks, state.keep), layout)
        return attend_positions(q, keys, values, index, scale, valid=valid)
    return _attend_blocks(cfg, q, keys, values, state.blocks, layout, scale)


def sparse_decode_step(
    session: SparseSession,
    state: LayerState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    n: int,
    scaling: float | None,
) -> torch.Tensor:
    """One sparse decode step of one layer: ``query (1, H, 1, d)``, ``key/value (1, KVH, >= n, d)``.

    Selects afresh at the first step of a chain of sparse steps and every ``reuse`` steps after it; otherwise
    reuses ``state``'s selection (the window still slides). ``state`` must describe these keys (the attention
    function sees to that, see :class:`LayerState`).
    """
    cfg = session.config
    q = query[0, :, 0, :]
    keys, values = key[0], value[0]
    query_heads, d = q.shape
    scale = scaling if scaling is not None else d**-0.5
    layout = BlockLayout(
        n=n, window=cfg.window, block_size=cfg.block_size, layer=state.layer, scale=scale, seed=cfg.seed
    )
    selector = cfg.selector
    h2o = selector.uses_history
    if h2o and not state.history_complete:
        if state.rebuilt:
            raise SparseDecodeError(
                f"{selector.spec()} needs the attention every position received since the prompt began, but "
                "this model's attention is handed keys rebuilt from its cache at every step (multi-head latent "
                "attention), so no history survives a step; use a block selector"
            )
        raise SparseDecodeError(
            f"{selector.spec()} needs the attention every position received since the prompt began, but this "
            "session did not see the forwards that filled part of the cache: run the prefill inside the "
            "sparse_decoding session, or give the session its history with session.adopt_history(cache, history)"
        )

    fresh = state.step % cfg.reuse == 0 or (state.blocks is None and state.positions is None)
    fresh = fresh or selector.reselects_every_step
    state.step += 1
    if cfg.token_level:
        if fresh:
            history = state.history_until(n, keys.shape[0], keys.device) if h2o else None  # earlier queries only
            state.positions = choose_positions(selector, cfg.distant_positions, q, keys, layout, history=history)
        index = token_index(state.positions, layout)  # reused distant positions, the window slides
        if h2o:  # H2O accumulates the attention the step computed: over its support, as with eviction
            out, received = attend_positions(q, keys, values, index, scale, weights=True)
            state.add_attention_at(index, received, n)
        else:
            out = attend_positions(q, keys, values, index, scale)
        valid = torch.ones_like(index, dtype=torch.bool)
        if session.track_reads:
            state.note_positions(index, layout)
            session.note_support(session.sequence, valid.sum(dim=1))
        blocks = None
    else:
        out = _block_step(session, state, q, keys, values, layout, scale, fresh)
        blocks = state.blocks
        if session.track_reads or session.observers:
            index, valid = support_of(BlockChoice(blocks, state.keep), layout)
        if session.track_reads:
            state.note_positions(index, layout, valid)
            session.note_support(session.sequence, valid.sum(dim=1))
    if session.observers:
        view = StepView(
            state.layer, state.step, q, keys, values, index, valid, out, scale, layout, blocks, session.sequence
        )
        for observe in session.observers:
            observe(view)
    if out.dtype != query.dtype:
        out = out.to(query.dtype)
    return out.view(1, 1, query_heads, -1)  # -1: the value head dim
