"""``sparsedecode report DIR`` for an evaluation folder (``eval.json``): Markdown, CSV and a heat map.

Writes next to ``runs.jsonl``: ``report.md``; ``accuracy.csv`` (per task, context, selector, support),
``paired.csv`` (per sparse setting, against dense on the same samples), ``regressions.csv`` (samples dense answers
fully and the sparse run does not, with both outputs); ``accuracy.png`` (mean score per task x context and mode).
Every number comes from :mod:`sparsedecode.experiments.eval_summary`. This module sits on top of the library.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import SparseDecodeError
from ..experiments import eval_summary as summary
from ..experiments.evaluate import RUNS_FILE, EvalSpec, load_eval
from ..experiments.ruler import TASKS
from ..files import write_text_atomic
from .environment import environment_lines
from .sweep import REPORT_FILE
from .tables import (
    changed_flags,
    code,
    markdown_table,
    restored_on_failure,
    shard_flags,
    shell_word,
    spec_cell,
    write_csv,
)

EXAMPLES = 20
"""Regressions shown in the Markdown (all of them are in ``regressions.csv``)."""


def _supports(spec) -> str:
    """The supports with what the first selector reads of each; the supports alone where that selector cannot be
    imported here (a selector file moved or gone: the rows hold what the report prints)."""
    try:
        return ", ".join(f"{c.support} (effective {c.effective_support})" for c in spec.configs()[: len(spec.supports)])
    except SparseDecodeError:
        return ", ".join(map(str, spec.supports))


def eval_command(spec: EvalSpec, directory: Path, shard: str | None = None) -> str:
    """The ``sparsedecode eval`` command line that reproduces ``spec`` into ``directory`` (with ``--shard``, for a
    folder that holds one shard: the folder takes no other)."""
    default = EvalSpec(model=spec.model)
    parts = ["sparsedecode eval", f"--model {shell_word(spec.model)}"]
    if spec.dtype != default.dtype:
        parts.append(f"--dtype {spec.dtype}")
    if spec.tasks != default.tasks:
        parts.append(f"--tasks {','.join(spec.tasks)}")
    parts += [
        f"--context {','.join(map(str, spec.contexts))}",
        f"--samples {spec.samples}",
        f"--selectors {shell_word(','.join(spec.selectors))}",
        f"--support {','.join(map(str, spec.supports))}",
    ]
    parts += changed_flags(
        spec, default, ("window", "block_size", "reuse", "corpus", "template", "seed", "answer_tokens")
    )
    parts += shard_flags(shard)
    parts.append(f"--out {shell_word(directory)}")
    return " ".join(parts)


def _mode(selector: str, support: int | None) -> str:
    """A mode's label as Markdown (:func:`~sparsedecode.experiments.eval_summary.mode_label`), its selector spec
    shown as written."""
    return summary.mode_label(spec_cell(selector), support)  # "dense" holds no markup: spec_cell leaves it


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}"


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())  # markdown_table escapes its `|`
    return text if len(text) <= width else text[: width - 1] + "…"


def write_eval_report(directory: Path) -> Path:
    """Render the evaluation folder ``directory``; returns the path of ``report.md``."""
    directory = Path(directory)
    meta, rows = load_eval(directory)
    spec = EvalSpec.from_dict(meta["spec"])
    accuracy = summary.accuracy(rows)
    paired = summary.paired(rows)
    regressions = summary.regressions(rows)
    with restored_on_failure(directory):  # a failure or an interrupt leaves the folder's earlier report whole
        write_csv(directory / "accuracy.csv", accuracy)
        write_csv(directory / "paired.csv", paired)
        write_csv(directory / "regressions.csv", regressions)
        table, matrix = _accuracy_table(rows, accuracy)
        out = [
            *_conditions_lines(directory, meta, spec, rows),
            *table,
            *_paired_lines(paired),
            *_dense_fails_lines(rows),
            *_dense_imperfect_lines(rows),
            *_regression_lines(regressions, paired),
            *_heatmap_lines(directory, spec, rows, matrix),
            *_caveat_lines(spec),
        ]
    path = directory / REPORT_FILE
    write_text_atomic(path, "\n".join(out))
    return path


def _conditions_lines(directory: Path, meta: dict, spec: EvalSpec, rows: list[dict]) -> list[str]:
    """The title, how much of the grid ran, the conditions it ran under (with the command that reproduces it) and
    the head of the accuracy section."""
    cells = summary.cells(rows)
    modes = summary.modes(rows)
    formats = sorted({r["prompt_format"] for r in rows})
    shown_modes = f"; {', '.join(_mode(*m) for m in modes)}" if modes else ""
    return [
        f"# Task accuracy under sparse decoding: {spec.model}",
        "",
        f"{len(rows)} of {len(spec.keys())} runs in `{RUNS_FILE}` ({len(cells)} task x context cells, up to "
        f"{spec.samples} samples each{shown_modes})."
        + ("" if rows else " No run is stored yet: there is nothing to report."),
        "",
        "## Conditions",
        "",
        f"- model {spec.model}, {spec.dtype}; tasks {', '.join(spec.tasks)}; contexts {list(spec.contexts)} tokens "
        f"(the model's own, prompt format {', '.join(formats) or '-'}); seed {spec.seed}; prose and cwe words from "
        f"{spec.corpus}",
        f"- sparse: W = {spec.window}, B = {spec.block_size}, R = {spec.reuse}; supports "
        + _supports(spec)
        + f"; selectors {', '.join(map(spec_cell, spec.selectors))}",
        "- per sample: one dense prefill of everything before the question; the question, the rest of the prompt "
        "and the answer prefix are fed one token at a time under each mode, then a greedy answer up to "
        + (
            f"{spec.answer_tokens} tokens"
            if spec.answer_tokens
            else "each task's budget (" + ", ".join(f"{t} {TASKS[t].max_new_tokens}" for t in spec.tasks) + ")"
        )
        + " or end of sequence; score = share of expected answers found in the output (RULER's string_match_all)",
        *environment_lines(meta),
        f"- reproduce: {code(eval_command(spec, directory, meta.get('shard')))}, then "
        + code(f"sparsedecode report {shell_word(directory)}"),
        "",
        "## Accuracy (mean score, %)",
        "",
        "Rows: task and context; columns: dense and each sparse setting, on the same samples (where a setting has "
        "run fewer of the cell's n so far, its count follows its score). "
        f"A cell where dense scores below {summary.DENSE_FAILS:.0%}, or answers no sample fully, is marked: dense "
        "cannot do it, so it says nothing about sparsity.",
        "",
    ]


def _accuracy_table(rows: list[dict], accuracy: list[dict]) -> tuple[list[str], list[list[float]]]:
    """The accuracy table (task and context by mode, cells where dense fails marked) as Markdown lines, and the
    same scores as the heat map's matrix (NaN where a mode has no run)."""
    modes = summary.modes(rows)
    index = {(a["task"], a["context"], a["selector"], a["support"]): a for a in accuracy}
    fails = {(f["task"], f["context"]) for f in summary.dense_fails(rows)}
    table, matrix = [], []
    for task, context in summary.cells(rows):
        values = [index.get((task, context, *m)) for m in modes]
        n = max((v["samples"] for v in values if v), default=0)
        mark = " (dense fails)" if (task, context) in fails else ""
        cells = [_percent(v["score"] if v else None) + (f" ({v['samples']} of {n})" if v and v["samples"] < n else "")
                 for v in values]  # fmt: skip
        table.append([task + mark, str(context), str(n), *cells])
        matrix.append([v["score"] if v else np.nan for v in values])
    return [markdown_table(["task", "context", "n", *[_mode(*m) for m in modes]], table), ""], matrix


