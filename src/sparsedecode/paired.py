"""Paired dense/sparse evaluation of one prompt (DESIGN.md section 3).

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

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from .attention import SparseSession, dense_attention, prefill_history, sparse_decoding
from .cache import rewind
from .config import SparseConfig
from .decode import Progress, decode_tokens, left_pad, prefill
from .diagnostics import (
    WARNING_MATCH_PERCENT,
    MassAudit,
    margin_certificate,
    summarize_audit,
    summarize_certificate,
)
from .errors import SparseDecodeError
from .validate import check_config, check_model, check_positions, check_prompt_ids, check_sparse_attention

FIRST_DIVERGENCE_CONVENTION = 2
"""Marks results and stored rows whose ``first_divergence`` follows DESIGN.md section 3 (see
:func:`first_divergence`). Rows without the mark were written under convention 1, the 1-based position of the
first differing token counting the shared first token (one more than today's value when the run diverged; ``T``
for a divergence at the last step as well as for survival): :func:`upgrade_row` recomputes them."""


LogitsHook = Callable[[int, torch.Tensor], None]
"""``hook(step, logits)``: called with the float32 logits of every decode step (1-based step)."""


@dataclass
class DenseReference:
    """Dense prefill and greedy continuation of one prompt.

    ``tokens[0]`` is the first generated token (from prefill logits); ``nll[i]`` is the dense model's NLL of
    ``tokens[i]``; ``logits[s - 1]`` are the float32 logits of decode step ``s`` (fed ``tokens[s - 1]``,
    predicting ``tokens[s]``), kept for the margin certificate. The prefilled ``cache`` holds exactly the
    prompt between runs. ``h2o_history`` is H2O's history of the prefill, computed by the first ``h2o`` run.
    """

    prompt_ids: torch.Tensor
    tokens: list[int]
    nll: list[float]
    cache: DynamicCache = field(repr=False)
    prefill_s: float
    decode_s: float
    logits: torch.Tensor = field(repr=False)
    h2o_history: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def context(self) -> int:
        return int(self.prompt_ids.shape[1])

    @property
    def ppl(self) -> float:
        """Dense perplexity of tokens 2..T (the tokens both dense and sparse predict)."""
        return _ppl(self.nll[1:])


@dataclass
class CompareResult:
    """Paired dense/sparse outcome for one prompt and one sparse setting. ``to_dict`` gives JSON-ready data."""

    context: int
    tokens: int
    settings: dict
    first_divergence: int
    survives: bool
    teacher_forced_match: float
    delta_ppl_percent: float
    dense_ppl: float
    sparse_ppl: float
    mean_unique_distant_positions_per_kv: float
    dense_tokens: list[int]
    sparse_tokens: list[int]
    teacher_forced_tokens: list[int]
    dense_nll: list[float]
    sparse_nll: list[float]
    sparse_steps: int
    dense_fallback_steps: int
    centroid_cache_bytes: int
    certified_fraction: float
    flips: int
    certificate_violations: int
    margin_at_divergence: float | None
    warning_regime: bool
    certificate: dict
    margins: list[float]
    logit_errors: list[float]
    prefill_s: float
    dense_decode_s: float
    sparse_decode_s: float
    teacher_forced_s: float
    identity_residual_max: float | None = None
    bound_violations: int | None = None
    omitted_mass_mean: float | None = None
    selector_recall_mean: float | None = None
    captured_mass_ratio_mean: float | None = None
    """Recall and captured/best are against the KV-head group's best set (reachable); the
    ``*_per_head_best`` pair against each query head's own best (see :mod:`sparsedecode.diagnostics`)."""
    selector_recall_per_head_best_mean: float | None = None
    captured_mass_ratio_per_head_best_mean: float | None = None
    audit: dict | None = None
    audit_arrays: dict | None = field(default=None, repr=False)
    first_divergence_convention: int = FIRST_DIVERGENCE_CONVENTION
    support_read_mean: float | None = None
    """Positions a KV head read per sparse step of the free-running run (mean, min, max over layers, heads and
    steps; ``None`` without a sparse step): the effective support for a fixed budget (a chosen short last block reads
    less), what an adaptive budget chose otherwise."""
    support_read_min: int | None = None
    support_read_max: int | None = None

    def to_dict(self) -> dict:
        """JSON-ready fields (the per-step audit arrays are left out: save them with ``save_audit``)."""
        data = asdict(self)
        data.pop("audit_arrays")
        return data


