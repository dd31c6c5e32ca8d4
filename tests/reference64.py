"""An independent float64, mask-based implementation of docs/definitions.md, sections 1 and 3, for checking the library.

Nothing here imports sparsedecode: the support is recomputed from its definition for every decode row and applied
as a mask over dense float64 attention (no gathers, no centroid cache, no kernels). The model is a float64 copy of
the one under test, decoding with transformers' own ``DynamicCache``; the paired protocol (dense reference,
free-running, teacher-forced) is written out again from docs/definitions.md, section 3.

Reuse interval ``R``: step ``k`` of a chain of sparse decode rows (a row with ``N`` above the support; a dense row
ends the chain) selects afresh when ``(k - 1) % R == 0`` and otherwise reads the block indices chosen then, each
block being positions ``[1 + jB, 1 + (j+1)B)`` of the current distant region ``[1, N - W)`` (README, "Reuse").
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
    """The support definition of docs/definitions.md, section 1 (mean-pooled block selector)."""

    support: int
    window: int = 64
    block: int = 16

    @property
    def blocks(self) -> int:
        return (self.support - 1 - self.window) // self.block

    @property
    def effective(self) -> int:
        return 1 + self.window + self.blocks * self.block

    def choose(self, query: torch.Tensor, keys: torch.Tensor, scaling: float) -> list[list[tuple[int, int]]]:
        """The chosen blocks, as ``(index, first position)`` per KV head, for one query ``(heads, d)``."""
        kv_heads, n, _ = keys.shape
        distant_end = n - self.window
        group = query.shape[0] // kv_heads
        chosen = []
        for h in range(kv_heads):
            q = query[h * group : (h + 1) * group].mean(dim=0)
            scored = []
            for j, start in enumerate(range(1, distant_end, self.block)):
                stop = min(start + self.block, distant_end)
                scored.append((float(q @ keys[h, start:stop].mean(dim=0)) * scaling, j))
            scored.sort(key=lambda item: (-item[0], item[1]))  # largest score first, ties towards the lowest index
            chosen.append([j for _, j in scored[: self.blocks]])
        return chosen

    def mask(self, blocks: list[list[int]], n: int) -> torch.Tensor:
        """Boolean ``(kv_heads, n)`` mask of the anchor, the window and the given blocks of the distant region."""
        keep = torch.zeros(len(blocks), n, dtype=torch.bool)
        keep[:, 0] = True
        keep[:, n - self.window :] = True
        distant_end = n - self.window
        for h, chosen in enumerate(blocks):
            for j in chosen:
                keep[h, 1 + j * self.block : min(1 + (j + 1) * self.block, distant_end)] = True
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
        chain = _STATE["chains"].setdefault(module.layer_idx, {"step": 0, "blocks": None})
        for r, position in enumerate(positions.tolist()):
            n_row = position + 1
            if position < _STATE["prompt_length"] or n_row <= support.effective:
                chain["step"] = 0  # dense rows end the chain
                continue
            if chain["step"] % _STATE["reuse"] == 0:
                chain["blocks"] = support.choose(queries[:, r], keys[:, :n_row], scale)
                chain["end"] = n_row - support.window  # the distant region's end when chosen
            elif any(1 + (j + 1) * support.block > chain["end"] for c in chain["blocks"] for j in c):
                _STATE["grown_reuses"] += 1  # a reused block that was short when chosen reads more now
            chain["step"] += 1
            keep[:, r] = False
            keep[:, r, :n_row] = support.mask(chain["blocks"], n_row)
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
    grown_reuses: int  # rows (layer by layer) that reused a block which was short when chosen


def _forward(model, ids, cache):
    return model(input_ids=ids, cache=cache, use_cache=True).logits[0].double()


def _nll(logits: torch.Tensor, target: int) -> float:
    return float(torch.logsumexp(logits, dim=-1) - logits[target])


def paired_protocol(
    model: torch.nn.Module, prompt_ids: torch.Tensor, support: int, tokens: int, reuse: int = 1
) -> PairedOutcome:
    """docs/definitions.md, section 3 for one prompt, one support and one reuse interval, in float64 with masks."""
    return paired_protocols(model, prompt_ids, support, tokens, (reuse,))[0]


@torch.no_grad()
def paired_protocols(
    model: torch.nn.Module, prompt_ids: torch.Tensor, support: int, tokens: int, reuses: tuple[int, ...]
) -> list[PairedOutcome]:
    """:func:`paired_protocol` for each reuse interval of ``reuses``, the float64 copy, the prefill and the dense
    reference made once (none of them depends on the reuse interval)."""
    reference = copy.deepcopy(model).double()
    reference.set_attn_implementation(NAME)
    prompt_length = prompt_ids.shape[1]
    _STATE.update(prompt_length=prompt_length, support=None, reuse=None, grown_reuses=0)

    # every prompt row is dense in every pass (``_attention``): the prefill is computed once, each pass continues a
    # copy of its cache
    prompt_cache = DynamicCache(config=reference.config)
    prompt_logits = _forward(reference, prompt_ids, prompt_cache)[-1]

    def prefilled():
        _STATE["chains"] = {}  # each pass starts its own chains of sparse steps
        return copy.deepcopy(prompt_cache), prompt_logits

    # 1. dense reference: T greedy tokens with their NLL
    cache, logits = prefilled()
    dense, dense_nll = [], []
    for _ in range(tokens):
        token = int(logits.argmax())
        dense.append(token)
        dense_nll.append(_nll(logits, token))
        logits = _forward(reference, torch.tensor([[token]]), cache)[-1]
    dense_ppl = math.exp(sum(dense_nll[1:]) / (tokens - 1))
    outcomes = []
    for reuse in reuses:
        _STATE.update(support=Support(support), reuse=reuse, grown_reuses=0)

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
        sparse_ppl = math.exp(sum(sparse_nll) / (tokens - 1))
        outcomes.append(
            PairedOutcome(
                first_divergence=diverged[0] if diverged else tokens,
                survives=not diverged,
                teacher_forced_match=100.0 * matches / (tokens - 1),
                delta_ppl_percent=100.0 * (sparse_ppl - dense_ppl) / dense_ppl,
                dense_tokens=dense,
                sparse_tokens=sparse,
                grown_reuses=_STATE["grown_reuses"],
            )
        )
    _STATE["support"] = None
    return outcomes
