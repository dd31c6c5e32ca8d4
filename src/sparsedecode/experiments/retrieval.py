"""Passkey retrieval probe (docs/definitions.md, section 4), with the selector's captured mass per trial.

A passkey (random digits from a fixed seed) is planted at a depth of a haystack, followed by the question:

    <intro> <haystack ... "The pass key is 40213. Remember it. 40213 is the pass key." ... haystack> <question>

The haystack is repeated filler sentences (the classic passkey task) or corpus text. ``context`` counts every
prompt token, question included. Everything before the question is prefilled densely; the question is then fed
one token at a time, each a decode step under the attention mode being tested (dense, or sparse inside
:func:`~sparsedecode.session.sparse_decoding`), as in Quest's passkey protocol, so the selector decides what
the question reads; then a few answer tokens are decoded greedily. A trial succeeds when the passkey appears in the
decoded answer as a whole number (:func:`found`: an exact substring not inside a longer run of digits).

Each sparse trial also records what the selector did while answering: the omitted-mass audit of
:class:`~sparsedecode.protocol.diagnostics.MassAudit` (captured-mass ratio and selector recall against the best set
reachable at the same budget, the same against each query head's own best as ``*_per_head_best``, omitted mass) and,
from
:class:`NeedleReads`, the share of needle positions inside the support and the true (dense) attention mass on
the needle. Relating those to success shows whether captured mass alone predicts retrieval.
"""

from __future__ import annotations

import contextlib
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..config import SparseConfig
from ..decoding.loop import Progress, cache_length, decode_tokens, prefill
from ..errors import SparseDecodeError
from ..protocol.diagnostics import MassAudit, summarize_audit
from ..session import StepView, prefill_history, sparse_decoding
from ..session.kv_cache import crop_cache
from ..validate import check_sparse_attention, max_positions
from .corpus import FILLER, corpus_ids
from .specs import RetrievalSpec

