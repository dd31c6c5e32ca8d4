"""Why a sparse run departs from dense (docs/definitions.md, section 2).

* :class:`MassAudit` (opt-in, ``SparseConfig(audit=True)``): at every sparse decode step, per layer and query
  head, the true dense attention of that same step is computed (an extra dense pass, so it is never on by
  default) and compared with what the sparse step read and produced:

  - the split of attention mass into anchor / window / selected blocks / omitted (``eps``);
  - ``||o_sparse - o_dense||``, ``||o_kept - o_omitted||``, the residual of the exact identity
    ``o_sparse - o_dense = eps * (o_kept - o_omitted)`` and the bound ``2 * eps * max ||v||``;
  - selector recall and the captured mass ratio ("captured/best") against the best set any selector of
    that kind can reach at the same budget. The query heads of a KV-head group share one selection, so the
    reference is per group: the top-``b`` distant blocks by the group's summed true mass (token-level
    selectors: the top ``S - 1 - W`` distant positions), ties towards the lowest index, which is exactly what
    ``oracle-blocks`` (``oracle-tokens``) picks. ``selector_recall`` is the share of that set the selector
    chose; ``captured_mass_ratio`` is the true mass of the chosen set over the mass of the best set, both
    summed over the group's query heads (a ratio of sums: at most 1 for a set shared by the group; a selector
    choosing per query head, such as ``quest``, can exceed it). Both are per group and repeated
    for each query head of the group, so the mean over query heads weighs every group equally. The oracles
    score 1 on both.
  - the same two figures against each query head's own top units, which no selector sharing a set across a
    group can reach when ``G > 1`` (``oracle-blocks`` scores below 1): kept only as
    ``selector_recall_per_head_best`` and ``captured_mass_ratio_per_head_best`` (the latter per head:
    chosen mass of the head over its own best mass).

* :func:`margin_certificate`: per teacher-forced step, the dense top-1/top-2 margin ``gamma`` and the logit
  error ``delta = max |z_sparse - z_dense|``; a step is certified when ``gamma > 2 * delta``, in which case its
  greedy token cannot flip. The converse does not hold: uncertified steps usually do not flip.

The audit maths is float64 so that what it measures is the sparse step's error, not its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..files import atomic_path
from ..layout import BlockLayout
from ..selectors.ops import top_blocks
from ..session import StepView

WARNING_MATCH_PERCENT = 70.0
WARNING_NOTE = (
    "teacher-forced match below 70%: in the reference study every such run had a perplexity increase above "
    "100% (7 runs from two prefixes); an observation, not a law"
)
AUDIT_FIELDS = (
    "mass_anchor",
    "mass_window",
    "mass_blocks",
    "omitted_mass",
    "error_norm",
    "kept_minus_omitted_norm",
    "identity_residual",
    "bound",
    "selector_recall",
    "captured_mass_ratio",
    "selector_recall_per_head_best",
    "captured_mass_ratio_per_head_best",
)
SELECTOR_FIELDS = AUDIT_FIELDS[-4:]
"""The selector's recall and captured/best, against the group's reachable best and against each head's own."""


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den``, 1 where ``den`` is 0 (nothing to capture counts as all of it)."""
    return torch.where(den > 0, num / den.clamp_min(1e-300), 1.0)


def selection_quality(mass: torch.Tensor, chosen: torch.Tensor, budget: int) -> dict[str, torch.Tensor]:
    """Recall and captured/best of one selection, against the group's reachable best and each head's own best.

    ``mass`` is the true attention of each query head on each distant unit ``(kv, G, U)`` (a unit is a distant
    block for block selectors, a distant position for token-level ones), ``chosen`` the units the selector
    chose, per KV head ``(kv, U)`` or per query head ``(kv, G, U)`` (bool), ``budget`` how many it may choose (``b``,
    or ``S - 1 - W``).

    The reachable best is the top ``budget`` units by the group's summed mass, ties towards the lowest index
    (what ``oracle-blocks`` / ``oracle-tokens`` pick). ``selector_recall`` is the share of it that was chosen,
    ``captured_mass_ratio`` the chosen units' mass over the best set's, both summed over the group's query heads.
    The ``*_per_head_best`` figures use each head's own top units instead (unreachable when ``G > 1``);
    there the captured ratio is per head. Every value is float64 ``(kv, G)`` (group figures repeated per head).
    """
    kv_heads, group, _ = mass.shape
    mass = mass.double()
    per_head = chosen.dim() == 3
    chosen = chosen if per_head else chosen.unsqueeze(1).expand(-1, group, -1)  # (kv, G, U)
    chosen_mass = (mass * chosen).sum(-1)  # (kv, G)

    best = top_blocks(mass.sum(1), budget)  # (kv, b'), b' = min(budget, U)
    size = best.shape[-1]
    hits = chosen.gather(-1, best.unsqueeze(1).expand(-1, group, -1)).sum(-1).double()  # (kv, G)
    hits = hits.mean(1) if per_head else hits[:, 0]  # a group's heads share one choice unless chosen per head
    best_mass = mass.gather(-1, best.unsqueeze(1).expand(-1, group, -1)).sum(-1)  # (kv, G)

    head_best = top_blocks(mass.reshape(kv_heads * group, -1), budget).view(kv_heads, group, size)
    head_hits = chosen.gather(-1, head_best).sum(-1).double()
    head_best_mass = mass.gather(-1, head_best).sum(-1)
    return {
        "selector_recall": (hits / size if size else torch.ones_like(hits)).unsqueeze(1).expand(-1, group),
        "captured_mass_ratio": _ratio(chosen_mass.sum(1), best_mass.sum(1)).unsqueeze(1).expand(-1, group),
        "selector_recall_per_head_best": head_hits / size if size else torch.ones_like(head_hits),
        "captured_mass_ratio_per_head_best": _ratio(chosen_mass, head_best_mass),
    }


def _units(view: StepView, distant: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The step's distant units: their true mass ``(kv, G, U)``, which were chosen (``(kv, G, U)``), and the
    budget."""
    layout: BlockLayout = view.layout
    kv_heads, group, length = distant.shape
    if view.blocks is None:  # token-level: single distant positions, S - 1 - W of them
        return (
            distant,
            kept[:, :, 1 : layout.distant_end],
            max(view.index.shape[1] - 1 - (layout.n - layout.distant_end), 0),
        )
    pad = layout.n_blocks * layout.block_size - length
    mass = torch.nn.functional.pad(distant, (0, pad)).view(kv_heads, group, layout.n_blocks, -1).sum(-1)
    # the blocks the step read, from its support: an adaptive budget's dropped blocks (in ``view.blocks``, masked
    # out of the support) were not read, so they are not chosen; per KV head, or per query head for such a selector
    read = torch.nn.functional.pad(kept[:, :, 1 : layout.distant_end], (0, pad))
    return mass, read.view(kv_heads, group, layout.n_blocks, -1).any(-1), view.blocks.shape[1]


