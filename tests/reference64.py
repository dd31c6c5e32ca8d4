"""An independent float64, mask-based implementation of DESIGN.md sections 1 and 3, for checking the library.

Nothing here imports sparsedecode: the support is recomputed from its definition for every decode row and applied
as a mask over dense float64 attention (no gathers, no centroid cache, no kernels). The model is a float64 copy of
the one under test, decoding with transformers' own ``DynamicCache``; the paired protocol (dense reference,
free-running, teacher-forced) is written out again from DESIGN.md section 3.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "reference64"


@dataclass
class Support:
    """The support definition of DESIGN.md section 1 (mean-pooled block selector)."""

    support: int
    window: int = 64
    block: int = 16

    @property
    def blocks(self) -> int:
        return (self.support - 1 - self.window) // self.block

    @property
    def effective(self) -> int:
        return 1 + self.window + self.blocks * self.block

    def mask(self, query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
        """Boolean ``(kv_heads, n)`` mask of what each KV head reads for one query ``(heads, d)`` over ``n`` keys."""
        kv_heads, n, d = keys.shape
        keep = torch.zeros(kv_heads, n, dtype=torch.bool)
        if n <= self.effective:
            keep[:] = True
            return keep
        keep[:, 0] = True
        keep[:, n - self.window :] = True
        distant_end = n - self.window
        group = query.shape[0] // kv_heads
        for h in range(kv_heads):
            q = query[h * group : (h + 1) * group].mean(dim=0)
            scored = []
            start = 1
            while start < distant_end:
                stop = min(start + self.block, distant_end)
                centroid = keys[h, start:stop].mean(dim=0)
                scored.append((float(q @ centroid) * scaling, start, stop))
                start = stop
            # largest score first, ties towards the lowest block index
            scored.sort(key=lambda item: (-item[0], item[1]))
            for _, lo, hi in scored[: self.blocks]:
                keep[h, lo:hi] = True
        return keep


_STATE: dict = {}


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Dense causal float64 attention; rows at positions >= the prompt length read only their support."""
    _, heads, q_len, d = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = scaling if scaling is not None else d**-0.5
    support: Support | None = _STATE.get("support")
    keys, values, queries = key[0].double(), value[0].double(), query[0].double()
    positions = torch.arange(n - q_len, n)
    keep = torch.arange(n)[None, :] <= positions[:, None]  # causal: (q_len, n)
    keep = keep[None].repeat(kv_heads, 1, 1)  # (kv_heads, q_len, n)
    if support is not None:
        for r, position in enumerate(positions.tolist()):
            if position >= _STATE["prompt_length"]:
                row = support.mask(queries[:, r], keys[:, : position + 1], scale)
                keep[:, r] = False
                keep[:, r, : position + 1] = row
    expanded = torch.arange(heads) // group
    logits = torch.einsum("hqd,hnd->hqn", queries, keys[expanded]) * scale
    logits = logits.masked_fill(~keep[expanded], -math.inf)
    out = torch.einsum("hqn,hnd->qhd", torch.softmax(logits, dim=-1), values[expanded])
    return out.unsqueeze(0).to(query.dtype), None


AttentionInterface.register(NAME, _attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


@dataclass
class PairedOutcome:
    first_divergence: int
    survives: bool
    teacher_forced_match: float
    delta_ppl_percent: float
    dense_tokens: list[int]
    sparse_tokens: list[int]


def _forward(model, ids, cache):
    return model(input_ids=ids, cache=cache, use_cache=True).logits[0].double()


def _nll(logits: torch.Tensor, target: int) -> float:
    return float(torch.logsumexp(logits, dim=-1) - logits[target])


@torch.no_grad()
def paired_protocol(model: torch.nn.Module, prompt_ids: torch.Tensor, support: int, tokens: int) -> PairedOutcome:
    """DESIGN.md section 3 for one prompt and one support, in float64 with masks."""
    reference = copy.deepcopy(model).double()
    reference.set_attn_implementation(NAME)
    prompt_length = prompt_ids.shape[1]
    _STATE.update(prompt_length=prompt_length, support=None)

    def prefilled():
        cache = DynamicCache(config=reference.config)
        return cache, _forward(reference, prompt_ids, cache)[-1]

    # 1. dense reference: T greedy tokens with their NLL
    cache, logits = prefilled()
    dense, dense_nll = [], []
    for _ in range(tokens):
        token = int(logits.argmax())
        dense.append(token)
        dense_nll.append(_nll(logits, token))
        logits = _forward(reference, torch.tensor([[token]]), cache)[-1]
    _STATE["support"] = Support(support)

    # 2. free-running sparse from the same first token
    cache, _ = prefilled()
    sparse = [dense[0]]
    for _ in range(tokens - 1):
        logits = _forward(reference, torch.tensor([[sparse[-1]]]), cache)[-1]
        sparse.append(int(logits.argmax()))
    diverged = [t for t in range(1, tokens) if sparse[t] != dense[t]]

    # 3. teacher-forced: one forward over d_0 .. d_{T-2}, every row with its own support
    cache, _ = prefilled()
    forced = _forward(reference, torch.tensor([dense[:-1]]), cache)
    matches = sum(int(forced[t - 1].argmax()) == dense[t] for t in range(1, tokens))
    sparse_nll = [_nll(forced[t - 1], dense[t]) for t in range(1, tokens)]
    dense_ppl = math.exp(sum(dense_nll[1:]) / (tokens - 1))
    sparse_ppl = math.exp(sum(sparse_nll) / (tokens - 1))
    _STATE["support"] = None
    return PairedOutcome(
        first_divergence=diverged[0] if diverged else tokens,
        survives=not diverged,
        teacher_forced_match=100.0 * matches / (tokens - 1),
        delta_ppl_percent=100.0 * (sparse_ppl - dense_ppl) / dense_ppl,
        dense_tokens=dense,
        sparse_tokens=sparse,
    )
