"""The one decode loop: a dense prefill in chunks, then one-token steps (gpt-fast's ``decode_one_token`` /
``decode_n_tokens``), for one prompt or a left-padded batch.

Every caller uses it: the paired protocol (free-running and teacher-forced), ``generate`` in its dense and sparse
modes, the task evaluation, the retrieval probe, the mass probe, the benchmarks and the lm-eval model. Lossless
drafting steps its drafter one token at a time itself (:mod:`sparsedecode.decoding.lossless`: the loop's log-sum-exp
over the vocabulary would be spent on NLLs nobody reads): a session through :func:`decode_one_token`, a compiled
decoder through its own step. Whether a step is dense or sparse is not the loop's business: it is decided by the
session (or its absence) the loop runs in. One convention for one prompt and several: token ids are per sequence (lists
of lists), logits are ``(B, vocab)`` float32. Without a mask (one prompt, or equal-length prompts) the model is called
with token ids alone; with one, each sequence is left-padded and gets its own RoPE positions.

A batch holds sequences of different lengths left-padded to the longest (:func:`left_pad`): sequence ``i`` of
length ``P_i`` sits at cache positions ``[P - P_i, P)`` and its RoPE positions are ``0 .. P_i - 1``, as if it were
alone. Inside a :func:`~sparsedecode.session.sparse_decoding` session every sequence then gets its own anchor,
window, blocks, centroids and reuse schedule (:mod:`sparsedecode.session.forward`); padding is never selected nor
attended. The mask grows with every decoded token; position ids are derived from it, as ``model.generate`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

import torch

from ..errors import SparseDecodeError
from ..session.kv_cache import checkpoint
from ..step.schedule import dense_forwards

Progress = Callable[..., None]
"""``progress(stage, done, total)``: called as work advances (a progress bar)."""
LogitsHook = Callable[[int, torch.Tensor], None]
"""``on_logits(step, logits)`` with ``logits`` ``(B, vocab)`` float32, after every step."""


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits (..., vocab)`` as (nested) lists, as ``torch.argmax`` gives it: the first
    of equal maxima, a NaN counting as the largest. float32 on the CPU goes through NumPy's argmax, the same choice
    in SIMD: torch's CPU argmax over SmolLM2's 49K vocabulary took 90-160 us a call, a greedy step's 1-2%, NumPy's
    about 6."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _nll(logits: torch.Tensor, targets: list[int]) -> list[float]:
    """Each row's negative log-likelihood of its target under ``logits (B, vocab)``."""
    target_ids = torch.tensor(targets, device=logits.device)
    return (torch.logsumexp(logits, dim=-1) - logits.gather(1, target_ids[:, None])[:, 0]).tolist()


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
    *,
    mask: torch.Tensor | None = None,
    cache=None,
    chunk: int = 1024,
    progress: Progress | None = None,
):
    """Dense prefill of ``ids`` ``(B, P)`` in chunks (bounded memory, visible progress) into ``cache`` (a new
    ``DynamicCache`` by default); ``mask`` ``(B, P)`` for a left-padded batch. Returns the cache and the last
    position's logits ``(B, vocab)`` float32. A checkpoint of the cache is taken so that layers ``crop`` cannot
    rewind (sliding-window, recurrent) can come back to the prompt."""
    from transformers import DynamicCache

    if ids.dim() != 2:
        raise SparseDecodeError(f"expected prompt ids of shape (batch, length), got {tuple(ids.shape)}")
    if mask is not None:
        check_left_padded(mask)
    cache = cache if cache is not None else DynamicCache(config=model.config)
    length, offset = ids.shape[1], cache_length(cache)
    pos = positions(mask) if mask is not None else None
    logits = None
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        if mask is None:  # positions given: a model may count each chunk from 0 without them (Bamba)
            where = {
                "position_ids": torch.arange(offset + start, offset + stop, device=ids.device).expand(len(ids), -1)
            }
        else:
            where = {"attention_mask": mask[:, :stop], "position_ids": pos[:, start:stop]}
        with dense_forwards():  # a last chunk of one token too, inside a session
            out = model(input_ids=ids[:, start:stop], cache=cache, use_cache=True, logits_to_keep=1, **where)
        logits = out.logits[:, -1].float()
        if progress:
            progress("prefill", stop, length)
    checkpoint(cache)
    return cache, logits