PAIRED_HEADER = ["setting", "samples", "dense %", "sparse %", "Δ points", "lower", "higher", "same output"]
"""The columns of the paired table but its last (the difference where dense does not fail)."""


def _length_ratio(p: dict) -> str:
    if p.get("dense_tokens") is None:
        return "-"
    ratio = p["sparse_tokens"] / p["dense_tokens"] if p["dense_tokens"] else float("nan")
    return f"{p['sparse_tokens']:.1f} / {p['dense_tokens']:.1f} ({ratio:.2f}x)"


def _paired_lines(paired: list[dict]) -> list[str]:
    """Each sparse setting against dense on the same samples: mean scores, the paired difference and its sign."""
    lines = ["## Paired against dense", ""]
    if not paired:
        return lines + ["No sparse run is paired with a dense run yet.", ""]
    table = [
        [
            _mode(p["selector"], p["support"]),
            str(p["samples"]),
            _percent(p["dense_score"]),
            _percent(p["sparse_score"]),
            f"{100 * p['difference']:+.1f}",
            str(p["lower"]),
            str(p["higher"]),
            str(p["same_output"]),
            "-" if p["difference_dense_ok"] is None else f"{100 * p['difference_dense_ok']:+.1f}",
            _length_ratio(p),
        ]
        for p in paired
    ]
    return lines + [
        "Per sparse setting over every sample: mean scores, the mean paired difference (sparse - dense, points), "
        "samples scoring lower / higher than dense, samples answered token for token as dense, the mean "
        "difference over the cells where dense does not fail, and the mean generated answer length against "
        "dense's (tokens; a ratio above 1 is a longer answer, which costs decode steps).",
        "",
        markdown_table([*PAIRED_HEADER, "Δ (dense ok)", "answer tokens sparse / dense"], table),
        "",
    ]


