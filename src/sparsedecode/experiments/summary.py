"""The reference study's summary of a survival sweep, computed from ``runs.jsonl`` rows (docs/definitions.md,
section 3).

Pure functions from rows (plain dicts) to plain dicts and lists, so the report, the CLI and the tests share them:

* :func:`conditions`: per (context, support, reuse, selector) the runs surviving all ``T`` tokens, median and
  range of first divergence, teacher-forced match and delta-PPL;
* :func:`by_selector`: the same totals and medians per selector, over all its conditions (a multi-selector sweep);
* :func:`within_tolerance`: how many conditions with ``S >= 193`` have a median delta-PPL within 5% of dense;
* :func:`warning_runs`: the runs with teacher-forced match below 70%, with their delta-PPL;
* :func:`overview`: totals over all runs (the reference study: none of 60 runs survived 128 tokens).

Runs whose support covers every position they attend to are dense by construction (see
:func:`dense_by_construction`): they test nothing, so every total, median and count here leaves them out;
:func:`conditions` keeps their conditions, marked, for a report to show apart.

``first_divergence`` as docs/definitions.md, section 3 defines it: the decode step ``t >= 1`` whose sparse token
first differs from dense, ``T`` when none (rows of an older convention are upgraded when read, see
:func:`sparsedecode.experiments.sweep.read_rows`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from ..protocol.diagnostics import WARNING_MATCH_PERCENT

CONDITION_KEY = ("context", "support", "reuse", "selector")


def dense_by_construction(entry: dict) -> bool:
    """Whether a run (or condition) never took a sparse step: its effective support ``S`` covers the
    ``context + T - 1`` positions the last decode step attends to (``S >= context + T - 1``), so every step is
    dense SDPA and the run equals dense decoding by construction; or a run that records no sparse step at all
    (``sparse_steps`` 0: per-layer settings kept every layer dense). A run that records its ``sparse_steps`` is
    judged by them alone: a layer given a smaller support (``--layer-supports``) decodes sparsely where ``S`` covers
    the context. ``entry`` holds ``context``, ``tokens`` and ``effective_support`` (or
    ``settings["effective_support"]``, or else ``support``)."""
    if entry.get("sparse_steps") is not None:
        return entry["sparse_steps"] == 0
    return covers_every_position(entry)


def covers_every_position(entry: dict) -> bool:
    """Whether a run's (or condition's) effective support covers the ``context + T - 1`` positions the last decode
    step attends to: the first of the two ways a run is dense by construction (:func:`dense_by_construction`); the
    other is a run whose every layer was kept dense (``--dense-layers``, ``--layer-supports``)."""
    support = entry.get("effective_support") or entry.get("settings", {}).get("effective_support") or entry["support"]
    return support >= entry["context"] + entry["tokens"] - 1


def tested(rows: Iterable[dict]) -> list[dict]:
    """The runs that are not dense by construction (the ones a summary counts)."""
    return [r for r in rows if not dense_by_construction(r)]


def _unmeasured(values: list[float]) -> bool:
    """No values, or one of them NaN (a delta-PPL of two infinite perplexities): sorting with a NaN depends on the
    order, so a median, minimum or maximum over it is NaN whatever the rows' order."""
    return not values or any(v != v for v in values)


def median(values: list[float]) -> float:
    """The median of ``values``; NaN for none, or where one is NaN (whatever their order: see :func:`_unmeasured`).
    The selector comparison's medians are these too."""
    return float("nan") if _unmeasured(values) else float(statistics.median(values))


def _extreme(values: list[float], pick) -> float:
    return float("nan") if _unmeasured(values) else pick(values)


def _stats(values: list[float], prefix: str) -> dict:
    return {
        f"{prefix}_median": median(values),
        f"{prefix}_min": _extreme(values, min),
        f"{prefix}_max": _extreme(values, max),
    }


def _by_condition(rows: Iterable[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[name] for name in CONDITION_KEY), []).append(row)
    return dict(sorted(groups.items(), key=lambda item: (item[0][0], item[0][1], item[0][2], item[0][3])))


def conditions(rows: Iterable[dict]) -> list[dict]:
    """One dict per (context, support, reuse, selector), sorted by context, then support, then reuse; conditions
    that are dense by construction are kept, with ``dense_by_construction`` true, for a report to show apart."""
    table = []
    for (context, support, reuse, selector), group in _by_condition(rows).items():
        divergence = [r["first_divergence"] for r in group if not r["survives"]]
        entry = {
            "context": context,
            "support": support,
            "effective_support": group[0].get("effective_support", support),
            "reuse": reuse,
            "selector": selector,
            "tokens": group[0].get("tokens"),
            "runs": len(group),
            "survived": sum(bool(r["survives"]) for r in group),
            **_stats([r["first_divergence"] for r in group], "first_divergence"),
            "diverged_runs_first_divergence_median": median(divergence),
            **_stats([r["teacher_forced_match"] for r in group], "teacher_forced_match"),
            **_stats([r["delta_ppl_percent"] for r in group], "delta_ppl_percent"),
            "abs_delta_ppl_percent_median": median([abs(r["delta_ppl_percent"]) for r in group]),
            "warning_runs": sum(r["teacher_forced_match"] < WARNING_MATCH_PERCENT for r in group),
            "dense_by_construction": all(dense_by_construction(r) for r in group),
        }
        table.append(entry)
    return table


