"""Numbers for the report of an evaluation folder (:mod:`.evaluate`), computed from its rows alone."""

from __future__ import annotations

from .eval_spec import DENSE

DENSE_FAILS = 0.5
"""A (task, context) whose dense mean score is below this says nothing about sparsity: dense cannot do it. Nor does
one where dense answers no sample fully (:func:`dense_fails`)."""


def mode_label(selector: str, support: int | None) -> str:
    return "dense" if selector == DENSE else f"{selector} S={support}"


def modes(rows: list[dict]) -> list[tuple[str, int | None]]:
    """``(selector, support)`` in first-seen order, dense first."""
    seen = list(dict.fromkeys((r["selector"], r["support"]) for r in rows))
    return sorted(seen, key=lambda m: (m[0] != DENSE, seen.index(m)))


def cells(rows: list[dict]) -> list[tuple[str, int]]:
    """``(task, context)`` in first-seen task order, contexts ascending."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    return sorted({(r["task"], r["context"]) for r in rows}, key=lambda c: (tasks.index(c[0]), c[1]))


def accuracy(rows: list[dict]) -> list[dict]:
    """Per (task, context, selector, support): samples, mean score (RULER's metric, 0-1) and share fully correct."""
    out = []
    for task, context in cells(rows):
        for selector, support in modes(rows):
            group = [
                r
                for r in rows
                if (r["task"], r["context"], r["selector"], r["support"]) == (task, context, selector, support)
            ]
            if not group:
                continue
            out.append(
                {
                    "task": task,
                    "context": context,
                    "selector": selector,
                    "support": support,
                    "samples": len(group),
                    "score": sum(r["score"] for r in group) / len(group),
                    "correct": sum(r["correct"] for r in group) / len(group),
                }
            )
    return out


def dense_fails(rows: list[dict]) -> list[dict]:
    """The (task, context) cells dense fails: its mean score is below :data:`DENSE_FAILS`, or it answers no sample
    fully (a partial answer on every sample: a sparse setting there can only lose part of it or find by chance what
    dense missed, so the cell measures the model, not sparse decoding)."""
    dense = accuracy([r for r in rows if r["selector"] == DENSE])
    return [a for a in dense if a["score"] < DENSE_FAILS or a["correct"] == 0]


def dense_imperfect(rows: list[dict]) -> list[dict]:
    """The (task, context) cells where dense does not answer every sample fully: dense's mean score, how many
    samples it answers fully and how many it scores 0 on. A sparse score there is judged against a partial answer."""
    dense = [r for r in rows if r["selector"] == DENSE]
    out = []
    for task, context in cells(dense):
        group = [r for r in dense if (r["task"], r["context"]) == (task, context)]
        fully = sum(r["correct"] for r in group)
        if fully < len(group):
            out.append(
                {
                    "task": task,
                    "context": context,
                    "samples": len(group),
                    "score": sum(r["score"] for r in group) / len(group),
                    "fully_right": fully,
                    "zero": sum(r["score"] == 0 for r in group),
                }
            )
    return out


def _dense_by_sample(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["task"], r["context"], r["sample"]): r for r in rows if r["selector"] == DENSE}


def paired(rows: list[dict]) -> list[dict]:
    """Per sparse (selector, support), over the samples that have a dense row: mean scores, the paired difference,
    how many samples scored lower / higher than dense and how many answered exactly as dense, the mean generated
    answer lengths (tokens; sparse decoding can answer longer where an end token applies). ``*_dense_ok`` counts
    only the cells where dense does not fail (see :func:`dense_fails`)."""
    dense = _dense_by_sample(rows)
    failing = {(a["task"], a["context"]) for a in dense_fails(rows)}
    out = []
    for selector, support in modes(rows):
        if selector == DENSE:
            continue
        group = [
            (r, dense[k])
            for r in rows
            if (r["selector"], r["support"]) == (selector, support)
            and (k := (r["task"], r["context"], r["sample"])) in dense
        ]
        if not group:
            continue
        ok = [(s, d) for s, d in group if (s["task"], s["context"]) not in failing]
        out.append(
            {
                "selector": selector,
                "support": support,
                "samples": len(group),
                "dense_score": sum(d["score"] for _, d in group) / len(group),
                "sparse_score": sum(s["score"] for s, _ in group) / len(group),
                "difference": sum(s["score"] - d["score"] for s, d in group) / len(group),
                "lower": sum(s["score"] < d["score"] for s, d in group),
                "higher": sum(s["score"] > d["score"] for s, d in group),
                "same_output": sum(s["output_ids"] == d["output_ids"] for s, d in group),
                "dense_tokens": sum(len(d["output_ids"]) for _, d in group) / len(group),
                "sparse_tokens": sum(len(s["output_ids"]) for s, _ in group) / len(group),
                "samples_dense_ok": len(ok),
                "difference_dense_ok": sum(s["score"] - d["score"] for s, d in ok) / len(ok) if ok else None,
            }
        )
    return out


def regressions(rows: list[dict]) -> list[dict]:
    """Samples where dense is fully correct and the sparse run is not, with both outputs."""
    dense = _dense_by_sample(rows)
    out = []
    for r in rows:
        d = dense.get((r["task"], r["context"], r["sample"]))
        if r["selector"] == DENSE or d is None or not d["correct"] or r["correct"]:
            continue
        out.append(
            {
                "task": r["task"],
                "context": r["context"],
                "sample": r["sample"],
                "selector": r["selector"],
                "support": r["support"],
                "answers": r["answers"],
                "dense_output": d["output"],
                "sparse_output": r["output"],
                "sparse_score": r["score"],
            }
        )
    return out
