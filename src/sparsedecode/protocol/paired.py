"""Paired dense/sparse evaluation of one prompt (docs/definitions.md, section 3).

1. :func:`dense_reference`: dense prefill, then ``T`` greedy tokens with their NLL under the dense model. The
   prefilled cache is kept and reused (cropped back to the prompt) by every sparse run of that prompt.
2. :func:`compare`, free-running: from the same cache and the same first token (it comes from the dense
   prefill), decode greedily with sparse attention. With dense tokens ``d_0..d_{T-1}`` and sparse tokens
   ``s_0 = d_0, s_1..s_{T-1}``, ``first_divergence = min{t >= 1 : s_t != d_t}``: the decode step whose token
   first differs, counted among the ``T - 1`` sparse-generated tokens (the reference study's convention);
   ``T`` if none, and the run *survives* exactly then.
3. :func:`compare`, teacher-forced: feed the dense continuation with sparse attention; the share of steps
   whose sparse argmax equals the dense token, and the sparse perplexity of the dense tokens against the
   dense perplexity over the same ``T - 1`` tokens. This perplexity is on the dense model's own
   continuation, not on the sparse model's free-running output.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

from ..config import SparseConfig, check_config, check_named_layers
from ..decoding.loop import Progress, decode_tokens, left_pad, prefill
from ..errors import SparseDecodeError
from ..session import SparseSession, dense_attention, prefill_history, sparse_decoding
from ..session.kv_cache import crop_cache
from ..validate import (
    attention_modules,
    check_callable,
    check_model,
    check_positions,
    check_prompt_ids,
    check_sparse_attention,
)
from .diagnostics import MassAudit
from .results import BatchReference, CompareResult, DenseReference, assemble


def _prompts(model: torch.nn.Module, prompts: object, where: str) -> tuple[list[torch.Tensor], bool]:
    """The prompts of a call as ``(1, P_i)`` tensors, and whether it was one prompt (a ``(1, P)`` tensor) rather than
    several (a list, or ``(B, P)`` ids with ``B > 1``)."""
    one = not isinstance(prompts, (list, tuple)) and not (
        isinstance(prompts, torch.Tensor) and prompts.dim() == 2 and prompts.shape[0] > 1
    )
    if one:  # anything but a list or (B, P) ids is checked as one prompt (and refused as such)
        check_prompt_ids(model, prompts, where)
        return [prompts], True
    return _check_batch(model, prompts, where), False


def dense_reference(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor | list[torch.Tensor],
    *,
    tokens: int = 128,
    progress: Progress | None = None,
) -> DenseReference | BatchReference:
    """Dense prefill and ``tokens`` greedy tokens with their dense NLL, for one prompt or several.

    One prompt (``(1, P)``) gives a :class:`DenseReference`; several (a list of ``(1, P_i)`` prompts, or ``(B, P)``
    ids with ``B > 1``) a :class:`BatchReference`, decoded together left-padded: each prompt's tokens and NLL are
    those of its batch-1 reference (the batch rounds matrix products differently, so NLLs agree to float32
    round-off, not bit for bit), and each reference's timings are its share of the batch's.
    """
    check_model(model, "dense_reference")
    prompts, one = _prompts(model, prompt_ids, "dense_reference")
    _check_tokens(tokens)
    for p in prompts:
        check_positions(model, int(p.shape[1]), tokens, "dense_reference")
    ids, mask = (prompts[0], None) if one else left_pad(prompts)
    steps: list[torch.Tensor] = []
    with dense_attention(model):  # dense even inside a session the caller has open on this model
        started = time.perf_counter()
        cache, logits = prefill(model, ids, mask=mask, progress=progress)
        prefill_s = time.perf_counter() - started
        first = logits.argmax(dim=-1).tolist()
        chosen = logits.gather(1, torch.tensor(first, device=logits.device)[:, None])[:, 0]
        first_nll = (torch.logsumexp(logits, dim=-1) - chosen).tolist()
        started = time.perf_counter()
        argmaxes, nll = decode_tokens(
            model,
            cache,
            first,
            tokens - 1,
            mask=mask,
            progress=progress,
            stage="dense decode",
            on_logits=lambda step, step_logits: steps.append(step_logits),
        )
        decode_s = time.perf_counter() - started
    crop_cache(cache, ids.shape[1])
    stacked = torch.stack(steps, dim=1) if steps else torch.zeros(len(prompts), 0, 0)
    count, made_by = len(prompts), (weakref.ref(model), _weights_dtype(model))
    references = [
        DenseReference(
            p,
            [first[i], *argmaxes[i]],
            [first_nll[i], *nll[i]],
            cache,
            prefill_s / count,
            decode_s / count,
            stacked[i],
            made_by=made_by,
            in_batch=not one,
        )
        for i, p in enumerate(prompts)
    ]
    return references[0] if one else BatchReference(references, cache, mask, prefill_s, decode_s)


def _h2o_history(model: torch.nn.Module, reference: DenseReference) -> dict[int, torch.Tensor]:
    """H2O's history of the reference's prompt (see :func:`~sparsedecode.session.prefill_history`), once."""
    if reference.h2o_history is None:
        reference.h2o_history = prefill_history(model, reference.prompt_ids)
    return reference.h2o_history


def _check_tokens(tokens: int) -> None:
    if not isinstance(tokens, int) or tokens < 2:
        raise SparseDecodeError(f"tokens must be an integer >= 2 (got {tokens!r}): step 1 is shared with dense")


def _weights_dtype(model: torch.nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _check_reference(model, reference, prompts: list[torch.Tensor], one: bool, tokens: int) -> list[DenseReference]:
    kind = DenseReference if one else BatchReference
    if not isinstance(reference, kind):
        what = (
            "one prompt's reference must be a DenseReference" if one else "a batch's reference must be a BatchReference"
        )
        raise SparseDecodeError(f"compare: {what}, got {type(reference).__name__}")
    if one and reference.in_batch:
        raise SparseDecodeError(
            "compare: this DenseReference is one prompt's part of a BatchReference (its cache holds the whole "
            "batch): pass the BatchReference with the batch's prompts, or dense_reference() of this prompt alone"
        )
    refs = [reference] if one else reference.references
    made_by = refs[0].made_by if refs else None
    if made_by is not None and (made_by[0]() is not model or made_by[1] != _weights_dtype(model)):
        raise SparseDecodeError(
            "compare: the dense reference was computed by another model (or this model in another dtype): compute "
            "it with dense_reference() of this model"
        )
    if len(refs) != len(prompts) or not all(
        r.prompt_ids.shape == p.shape and torch.equal(r.prompt_ids, p) for r, p in zip(refs, prompts)
    ):
        raise SparseDecodeError(
            "the dense reference was computed for another prompt"
            if one
            else "the dense reference was computed for other prompts"
        )
    if tokens > min(len(r.tokens) for r in refs):
        raise SparseDecodeError(
            f"the dense reference has {min(len(r.tokens) for r in refs)} tokens; asked for {tokens}"
        )
    return refs


def compare(
    model: torch.nn.Module,
    tokenizer: object | None,
    prompt_ids: torch.Tensor | list[torch.Tensor],
    cfg: SparseConfig,
    tokens: int = 128,
    *,
    reference: DenseReference | BatchReference | None = None,
    progress: Progress | None = None,
    session_hook: Callable[[str, SparseSession], None] | None = None,
) -> CompareResult | list[CompareResult]:
    """Paired dense/sparse comparison (docs/definitions.md, section 3) of one prompt or several under ``cfg``.

    One prompt (``(1, P)``) gives a :class:`CompareResult`; several (a list of ``(1, P_i)`` prompts, or ``(B, P)``
    ids with ``B > 1``) a list, one per prompt, decoded together left-padded: each equals its batch-1 result apart
    from timings (each sequence's share of the batch's wall time) and float32 round-off, since every sequence gets
    its own support (:mod:`sparsedecode.session.forward`). Pass ``reference`` (from :func:`dense_reference` of the
    same prompts) to reuse one dense run across settings; otherwise one is computed. ``tokenizer`` is accepted for
    symmetry with generation APIs and unused here. The teacher-forced pass always yields the margin certificate (it
    reuses the dense logits kept by the reference); ``cfg.audit`` adds the omitted-mass audit of every free-running
    sparse step. ``session_hook(phase, session)`` is called as each sparse phase ("free", "teacher") starts.
    """
    del tokenizer
    check_model(model, "compare")
    check_callable(progress, "progress", "compare")
    check_callable(session_hook, "session_hook", "compare")
    prompts, one = _prompts(model, prompt_ids, "compare")
    check_config(cfg, "compare")
    check_sparse_attention(model, "compare")
    check_named_layers(cfg, attention_modules(model))  # before the dense reference, not as the session opens
    _check_tokens(tokens)
    for p in prompts:
        check_positions(model, int(p.shape[1]), tokens, "compare")
    if reference is None:
        reference = dense_reference(model, prompts[0] if one else prompts, tokens=tokens, progress=progress)
    refs = _check_reference(model, reference, prompts, one, tokens)
    cache, mask = reference.cache, None if one else reference.mask
    length = prompts[0].shape[1] if one else mask.shape[1]
    dense = [r.tokens[:tokens] for r in refs]
    histories = [_h2o_history(model, r) for r in refs] if cfg.selector.uses_history else None
    audits = ([MassAudit()] if one else [MassAudit(sequence=i) for i in range(len(refs))]) if cfg.audit else None
    sequences = [None] if one else list(range(len(refs)))

    def adopt(session: SparseSession) -> None:
        if histories is not None and one:
            session.adopt_history(cache, histories[0])
        elif histories is not None:
            session.adopt_batch_history(cache, histories, reference.pads)

    # the reference's cache holds the prompts only; whatever happens below (an interrupt, an error), it is left so
    crop_cache(cache, length)
    try:
        passes = (model, cfg, cache, mask, dense, adopt, session_hook, progress)
        free, stats, sparse_decode_s = _free_run(*passes, sequences, audits)
        crop_cache(cache, length)
        forced, sparse_nll, teacher_logits, teacher_forced_s = _teacher_run(*passes)
    finally:
        crop_cache(cache, length)
    results = [
        assemble(
            ref,
            cfg,
            tokens,
            free[i],
            forced[i],
            sparse_nll[i],
            teacher_logits[i],
            steps=stats["steps"][i],
            centroid_bytes=stats["centroid_bytes"][i],
            unique=stats["unique"][i],
            audit=audits[i] if audits else None,
            timings=(sparse_decode_s / len(refs), teacher_forced_s / len(refs)),
            support_read=stats["support_read"][i],
        )
        for i, ref in enumerate(refs)
    ]
    return results[0] if one else results


def _free_run(model, cfg, cache, mask, dense, adopt, session_hook, progress, sequences, audits):
    """The free-running sparse pass of :func:`compare`: each sequence's tokens, what its session read, seconds."""
    tokens = len(dense[0])
    started = time.perf_counter()
    with sparse_decoding(model, cfg) as session:
        adopt(session)
        session.track_reads = True
        session.observers.extend(audits or ())
        if session_hook:
            session_hook("free", session)
        first = [d[0] for d in dense]
        free, _ = decode_tokens(
            model, cache, first, tokens - 1, mask=mask, progress=progress, stage="sparse decode", nll=False
        )
    seconds = time.perf_counter() - started
    totals = len(sequences) == 1  # one prompt, or a batch of one (which runs as one prompt does)
    stats = {
        "unique": [session.unique_distant_positions(i) for i in sequences],
        "centroid_bytes": [session.centroid_bytes(i) for i in sequences],
        "support_read": [session.support_read(i or 0) for i in sequences],
        "steps": [
            (session.sparse_steps, session.dense_steps) if totals else tuple(session.sequence_steps.get(i, [0, 0]))
            for i in sequences
        ],
    }
    return free, stats, seconds