INTRO = (
    "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey(seed: int, trial: int, digits: int = 5) -> str:
    """The passkey of one trial: ``digits`` random digits (no leading zero), fixed by ``(seed, trial)``."""
    rng = random.Random(f"passkey-{seed}-{trial}")
    return _decimal(rng.randint(10 ** (digits - 1), 10**digits - 1))


def found(key: str, text: str) -> bool:
    """Whether ``text`` holds the passkey ``key`` as a whole number: ``key`` with no digit right before or after it
    (``402135`` or ``140213`` is another number, not the passkey ``40213``)."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", text) is not None


def _decimal(value: int, chunk: int = 1000) -> str:
    """``str(value)`` of a non-negative integer of any length: ``str`` refuses one of more than 4300 digits
    (``sys.get_int_max_str_digits``), which ``--digits`` may ask for; converted ``chunk`` digits at a time."""
    parts = []
    while value >= 10**chunk:
        value, low = divmod(value, 10**chunk)
        parts.append(f"{low:0{chunk}d}")
    return str(value) + "".join(reversed(parts))


@dataclass
class PasskeyPrompt:
    """A prompt of exactly ``context`` tokens; ``ids[:, question_start:]`` is the question."""

    ids: torch.Tensor
    passkey: str
    question_start: int
    needle_start: int
    needle_end: int
    depth: float
    needle_depth: float
    """Where the needle actually starts, as a fraction of the haystack (sentence boundaries round ``depth``)."""

    @property
    def context(self) -> int:
        return int(self.ids.shape[1])


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_prompt(
    tokenizer, context: int, depth: float, key: str, *, haystack: str = "filler", offset: int = 0
) -> PasskeyPrompt:
    """Plant ``key`` at ``depth`` (0 = right after the intro, 1 = right before the question) of a haystack.

    With the filler haystack the needle goes at the sentence boundary nearest to ``depth``; with a corpus
    haystack (tokens ``offset ..`` of the tokenised corpus, the offset taken modulo the corpus' start positions) at
    the nearest token.
    """
    intro, needle, question = (_encode(tokenizer, t) for t in (INTRO, NEEDLE.format(key=key), QUESTION))
    length = context - len(intro) - len(needle) - len(question)
    if length < 1:
        raise SparseDecodeError(
            f"context {context} is too short for the passkey prompt ({context - length} tokens without haystack)"
        )
    if haystack == "filler":
        sentences = [_encode(tokenizer, s) for s in FILLER]
        hay: list[int] = []
        boundaries = [0]
        while len(hay) < length:
            hay.extend(sentences[(len(boundaries) - 1) % len(sentences)])
            boundaries.append(len(hay))
        hay = hay[:length]
        boundaries = [b for b in boundaries if b < length] + [length]  # the end (right before the question) too
    else:
        text = corpus_ids(tokenizer, haystack)
        if len(text) < length:
            raise SparseDecodeError(f"corpus {haystack} has {len(text)} tokens, fewer than the {length} needed")
        offset %= len(text) - length + 1  # past the corpus' last start: around again, not back to trial 0's text
        hay = text[offset : offset + length].tolist()
        boundaries = list(range(length + 1))
    target = depth * length
    cut = min(boundaries, key=lambda b: (abs(b - target), b))
    ids = [*intro, *hay[:cut], *needle, *hay[cut:], *question]
    return PasskeyPrompt(
        ids=torch.tensor([ids], dtype=torch.long),
        passkey=key,
        question_start=len(ids) - len(question),
        needle_start=len(intro) + cut,
        needle_end=len(intro) + cut + len(needle),
        depth=depth,
        needle_depth=cut / length,
    )


@dataclass
class NeedleReads:
    """Session observer: per sparse step and layer, how much of the needle the support holds and attracts.

    ``read``: share of the needle positions inside the support, averaged over the step's supports (one per KV head,
    or per query head for a selector choosing one per query head, such as ``quest``); ``mass``: the true
    (dense, float64) attention mass on the needle positions, averaged over query heads.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        self.read: list[float] = []
        self.mass: list[float] = []

    def __call__(self, view: StepView) -> None:
        n = view.layout.n
        width = self.end - self.start
        index = torch.where(view.valid, view.index, -1)
        inside = (index >= self.start) & (index < self.end)
        self.read.append(float(inside.sum(dim=1).double().mean()) / width)  # support positions are unique
        keys = view.keys[:, :n].double()
        kv_heads, _, d = keys.shape
        q = view.query.double().view(kv_heads, -1, d)
        probs = torch.softmax(torch.bmm(q, keys.transpose(1, 2)) * view.scaling, dim=-1)
        self.mass.append(float(probs[:, :, self.start : self.end].sum(-1).mean()))


@torch.no_grad()
def answer(
    model: torch.nn.Module,
    tokenizer,
    prompt: PasskeyPrompt,
    cache,
    cfg: SparseConfig | None,
    *,
    answer_tokens: int = 8,
    history: dict | None = None,
) -> dict:
    """Feed the question token by token and decode ``answer_tokens`` greedily, densely (``cfg=None``) or sparsely.

    ``cache`` holds exactly ``prompt.ids[:, :question_start]`` (it is cropped back afterwards); ``history`` is H2O's
    history of that prefill (:func:`~sparsedecode.session.prefill_history`), needed by ``h2o``.
    """
    if cache_length(cache) != prompt.question_start:  # another length would answer another prompt, silently
        raise SparseDecodeError(
            f"answer: the cache holds {cache_length(cache)} positions, not the prompt's {prompt.question_start} "
            "before the question: prefill prompt.ids[:, :question_start]"
        )
    audit = MassAudit()
    needle = NeedleReads(prompt.needle_start, prompt.needle_end)
    question = prompt.ids[0, prompt.question_start :].tolist()
    started = time.perf_counter()
    with sparse_decoding(model, cfg) if cfg is not None else contextlib.nullcontext() as session:
        if session is not None:
            session.observers.extend([audit, needle])
            if cfg.selector.uses_history:  # H2O keeps the attention history of the prefill
                session.adopt_history(cache, history or prefill_history(model, prompt.ids[:, : prompt.question_start]))
        steps = len(question) - 1 + answer_tokens  # feed the question, then decode the answer
        (out,), _ = decode_tokens(model, cache, question[:1], steps, teacher=[question], nll=False)
        generated = out[len(question) - 1 :]
    decode_s = time.perf_counter() - started
    crop_cache(cache, prompt.question_start)
    text = tokenizer.decode(generated)
    audit_summary = summarize_audit(audit.arrays()) if audit.steps else {}
    return {
        "mode": "dense" if cfg is None else "sparse",
        "selector": None if cfg is None else cfg.selector_name,
        "support": None if cfg is None else cfg.support,
        "effective_support": None if cfg is None else cfg.effective_support,
        "answer_ids": generated,
        "answer": text,
        "correct": found(prompt.passkey, text),
        "sparse_steps": 0 if session is None else session.sparse_steps,
        "captured_mass_ratio_mean": audit_summary.get("captured_mass_ratio_mean"),
        "omitted_mass_mean": audit_summary.get("omitted_mass_mean"),
        "selector_recall_mean": audit_summary.get("selector_recall_mean"),
        "captured_mass_ratio_per_head_best_mean": audit_summary.get("captured_mass_ratio_per_head_best_mean"),
        "selector_recall_per_head_best_mean": audit_summary.get("selector_recall_per_head_best_mean"),
        "needle_read_mean": float(np.mean(needle.read)) if needle.read else None,
        "needle_mass_mean": float(np.mean(needle.mass)) if needle.mass else None,
        "decode_s": decode_s,
    }


TrialHook = Callable[[dict], None]


def trial_prompt(
    tokenizer, context: int, depth: float, trial: int, *, haystack: str = "filler", digits: int = 5, seed: int = 0
) -> PasskeyPrompt:
    """The prompt of one trial: ``passkey(seed, trial, digits)`` planted at ``depth`` of ``context`` tokens.

    A corpus haystack starts ``trial * context`` tokens into the corpus (around again where the corpus runs out),
    so different trials read different text.
    """
    key = passkey(seed, trial, digits)
    return build_prompt(tokenizer, context, depth, key, haystack=haystack, offset=trial * context)


def run_trial(
    model: torch.nn.Module,
    tokenizer,
    prompt: PasskeyPrompt,
    configs: list[SparseConfig],
    *,
    trial: int,
    answer_tokens: int = 8,
    on_trial: TrialHook | None = None,
) -> list[dict]:
    """One dense prefill of ``prompt``, then the dense answer and one sparse answer per config (any selectors).

    Returns one dict per answer (dense first); ``on_trial`` is called with each as soon as it is done.
    """
    if configs:
        check_sparse_attention(model, "retrieval")  # before the prefill, as every sparse entry point refuses
    started = time.perf_counter()
    cache, _ = prefill(model, prompt.ids[:, : prompt.question_start])
    wants_history = any(cfg.selector.uses_history for cfg in configs)
    history = prefill_history(model, prompt.ids[:, : prompt.question_start]) if wants_history else None
    prefill_s = time.perf_counter() - started
    results = []
    for cfg in [None, *configs]:
        result = {
            "context": prompt.context,
            "depth": prompt.depth,
            "trial": trial,
            "passkey": prompt.passkey,
            "needle_start": prompt.needle_start,
            "needle_depth": prompt.needle_depth,
            "question_tokens": prompt.context - prompt.question_start,
            **answer(model, tokenizer, prompt, cache, cfg, answer_tokens=answer_tokens, history=history),
            "prefill_s": prefill_s,
        }
        results.append(result)
        if on_trial:
            on_trial(result)
    return results


def run_retrieval(
    spec: RetrievalSpec,
    *,
    loaded: tuple | None = None,
    progress: Progress | None = None,
    on_trial: TrialHook | None = None,
) -> list[dict]:
    """Every (context, depth, trial): one dense prefill, then the dense answer and one sparse answer per support.

    Returns one dict per (context, depth, trial, mode), in run order.
    """
    if loaded is None:
        from ..models.catalog import load_model

        loaded = load_model(spec.model, dtype=spec.dtype)
    model, tokenizer = loaded
    limit = max_positions(model)
    for context in spec.contexts:
        if limit is not None and context + spec.answer_tokens > limit:
            raise SparseDecodeError(f"context {context} + {spec.answer_tokens} answer tokens exceeds {limit} positions")
    configs = spec.configs()
    cells = [(c, d, t) for c in spec.contexts for d in spec.depths for t in range(spec.trials)]
    # every prompt first: a context too short for its passkey prompt, or a corpus too short, is refused before any
    # trial runs, not after the grid's earlier cells (whose results, written only at the end, it would lose)
    prompts = [
        trial_prompt(tokenizer, context, depth, trial, haystack=spec.haystack, digits=spec.digits, seed=spec.seed)
        for context, depth, trial in cells
    ]
    results = []
    for number, ((_, _, trial), prompt) in enumerate(zip(cells, prompts), start=1):
        results += run_trial(
            model, tokenizer, prompt, configs, trial=trial, answer_tokens=spec.answer_tokens, on_trial=on_trial
        )
        if progress:
            progress("retrieval", number, len(cells))
    return results


def mode_label(trial: dict) -> str:
    return "dense" if trial["mode"] == "dense" else f"S={trial['support']}"


def dense_by_construction(trial: dict) -> bool:
    """A sparse trial that never took a sparse step: its question and answer fit the support (a dense result)."""
    return trial["mode"] == "sparse" and trial.get("sparse_steps") == 0


def accuracy(trials: list[dict]) -> list[dict]:
    """Exact-match accuracy per (context, depth, mode), sorted by mode (dense first), context, depth;
    ``dense_by_construction``: a sparse cell whose every trial was dense by construction."""
    cells: dict[tuple, list[dict]] = {}
    for t in trials:
        cells.setdefault((t["support"] or 0, t["context"], t["depth"]), []).append(t)
    return [
        {
            "mode": mode_label(group[0]),
            "support": group[0]["support"],
            "context": context,
            "depth": depth,
            "trials": len(group),
            "correct": sum(t["correct"] for t in group),
            "accuracy": sum(t["correct"] for t in group) / len(group),
            "dense_by_construction": all(dense_by_construction(t) for t in group) and group[0]["mode"] == "sparse",
        }
        for (_, context, depth), group in sorted(cells.items())
    ]


def mass_vs_success(trials: list[dict], *, high: float = 0.9) -> list[dict]:
    """Per support: does the selector's captured mass tell successful sparse trials from failed ones?

    ``high``: a captured-mass ratio at least this is "high"; ``failed_with_high_mass`` counts failures despite it,
    ``failed_where_dense_succeeded`` the failures that are the selector's (dense found the passkey). Trials dense by
    construction are left out of every count (``dense_by_construction`` says how many); a support with no other
    trial has no row.
    """
    dense = {(t["context"], t["depth"], t["trial"]): t["correct"] for t in trials if t["mode"] == "dense"}
    out = []
    for support in sorted({t["support"] for t in trials if t["mode"] == "sparse"}):
        every = [t for t in trials if t["mode"] == "sparse" and t["support"] == support]
        group = [t for t in every if not dense_by_construction(t)]
        if not group:
            continue
        audited = [t for t in group if t["captured_mass_ratio_mean"] is not None]
        good = [t["captured_mass_ratio_mean"] for t in audited if t["correct"]]
        bad = [t["captured_mass_ratio_mean"] for t in audited if not t["correct"]]
        out.append(
            {
                "support": support,
                "trials": len(group),
                "dense_by_construction": len(every) - len(group),
                "audited": len(audited),
                "accuracy": sum(t["correct"] for t in group) / len(group),
                "captured_mass_correct_mean": float(np.mean(good)) if good else None,
                "captured_mass_failed_mean": float(np.mean(bad)) if bad else None,
                "failed_with_high_mass": sum(
                    1 for t in audited if not t["correct"] and t["captured_mass_ratio_mean"] >= high
                ),
                "failed_where_dense_succeeded": sum(
                    1 for t in group if not t["correct"] and dense.get((t["context"], t["depth"], t["trial"]))
                ),
                "needle_read_failed_mean": _mean(t.get("needle_read_mean") for t in group if not t["correct"]),
                "needle_read_correct_mean": _mean(t.get("needle_read_mean") for t in group if t["correct"]),
            }
        )
    return out


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None
