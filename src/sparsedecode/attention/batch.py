"""A forward of a left-padded batch: each sequence decoded in its own coordinates, as it would be alone."""

from __future__ import annotations

import functools

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .. import kernels
from ..errors import SparseDecodeError
from ..layout import BlockLayout, support_positions
from ..selectors import causal_attention_received, choose_blocks, group_attention
from .step import _remember_attention, sparse_decode_step


def _context_length(key: torch.Tensor, kwargs: dict) -> int:
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.numel():
        return int(position_ids.reshape(-1)[-1]) + 1
    return key.shape[2]


def row_extents(attention_mask: torch.Tensor | None, key: torch.Tensor, kwargs: dict) -> tuple[int, tuple[int, ...]]:
    """Where each sequence of a batch lies in the cache: ``(n, pads)``, sequence ``i`` at positions ``[pads[i], n)``.

    Read from the attention mask's last query row (it sees every real key of its sequence): each sequence must
    attend to one contiguous run of positions ending at the current token, i.e. the batch is left-padded. Without
    a mask (no padding) every sequence starts at 0.
    """
    batch = key.shape[0]
    if attention_mask is None:
        return _context_length(key, kwargs), (0,) * batch
    last = attention_mask[..., -1, :] if attention_mask.dim() == 4 else attention_mask
    last = last.reshape(last.shape[0], -1)[:, -key.shape[2] :] if last.dim() > 2 else last
    valid = last if last.dtype == torch.bool else last == 0  # additive float masks: 0 where attended
    valid = valid.expand(batch, -1) if valid.shape[0] == 1 else valid
    counts = valid.sum(dim=-1)
    if bool((counts == 0).any()):
        raise SparseDecodeError("sparse decoding: a sequence of the batch attends to no position at all")
    columns = valid.shape[-1]
    first = valid.int().argmax(dim=-1)
    end = columns - valid.flip(-1).int().argmax(dim=-1)
    if not bool((end == end[0]).all()) or not bool((end - first == counts).all()):
        raise SparseDecodeError(
            "sparse decoding of a batch needs left padding: every sequence must attend to one contiguous run of "
            "positions ending at the current token"
        )
    return int(end[0]), tuple(int(p) for p in first.tolist())


def _extents(session, attention_mask, key, q_len, kwargs) -> tuple[int, tuple[int, ...]]:
    """:func:`row_extents`, computed once per forward: every layer sees the same mask and position ids (held in
    ``session.extents``, so no other object takes their ids); without a mask n comes from the position ids, which a
    fixed-size cache needs to tell steps apart."""
    position_ids, extents = kwargs.get("position_ids"), session.extents
    shape = (key.shape[2], q_len)
    if extents is not None and extents[0] == shape and extents[1] is attention_mask and extents[2] is position_ids:
        return extents[3]
    found = row_extents(attention_mask, key, kwargs)
    session.extents = (shape, attention_mask, position_ids, found)
    return found


def _rows_after_dense_forward(rows, pads, query, key, n, keep, scale, h2o) -> None:
    """Each row's bookkeeping after a multi-token dense forward of the batch: what survives, H2O's history."""
    q_len = query.shape[2]
    start = n - q_len
    for i, (row, pad) in enumerate(zip(rows, pads)):
        row_start = max(start - pad, 0)
        row_q = n - pad - row_start
        if row_q <= 0:
            row.forget()
            continue
        row.unchanged = max(keep - pad, 0)
        row.begin(row_start, row_q)
        keys_i = key[i : i + 1, :, pad:]
        if h2o:
            q_i = query[i, :, q_len - row_q :]
            received = functools.partial(causal_attention_received, q_i, keys_i[0, :, : n - pad], row_start, scale)
            _remember_attention(row, keys_i, n - pad, received)
        row.end_row(n - pad)


def _batch_forward(session, state, module, query, key, value, attention_mask, dropout, scaling, kwargs):
    """A forward of a batch: each sequence is handled as it would be alone, in its own coordinates.

    Sequence ``i`` occupies cache positions ``[pads[i], n)`` (:func:`row_extents`); its state is
    ``state.rows[i]`` (:meth:`LayerState.batch_rows`), whose position 0 is the sequence's first real token. The
    batch state proves what is unchanged (as for batch 1) and each row keeps what lies inside its own run. Multi-
    token forwards and decode steps where every sequence is dense run as one batched SDPA call with the mask
    (dense batched decoding, exactly); otherwise each sequence runs its own dense or sparse step over its own
    slice of the cache, so padding is never selected nor attended.
    """
    batch, _, q_len, _ = query.shape
    n, pads = _extents(session, attention_mask, key, q_len, kwargs)
    start = n - q_len
    keep = state.begin(start, q_len)
    rows = state.batch_rows(pads)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cfg = session.config
    sliding = kwargs.get("sliding_window")
    h2o = cfg.selector.uses_history

    def dense_all():
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )[0]

    if q_len != 1:
        out = dense_all()
        _rows_after_dense_forward(rows, pads, query, key, n, keep, scale, h2o)
        state.end(key, n)
        return out, None
    lengths = [n - pad for pad in pads]
    dense_rows = [m <= cfg.effective_support or (sliding is not None and m > sliding) for m in lengths]
    all_dense = all(dense_rows)
    out = dense_all() if all_dense else query.new_empty(batch, 1, query.shape[1], value.shape[-1])
    sparse = []
    for i, (row, pad, m) in enumerate(zip(rows, pads, lengths)):
        row.unchanged = max(keep - pad, 0)
        row.begin(m - 1, 1)
        if not dense_rows[i]:
            sparse.append((i, row, pad, m))
            continue
        q_i, k_i, v_i = query[i : i + 1], key[i : i + 1, :, pad:], value[i : i + 1, :, pad:]
        session.dense_steps += 1
        session.sequence_steps.setdefault(i, [0, 0])[1] += 1
        if session.track_reads:
            row.note_all_distant(
                key.shape[1], BlockLayout(n=m, window=cfg.window, block_size=cfg.block_size), key.device
            )
        if h2o:
            _remember_attention(row, k_i, m, functools.partial(group_attention, q_i[0, :, 0], k_i[0, :, :m], scale))
        if not all_dense:
            out[i : i + 1] = sdpa_attention_forward(
                module, q_i, k_i[:, :, :m], v_i[:, :, :m], None, dropout=dropout, scaling=scaling, **kwargs
            )[0]
        row.end_row(m)
    if sparse and not _sparse_rows_in_one_call(session, sparse, query, key, value, out, scale):
        for i, row, pad, m in sparse:  # one sparse step per sequence, over its own slice of the cache
            k_i = key[i : i + 1, :, pad:]
            session.sparse_steps += 1
            session.sequence_steps.setdefault(i, [0, 0])[0] += 1
            session.sequence = i
            try:
                out[i : i + 1] = sparse_decode_step(
                    session, row, query[i : i + 1], k_i, value[i : i + 1, :, pad:], m, scaling
                )
            finally:
                session.sequence = 0
            row.end_row(m, chained=True)
    state.end(key, n)
    return out, None