def _teacher_run(model, cfg, cache, mask, dense, adopt, session_hook, progress):
    """The teacher-forced sparse pass of :func:`compare`: argmaxes, NLLs and logits ``(B, T - 1, vocab)``, seconds."""
    tokens = len(dense[0])
    logits: list[torch.Tensor] = []
    started = time.perf_counter()
    with sparse_decoding(model, cfg) as session:
        adopt(session)
        if session_hook:
            session_hook("teacher", session)
        forced, nll = decode_tokens(
            model,
            cache,
            [d[0] for d in dense],
            tokens - 1,
            mask=mask,
            teacher=dense,
            progress=progress,
            stage="teacher-forced",
            on_logits=lambda step, step_logits: logits.append(step_logits),
        )
    return forced, nll, torch.stack(logits, dim=1), time.perf_counter() - started


def _check_batch(model: torch.nn.Module, prompts: object, where: str) -> list[torch.Tensor]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2:
            raise SparseDecodeError(
                f"{where}: expected prompt ids of shape (batch, length), got {tuple(prompts.shape)}"
            )
        prompts = [prompts[i : i + 1] for i in range(prompts.shape[0])]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise SparseDecodeError(f"{where}: a batch is a non-empty list of (1, length) prompt tensors")
    for p in prompts:
        check_prompt_ids(model, p, where)
    return list(prompts)