def _dense_fails_lines(rows: list[dict]) -> list[str]:
    """The cells where dense decoding fails (they measure the model, not sparsity), and those with no dense run."""
    cells = summary.cells(rows)
    failing = summary.dense_fails(rows)
    dense_cells = set(summary.cells([r for r in rows if r["selector"] == summary.DENSE]))
    without_dense = [cell for cell in cells if cell not in dense_cells]
    lines = ["## Where dense fails", ""]
    if not dense_cells:
        lines += ["No dense run is stored yet, so nothing can be said of where dense fails.", ""]
    elif failing:
        lines += [
            f"Dense decoding scores below {summary.DENSE_FAILS:.0%}, or answers no sample fully, here, so these "
            "cells measure the model, not sparse decoding (they are left out of Δ (dense ok)): "
            + "; ".join(
                f"{f['task']} at {f['context']} ({_percent(f['score'])}%, {round(f['correct'] * f['samples'])} of "
                f"{f['samples']} fully)"
                for f in failing
            )
            + ".",
            "",
        ]
    elif not without_dense:
        lines += [
            f"Dense decoding scores at least {summary.DENSE_FAILS:.0%} and answers some sample fully in every cell.",
            "",
        ]
    else:
        lines += [
            f"Dense decoding scores at least {summary.DENSE_FAILS:.0%} and answers some sample fully in every cell "
            f"where it has run ({len(dense_cells)} of {len(cells)}).",
            "",
        ]
    if without_dense:
        lines += [
            f"No dense run yet in {len(without_dense)} of {len(cells)} cells ("
            + ", ".join(f"{task} at {context}" for task, context in without_dense)
            + "): their sparse scores are paired with nothing, and nothing here is said of dense there.",
            "",
        ]
    return lines


