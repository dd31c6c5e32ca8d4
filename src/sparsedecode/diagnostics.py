"""Why a sparse run departs from dense (DESIGN.md section 2).

* :class:`MassAudit` (opt-in, ``SparseConfig(audit=True)``): at every sparse decode step, per layer and query
  head, the true dense attention of that same step is computed (an extra dense pass, so it is never on by
  default) and compared with what the sparse step read and produced:

  - the split of attention mass into anchor / window / selected blocks / omitted (``eps``);
  - ``||o_sparse - o_dense||``, ``||o_kept - o_omitted||``, the residual of the exact identity
    ``o_sparse - o_dense = eps * (o_kept - o_omitted)`` and the bound ``2 * eps * max ||v||``;
  - selector recall (share of the dense top-b blocks by true mass that the selector chose) and the captured
    mass ratio (mass of the chosen blocks over the best mass any b blocks could capture); for token-level
    selectors the same against the best ``m`` single distant positions, ``m`` being how many were kept.

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

from .attention import StepView
from .selectors import BlockLayout

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
)


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
    kept = torch.zeros(kv_heads, n, dtype=torch.bool, device=keys.device)
    kept.scatter_(1, view.index, True)  # invalid slots point at the anchor, which is always kept
    kept_probs = probs * kept.unsqueeze(1)
    omitted_probs = probs - kept_probs
    eps = omitted_probs.sum(-1)
    o_dense = torch.bmm(probs, values)
    kept_weighted = torch.bmm(kept_probs, values)
    omitted_weighted = torch.bmm(omitted_probs, values)
    o_kept = kept_weighted / (1 - eps).clamp_min(1e-300).unsqueeze(-1)
    o_omitted = torch.where(eps.unsqueeze(-1) > 0, omitted_weighted / eps.clamp_min(1e-300).unsqueeze(-1), 0.0)
    o_sparse = view.output.double().view(kv_heads, group, d)
    residual = o_sparse - o_dense - (eps.unsqueeze(-1) * o_kept - omitted_weighted)
    scale = o_dense.abs().amax(-1).clamp_min(1e-6)
    max_value_norm = values.norm(dim=-1).amax(-1)  # (kv,)

    distant = probs[:, :, 1 : layout.distant_end]
    chosen_mass = kept_probs[:, :, 1 : layout.distant_end].sum(-1)
    if view.blocks is not None:  # block selectors: against the best b blocks by true mass
        pad = layout.n_blocks * layout.block_size - distant.shape[-1]
        block_mass = torch.nn.functional.pad(distant, (0, pad)).view(kv_heads, group, layout.n_blocks, -1).sum(-1)
        b = view.blocks.shape[1]
        chosen = view.blocks.unsqueeze(1).expand(-1, group, -1)
        best = block_mass.topk(b, dim=-1)
        in_best = (best.indices.unsqueeze(-1) == chosen.unsqueeze(-2)).any(-1).sum(-1)
    else:  # token-level selectors: against the best m single distant positions, m = what was kept
        kept_distant = kept[:, 1 : layout.distant_end]
        b = int(kept_distant.sum(-1).max())
        best = distant.topk(b, dim=-1)
        in_best = kept_distant.unsqueeze(1).expand(-1, group, -1).gather(-1, best.indices).sum(-1)
    best_mass = best.values.sum(-1)

    out = {
        "mass_anchor": probs[:, :, 0],
        "mass_window": probs[:, :, layout.distant_end :].sum(-1),
        "mass_blocks": chosen_mass,
        "omitted_mass": eps,
        "error_norm": (o_sparse - o_dense).norm(dim=-1),
        "kept_minus_omitted_norm": (o_kept - o_omitted).norm(dim=-1),
        "identity_residual": residual.abs().amax(-1) / scale,
        "bound": 2 * eps * max_value_norm.unsqueeze(-1),
        "selector_recall": in_best.double() / b if b else torch.ones_like(eps),
        "captured_mass_ratio": torch.where(best_mass > 0, chosen_mass / best_mass.clamp_min(1e-300), 1.0),
    }
    return {name: value.reshape(query_heads) for name, value in out.items()}


@dataclass
class MassAudit:
    """Session observer collecting :func:`audit_step` for every sparse step.

    Attach with ``session.observers.append(audit)``; :meth:`arrays` stacks the records into
    ``(steps, layers, query_heads)`` float64 arrays, one per name in :data:`AUDIT_FIELDS`.
    """

    records: dict[int, list[dict[str, torch.Tensor]]] = field(default_factory=dict)
    value_norms: dict[int, list[float]] = field(default_factory=dict)

    def __call__(self, view: StepView) -> None:
        self.records.setdefault(view.layer, []).append(audit_step(view))
        n = view.layout.n
        self.value_norms.setdefault(view.layer, []).append(float(view.values[:, :n].double().norm(dim=-1).max()))

    @property
    def steps(self) -> int:
        return min((len(v) for v in self.records.values()), default=0)

    def arrays(self) -> dict[str, np.ndarray]:
        layers = sorted(self.records)
        steps = self.steps
        out = {
            name: np.stack([np.stack([self.records[layer][s][name].numpy() for layer in layers]) for s in range(steps)])
            if steps
            else np.zeros((0, len(layers), 0))
            for name in AUDIT_FIELDS
        }
        out["max_value_norm"] = np.array([[self.value_norms[layer][s] for layer in layers] for s in range(steps)])
        out["layers"] = np.array(layers)
        return out


def summarize_audit(arrays: dict[str, np.ndarray]) -> dict:
    """Run-level and per-layer summary of :meth:`MassAudit.arrays` (JSON-ready)."""
    if arrays["omitted_mass"].size == 0:
        return {"audited_steps": 0}
    tolerance = 1e-5 * np.maximum(arrays["max_value_norm"], 1.0)[:, :, None]
    violations = arrays["error_norm"] > arrays["bound"] + tolerance
    per_layer = []
    for i, layer in enumerate(arrays["layers"].tolist()):
        per_layer.append(
            {
                "layer": layer,
                "omitted_mass_mean": float(arrays["omitted_mass"][:, i].mean()),
                "mass_anchor_mean": float(arrays["mass_anchor"][:, i].mean()),
                "mass_window_mean": float(arrays["mass_window"][:, i].mean()),
                "mass_blocks_mean": float(arrays["mass_blocks"][:, i].mean()),
                "selector_recall_mean": float(arrays["selector_recall"][:, i].mean()),
                "captured_mass_ratio_mean": float(arrays["captured_mass_ratio"][:, i].mean()),
                "identity_residual_max": float(arrays["identity_residual"][:, i].max()),
                "error_norm_mean": float(arrays["error_norm"][:, i].mean()),
                "bound_violations": int(violations[:, i].sum()),
            }
        )
    return {
        "audited_steps": int(arrays["omitted_mass"].shape[0]),
        "identity_residual_max": float(arrays["identity_residual"].max()),
        "bound_violations": int(violations.sum()),
        "omitted_mass_mean": float(arrays["omitted_mass"].mean()),
        "selector_recall_mean": float(arrays["selector_recall"].mean()),
        "captured_mass_ratio_mean": float(arrays["captured_mass_ratio"].mean()),
        "layers": per_layer,
    }


def save_audit(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write the audit arrays as a compressed ``.npz`` (plain arrays, no pickles)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)


def load_audit(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


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

    ``first_divergence`` is the free-running divergence as DESIGN.md section 3 defines it (the decode step
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
