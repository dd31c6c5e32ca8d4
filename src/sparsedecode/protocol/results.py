"""What a paired comparison gives (docs/definitions.md, section 3): the dense reference of a prompt
(:class:`DenseReference`, several in a :class:`BatchReference`), the paired result (:class:`CompareResult`) and how it
is assembled from the two sparse passes, the first-divergence convention, and the upgrade of rows stored under an older
convention."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from ..config import SparseConfig
from ..errors import SparseDecodeError
from .diagnostics import WARNING_MATCH_PERCENT, MassAudit, margin_certificate, summarize_audit, summarize_certificate

FIRST_DIVERGENCE_CONVENTION = 2
"""Marks results and stored rows whose ``first_divergence`` follows docs/definitions.md, section 3 (see
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
    # what computed it: the model (a weak reference) and its weights' dtype; and whether its cache is a batch's
    made_by: tuple[Callable[[], object], torch.dtype] | None = field(default=None, repr=False, compare=False)
    in_batch: bool = field(default=False, repr=False)

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
    ``*_per_head_best`` pair against each query head's own best (see :mod:`sparsedecode.protocol.diagnostics`)."""
    selector_recall_per_head_best_mean: float | None = None
    captured_mass_ratio_per_head_best_mean: float | None = None
    audit: dict | None = None
    audit_arrays: dict | None = field(default=None, repr=False)
    support_read_mean: float | None = None
    """Positions a KV head read per sparse step of the free-running run (mean, min, max over layers, heads and
    steps; ``None`` without a sparse step): the effective support for a fixed budget (a chosen short last block reads
    less), what an adaptive budget chose otherwise."""
    support_read_min: int | None = None
    support_read_max: int | None = None
    first_divergence_convention: int = FIRST_DIVERGENCE_CONVENTION

    def to_dict(self) -> dict:
        """JSON-ready fields (the per-step audit arrays are left out: save them with ``save_audit``)."""
        data = asdict(self)
        data.pop("audit_arrays")
        return data


def first_divergence(dense_tokens: list[int], sparse_tokens: list[int]) -> int:
    """``min{t >= 1 : s_t != d_t}`` over the paired tokens (``s_0 = d_0`` is shared), ``T`` if none (docs/definitions.md
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


GROUP_MEAN_BEFORE = ("quest", "sparq")
"""Built-in selectors that chose one support per KV head from the group's mean query until they followed their
official code (issue #39): a stored row naming one without a ``grouping`` parameter ran that variant, now named
``NAME:...,grouping=mean-query``."""
RENAMED = {"top-p": "block-top-p"}
"""Built-in selectors stored under a name they no longer have (``top-p`` kept whole blocks: not Twilight's top-p)."""


def upgrade_selector(record: dict) -> dict:
    """``record`` (a row, or anything with ``selector`` and ``selector_params``) naming its selector as today: a
    renamed built-in under its new name, a group-mean variant under ``grouping=mean-query`` (see
    :data:`GROUP_MEAN_BEFORE`); anything else as it is."""
    spec = record.get("selector")
    if not isinstance(spec, str) or spec.partition(":")[0].endswith(".py"):
        return record
    name, sep, params = spec.partition(":")
    name = RENAMED.get(name, name)
    settings = record.get("settings") if isinstance(record.get("settings"), dict) else None
    stored = record.get("selector_params", (settings or {}).get("selector_params"))
    stored = stored if isinstance(stored, dict) else {}  # rows written since #39 store grouping with the rest
    upgraded = dict(record)
    named = {item.partition("=")[0].strip() for item in params.split(",")} if params else set()
    if name in GROUP_MEAN_BEFORE and "grouping" not in stored and "grouping" not in named:
        params = f"{params},grouping=mean-query" if params else "grouping=mean-query"
        if "selector_params" in record:
            upgraded["selector_params"] = {**stored, "grouping": "mean-query"}
    upgraded["selector"] = f"{name}:{params}" if params else name
    if settings is not None and settings.get("selector") == spec:  # a comparison run's own settings
        upgraded["settings"] = upgrade_selector(settings)
    return upgraded


def upgrade_row(row: dict) -> dict:
    """A stored result row (sweep or selector comparison) in today's ``first_divergence`` convention, its selector
    named as today (:func:`upgrade_selector`).

    Rows carrying ``first_divergence_convention`` are returned as they are; older rows get ``first_divergence``
    recomputed from their ``dense_tokens`` and ``sparse_tokens`` (checked against the value they hold) and the
    mark appended last, as new rows carry it; every other field keeps its value and place.
    ``margin_at_divergence`` needs no change: it always referred to the decode step that produced the differing
    token, which is today's ``first_divergence``.
    """
    row = upgrade_selector(upgrade_audit_fields(row))
    convention = row.get("first_divergence_convention", 1)
    if convention == FIRST_DIVERGENCE_CONVENTION:
        return row
    if convention != 1:
        raise SparseDecodeError(
            f"a row has first_divergence_convention {convention!r}, unknown here: written by a newer version?"
        )
    if not all(isinstance(row.get(name), list) for name in ("dense_tokens", "sparse_tokens")):
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
    """exp of the mean NLL; ``inf`` where that overflows (a model giving huge logits); NaN where an NLL is NaN."""
    if not nll:
        return float("nan")
    mean = sum(nll) / len(nll)
    if math.isnan(mean):
        return float("nan")
    return math.exp(mean) if mean < 709.0 else float("inf")


def assemble(
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