def _dense_imperfect_lines(rows: list[dict]) -> list[str]:
    """The cells where dense does not answer every sample fully, against which a sparse setting can lose part of an
    answer or find one by chance; or that dense answers every sample it has run."""
    dense_rows = [r for r in rows if r["selector"] == summary.DENSE]
    samples = {(r["task"], r["context"], r["sample"]) for r in rows}
    dense_samples = {(r["task"], r["context"], r["sample"]) for r in dense_rows}
    imperfect = summary.dense_imperfect(rows)
    if imperfect:
        table = [
            [
                c["task"],
                str(c["context"]),
                str(c["samples"]),
                _percent(c["score"]),
                str(c["fully_right"]),
                str(c["zero"]),
            ]
            for c in imperfect
        ]
        return [
            "Cells where dense does not answer every sample fully. A sparse setting there is measured against a "
            "partial answer: it can lose part of it, or find by chance an answer dense missed. Where dense answers "
            "no sample fully, the cell says little about sparsity.",
            "",
            markdown_table(["task", "context", "samples", "dense %", "answered fully", "scored 0"], table),
            "",
        ]
    if not dense_rows:
        return []  # said with where dense fails: no dense run yet
    if dense_samples == samples:
        return ["Dense answers every sample fully.", ""]
    return [
        f"Dense answers fully every sample it has run ({len(dense_samples)}); {len(samples - dense_samples)} "
        "sample(s) with sparse runs have no dense run yet.",
        "",
    ]


def _regression_lines(regressions: list[dict], paired: list[dict]) -> list[str]:
    """The first :data:`EXAMPLES` samples dense answers fully and a sparse setting does not, with both outputs."""
    lines = ["## Samples dense answers and sparse decoding does not", ""]
    if not regressions:
        if not paired:
            return lines + ["None to show: no sparse run is paired with a dense run yet.", ""]
        return lines + ["None: wherever dense answered fully, every sparse setting did too.", ""]
    shown = regressions[:EXAMPLES]
    table = [
        [
            r["task"],
            str(r["context"]),
            str(r["sample"]),
            _mode(r["selector"], r["support"]),
            _short(", ".join(r["answers"]), 40),
            _short(r["dense_output"]),
            _short(r["sparse_output"]),
        ]
        for r in shown
    ]
    return lines + [
        f"{len(regressions)} (all in `regressions.csv`)"
        + (f"; the first {len(shown)}:" if len(shown) < len(regressions) else ":"),
        "",
        markdown_table(["task", "context", "sample", "setting", "expected", "dense output", "sparse output"], table),
        "",
    ]


def _heatmap_lines(directory: Path, spec: EvalSpec, rows: list[dict], matrix: list[list[float]]) -> list[str]:
    """``accuracy.png``, the mean score per task x context and mode, and its line (nothing without a mode)."""
    from . import plots

    modes = summary.modes(rows)
    if not (matrix and modes):
        return []
    plots.heatmap(
        np.array(matrix, dtype=float),
        directory / "accuracy.png",
        title=f"{spec.model}: mean RULER score per task and context",
        xlabel="mode",
        ylabel="task @ context",
        colorbar="mean score",
        xticks=[summary.mode_label(*m) for m in modes],
        yticks=[f"{t} @ {c}" for t, c in summary.cells(rows)],
        vmin=0.0,
        vmax=1.0,
        annotate=True,
    )
    return ["![mean score per task, context and mode](accuracy.png)", ""]


def _caveat_lines(spec: EvalSpec) -> list[str]:
    """What the evaluation does not establish: few samples, generated tasks, substring scoring, no timing."""
    return [
        "## What this does not establish",
        "",
        f"- Each cell holds at most {spec.samples} samples: one sample moves a cell by {100 / spec.samples:.0f} "
        "points. Differences of a sample or two are noise.",
        "- The tasks are RULER-style, generated here: filler and corpus prose instead of RULER's essays, words from "
        "the corpus's vocabulary, no few-shot examples for cwe and fwe. They are not RULER's published numbers.",
        "- Greedy answers within a token budget, scored by substring match: a model that answers in another form "
        "scores 0 in both modes alike.",
        "- Accuracy says nothing about speed; the decode steps here are not timed for comparison.",
        "",
    ]