def audit_step(view: StepView) -> dict[str, torch.Tensor]:
    """Audit one sparse step of one layer; every value is a float64 tensor of shape ``(query_heads,)``."""
    layout: BlockLayout = view.layout
    n = layout.n
    keys = view.keys[:, :n].double()
    values = view.values[:, :n].double()
    kv_heads, _, d = keys.shape
    query_heads = view.query.shape[0]
    group = query_heads // kv_heads
    q = view.query.double().view(kv_heads, group, d)

    probs = torch.softmax(torch.bmm(q, keys.transpose(1, 2)) * view.scaling, dim=-1)  # (kv, G, N)
    kept = torch.zeros(view.index.shape[0], n, dtype=torch.bool, device=keys.device)
    kept.scatter_(1, view.index.masked_fill(~view.valid, 0), True)  # dropped slots at the anchor, always kept
    # (kv, G, N): a support per KV head is its group's, one per query head that head's own
    kept = kept.view(kv_heads, group, n) if kept.shape[0] == query_heads else kept.unsqueeze(1).expand(-1, group, -1)
    kept_probs = probs * kept
    omitted_probs = probs - kept_probs
    eps = omitted_probs.sum(-1)
    o_dense = torch.bmm(probs, values)
    kept_weighted = torch.bmm(kept_probs, values)
    omitted_weighted = torch.bmm(omitted_probs, values)
    o_kept = kept_weighted / (1 - eps).clamp_min(1e-300).unsqueeze(-1)
    o_omitted = torch.where(eps.unsqueeze(-1) > 0, omitted_weighted / eps.clamp_min(1e-300).unsqueeze(-1), 0.0)
    o_sparse = view.output.double().view(kv_heads, group, values.shape[-1])  # the value head dim may differ from d
    residual = o_sparse - o_dense - (eps.unsqueeze(-1) * o_kept - omitted_weighted)
    scale = o_dense.abs().amax(-1).clamp_min(1e-6)
    max_value_norm = values.norm(dim=-1).amax(-1)  # (kv,)

    distant = probs[:, :, 1 : layout.distant_end]
    chosen_mass = kept_probs[:, :, 1 : layout.distant_end].sum(-1)

    out = {
        "mass_anchor": probs[:, :, 0],
        "mass_window": probs[:, :, layout.distant_end :].sum(-1),
        "mass_blocks": chosen_mass,
        "omitted_mass": eps,
        "error_norm": (o_sparse - o_dense).norm(dim=-1),
        "kept_minus_omitted_norm": (o_kept - o_omitted).norm(dim=-1),
        "identity_residual": residual.abs().amax(-1) / scale,
        "bound": 2 * eps * max_value_norm.unsqueeze(-1),
        **selection_quality(*_units(view, distant, kept)),
    }
    return {name: value.reshape(query_heads) for name, value in out.items()}


