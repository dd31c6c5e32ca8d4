"""The survival sweep's section of ``report.md``: its conditions, findings, tables and plots.

Renders the rows of a sweep folder (``sweep.json`` and ``runs.jsonl``, see :mod:`sparsedecode.experiments.sweep`)
and writes beside them ``conditions.csv``, ``runs.csv``, ``warning_runs.csv`` (``selectors.csv`` for several
selectors) and the plots. Every number is computed from the rows by :mod:`sparsedecode.experiments.summary`;
conditions that are dense by construction are shown apart and counted nowhere else.
"""

from __future__ import annotations

from pathlib import Path

from ..experiments import summary
from ..experiments.sweep import SweepSpec
from .environment import environment_lines
from .findings import findings_lines
from .tables import code, format_range, format_value, layer_flags, markdown_table, shard_flags, shell_word, write_csv


def sweep_command(spec: SweepSpec, directory: Path, shard: str | None = None) -> str:
    """The ``sparsedecode sweep`` command line that reproduces ``spec`` into ``directory`` (with ``--shard``, for a
    folder that holds one shard: the folder takes no other)."""
    default = SweepSpec(model=spec.model)
    parts = ["sparsedecode sweep", f"--model {shell_word(spec.model)}"]
    if spec.dtype != default.dtype:
        parts.append(f"--dtype {spec.dtype}")
    if spec.corpus != default.corpus:
        parts.append(f"--corpus {shell_word(spec.corpus)}")
    parts += [
        f"--context {','.join(map(str, spec.contexts))}",
        f"--support {','.join(map(str, spec.supports))}",
        f"--reuse {','.join(map(str, spec.reuse))}",
        f"--prompts {spec.prompts}",
        f"--tokens {spec.tokens}",
    ]
    for name, flag in (("window", "--window"), ("block_size", "--block-size")):
        if getattr(spec, name) != getattr(default, name):
            parts.append(f"{flag} {getattr(spec, name)}")
    if len(spec.selectors) > 1:
        parts.append(f"--selectors {shell_word(','.join(spec.selectors))}")
    elif spec.selectors != default.selectors:
        parts.append(f"--selector {shell_word(spec.selectors[0])}")
    parts += layer_flags(spec.dense_layers, spec.layer_supports)
    if spec.audit:
        parts.append("--audit")
    parts += shard_flags(shard)
    parts.append(f"--out {shell_word(directory)}")
    return " ".join(parts)


def sweep_section(directory: Path, meta: dict, rows: list[dict]) -> list[str]:
    """The section's Markdown lines for the sweep ``meta`` (``sweep.json``) and its ``rows``; its CSVs and plots go
    into ``directory``."""
    spec = SweepSpec.from_dict(meta["spec"])
    lines = _conditions_lines(directory, meta, spec, rows)
    if not rows:
        return lines + ["No runs finished yet.", ""]
    every_condition = summary.conditions(rows)
    dense = [c for c in every_condition if c["dense_by_construction"]]
    lines += findings_lines(spec, rows, dense)
    if len(spec.selectors) > 1:
        lines += _selector_lines(directory, rows)
    lines += _condition_lines(directory, spec, rows, every_condition)
    lines += _warning_lines(directory, spec, rows)
    return lines + _plot_lines(directory, spec, rows, dense)