def first_divergence(dense_tokens: list[int], sparse_tokens: list[int]) -> int:
    """``min{t >= 1 : s_t != d_t}`` over the paired tokens (``s_0 = d_0`` is shared), ``T`` if none (DESIGN.md
    section 3): the decode step whose sparse token first differs; ``T`` is the number of dense tokens."""
    if len(dense_tokens) != len(sparse_tokens):
        raise SparseDecodeError(f"{len(dense_tokens)} dense tokens but {len(sparse_tokens)} sparse tokens")
    return next((t for t in range(1, len(dense_tokens)) if sparse_tokens[t] != dense_tokens[t]), len(dense_tokens))


def upgrade_audit_fields(row: dict) -> dict:
    """A stored row (sweep run, selector run, retrieval trial) with audit figures in today's meaning.

    Rows audited before recall and captured/best were measured against the best set reachable at the same budget
    (the KV-head group's top blocks or positions) hold figures against each query head's own best under the
    headline names. They are moved to the ``*_per_head_best_mean`` names, and the headline figures, never
    measured for those rows, become ``None``: old and new meanings are never mixed under one name.
    """
    if "captured_mass_ratio_per_head_best_mean" in row or row.get("captured_mass_ratio_mean") is None:
        return row
    return {
        **row,
        "selector_recall_mean": None,
        "captured_mass_ratio_mean": None,
        "selector_recall_per_head_best_mean": row.get("selector_recall_mean"),
        "captured_mass_ratio_per_head_best_mean": row["captured_mass_ratio_mean"],
    }


def upgrade_row(row: dict) -> dict:
    """A stored result row (sweep or selector comparison) in today's ``first_divergence`` convention.

    Rows carrying ``first_divergence_convention`` are returned as they are; older rows get ``first_divergence``
    recomputed from their ``dense_tokens`` and ``sparse_tokens`` (checked against the value they hold) and the
    mark appended last, as new rows carry it; every other field keeps its value and place.
    ``margin_at_divergence`` needs no change: it always referred to the decode step that produced the differing
    token, which is today's ``first_divergence``.
    """
    row = upgrade_audit_fields(row)
    convention = row.get("first_divergence_convention", 1)
    if convention == FIRST_DIVERGENCE_CONVENTION:
        return row
    if convention != 1:
        raise SparseDecodeError(
            f"a row has first_divergence_convention {convention!r}, unknown here: written by a newer version?"
        )
    if "dense_tokens" not in row or "sparse_tokens" not in row:
        raise SparseDecodeError("a row of the old first_divergence convention lacks its token ids: cannot migrate")
    value = first_divergence(row["dense_tokens"], row["sparse_tokens"])
    tokens = len(row["dense_tokens"])
    survives = value == tokens
    old = tokens if survives else value + 1
    if row.get("first_divergence") != old or bool(row.get("survives")) != survives:
        raise SparseDecodeError(
            f"a row of the old convention holds first_divergence {row.get('first_divergence')!r}, survives "
            f"{row.get('survives')!r}, but its tokens give {old}: the row is inconsistent, fix or remove it"
        )
    return {**row, "first_divergence": value, "first_divergence_convention": FIRST_DIVERGENCE_CONVENTION}