@dataclass
class MassAudit:
    """Session observer collecting :func:`audit_step` for every sparse step.

    Attach with ``session.observers.append(audit)``; :meth:`arrays` stacks the records into
    ``(steps, layers, query_heads)`` float64 arrays, one per name in :data:`AUDIT_FIELDS`. A row is one decode step
    (records matched across layers by the step's position, not by their order), a column one layer that was sparse
    at some step; where a layer was dense at a step (per-layer supports: its support covered the context then) or
    has fewer query heads than another, the entries are NaN.
    """

    records: dict[int, list[dict[str, torch.Tensor]]] = field(default_factory=dict)
    value_norms: dict[int, list[float]] = field(default_factory=dict)
    keys: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """Per layer, each record's decode step: (positions read, how often the layer was audited there before)."""
    _visits: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)  # (layer, n): records so far
    sequence: int | None = None
    """In a batch, the one sequence audited (``None``: every step seen, right for batch 1)."""

    def __call__(self, view: StepView) -> None:
        if self.sequence is not None and view.sequence != self.sequence:
            return
        n = view.layout.n
        before = self._visits.get((view.layer, n), 0)  # a step repeated (a rewind) is another step
        self._visits[view.layer, n] = before + 1
        self.keys.setdefault(view.layer, []).append((n, before))
        self.records.setdefault(view.layer, []).append(audit_step(view))
        self.value_norms.setdefault(view.layer, []).append(float(view.values[:, :n].double().norm(dim=-1).max()))

    def _steps(self) -> list[tuple[int, int]]:
        return sorted({key for keys in self.keys.values() for key in keys})

    @property
    def steps(self) -> int:
        """Decode steps at which at least one layer was audited."""
        return len(self._steps())

    def arrays(self) -> dict[str, np.ndarray]:
        layers, steps = sorted(self.records), self._steps()
        row = {key: i for i, key in enumerate(steps)}
        heads = max((len(r[AUDIT_FIELDS[0]]) for records in self.records.values() for r in records), default=0)
        out = {name: np.full((len(steps), len(layers), heads), np.nan) for name in AUDIT_FIELDS}
        out["max_value_norm"] = np.full((len(steps), len(layers)), np.nan)
        for column, layer in enumerate(layers):
            for key, record, norm in zip(self.keys[layer], self.records[layer], self.value_norms[layer]):
                for name in AUDIT_FIELDS:
                    values = record[name].numpy()
                    out[name][row[key], column, : len(values)] = values
                out["max_value_norm"][row[key], column] = norm
        out["layers"] = np.array(layers)
        return out


_MASSES = ("omitted_mass", "mass_anchor", "mass_window", "mass_blocks")


def _mean(arrays: dict[str, np.ndarray], name: str, layer: int | None = None) -> float | None:
    """Mean of one audit field over everything (or over one layer's column); ``None`` if the field is absent."""
    if name not in arrays:
        return None
    return float(np.nanmean(arrays[name] if layer is None else arrays[name][:, layer]))


