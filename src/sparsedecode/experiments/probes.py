"""Probes built on the library (docs/definitions.md, section 4).

* :func:`mass_probe`: dense prefill of one prompt, then sparse greedy decoding with the omitted-mass audit on;
  returns, per layer and query head, the share of true attention mass on anchor / window / selected blocks /
  omitted positions, with the selector's recall and captured-mass ratio against the best set reachable at the same
  budget (the KV-head group's top blocks by summed mass; ``*_per_head_best``: each query head's own, unreachable).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ..config import SparseConfig
from ..decoding.loop import Progress, decode_tokens, prefill
from ..errors import SparseDecodeError
from ..protocol.diagnostics import MassAudit, summarize_audit
from ..session import prefill_history, sparse_decoding
from ..session.kv_cache import crop_cache
from ..validate import check_count, check_sparse_attention


@dataclass
class MassProbe:
    """Audit arrays ``(steps, layers, query_heads)`` of one prompt under one support, and their summary."""

    context: int
    settings: dict
    tokens: list[int]
    arrays: dict[str, np.ndarray]
    summary: dict
    seconds: float

    def per_head(self, name: str) -> np.ndarray:
        """Mean over steps of one audit field: ``(layers, query_heads)``."""
        with warnings.catch_warnings():  # a head a layer lacks (NaN at every step) stays NaN, without a warning
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmean(self.arrays[name], axis=0)  # NaN: a layer dense at a step (per-layer supports)


def mass_probe(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    cfg: SparseConfig,
    *,
    tokens: int = 16,
    progress: Progress | None = None,
    cache=None,
    first: int | None = None,
) -> MassProbe:
    """Sparse greedy decoding of ``tokens`` tokens with the audit on (the prefill is dense).

    Pass ``cache`` and ``first`` (a prefilled cache and the first token) to reuse one prefill across supports;
    the cache is cropped back to the prompt afterwards.
    """
    check_sparse_attention(model, "mass_probe")  # before the prefill, as every sparse entry point refuses
    check_count(tokens, "mass_probe: tokens", 1)
    if (cache is None) != (first is None):  # a first token without its cache would be replaced by the prefill's
        raise SparseDecodeError(
            "mass_probe: pass cache and first together (a cache prefilled with prompt_ids and the token it predicts), "
            "or neither"
        )
    started = time.perf_counter()
    if cache is None:
        cache, logits = prefill(model, prompt_ids, progress=progress)
        first = int(logits.argmax())
    audit = MassAudit()
    history = prefill_history(model, prompt_ids) if cfg.selector.uses_history else None  # H2O's, of the prefill
    with sparse_decoding(model, cfg) as session:
        if history is not None:
            session.adopt_history(cache, history)
        session.observers.append(audit)
        (generated,), _ = decode_tokens(
            model, cache, [first], tokens - 1, progress=progress, stage="audited decode", nll=False
        )
    crop_cache(cache, prompt_ids.shape[1])
    arrays = audit.arrays()
    return MassProbe(
        context=int(prompt_ids.shape[1]),
        settings=cfg.to_dict(),
        tokens=[first, *generated],
        arrays=arrays,
        summary=summarize_audit(arrays),
        seconds=time.perf_counter() - started,
    )