@torch.no_grad()
def decode_one_token(model: torch.nn.Module, cache, tokens: torch.Tensor, *, mask=None, position=None) -> torch.Tensor:
    """One step: feed ``tokens`` ``(B,)`` (one per sequence) and return the next logits ``(B, vocab)`` float32.
    With a left-padded batch, ``mask`` ``(B, L + 1)`` covers the cache and this token, ``position`` ``(B,)`` is each
    sequence's position of it."""
    if mask is None:  # given, as transformers' generate gives them: a model may count from 0 without (Bamba)
        where = {"position_ids": torch.full((tokens.shape[0], 1), cache_length(cache), device=tokens.device)}
    else:
        where = {"attention_mask": mask, "position_ids": position[:, None]}
    return model(input_ids=tokens[:, None], cache=cache, use_cache=True, **where).logits[:, -1].float()


def cache_length(cache) -> int:
    """The positions ``cache`` holds: its longest layer's (a hybrid model's recurrent layers hold none, and a layer
    that reads another's cache, as Gemma 3n's KV-shared layers do, is a ``DummyLayer`` with no length at all)."""
    layers = getattr(cache, "layers", None)
    if layers:
        return max((int(layer.get_seq_length()) for layer in layers if hasattr(layer, "get_seq_length")), default=0)
    return int(cache.get_seq_length())


@torch.no_grad()
def decode_tokens(
    model: torch.nn.Module,
    cache,
    first: Sequence[int],
    steps: int,
    *,
    mask: torch.Tensor | None = None,
    teacher: Sequence[Sequence[int]] | None = None,
    stop: int | Container[int] | Callable[[list[int]], bool] | None = None,
    on_logits: LogitsHook | None = None,
    progress: Progress | None = None,
    stage: str = "decode",
    step_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    nll: bool = True,
) -> tuple[list[list[int]], list[list[float]]]:
    """``steps`` one-token steps from ``first`` (a token per sequence); per sequence, the argmax and the NLL of the
    step's target at every step (with ``nll=False``, none: empty lists, no log-sum-exp over the vocabulary).

    The target of step ``s`` (``1 .. steps``), the token fed next, is ``teacher[i][s]`` while the sequence's teacher
    lasts (teacher forcing, or feeding known tokens such as a question), its own argmax afterwards (greedy). ``stop``
    ends a sequence at a greedy step: a token id or a set of them (the step's argmax is one), or a function of the
    sequence's greedy tokens so far (``first`` included when there is no teacher) that returns true to stop. A
    stopped sequence's outputs end with the token that stopped it; it is fed that token again while the others go
    on, and the loop ends once every sequence has stopped.
    ``mask`` ``(B, P)`` is a left-padded batch's prompt mask; without it the model gets token ids alone. ``step_fn(
    tokens) -> logits`` replaces a step's forward (:meth:`~sparsedecode.compiled.decoder.CompiledDecoder.step`).
    """
    device = next(model.parameters()).device
    batch = len(first)
    stopped, stops = stop, None
    if not callable(stop):
        stops = set() if stop is None else {stop} if isinstance(stop, int) else set(stop)

        def stopped(greedy: list[int]) -> bool:
            return bool(greedy) and greedy[-1] in stops

    if mask is not None:
        mask = mask.to(device)
        next_position = mask.long().sum(dim=1)
    forced = [list(t) for t in teacher] if teacher is not None else [[] for _ in range(batch)]
    fed = [int(t) for t in first]
    tokens = torch.tensor(fed, device=device)
    argmaxes: list[list[int]] = [[] for _ in range(batch)]
    nlls: list[list[float]] = [[] for _ in range(batch)]
    head = [[] if forced[i] else [fed[i]] for i in range(batch)]  # without a teacher, first is a greedy token too

    def greedy(i: int) -> list[int]:
        return head[i] + argmaxes[i][max(len(forced[i]) - 1, 0) :]

    done = [not forced[i] and stopped(head[i]) for i in range(batch)]
    for step in range(1, steps + 1):
        if all(done):
            break
        if step_fn is not None:
            logits = step_fn(tokens)
        elif mask is not None:
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            logits = decode_one_token(model, cache, tokens, mask=mask, position=next_position + step - 1)
        else:
            logits = decode_one_token(model, cache, tokens)
        best = argmax_rows(logits)
        targets = [forced[i][step] if step < len(forced[i]) else best[i] for i in range(batch)]
        step_nll = _nll(logits, targets) if nll else None
        for i in range(batch):
            if done[i]:
                targets[i] = fed[i]  # a stopped sequence is fed its stop token again; nothing is kept
                continue
            argmaxes[i].append(best[i])
            if step_nll is not None:
                nlls[i].append(step_nll[i])
            if step >= len(forced[i]):  # a greedy step (a set of stop ids needs only its token)
                done[i] = best[i] in stops if stops is not None else stopped(greedy(i))
            fed[i] = targets[i]
        if on_logits:
            on_logits(step, logits)
        tokens = torch.tensor(targets, device=device)
        if progress:
            progress(stage, step, steps)
    return argmaxes, nlls