def summarize_audit(arrays: dict[str, np.ndarray]) -> dict:
    """Run-level and per-layer summary of :meth:`MassAudit.arrays` (JSON-ready).

    ``selector_recall_mean`` and ``captured_mass_ratio_mean`` are against the group's reachable best (see the
    module docstring); the ``*_per_head_best_mean`` fields against each query head's own best. A field missing
    from the arrays (an audit saved before it existed) summarises to ``None``. Means and maxima are over the
    audited entries (a layer dense at a step holds NaN there); ``audited_steps`` counts decode steps with any layer
    audited, a layer's own ``audited_steps`` those at which it was.
    """
    if np.isnan(arrays["omitted_mass"]).all():
        return {"audited_steps": 0}
    tolerance = 1e-5 * np.maximum(arrays["max_value_norm"], 1.0)[:, :, None]
    violations = arrays["error_norm"] > arrays["bound"] + tolerance
    per_layer = []
    for i, layer in enumerate(arrays["layers"].tolist()):
        per_layer.append(
            {
                "layer": layer,
                "audited_steps": int((~np.isnan(arrays["omitted_mass"][:, i])).any(-1).sum()),
                **{f"{name}_mean": _mean(arrays, name, i) for name in _MASSES},
                **{f"{name}_mean": _mean(arrays, name, i) for name in SELECTOR_FIELDS},
                "identity_residual_max": float(np.nanmax(arrays["identity_residual"][:, i])),
                "error_norm_mean": _mean(arrays, "error_norm", i),
                "bound_violations": int(violations[:, i].sum()),
            }
        )
    return {
        "audited_steps": int(arrays["omitted_mass"].shape[0]),
        "identity_residual_max": float(np.nanmax(arrays["identity_residual"])),
        "bound_violations": int(violations.sum()),
        "omitted_mass_mean": _mean(arrays, "omitted_mass"),
        **{f"{name}_mean": _mean(arrays, name) for name in SELECTOR_FIELDS},
        "layers": per_layer,
    }


def save_audit(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write the audit arrays as a compressed ``.npz`` (plain arrays, no pickles)."""
    with atomic_path(path) as tmp:  # its suffix is .npz, so numpy adds none
        np.savez_compressed(tmp, **arrays)


def load_audit(path: Path) -> dict[str, np.ndarray]:
    """Read :func:`save_audit`'s arrays.

    An audit saved before the group-level reference existed has no ``*_per_head_best`` arrays: its
    ``selector_recall`` and ``captured_mass_ratio`` were against each head's own best, so they are returned
    under the per-head names and the group-level ones are absent.
    """
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    if "omitted_mass" in arrays and "selector_recall_per_head_best" not in arrays:
        for name in ("selector_recall", "captured_mass_ratio"):
            if name in arrays:
                arrays[f"{name}_per_head_best"] = arrays.pop(name)
    return arrays


def margin_certificate(dense_logits: torch.Tensor, sparse_logits: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-step downstream margin condition on ``(steps, vocab)`` logits of the same prefixes.

    Returns float64/bool arrays: ``gamma`` (dense top-1 minus top-2), ``delta`` (max abs logit error),
    ``certified`` (``gamma > 2 * delta``) and ``flipped`` (sparse argmax differs from dense argmax).
    """
    dense = dense_logits.double()
    sparse = sparse_logits.double()
    top2 = dense.topk(2, dim=-1).values
    gamma = top2[:, 0] - top2[:, 1]
    delta = (sparse - dense).abs().amax(-1)
    return {
        "gamma": gamma.numpy(),
        "delta": delta.numpy(),
        "certified": (gamma > 2 * delta).numpy(),
        "flipped": (sparse.argmax(-1) != dense.argmax(-1)).numpy(),
    }


def summarize_certificate(cert: dict[str, np.ndarray], first_divergence: int | None) -> dict:
    """Certified fraction, flips, violations (flips at certified steps) and the margin at the divergence.

    ``first_divergence`` is the free-running divergence as docs/definitions.md, section 3 defines it (the decode step
    ``t >= 1`` whose sparse token ``s_t`` first differs from ``d_t``; ``None`` if none); ``d_t`` is predicted by
    teacher-forced step ``t``, whose prefix is the dense one, at index ``t - 1`` of the certificate arrays.
    """
    steps = len(cert["gamma"])
    at = first_divergence - 1 if first_divergence is not None and 1 <= first_divergence <= steps else None
    return {
        "certified_fraction": float(cert["certified"].mean()) if steps else float("nan"),
        "flips": int(cert["flipped"].sum()),
        "certificate_violations": int((cert["flipped"] & cert["certified"]).sum()),
        "uncertified_flips": int((cert["flipped"] & ~cert["certified"]).sum()),
        "margin_at_divergence": float(cert["gamma"][at]) if at is not None else None,
        "delta_at_divergence": float(cert["delta"][at]) if at is not None else None,
        "median_margin": float(np.median(cert["gamma"])) if steps else float("nan"),
        "median_delta": float(np.median(cert["delta"])) if steps else float("nan"),
    }
