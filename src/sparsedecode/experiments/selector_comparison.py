"""All selectors on the same model, prompts and budget, side by side.

For each (context, prompt) one dense reference is computed; every selector then runs the paired protocol of
:func:`sparsedecode.protocol.paired.compare` at every support (optionally with the omitted-mass audit, which gives the
captured-mass ratio against the best set reachable at the same budget). The operator time of one decode-attention
call per selector is measured on synthetic data of the model's shape at each context, in the same process
(:func:`sparsedecode.experiments.bench_operator.bench_op`).

Optionally (``retrieval`` trials per context) the passkey probe of :mod:`sparsedecode.experiments.retrieval`
runs on the same model and contexts: each trial plants its own passkey at its own depth (spread evenly from the
start of the haystack to right before the question), is prefilled densely once and answered densely (the
baseline) and then by every selector at every support.

A comparison is stored as one JSON document (``settings``, ``summary``, ``runs``, ``retrieval``); the summary is a
function of the stored runs and trials (:func:`summarize`), so :func:`rebuild` recomputes it with today's code:
runs of an older ``first_divergence`` convention are upgraded first (:func:`sparsedecode.protocol.paired.upgrade_row`),
and the measured operator times are kept. Conditions that are dense by construction (effective support
``>= context + T - 1``, see :func:`sparsedecode.experiments.summary.dense_by_construction`) are marked, so a
table can show them apart: they compare nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from ..config import SparseConfig
from ..decoding.loop import Progress
from ..errors import SparseDecodeError
from ..protocol.paired import compare, dense_reference
from ..protocol.results import upgrade_row
from ..selectors import resolve_selector, selector_names
from .bench_operator import bench_op
from .corpus import prompt_ids
from .retrieval import run_trial, trial_prompt
from .summary import dense_by_construction, median
from .work import Executor

ANSWER_TOKENS = 8
"""Greedy answer tokens per retrieval trial (the retrieval probe's default)."""


@dataclass
class SelectorRow:
    """Paired results of one selector at one (context, support) over all prompts."""

    selector: str
    practical: bool
    reads: str
    context: int
    support: int
    runs: int
    survived: int
    median_first_divergence: float
    median_teacher_forced_match: float
    median_delta_ppl_percent: float
    certified_fraction: float
    captured_mass_ratio: float | None
    """Mean captured/best with ``--audit``: the chosen set's true mass over the best reachable at the same budget
    (the KV-head group's top blocks or positions by summed mass, what the oracles pick)."""
    captured_mass_ratio_per_head_best: float | None
    """The same against each query head's own best set, which no selector sharing one set per group can reach."""
    retrieval_trials: int
    """Passkey trials at this context (0: retrieval not measured)."""
    retrieval_correct: int | None
    retrieval_accuracy: float | None
    dense_retrieval_correct: int | None
    """Dense attention on the same trials: the baseline (a model that fails densely says nothing of a selector)."""
    op_ms: float | None
    dense_by_construction: bool = False
    """Every run of the condition is dense by construction (effective support >= context + T - 1, or no sparse step:
    every layer kept dense)."""
    support_read_mean: float | None = None
    """Positions a KV head read per sparse step, over the runs (mean of their means, min of their minima, max of
    their maxima; ``None`` where no run recorded it): below the support for an adaptive budget."""
    support_read_min: int | None = None
    support_read_max: int | None = None


@dataclass(eq=False)
class PromptUnit:
    """Every selector at every support on prompts ``indices`` of one context, each paired with its own dense
    reference (a :class:`~.work.Unit`; ``ids`` are the prompts, cut by the caller). ``batched``: decoded together
    (:func:`~sparsedecode.protocol.paired.compare` of several prompts), as ``compare_selectors(batch > 1)`` does."""

    context: int
    indices: list[int]
    ids: list
    tokens: int
    selectors: tuple[str, ...]
    supports: tuple[int, ...]
    audit: bool = False
    batched: bool = False
    dense_layers: tuple[int, ...] = ()
    layer_supports: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        return (
            f"context {self.context}, prompt{'s' if len(self.indices) > 1 else ''} {', '.join(map(str, self.indices))}"
        )

    def run(self, model, tokenizer, *, progress: Progress | None = None, on_row=None) -> list[dict]:
        if self.batched:
            reference = dense_reference(model, self.ids, tokens=self.tokens, progress=progress)
        else:
            reference = dense_reference(model, self.ids[0], tokens=self.tokens, progress=progress)
        runs = []
        for selector in self.selectors:
            for support in self.supports:
                cfg = SparseConfig(
                    support=support,
                    selector=selector,
                    audit=self.audit,
                    dense_layers=self.dense_layers,
                    layer_supports=self.layer_supports,
                )
                if self.batched:
                    results = compare(model, None, self.ids, cfg, self.tokens, reference=reference, progress=progress)
                else:
                    results = [
                        compare(model, tokenizer, self.ids[0], cfg, self.tokens, reference=reference, progress=progress)
                    ]
                for index, result in zip(self.indices, results):
                    row = result.to_dict()
                    for name in ("dense_nll", "sparse_nll", "teacher_forced_tokens", "margins", "logit_errors"):
                        row.pop(name)
                    runs.append({"selector": selector, "support": support, "prompt_index": index, **row})
                    if on_row:
                        on_row(runs[-1])
        return runs


@dataclass(eq=False)
class TrialUnit:
    """One passkey trial answered densely and by every config (a :class:`~.work.Unit`)."""

    context: int
    trial: int
    prompt: object
    configs: list[SparseConfig]

    def __str__(self) -> str:
        return f"passkey trial {self.trial} at context {self.context}"

    def run(self, model, tokenizer, *, progress: Progress | None = None, on_row=None) -> list[dict]:
        hook = {} if on_row is None else {"on_trial": on_row}
        return run_trial(
            model, tokenizer, self.prompt, self.configs, trial=self.trial, answer_tokens=ANSWER_TOKENS, **hook
        )


def compare_selectors(
    model: torch.nn.Module,
    tokenizer,
    *,
    corpus: str,
    contexts: tuple[int, ...],
    supports: tuple[int, ...],
    prompts: int,
    tokens: int,
    selectors: tuple[str, ...] | None = None,
    audit: bool = False,
    retrieval: int = 0,
    op_shape: tuple[int, int, int] | None = None,
    progress: Progress | None = None,
    batch: int = 1,
    execute: Executor | None = None,
    dense_layers: tuple[int, ...] = (),
    layer_supports: tuple[tuple[int, int], ...] = (),
) -> tuple[list[SelectorRow], list[dict], list[dict]]:
    """Run every selector on the same prompts; returns summary rows, the per-run results and the retrieval trials.

    ``retrieval``: passkey trials per context (0 = none); the trials are dicts of
    :func:`~sparsedecode.experiments.retrieval.run_trial` (JSON-ready, like the runs). ``batch > 1`` decodes up to
    that many prompts of one context together: the same runs apart from timings (each its share of the batch's)
    and float32 round-off. With ``execute`` the prompts (or batches of them) and trials run as units elsewhere
    (:class:`PromptUnit`, :class:`TrialUnit`, see :mod:`.work`); the operator times are measured here either way.
    ``dense_layers``, ``layer_supports``: the per-layer part of every selector's configuration.
    """
    if not isinstance(retrieval, int) or retrieval < 0:
        raise SparseDecodeError(f"retrieval must be an integer >= 0 (trials per context), got {retrieval!r}")
    from .specs import canonical_selectors

    selectors = canonical_selectors(selector_names() if selectors is None else selectors)  # none named: all registered
    # Built first, so a context too short for the passkey prompt is refused before any run.
    passkey_prompts = {
        (context, trial): trial_prompt(tokenizer, context, depth, trial)
        for context in contexts
        for trial, depth in enumerate(retrieval_depths(retrieval))
    }
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise SparseDecodeError(f"batch must be an integer >= 1, got {batch!r}")
    chunks = [list(range(first, min(first + batch, prompts))) for first in range(0, prompts, batch)]
    prompt_units = [
        PromptUnit(
            context,
            indices,
            [prompt_ids(tokenizer, corpus, context, index, tokens) for index in indices],
            tokens,
            selectors,
            supports,
            audit,
            batched=batch > 1,
            dense_layers=dense_layers,
            layer_supports=layer_supports,
        )
        for context in contexts
        for indices in chunks
    ]
    configs = [
        SparseConfig(support=support, selector=selector, dense_layers=dense_layers, layer_supports=layer_supports)
        for selector in selectors
        for support in supports
    ]
    trial_units = [TrialUnit(context, trial, prompt, configs) for (context, trial), prompt in passkey_prompts.items()]
    if execute is not None:
        made = dict(execute.run([*prompt_units, *trial_units], len(prompt_units) + len(trial_units)))
    else:
        made = _run_here(prompt_units, trial_units, model, tokenizer, progress)
    runs = [run for unit in prompt_units for run in made[unit]]
    runs.sort(key=lambda r: (contexts.index(r["context"]), r["prompt_index"]))  # batch-1 order (a stable sort)
    trials = [trial for unit in trial_units for trial in made[unit]]
    op_ms = _op_times(op_shape, contexts, supports, selectors) if op_shape else {}
    rows = summarize(runs, trials, contexts=contexts, supports=supports, selectors=selectors, op_ms=op_ms)
    return rows, runs, trials


def _run_here(prompt_units, trial_units, model, tokenizer, progress) -> dict:
    """Each unit's runs, in this process; ``progress`` hears of the prompts and passkey trials done."""
    made = {}
    for number, unit in enumerate(prompt_units):
        if progress:
            progress("prompts", number, len(prompt_units))
        made[unit] = unit.run(model, tokenizer, progress=progress)
    if progress and prompt_units:
        progress("prompts", len(prompt_units), len(prompt_units))
    for number, unit in enumerate(trial_units, start=1):
        made[unit] = unit.run(model, tokenizer)
        if progress:
            progress("retrieval", number, len(trial_units))
    return made


def _describe(spec: str) -> tuple[bool | None, str]:
    """Whether one could deploy the selector, and what its selection reads (from its class)."""
    try:
        selector = resolve_selector(spec)
    except SparseDecodeError:  # a stored comparison of a selector file that is not here
        return None, "unknown here (the selector cannot be imported)"
    return selector.practical, selector.describe_reads()


def summarize(
    runs: list[dict],
    trials: list[dict],
    *,
    contexts: tuple[int, ...],
    supports: tuple[int, ...],
    selectors: tuple[str, ...],
    op_ms: dict[tuple[int, str, int], float],
) -> list[SelectorRow]:
    """One :class:`SelectorRow` per (context, selector, support) from the per-run results and retrieval trials;
    ``op_ms`` maps ``(context, selector, support)`` to a measured operator time."""
    described = {selector: _describe(selector) for selector in selectors}  # each selector resolved once
    rows = []
    for context in contexts:
        for selector in selectors:
            for support in supports:
                mine = [r for r in runs if (r["context"], r["selector"], r["support"]) == (context, selector, support)]
                captured = [r["captured_mass_ratio_mean"] for r in mine if r["captured_mass_ratio_mean"] is not None]
                per_head = [
                    r["captured_mass_ratio_per_head_best_mean"]
                    for r in mine
                    if r.get("captured_mass_ratio_per_head_best_mean") is not None
                ]
                found = [
                    t["correct"]
                    for t in trials
                    if (t["context"], t["selector"], t["support"]) == (context, selector, support)
                ]
                dense = [t["correct"] for t in trials if t["context"] == context and t["mode"] == "dense"]
                read = [r for r in mine if r.get("support_read_mean") is not None]
                rows.append(
                    SelectorRow(
                        selector=selector,
                        practical=described[selector][0],
                        reads=described[selector][1],
                        context=context,
                        support=support,
                        runs=len(mine),
                        survived=sum(r["survives"] for r in mine),
                        median_first_divergence=median([r["first_divergence"] for r in mine]),
                        median_teacher_forced_match=median([r["teacher_forced_match"] for r in mine]),
                        median_delta_ppl_percent=median([r["delta_ppl_percent"] for r in mine]),  # NaN in any order
                        certified_fraction=statistics.mean(r["certified_fraction"] for r in mine),
                        captured_mass_ratio=statistics.mean(captured) if captured else None,
                        captured_mass_ratio_per_head_best=statistics.mean(per_head) if per_head else None,
                        retrieval_trials=len(found),
                        retrieval_correct=sum(found) if found else None,
                        retrieval_accuracy=sum(found) / len(found) if found else None,
                        dense_retrieval_correct=sum(dense) if dense else None,
                        op_ms=op_ms.get((context, selector, support)),
                        dense_by_construction=bool(mine) and all(dense_by_construction(r) for r in mine),
                        support_read_mean=statistics.mean(r["support_read_mean"] for r in read) if read else None,
                        support_read_min=min(r["support_read_min"] for r in read) if read else None,
                        support_read_max=max(r["support_read_max"] for r in read) if read else None,
                    )
                )
    return rows


def named_as_today(data: dict) -> dict:
    """A stored comparison with its runs upgraded (:func:`~sparsedecode.protocol.results.upgrade_row`) and every
    selector named as its runs say it ran: the settings (and a merged comparison's parts), the passkey trials and
    the summary follow the runs (``quest`` of a comparison written before issue #39 is
    ``quest:grouping=mean-query``)."""
    runs = [upgrade_row(run) for run in data["runs"]]
    renamed = {old["selector"]: new["selector"] for old, new in zip(data["runs"], runs)}

    def rename(name):
        return renamed.get(name, name)

    settings = {**data["settings"], "selectors": [rename(s) for s in data["settings"]["selectors"]]}
    if isinstance(settings.get("parts"), list):
        settings["parts"] = [{**part, "selectors": [rename(s) for s in part.get("selectors", [])]}
                             for part in settings["parts"]]  # fmt: skip
    trials = [{**t, "selector": rename(t["selector"])} if "selector" in t else t for t in data.get("retrieval", [])]
    summary = [{**row, "selector": rename(row["selector"])} for row in data["summary"]]
    return {**data, "settings": settings, "summary": summary, "runs": runs, "retrieval": trials}


def rebuild(data: dict) -> dict:
    """A stored comparison (the JSON document) named as today (:func:`named_as_today`), its runs in today's
    ``first_divergence`` convention and its summary recomputed from them by :func:`summarize`; the operator times of
    the stored summary are kept."""
    data = named_as_today(data)
    settings, runs, trials = data["settings"], data["runs"], data["retrieval"]
    op_ms = {(r["context"], r["selector"], r["support"]): r.get("op_ms") for r in data["summary"]}
    rows = summarize(
        runs,
        trials,
        contexts=tuple(settings["context"]),
        supports=tuple(settings["support"]),
        selectors=tuple(settings["selectors"]),
        op_ms={key: ms for key, ms in op_ms.items() if ms is not None},
    )
    return {**data, "settings": settings, "summary": [asdict(r) for r in rows], "runs": runs, "retrieval": trials}


def retrieval_depths(trials: int) -> tuple[float, ...]:
    """Needle depths of ``trials`` passkey trials, evenly spread over [0, 1] (one trial: the middle)."""
    if trials == 1:
        return (0.5,)
    return tuple(i / (trials - 1) for i in range(trials))


def _op_times(shape, contexts, supports, selectors) -> dict[tuple[int, str, int], float]:
    """Median ms of one sparse decode-attention call per (context, selector, support), synthetic data, with the
    kernel sparse decoding picks here (``SparseConfig.kernel="auto"``).

    Only supports below the context are timed: at ``S >= N`` decoding reads everything densely, so there is no
    sparse call to time (the row shows none).
    """
    groups: dict[tuple[int, ...], list[int]] = {}  # contexts sharing the same sparse supports, timed in one call
    for context in contexts:
        groups.setdefault(tuple(s for s in supports if s < context), []).append(context)
    times = {}
    for selector in selectors:
        for sparse, group in groups.items():
            if not sparse:
                continue
            # the kernel decoding itself used (``auto``); rows are matched by (context, support), not by position
            rows, _ = bench_op(shape, tuple(group), sparse, selector=selector, budget_s=0.2, kernels=("auto",))
            asked = {SparseConfig(support=s, selector=selector).effective_support: s for s in sparse}
            for row in rows:  # rows carry the effective support (whole blocks)
                times[(row.context, selector, asked[row.support])] = row.sparse_ms
    return times