def _conditions_lines(directory: Path, meta: dict, spec: SweepSpec, rows: list[dict]) -> list[str]:
    """The title, how much of the grid ran, the conditions it ran under and the commands that reproduce it."""
    grid = len(spec.keys())
    several = len(spec.selectors) > 1
    covered = f"{len(rows)} of the {grid} runs of the grid"
    return [
        f"# Survival sweep: {spec.model}",
        "",
        f"**{covered}** ({len(spec.contexts)} contexts x {spec.prompts} prompts x "
        + (f"{len(spec.selectors)} selectors x " if several else "")
        + f"{len(spec.supports)} supports x {len(spec.reuse)} reuse intervals)"
        + ("." if len(rows) == grid else "; the missing runs were not measured and are not in any number below."),
        "",
        "## Conditions",
        "",
        f"- model {code(spec.model)}, dtype {spec.dtype}; corpus {code(spec.corpus)} (text sha256 "
        f"`{(meta.get('corpus_sha256') or '?')[:16]}…`), prompts = non-overlapping prefixes 0..{spec.prompts - 1} "
        f"(stride context + T + {spec.gap})",
        f"- contexts {list(spec.contexts)}; supports S {list(spec.supports)}; reuse R {list(spec.reuse)}; "
        f"{'selectors' if several else 'selector'} {', '.join(spec.selectors)} (the same dense references); "
        f"window W = {spec.window}, block B = {spec.block_size}; T = {spec.tokens} greedy tokens",
        *environment_lines(meta),
        "",
        "Command:",
        "",
        "```sh",
        sweep_command(spec, directory, meta.get("shard")),
        f"sparsedecode report {shell_word(directory)}",
        "```",
        "",
    ]


def _selector_lines(directory: Path, rows: list[dict]) -> list[str]:
    """One row per selector over all its runs that take a sparse step (for a sweep of several), and
    ``selectors.csv``."""
    selectors = summary.by_selector(rows)
    table = [
        [
            code(c["selector"]),
            f"{c['survived']}/{c['runs']}",
            format_value(c["first_divergence_median"], None),  # a median of two steps may end in .5
            format_value(c["teacher_forced_match_median"]),
            format_value(c["delta_ppl_percent_median"], 2, "+"),
            f"{c['conditions_within_tolerance']}/{c['conditions_min_support']}",
            str(c["warning_runs"]),
        ]
        for c in selectors
    ]
    header = ["selector", "survived", "median first divergence", "median TF match %", "median ΔPPL %"]
    write_csv(directory / "selectors.csv", selectors)
    return [
        "## Per selector",
        "",
        "All runs of each selector (every context, prompt, support and reuse interval) that take a sparse step, "
        "against the same dense references. Medians over runs; within 5% counts the selector's conditions with "
        "S >= 193 whose median ΔPPL lies within ±5%.",
        "",
        markdown_table(header + ["within 5% (S >= 193)", "TF < 70%"], table),
        "",
        "CSV: [selectors.csv](selectors.csv)",
        "",
    ]


def _condition_lines(directory: Path, spec: SweepSpec, rows: list[dict], every_condition: list[dict]) -> list[str]:
    """The per-condition table (median [min, max] over prompts), the conditions that are dense by construction
    apart, and ``conditions.csv`` and ``runs.csv``."""
    reuse = len(spec.reuse) > 1
    several = len(spec.selectors) > 1
    sparse = [c for c in every_condition if not c["dense_by_construction"]]
    dense = [c for c in every_condition if c["dense_by_construction"]]
    lines = [
        "## Per condition",
        "",
        "First divergence: the decode step t >= 1 whose sparse token first differs from dense, counted among the "
        f"T - 1 sparse-generated tokens (token 0 comes from the shared dense prefill; a run that never diverges "
        f"counts as {spec.tokens}). TF match: % of the T - 1 teacher-forced steps whose sparse "
        "argmax is the dense token. ΔPPL: sparse vs dense perplexity of the dense continuation. Median [min, max].",
        "",
    ]
    table = [
        [
            str(c["context"]),
            str(c["support"]),
            *([str(c["reuse"])] if reuse else []),
            *([code(c["selector"])] if several else []),
            f"{c['survived']}/{c['runs']}",
            format_range(c, "first_divergence", None),
            format_range(c, "teacher_forced_match", 1),
            format_range(c, "delta_ppl_percent", 2, "+"),
            format_value(c["abs_delta_ppl_percent_median"], 2),
            str(c["warning_runs"]),
        ]
        for c in sparse
    ]
    header = ["context", "S", *(["R"] if reuse else []), *(["selector"] if several else []), "survived"]
    header += ["first divergence", "TF match %", "ΔPPL %", "median abs ΔPPL %", "TF < 70%"]
    lines += [markdown_table(header, table) if table else "No condition takes a sparse step."]
    if dense:
        why = "effective S >= context + T - 1"
        if not all(summary.covers_every_position(c) for c in dense):  # every layer kept dense: effective S is less
            why += ", or no sparse step: every layer kept dense by --dense-layers or --layer-supports"
        lines += ["", f"Dense by construction ({why}; not counted anywhere else):", ""]
        lines += [_dense_table(dense, reuse=reuse, several=several)]
    lines += ["", "CSV: [conditions.csv](conditions.csv), all runs: [runs.csv](runs.csv)"]
    write_csv(directory / "conditions.csv", every_condition)
    write_csv(directory / "runs.csv", [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows])
    return lines