def within_tolerance(rows: Iterable[dict], *, min_support: int = 193, tolerance_percent: float = 5.0) -> dict:
    """Conditions with ``support >= min_support`` whose median delta-PPL lies within ``tolerance_percent`` of dense
    (``|median| <= tolerance_percent``, the band the report's plot draws around the medians).

    The reference study reports 7 of its 9 conditions with S >= 193 whose "median teacher-forced continuation
    perplexity changes [are] within 5% of dense": the median of the signed changes, not of their sizes (a condition
    of -8%, +1%, +9% is within; its median size, 8%, is the condition table's ``median abs ΔPPL`` column). Conditions
    that are dense by construction are not counted (``dense_conditions`` says how many were left out).
    """
    large = [c for c in conditions(rows) if c["support"] >= min_support]
    eligible = [c for c in large if not c["dense_by_construction"]]
    within = [c for c in eligible if abs(c["delta_ppl_percent_median"]) <= tolerance_percent]
    return {
        "min_support": min_support,
        "tolerance_percent": tolerance_percent,
        "conditions": len(eligible),
        "dense_conditions": len(large) - len(eligible),
        "within": len(within),
        "within_conditions": [(c["context"], c["support"], c["reuse"], c["selector"]) for c in within],
        "outside_conditions": [
            (c["context"], c["support"], c["reuse"], c["selector"]) for c in eligible if c not in within
        ],
    }


def warning_runs(rows: Iterable[dict], *, threshold: float = WARNING_MATCH_PERCENT) -> list[dict]:
    """Runs whose teacher-forced match is below ``threshold`` percent, worst match first, with their delta-PPL
    (runs that are dense by construction left out)."""
    picked = [r for r in tested(rows) if r["teacher_forced_match"] < threshold]
    picked.sort(
        key=lambda r: (
            r["teacher_forced_match"],
            r["context"],
            r["prompt_index"],
            r["support"],
            r["reuse"],
            r["selector"],
        )
    )
    return [
        {
            "context": r["context"],
            "prompt_index": r["prompt_index"],
            "support": r["support"],
            "reuse": r["reuse"],
            "selector": r["selector"],
            "teacher_forced_match": r["teacher_forced_match"],
            "delta_ppl_percent": r["delta_ppl_percent"],
            "first_divergence": r["first_divergence"],
        }
        for r in picked
    ]


def by_selector(rows: Iterable[dict], *, min_support: int = 193, tolerance_percent: float = 5.0) -> list[dict]:
    """Totals and medians per selector (in first-seen order) over all its runs that are not dense by construction
    (``dense_by_construction_runs`` counts the others).

    ``conditions_within_tolerance``: how many of the selector's conditions with ``support >= min_support`` have a
    median delta-PPL within ``tolerance_percent`` of dense (:func:`within_tolerance`), of ``conditions_min_support``.
    """
    rows = list(rows)
    table = []
    for selector in dict.fromkeys(r["selector"] for r in rows):
        every = [r for r in rows if r["selector"] == selector]
        mine = tested(every)
        tolerance = within_tolerance(mine, min_support=min_support, tolerance_percent=tolerance_percent)
        table.append(
            {
                "selector": selector,
                "runs": len(mine),
                "dense_by_construction_runs": len(every) - len(mine),
                "survived": sum(bool(r["survives"]) for r in mine),
                "first_divergence_median": median([r["first_divergence"] for r in mine]),
                "teacher_forced_match_median": median([r["teacher_forced_match"] for r in mine]),
                "delta_ppl_percent_median": median([r["delta_ppl_percent"] for r in mine]),
                "warning_runs": sum(r["teacher_forced_match"] < WARNING_MATCH_PERCENT for r in mine),
                "conditions_min_support": tolerance["conditions"],
                "conditions_within_tolerance": tolerance["within"],
            }
        )
    return table


def overview(rows: list[dict], *, threshold: float = WARNING_MATCH_PERCENT) -> dict:
    """Totals: runs, survivors, median first divergence, and how the warning runs' delta-PPL fall, over the runs
    that are not dense by construction (``dense_by_construction_runs`` counts the others)."""
    every = list(rows)
    rows = tested(every)
    warnings = warning_runs(rows, threshold=threshold)
    return {
        "runs": len(rows),
        "dense_by_construction_runs": len(every) - len(rows),
        "survived": sum(bool(r["survives"]) for r in rows),
        "first_divergence_median": median([r["first_divergence"] for r in rows]),
        "warning_runs": len(warnings),
        "warning_runs_prompts": sorted({(w["context"], w["prompt_index"]) for w in warnings}),
        "warning_runs_above_100_percent": sum(w["delta_ppl_percent"] > 100 for w in warnings),
        "runs_above_100_percent": sum(r["delta_ppl_percent"] > 100 for r in rows),
        "max_delta_ppl_percent": _extreme([r["delta_ppl_percent"] for r in rows], max),
    }