def _ppl(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll)) if nll else float("nan")


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Drop cached positions past ``length`` (:func:`~sparsedecode.cache.rewind`: crops, and restores the layers
    crop cannot rewind from the checkpoint :func:`prefill` took)."""
    rewind(cache, length)


def _prompts(model: torch.nn.Module, prompts: object, where: str) -> tuple[list[torch.Tensor], bool]:
    """The prompts of a call as ``(1, P_i)`` tensors, and whether it was one prompt (a ``(1, P)`` tensor) rather than
    several (a list, or ``(B, P)`` ids with ``B > 1``)."""
    one = isinstance(prompts, torch.Tensor) and prompts.dim() == 2 and prompts.shape[0] == 1
    if one:
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
        first_nll = (torch.logsumexp(logits, dim=-1) - logits.gather(1, torch.tensor(first)[:, None])[:, 0]).tolist()
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
    count = len(prompts)
    references = [
        DenseReference(
            p, [first[i], *argmaxes[i]], [first_nll[i], *nll[i]], cache, prefill_s / count, decode_s / count, stacked[i]
        )
        for i, p in enumerate(prompts)
    ]
    return references[0] if one else BatchReference(references, cache, mask, prefill_s, decode_s)


def _h2o_history(model: torch.nn.Module, reference: DenseReference) -> dict[int, torch.Tensor]:
    """H2O's history of the reference's prompt (see :func:`~sparsedecode.attention.prefill_history`), once."""
    if reference.h2o_history is None:
        reference.h2o_history = prefill_history(model, reference.prompt_ids)
    return reference.h2o_history


def _check_tokens(tokens: int) -> None:
    if not isinstance(tokens, int) or tokens < 2:
        raise SparseDecodeError(f"tokens must be an integer >= 2 (got {tokens!r}): step 1 is shared with dense")


def _check_reference(reference, prompts: list[torch.Tensor], one: bool, tokens: int) -> list[DenseReference]:
    kind = DenseReference if one else BatchReference
    if not isinstance(reference, kind):
        what = (
            "one prompt's reference must be a DenseReference" if one else "a batch's reference must be a BatchReference"
        )
        raise SparseDecodeError(f"compare: {what}, got {type(reference).__name__}")
    refs = [reference] if one else reference.references
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
    """Paired dense/sparse comparison (DESIGN.md section 3) of one prompt or several under ``cfg``.

    One prompt (``(1, P)``) gives a :class:`CompareResult`; several (a list of ``(1, P_i)`` prompts, or ``(B, P)``
    ids with ``B > 1``) a list, one per prompt, decoded together left-padded: each equals its batch-1 result apart
    from timings (each sequence's share of the batch's wall time) and float32 round-off, since every sequence gets
    its own support (:mod:`sparsedecode.attention.batch`). Pass ``reference`` (from :func:`dense_reference` of the
    same prompts) to reuse one dense run across settings; otherwise one is computed. ``tokenizer`` is accepted for
    symmetry with generation APIs and unused here. The teacher-forced pass always yields the margin certificate (it
    reuses the dense logits kept by the reference); ``cfg.audit`` adds the omitted-mass audit of every free-running
    sparse step. ``session_hook(phase, session)`` is called as each sparse phase ("free", "teacher") starts.
    """
    del tokenizer
    check_model(model, "compare")
    prompts, one = _prompts(model, prompt_ids, "compare")
    check_config(cfg, "compare")
    check_sparse_attention(model, "compare")
    _check_tokens(tokens)
    for p in prompts:
        check_positions(model, int(p.shape[1]), tokens, "compare")
    if reference is None:
        reference = dense_reference(model, prompts[0] if one else prompts, tokens=tokens, progress=progress)
    refs = _check_reference(reference, prompts, one, tokens)
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
        started = time.perf_counter()
        with sparse_decoding(model, cfg) as session:
            adopt(session)
            session.track_reads = True
            session.observers.extend(audits or ())
            if session_hook:
                session_hook("free", session)
            free, _ = decode_tokens(
                model, cache, [d[0] for d in dense], tokens - 1, mask=mask, progress=progress, stage="sparse decode"
            )
        sparse_decode_s = time.perf_counter() - started
        unique = [session.unique_distant_positions(i) for i in sequences]
        centroid_bytes = [session.centroid_bytes(i) for i in sequences]
        support_read = [session.support_read(i or 0) for i in sequences]
        steps = [
            (session.sparse_steps, session.dense_steps) if one else tuple(session.sequence_steps.get(i, [0, 0]))
            for i in sequences
        ]
        crop_cache(cache, length)

        teacher_logits: list[torch.Tensor] = []
        started = time.perf_counter()
        with sparse_decoding(model, cfg) as teacher_session:
            adopt(teacher_session)
            if session_hook:
                session_hook("teacher", teacher_session)
            forced, sparse_nll = decode_tokens(
                model,
                cache,
                [d[0] for d in dense],
                tokens - 1,
                mask=mask,
                teacher=dense,
                progress=progress,
                stage="teacher-forced",
                on_logits=lambda step, logits: teacher_logits.append(logits),
            )
        teacher_forced_s = time.perf_counter() - started
    finally:
        crop_cache(cache, length)
    stacked = torch.stack(teacher_logits, dim=1)
    results = [
        _assemble(
            ref,
            cfg,
            tokens,
            free[i],
            forced[i],
            sparse_nll[i],
            stacked[i],
            steps=steps[i],
            centroid_bytes=centroid_bytes[i],
            unique=unique[i],
            audit=audits[i] if audits else None,
            timings=(sparse_decode_s / len(refs), teacher_forced_s / len(refs)),
            support_read=support_read[i],
        )
        for i, ref in enumerate(refs)
    ]
    return results[0] if one else results


def _assemble(
    reference: DenseReference,
    cfg: SparseConfig,
    tokens: int,
    free: list[int],
    forced: list[int],
    sparse_nll: list[float],
    teacher_logits: torch.Tensor,
    *,
    steps: tuple[int, int],
    centroid_bytes: int,
    unique: torch.Tensor,
    audit: MassAudit | None,
    timings: tuple[float, float],
    support_read: dict | None = None,
) -> CompareResult:
    """A :class:`CompareResult` from one prompt's dense reference and its two sparse passes."""
    dense_tokens = reference.tokens[:tokens]
    sparse_tokens = [dense_tokens[0], *free]
    divergence = first_divergence(dense_tokens, sparse_tokens)
    survives = divergence == tokens
    sparse_decode_s, teacher_forced_s = timings
    dense_nll = reference.nll[:tokens]
    dense_ppl, sparse_ppl = _ppl(dense_nll[1:]), _ppl(sparse_nll)
    matches = sum(a == b for a, b in zip(forced, dense_tokens[1:]))
    match_percent = 100.0 * matches / (tokens - 1)
    certificate = margin_certificate(reference.logits[: tokens - 1], teacher_logits)
    cert = summarize_certificate(certificate, None if survives else divergence)
    audit_arrays = audit.arrays() if audit is not None else None
    audit_summary = summarize_audit(audit_arrays) if audit_arrays is not None else None
    audited = audit_summary is not None and audit_summary.get("audited_steps", 0) > 0
    return CompareResult(
        context=reference.context,
        tokens=tokens,
        settings=cfg.to_dict(),
        first_divergence=divergence,
        survives=survives,
        teacher_forced_match=match_percent,
        delta_ppl_percent=100.0 * (sparse_ppl - dense_ppl) / dense_ppl,
        dense_ppl=dense_ppl,
        sparse_ppl=sparse_ppl,
        mean_unique_distant_positions_per_kv=float(unique.float().mean()) if unique.numel() else 0.0,
        dense_tokens=dense_tokens,
        sparse_tokens=sparse_tokens,
        teacher_forced_tokens=forced,
        dense_nll=dense_nll,
        sparse_nll=[dense_nll[0], *sparse_nll],
        sparse_steps=steps[0],
        dense_fallback_steps=steps[1],
        centroid_cache_bytes=centroid_bytes,
        certified_fraction=cert["certified_fraction"],
        flips=cert["flips"],
        certificate_violations=cert["certificate_violations"],
        margin_at_divergence=cert["margin_at_divergence"],
        warning_regime=match_percent < WARNING_MATCH_PERCENT,
        certificate=cert,
        margins=certificate["gamma"].tolist(),
        logit_errors=certificate["delta"].tolist(),
        prefill_s=reference.prefill_s,
        dense_decode_s=reference.decode_s * (tokens - 1) / max(len(reference.tokens) - 1, 1),
        sparse_decode_s=sparse_decode_s,
        teacher_forced_s=teacher_forced_s,
        identity_residual_max=audit_summary["identity_residual_max"] if audited else None,
        bound_violations=audit_summary["bound_violations"] if audited else None,
        omitted_mass_mean=audit_summary["omitted_mass_mean"] if audited else None,
        selector_recall_mean=audit_summary["selector_recall_mean"] if audited else None,
        captured_mass_ratio_mean=audit_summary["captured_mass_ratio_mean"] if audited else None,
        selector_recall_per_head_best_mean=audit_summary["selector_recall_per_head_best_mean"] if audited else None,
        captured_mass_ratio_per_head_best_mean=(
            audit_summary["captured_mass_ratio_per_head_best_mean"] if audited else None
        ),
        audit=audit_summary,
        audit_arrays=audit_arrays,
        **(support_read or {}),
    )


@dataclass
class BatchReference:
    """Dense references of several prompts decoded together (left-padded): one :class:`DenseReference` per prompt
    (their ``cache`` is the shared batch cache) and the batch's ``cache`` and prompt ``mask`` ``(B, P)``."""

    references: list[DenseReference]
    cache: DynamicCache = field(repr=False)
    mask: torch.Tensor = field(repr=False)
    prefill_s: float
    decode_s: float

    @property
    def pads(self) -> list[int]:
        return [int(p) for p in (self.mask.shape[1] - self.mask.sum(dim=1)).tolist()]


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