def _dense_table(dense: list[dict], *, reuse: bool, several: bool) -> str:
    """The conditions whose effective support covers every position, with the support they were floored to."""
    header = ["context", "S", "effective S", *(["R"] if reuse else []), *(["selector"] if several else [])]
    table = [
        [
            str(c["context"]),
            str(c["support"]),
            str(c["effective_support"]),
            *([str(c["reuse"])] if reuse else []),
            *([code(c["selector"])] if several else []),
            f"{c['survived']}/{c['runs']}",
            format_value(c["delta_ppl_percent_median"], 2, "+"),
        ]
        for c in dense
    ]
    return markdown_table(header + ["survived", "ΔPPL %"], table)


def _warning_lines(directory: Path, spec: SweepSpec, rows: list[dict]) -> list[str]:
    """The runs with teacher-forced match below 70% (the reference study's warning regime), and
    ``warning_runs.csv``."""
    several = len(spec.selectors) > 1
    warnings = summary.warning_runs(rows)
    lines = ["", "## Runs with teacher-forced match below 70%", ""]
    if warnings:
        header = ["context", "prompt", "S", "R", *(["selector"] if several else []), "TF match %", "ΔPPL %"]
        table = [
            [
                str(w["context"]),
                str(w["prompt_index"]),
                str(w["support"]),
                str(w["reuse"]),
                *([code(w["selector"])] if several else []),
                format_value(w["teacher_forced_match"]),
                format_value(w["delta_ppl_percent"], 2, "+"),  # NaN (two infinite perplexities): '-' as elsewhere
                str(w["first_divergence"]),
            ]
            for w in warnings
        ]
        lines += [markdown_table(header + ["first divergence"], table), "", "CSV: [warning_runs.csv](warning_runs.csv)"]
    else:
        lines.append("None.")
    write_csv(directory / "warning_runs.csv", warnings)
    return lines


def _plot_lines(directory: Path, spec: SweepSpec, rows: list[dict], dense: list[dict]) -> list[str]:
    """The three plots of the runs that take a sparse step (``match_vs_delta_ppl.png``,
    ``delta_ppl_by_support.png``, ``first_divergence.png``), or why there are none."""
    from . import plots

    tested = summary.tested(rows)
    if not tested:
        return ["", "## Plots", "", "None: no run takes a sparse step.", ""]
    several = len(spec.selectors) > 1
    title = f"{spec.model}, {spec.corpus}, T = {spec.tokens}"
    plots.match_vs_delta_ppl(tested, directory / "match_vs_delta_ppl.png", title=f"{title}: one dot per run")
    plots.delta_ppl_by_support(tested, directory / "delta_ppl_by_support.png", title=title)
    plots.first_divergence_histogram(tested, directory / "first_divergence.png", title=title)
    return [
        "",
        "## Plots",
        "",
        *(["Runs that are dense by construction are left out.", ""] if dense else []),
        "Teacher-forced match against ΔPPL, one dot per run"
        + (" (marker: selector; contexts pooled)" if several else "")
        + "; the dashed line is the 70% warning threshold:",
        "",
        "![teacher-forced match vs delta-PPL](match_vs_delta_ppl.png)",
        "",
        "ΔPPL by support, per context (dots: runs; bars: medians"
        + (", one colour per selector" if several else "")
        + "; green band: within 5%):",
        "",
        "![delta-PPL by support](delta_ppl_by_support.png)",
        "",
        f"First divergence, stacked by {'selector' if several else 'support'}:",
        "",
        "![first divergence](first_divergence.png)",
        "",
    ]