def _sparse_rows_in_one_call(session, sparse, query, key, value, out, scale) -> bool:
    """The sparse steps of a batch's ``sparse`` rows ``(i, row state, pad, length)`` in one C kernel call, each
    written to ``out[i]``; ``False`` (nothing done) where that call cannot serve them.

    It serves block selectors under the C kernel without observers (they need a :class:`StepView` per sequence):
    mean-pooled selection happens inside the call, other block selectors select per sequence in torch first. The
    bookkeeping is :func:`sparse_decode_step`'s, per sequence: fresh selection at the first step of a chain and
    every ``reuse`` steps, the centroid cache extended by the blocks completed since, the reads noted, the step
    counted, the state marked; and the call scores and attends with the code of the single-sequence C calls, so
    every sequence gets the very blocks and output :func:`sparse_decode_step` gives it. Per sequence and layer the
    call reads the support's keys and values, ``S x kv x d x 2`` elements, plus ``n_full x kv x d`` float32
    centroids and the tail block's keys at a fresh step (docs/benchmarks.md, "Batches").
    """
    cfg = session.config
    if session.observers or cfg.token_level or cfg.selector.adaptive:
        return False
    q = query[:, :, 0, :]  # (batch, H, d)
    first, m = sparse[0][0], sparse[0][3]  # what the kernel needs of the tensors, all sequences alike
    layout = BlockLayout(n=m, window=cfg.window, block_size=cfg.block_size)
    if kernels.attention_kernel(cfg.kernel, q[first], key[first], value[first], layout) != "c":
        return False
    window, block, reuse = cfg.window, cfg.block_size, cfg.reuse
    mean_pooled = cfg.selector.kernel_scoring == "mean-dot"
    fresh = [row.step % reuse == 0 or (row.blocks is None and row.positions is None) for _, row, _, _ in sparse]
    selecting = [i for (i, *_), f in zip(sparse, fresh) if f] if mean_pooled else []
    if selecting:  # a non-finite query or key makes a score non-finite: the C call finds it and raises
        # run_selection's cap, b <= n_blocks (a sequence past the support always has more than cfg.blocks)
        b = min(cfg.blocks, *(-(-(max(n - window, 1) - 1) // block) for (*_, n), f in zip(sparse, fresh) if f))
        chosen = torch.empty(len(selecting), key.shape[1], b, dtype=torch.int64)
    calls, j = [], 0
    for (i, row, pad, m), f in zip(sparse, fresh):
        storage = None
        if f and mean_pooled:
            n_full = (max(m - window, 1) - 1) // block
            if row.centroids.count < n_full:  # what select_blocks' centroid update does, without the views
                row.centroids.update(key[i, :, pad:], n_full)
            storage = row.centroids.storage()
            row.blocks, j = chosen[j], j + 1
            blocks = row.blocks
        else:
            if f:
                layout = BlockLayout(n=m, window=window, block_size=block, layer=row.layer, scale=scale, seed=cfg.seed)
                choice = choose_blocks(
                    cfg.selector, cfg.blocks, row.centroids, q[i], key[i, :, pad:], layout, cfg.kernel
                )
                row.blocks = choice.blocks
            blocks = row.blocks.to(torch.int64).contiguous()  # as run_attention takes them
        calls.append((i, pad, m, storage, blocks, f and mean_pooled))
        row.step += 1
    if not q.is_contiguous():
        q = q.contiguous()
    kernels.cpu_batch.run_step_batch(q, key, value, out.view(q.shape), calls, window, block, scale)
    for i, row, _pad, m in sparse:
        if session.track_reads:
            index, valid = support_positions(row.blocks, BlockLayout(n=m, window=window, block_size=block))
            row.note_positions(index, BlockLayout(n=m, window=window, block_size=block), valid)
            session.note_support(i, valid.sum(dim=1))
        session.sparse_steps += 1
        session.sequence_steps.setdefault(i, [0, 0])[0] += 1
        row.end_row(m, chained=True)
    return True
