"""Batches of prompts decoded together: left padding, prefill and greedy decoding (issue #12).

A batch holds sequences of different lengths left-padded to the longest: sequence ``i`` of length ``P_i`` sits at
cache positions ``[P - P_i, P)`` and its RoPE positions are ``0 .. P_i - 1``, as if it were alone. Inside a
:func:`~sparsedecode.attention.sparse_decoding` session every sequence then gets its own anchor, window, blocks,
centroids and reuse schedule (see ``_batch_forward`` in :mod:`sparsedecode.attention`); padding is never selected
nor attended. Outside a session the same functions decode the batch densely.

The functions here take ``ids`` ``(B, P)`` and ``mask`` ``(B, P)`` (1 for real tokens) and keep the mask growing
with every decoded token; position ids are derived from it, as ``model.generate`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .cache import checkpoint
from .errors import SparseDecodeError

Progress = Callable[[str, int, int], None]
BatchLogitsHook = Callable[[int, torch.Tensor], None]
"""``hook(step, logits)``: the float32 logits ``(B, vocab)`` of every batched decode step (1-based step)."""


def left_pad(prompts: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack prompts (each ``(1, P_i)`` or ``(P_i,)``) left-padded with ``pad_id``: ``ids, mask``, both ``(B, P)``."""
    rows = [p.reshape(-1) for p in prompts]
    if not rows:
        raise SparseDecodeError("a batch needs at least one prompt")
    if any(r.numel() == 0 for r in rows):
        raise SparseDecodeError("every prompt of a batch needs at least one token")
    longest = max(r.numel() for r in rows)
    device = rows[0].device
    ids = torch.full((len(rows), longest), pad_id, dtype=rows[0].dtype, device=device)
    mask = torch.zeros(len(rows), longest, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, longest - row.numel() :] = row
        mask[i, longest - row.numel() :] = 1
    return ids, mask


def check_left_padded(mask: torch.Tensor) -> None:
    """Every row of ``mask`` ``(B, P)`` is zeros then ones, at least one."""
    if not isinstance(mask, torch.Tensor):
        raise SparseDecodeError(f"attention_mask must be a torch tensor of 0 and 1, got {type(mask).__name__}")
    if mask.dim() != 2 or bool(((mask != 0) & (mask != 1)).any()):  # before any cast: 0.5 is neither
        raise SparseDecodeError(
            f"attention_mask must be a (batch, length) tensor of 0 and 1, got shape {tuple(mask.shape)}"
            + ("" if mask.dim() != 2 else " with other values")
        )
    m = mask.to(torch.long)
    if bool((m.sum(dim=1) == 0).any()) or bool((m[:, 1:] < m[:, :-1]).any()):
        raise SparseDecodeError("batched decoding needs left padding: each mask row must be zeros, then ones")


def positions(mask: torch.Tensor) -> torch.Tensor:
    """RoPE position ids of a left-padded mask: each sequence counts from 0 at its first real token."""
    return (mask.long().cumsum(dim=1) - 1).clamp(min=0)


@torch.no_grad()
def prefill(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    cache,
    *,
    chunk: int = 1024,
    progress: Progress | None = None,
) -> torch.Tensor:
    """Dense prefill of a left-padded batch into ``cache`` in chunks; returns the last logits ``(B, vocab)``."""
    check_left_padded(mask)
    length = ids.shape[1]
    pos = positions(mask)
    logits = None
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        out = model(
            input_ids=ids[:, start:stop],
            attention_mask=mask[:, :stop],
            position_ids=pos[:, start:stop],
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1].float()
        if progress:
            progress("prefill", stop, length)
    checkpoint(cache)  # so that sliding-window and recurrent layers can come back to the prompt
    return logits


@torch.no_grad()
def greedy_decode(
    model: torch.nn.Module,
    cache,
    mask: torch.Tensor,
    first: Sequence[int],
    steps: int,
    *,
    teachers: Sequence[Sequence[int]] | None = None,
    progress: Progress | None = None,
    stage: str = "decode",
    on_logits: BatchLogitsHook | None = None,
    eos_token_id: int | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy (or teacher-forced) decoding of a batch from the tokens ``first``; per sequence, the argmax and the
    NLL of the target at every step (``teachers[i][step]`` when teacher-forced). ``mask`` is the prompt's.

    With ``eos_token_id`` (free-running only), a sequence whose last token is EOS stops there: it is fed EOS again,
    its outputs are not kept (as ``model.generate`` does), and decoding ends early once every sequence has stopped.
    """
    if eos_token_id is not None and teachers is not None:
        raise SparseDecodeError("greedy_decode: eos_token_id stops free-running decoding; teacher forcing has none")
    device = next(model.parameters()).device
    batch = mask.shape[0]
    mask = mask.to(device)
    next_position = mask.long().sum(dim=1)
    tokens = torch.tensor(list(first), device=device)
    argmaxes: list[list[int]] = [[] for _ in range(batch)]
    nll: list[list[float]] = [[] for _ in range(batch)]
    targets_all = torch.tensor([list(t) for t in teachers], device=device) if teachers is not None else None
    done = [eos_token_id is not None and t == eos_token_id for t in first]
    for step in range(1, steps + 1):
        if all(done):
            break
        mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
        logits = (
            model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=(next_position + step - 1)[:, None],
                cache=cache,
                use_cache=True,
            )
            .logits[:, -1]
            .float()
        )
        best = logits.argmax(dim=-1)
        targets = targets_all[:, step] if targets_all is not None else best
        step_nll = torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None])[:, 0]
        if eos_token_id is not None:
            finished = torch.tensor(done, device=device)
            targets = targets.masked_fill(finished, eos_token_id)
        for i, (b, value) in enumerate(zip(best.tolist(), step_nll.tolist())):
            if done[i]:
                continue
            argmaxes[i].append(b)
            nll[i].append(value)
            done[i] = eos_token_id is not None and b == eos_token_id
        if on_logits:
            on_logits(step, logits)
        tokens = targets
        if progress:
            progress(stage, step, steps)
    return argmaxes, nll
