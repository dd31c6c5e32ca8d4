"""``sparsedecode report DIR``: a sweep folder (and optional retrieval results) rendered as Markdown, CSV and PNG.

Reads ``sweep.json`` and ``runs.jsonl`` (see :mod:`sparsedecode.experiments.sweep`) and, when present,
``retrieval.json`` (see :mod:`sparsedecode.experiments.retrieval`), and writes next to them ``report.md``,
one CSV per table and the plots. A folder of ``compare-selectors`` (``selectors.json``) is rendered as
``selectors.md`` and ``selectors.csv``, its summary recomputed from its stored runs with today's code (see
:func:`sparsedecode.experiments.selector_comparison.rebuild`). Every number is computed from the rows by
:mod:`sparsedecode.experiments.summary`; the report states the conditions the rows were measured under and
what they do not establish. This module sits on top of the library; the library never imports it.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from ..errors import SparseDecodeError
from ..experiments import summary
from ..experiments.comparison_file import COMPARISON_FILE
from ..experiments.sweep import RUNS_FILE, SPEC_FILE, SweepSpec, load_sweep
from ..files import write_json_atomic, write_text_atomic

REPORT_FILE = "report.md"
RETRIEVAL_FILE = "retrieval.json"
SELECTORS_FILE = COMPARISON_FILE
REFERENCE = (
    "Qwen2-0.5B, fp16 GPU, WikiText-2 test prefixes; contexts 2K/8K/16K; S in 97..769; 5 prefixes; T = 128; 60 runs"
)


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def _range(entry: dict, name: str, digits: int = 1, sign: str = "") -> str:
    median, low, high = (entry[f"{name}_{part}"] for part in ("median", "min", "max"))
    return f"{median:{sign}.{digits}f} [{low:{sign}.{digits}f}, {high:{sign}.{digits}f}]"


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" ---: " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> Path:
    """Rows of dicts as CSV (columns in first-seen order; lists written as JSON)."""
    columns: list[str] = []
    for row in rows:
        columns += [name for name in row if name not in columns]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, tuple, dict)) else v for k, v in row.items()})
    write_text_atomic(path, text.getvalue())
    return path


def sweep_command(spec: SweepSpec, directory: Path) -> str:
    """The ``sparsedecode sweep`` command line that reproduces ``spec`` into ``directory``."""
    default = SweepSpec(model=spec.model)
    parts = ["sparsedecode sweep", f"--model {spec.model}"]
    if spec.dtype != default.dtype:
        parts.append(f"--dtype {spec.dtype}")
    if spec.corpus != default.corpus:
        parts.append(f"--corpus {spec.corpus}")
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
        parts.append(f"--selectors {','.join(spec.selectors)}")
    elif spec.selectors != default.selectors:
        parts.append(f"--selector {spec.selectors[0]}")
    if spec.audit:
        parts.append("--audit")
    parts.append(f"--out {directory}")
    return " ".join(parts)


def _environment_lines(meta: dict) -> list[str]:
    """One line per distinct (environment, backend) of the sessions that wrote the folder. A session on a backend
    (Ray) ran its units in worker processes: their count and threads are what the timings saw, not the driver's."""
    sessions = meta.get("sessions", [])
    seen: list[tuple] = []
    for s in sessions:
        key = (s.get("environment"), s.get("backend"))
        if key not in seen:
            seen.append(key)
    lines = []
    for env, backend in seen:
        if not env:
            continue
        if backend and backend.get("workers"):
            where = (
                f"{backend.get('backend', 'a backend')}: {backend['workers']} worker(s) x "
                f"{backend.get('threads_per_worker')} thread(s) on {backend.get('nodes')} node(s), "
                f"{backend.get('cpus')} CPUs"
            )
        else:
            where = f"{env.get('threads')} threads ({env.get('cpu_count')} CPUs, {env.get('processor')})"
        lines.append(
            f"- device {env.get('device')}, {where}; Python {env.get('python')}, torch {env.get('torch')}, "
            f"transformers {env.get('transformers')}, numpy {env.get('numpy')}, sparsedecode {env.get('sparsedecode')}"
            + (f" (source {env['revision']})" if env.get("revision") else "")
        )
    starts = [s.get("started") for s in sessions if s.get("started")]
    if starts:
        lines.append(f"- {len(sessions)} session(s) wrote this folder, the first started {starts[0]}")
    return lines


def _sweep_section(directory: Path, meta: dict, rows: list[dict], out: list[str]) -> None:
    from . import plots

    spec = SweepSpec.from_dict(meta["spec"])
    grid = len(spec.keys())
    every_condition = summary.conditions(rows)
    conditions = [c for c in every_condition if not c["dense_by_construction"]]
    dense = [c for c in every_condition if c["dense_by_construction"]]
    tested = summary.tested(rows)
    tolerance = summary.within_tolerance(rows)
    warnings = summary.warning_runs(rows)
    overview = summary.overview(rows)
    several = len(spec.selectors) > 1
    covered = f"{len(rows)} of the {grid} runs of the grid"
    out += [
        f"# Survival sweep: {spec.model}",
        "",
        f"**{covered}** ({len(spec.contexts)} contexts x {spec.prompts} prompts x "
        + (f"{len(spec.selectors)} selectors x " if several else "")
        + f"{len(spec.supports)} supports x {len(spec.reuse)} reuse intervals)"
        + ("." if len(rows) == grid else "; the missing runs were not measured and are not in any number below."),
        "",
        "## Conditions",
        "",
        f"- model `{spec.model}`, dtype {spec.dtype}; corpus `{spec.corpus}` (text sha256 "
        f"`{(meta.get('corpus_sha256') or '?')[:16]}…`), prompts = non-overlapping prefixes 0..{spec.prompts - 1} "
        f"(stride context + T + {spec.gap})",
        f"- contexts {list(spec.contexts)}; supports S {list(spec.supports)}; reuse R {list(spec.reuse)}; "
        f"{'selectors' if several else 'selector'} {', '.join(spec.selectors)} (the same dense references); "
        f"window W = {spec.window}, block B = {spec.block_size}; T = {spec.tokens} greedy tokens",
        *_environment_lines(meta),
        "",
        "Command:",
        "",
        "```sh",
        sweep_command(spec, directory),
        f"sparsedecode report {directory}",
        "```",
        "",
    ]
    if not rows:
        out += ["No runs finished yet.", ""]
        return

    apart = (
        [
            f"{overview['dense_by_construction_runs']} run(s) in {len(dense)} condition(s) have an effective support "
            f"S >= context + T - 1: every step attends to the whole cache, so they equal dense decoding by "
            "construction. They are left out of every number, table and plot below except the table of their own.",
            "",
        ]
        if dense
        else []
    )
    out += [
        "## Findings, in the reference study's terms",
        "",
        f"The reference study (DESIGN.md section 3): {REFERENCE}.",
        "",
        *apart,
        f"- **Survival**: {overview['survived']} of {overview['runs']} runs stayed identical to dense greedy "
        f"decoding for all {spec.tokens} tokens (reference: 0 of 60); median first divergence "
        f"{_fmt(overview['first_divergence_median'])} (runs that never diverge count as {spec.tokens}).",
        f"- **Perplexity**: {tolerance['within']} of the {tolerance['conditions']} conditions with S >= 193 have a "
        f"median |ΔPPL| of at most 5% (reference: 7 of 9); largest ΔPPL of any run "
        f"{_fmt(overview['max_delta_ppl_percent'], 2)}%.",
        f"- **Warning regime**: {overview['warning_runs']} run(s) have teacher-forced match below 70%, from "
        f"{len(overview['warning_runs_prompts'])} (context, prompt) pair(s); "
        f"{overview['warning_runs_above_100_percent']} of them have ΔPPL above 100% (reference: all 7, from two "
        f"prefixes). {overview['runs_above_100_percent']} run(s) in all have ΔPPL above 100%.",
        "",
    ]
    if several:
        selectors = summary.by_selector(rows)
        out += [
            "## Per selector",
            "",
            "All runs of each selector (every context, prompt, support and reuse interval) that take a sparse step, "
            "against the same dense references. Medians over runs; within 5% counts the selector's conditions with "
            "S >= 193 whose median |ΔPPL| is at most 5%.",
            "",
            _markdown_table(
                ["selector", "survived", "median first divergence", "median TF match %", "median ΔPPL %"]
                + ["within 5% (S >= 193)", "TF < 70%"],
                [
                    [
                        f"`{c['selector']}`",
                        f"{c['survived']}/{c['runs']}",
                        _fmt(c["first_divergence_median"], 0),
                        _fmt(c["teacher_forced_match_median"]),
                        f"{c['delta_ppl_percent_median']:+.2f}",
                        f"{c['conditions_within_tolerance']}/{c['conditions_min_support']}",
                        str(c["warning_runs"]),
                    ]
                    for c in selectors
                ],
            ),
            "",
            "CSV: [selectors.csv](selectors.csv)",
            "",
        ]
        write_csv(directory / "selectors.csv", selectors)
    out += [
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
            *([str(c["reuse"])] if len(spec.reuse) > 1 else []),
            *([f"`{c['selector']}`"] if several else []),
            f"{c['survived']}/{c['runs']}",
            _range(c, "first_divergence", 0),
            _range(c, "teacher_forced_match", 1),
            _range(c, "delta_ppl_percent", 2, "+"),
            _fmt(c["abs_delta_ppl_percent_median"], 2),
            str(c["warning_runs"]),
        ]
        for c in conditions
    ]
    header = [
        "context",
        "S",
        *(["R"] if len(spec.reuse) > 1 else []),
        *(["selector"] if several else []),
        "survived",
        "first divergence",
        "TF match %",
        "ΔPPL %",
        "median abs ΔPPL %",
        "TF < 70%",
    ]
    out += [_markdown_table(header, table) if table else "No condition takes a sparse step."]
    if dense:
        out += [
            "",
            "Dense by construction (effective S >= context + T - 1; not counted anywhere else):",
            "",
            _markdown_table(
                ["context", "S", "effective S", *(["R"] if len(spec.reuse) > 1 else [])]
                + [*(["selector"] if several else []), "survived", "ΔPPL %"],
                [
                    [
                        str(c["context"]),
                        str(c["support"]),
                        str(c["effective_support"]),
                        *([str(c["reuse"])] if len(spec.reuse) > 1 else []),
                        *([f"`{c['selector']}`"] if several else []),
                        f"{c['survived']}/{c['runs']}",
                        f"{c['delta_ppl_percent_median']:+.2f}",
                    ]
                    for c in dense
                ],
            ),
        ]
    out += ["", "CSV: [conditions.csv](conditions.csv), all runs: [runs.csv](runs.csv)"]
    write_csv(directory / "conditions.csv", every_condition)
    write_csv(directory / "runs.csv", [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows])

    out += ["", "## Runs with teacher-forced match below 70%", ""]
    if warnings:
        out += [
            _markdown_table(
                ["context", "prompt", "S", "R", *(["selector"] if several else []), "TF match %", "ΔPPL %"]
                + ["first divergence"],
                [
                    [
                        str(w["context"]),
                        str(w["prompt_index"]),
                        str(w["support"]),
                        str(w["reuse"]),
                        *([f"`{w['selector']}`"] if several else []),
                        _fmt(w["teacher_forced_match"]),
                        f"{w['delta_ppl_percent']:+.2f}",
                        str(w["first_divergence"]),
                    ]
                    for w in warnings
                ],
            ),
            "",
            "CSV: [warning_runs.csv](warning_runs.csv)",
        ]
    else:
        out.append("None.")
    write_csv(directory / "warning_runs.csv", warnings)

    if not tested:
        out += ["", "## Plots", "", "None: no run takes a sparse step.", ""]
        return
    title = f"{spec.model}, {spec.corpus}, T = {spec.tokens}"
    plots.match_vs_delta_ppl(tested, directory / "match_vs_delta_ppl.png", title=f"{title}: one dot per run")
    plots.delta_ppl_by_support(tested, directory / "delta_ppl_by_support.png", title=title)
    plots.first_divergence_histogram(tested, directory / "first_divergence.png", title=title)
    out += [
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


def _retrieval_section(directory: Path, data: dict, out: list[str]) -> None:
    from ..experiments.retrieval import accuracy, mass_vs_success
    from . import plots

    spec, trials = data["spec"], data["trials"]
    env = data.get("environment", {})
    out += [
        f"# Passkey retrieval: {spec['model']}",
        "",
        f"- model `{spec['model']}`, dtype {spec['dtype']}; haystack `{spec['haystack']}`; contexts "
        f"{spec['contexts']}; depths {spec['depths']}; {spec['trials']} trial(s) per cell; {spec['digits']}-digit "
        f"passkeys (seed {spec['seed']}); {spec['answer_tokens']} answer tokens; supports {spec['supports']}, "
        f"W = {spec['window']}, B = {spec['block_size']}, R = {spec['reuse']}, selector {spec['selector']}",
        f"- device {env.get('device')}, {env.get('threads')} threads; torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}",
        "- the prompt before the question is prefilled densely; the question is fed token by token under the mode "
        "tested, then the answer is decoded greedily; success = the passkey digits appear in the answer",
    ]
    if data.get("command"):
        out += ["", "```sh", data["command"], "```"]
    table = accuracy(trials)
    write_csv(directory / "retrieval_accuracy.csv", table)
    modes = list(dict.fromkeys(row["mode"] for row in table))
    contexts = sorted({row["context"] for row in table})
    depths = sorted({row["depth"] for row in table})
    cell = {(r["mode"], r["context"], r["depth"]): r for r in table}
    out += ["", "Exact-match accuracy (correct / trials), per context (rows) and depth (columns):", ""]
    for mode in modes:
        out += [
            f"**{mode}**",
            "",
            _markdown_table(
                ["context", *[f"depth {d:g}" for d in depths]],
                [
                    [
                        str(c),
                        *[
                            f"{cell[mode, c, d]['correct']}/{cell[mode, c, d]['trials']}"
                            if (mode, c, d) in cell
                            else "-"
                            for d in depths
                        ],
                    ]
                    for c in contexts
                ],
            ),
            "",
        ]
    import numpy as np

    for mode in modes:
        matrix = np.array(
            [[cell[mode, c, d]["accuracy"] if (mode, c, d) in cell else np.nan for d in depths] for c in contexts]
        )
        name = f"retrieval_{mode.replace('=', '').lower()}.png"
        plots.heatmap(
            matrix,
            directory / name,
            title=f"{spec['model']}: passkey accuracy, {mode}",
            xlabel="depth of the passkey",
            ylabel="context",
            colorbar="exact-match accuracy",
            xticks=[f"{d:g}" for d in depths],
            yticks=[str(c) for c in contexts],
            vmin=0.0,
            vmax=1.0,
            annotate=True,
        )
        out += [f"![retrieval {mode}]({name})", ""]
    out += ["CSV: [retrieval_accuracy.csv](retrieval_accuracy.csv)", ""]

    mass = mass_vs_success(trials)
    write_csv(directory / "mass_vs_retrieval.csv", mass)
    out += [
        "## Captured attention mass vs retrieval",
        "",
        "Per sparse trial, the omitted-mass audit measures the selector's captured-mass ratio (mass of the chosen "
        "blocks over that of the best b blocks by the KV-head group's summed mass, the best a selector sharing one "
        "set per group can reach; mean over the question and answer steps, layers and heads) and the share of "
        "passkey positions inside the support. If captured mass were a retrieval guarantee, "
        "failures would have low captured mass.",
        "",
        _markdown_table(
            [
                "S",
                "trials",
                "accuracy",
                "captured mass (found)",
                "captured mass (missed)",
                "missed with captured >= 0.9",
                "missed where dense found it",
                "needle read (found)",
                "needle read (missed)",
            ],
            [
                [
                    str(m["support"]),
                    str(m["trials"]),
                    _fmt(m["accuracy"], 2),
                    _fmt(m["captured_mass_correct_mean"], 3),
                    _fmt(m["captured_mass_failed_mean"], 3),
                    str(m["failed_with_high_mass"]),
                    str(m["failed_where_dense_succeeded"]),
                    _fmt(m["needle_read_correct_mean"], 3),
                    _fmt(m["needle_read_failed_mean"], 3),
                ]
                for m in mass
            ],
        ),
        "",
        "CSV: [mass_vs_retrieval.csv](mass_vs_retrieval.csv), per trial: [retrieval_trials.csv](retrieval_trials.csv)",
        "",
    ]
    older = sum(
        t.get("captured_mass_ratio_mean") is None and t.get("captured_mass_ratio_per_head_best_mean") is not None
        for t in trials
    )
    if older:
        out += [
            f"{older} trial(s) were audited before captured/best was measured against the KV-head group's best: "
            "their figure, against each query head's own best (which no selector sharing one set per group can "
            "reach), is kept apart as `captured_mass_ratio_per_head_best_mean` in the per-trial CSV and is not "
            "shown above. Rerun the probe for the group figure.",
            "",
        ]
    write_csv(directory / "retrieval_trials.csv", [{k: v for k, v in t.items() if k != "answer_ids"} for t in trials])
    if any(t.get("captured_mass_ratio_mean") is not None for t in trials):
        plots.captured_mass_vs_success(
            trials, directory / "mass_vs_retrieval.png", title=f"{spec['model']}: captured mass vs passkey found"
        )
        out += ["![captured mass vs retrieval](mass_vs_retrieval.png)", ""]


SELECTOR_HEADERS = (
    "context",
    "selector",
    "practical",
    "S",
    "survived",
    "median first div.",
    "median TF match %",
    "median ΔPPL %",
    "certified %",
    "captured / best",
    "passkey found",
    "op ms",
)


def selector_cells(rows: list[dict]) -> list[tuple[str, ...]]:
    """The cells of the selector table (columns :data:`SELECTOR_HEADERS`), one tuple per summary row."""
    return [
        (
            str(r["context"]),
            r["selector"],
            "yes" if r["practical"] else "reference",
            str(r["support"]),
            f"{r['survived']}/{r['runs']}",
            f"{r['median_first_divergence']:g}",
            f"{r['median_teacher_forced_match']:.1f}",
            f"{r['median_delta_ppl_percent']:+.2f}",
            f"{100 * r['certified_fraction']:.1f}",
            "-" if r["captured_mass_ratio"] is None else f"{r['captured_mass_ratio']:.3f}",
            "-" if r["retrieval_correct"] is None else f"{r['retrieval_correct']}/{r['retrieval_trials']}",
            "-" if r["op_ms"] is None else f"{r['op_ms']:.3f}",
        )
        for r in rows
    ]


def dense_retrieval_lines(rows: list[dict]) -> list[str]:
    """The dense baseline of the passkey trials, one sentence per context (nothing when retrieval was off)."""
    dense = {r["context"]: r for r in rows if r["retrieval_trials"]}
    if not dense:
        return []
    found = "; ".join(
        f"{r['dense_retrieval_correct']}/{r['retrieval_trials']} at context {context}" for context, r in dense.items()
    )
    return [f"Dense attention found the passkey in {found} (the same trials).", ""]


def _selectors_command(settings: dict) -> str:
    from ..selectors import selector_names

    selectors = settings["selectors"]
    return (
        f"sparsedecode compare-selectors --model {settings['model']} --context "
        f"{','.join(map(str, settings['context']))} --support {','.join(map(str, settings['support']))} --prompts "
        f"{settings['prompts']} --tokens {settings['tokens']}"
        + ("" if list(selectors) == list(selector_names()) else f" --selectors {','.join(selectors)}")
        + (" --audit" if settings.get("audit") else "")
        + (f" --retrieval {settings['retrieval']}" if settings.get("retrieval") else "")
        + (f" --batch {settings['batch']}" if settings.get("batch", 1) > 1 else "")
    )


def _parts_lines(settings: dict) -> list[str]:
    """Where a merged comparison's selectors ran (``sparsedecode merge`` of comparison folders)."""
    parts = settings.get("parts")
    if not parts:
        return []
    described = "; ".join(
        f"{', '.join(f'`{name}`' for name in part['selectors'])} at revision "
        f"{(part.get('environment') or {}).get('revision')} (batch {part.get('batch', 1)}"
        + (", op ms re-measured" if part.get("op_ms_remeasured") else "")
        + ")"
        for part in parts
    )
    return [
        f"Merged by `sparsedecode merge` from {len(parts)} comparisons of these settings, the same prompts and dense "
        f"references: {described}.",
        "",
    ]


def _table_lines(rows: list[dict]) -> list[str]:
    return [
        "| " + " | ".join(SELECTOR_HEADERS) + " |",
        "|" + "---|" * len(SELECTOR_HEADERS),
        *("| " + " | ".join(cells) + " |" for cells in selector_cells(rows)),
    ]


def _kind(practical: bool | None) -> str:
    return "unknown" if practical is None else "practical" if practical else "reference"


def selector_markdown(data: dict) -> str:
    """``selectors.md`` of a comparison (the JSON document of ``compare-selectors``)."""
    from ..experiments.selector_comparison import ANSWER_TOKENS

    settings, rows = data["settings"], data["summary"]
    env = settings.get("environment") or {}
    sparse = [r for r in rows if not r.get("dense_by_construction")]
    dense = [r for r in rows if r.get("dense_by_construction")]
    out = [
        f"# Selectors under one budget: {settings['model']}",
        "",
        f"Produced by `{_selectors_command(settings)}` ({settings['dtype']}, {env.get('device', 'cpu')}, "
        f"{env.get('threads')} threads, corpus {settings['corpus']}, torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}).",
        "",
        *_parts_lines(settings),
        *(_table_lines(sparse) if sparse else ["No condition takes a sparse step."]),
        "",
    ]
    if dense:
        out += [
            f"Dense by construction (effective S >= context + T - 1, T = {settings['tokens']}): every step attends to "
            "the whole cache, so these rows equal dense decoding and compare nothing:",
            "",
            *_table_lines(dense),
            "",
        ]
    fewer = [r for r in sparse if r.get("support_read_mean") is not None and r["support_read_mean"] < r["support"]]
    if fewer:
        out += [
            "Positions read per KV head and sparse step, where fewer than S on average (an adaptive budget, or a "
            "chosen short last block): "
            + "; ".join(
                f"`{r['selector']}` at S = {r['support']}: mean {r['support_read_mean']:.1f}, min "
                f"{r['support_read_min']}, max {r['support_read_max']}"
                for r in fewer
            )
            + ".",
            "",
        ]
    remeasured = settings.get("op_ms_remeasured")
    if remeasured:
        renv = remeasured.get("environment") or {}
        out += [
            f"The op ms column was re-measured alone by `{remeasured.get('by')}` (torch {renv.get('torch')}, "
            f"{renv.get('threads')} threads, revision {renv.get('revision')}) with the kernel decoding uses "
            "(`kernel=auto`).",
            "",
        ]
    out += [
        *dense_retrieval_lines(rows),
        "What each selector reads per step:",
        "",
        "| selector | kind | reads |",
        "|---|---|---|",
        *(
            f"| `{name}` | {_kind(practical)} | {what} |"
            for name, (practical, what) in {r["selector"]: (r["practical"], r["reads"]) for r in rows}.items()
        ),
        "",
        "Medians over the prompts; first div. = the decode step t >= 1 whose sparse token first differs from dense "
        f"(token 0 comes from the shared dense prefill; {settings['tokens']} = never); ΔPPL is teacher-forced on the "
        "dense continuation; certified = share of teacher-forced steps whose dense margin exceeds twice the logit "
        "error; captured / best = true attention mass on the kept distant positions over the best mass at the same "
        "budget (needs --audit); passkey found = passkey retrieval trials answered correctly (needs --retrieval N: "
        "N passkeys per context at depths spread over the haystack, filler haystack, "
        f"{ANSWER_TOKENS} greedy answer tokens, exact match); op ms = one sparse decode-attention call on synthetic "
        "data of this model's shape (selection + attention), measured in the same process. Few prompts and one "
        "model: this ranks selectors on this setup, it does not establish a general ordering.",
        "",
    ]
    return "\n".join(out)


def write_selector_comparison(directory: Path, data: dict | None = None) -> Path:
    """Write ``selectors.json``, ``selectors.csv`` and ``selectors.md`` into ``directory``; returns the markdown's
    path. Without ``data`` the stored ``selectors.json`` is read and rebuilt with today's code (runs upgraded to
    today's ``first_divergence`` convention, summary recomputed; see
    :func:`~sparsedecode.experiments.selector_comparison.rebuild`)."""
    from ..experiments.comparison_file import read_comparison
    from ..experiments.selector_comparison import rebuild

    directory = Path(directory)
    if data is None:
        data = rebuild(read_comparison(directory))  # checked whole (one line naming what is wrong) first
    rows = data["summary"]
    if not rows:
        raise SparseDecodeError(f"the selector comparison in {directory} has no summary rows")
    table = io.StringIO(newline="")
    writer = csv.writer(table)
    writer.writerow(list(rows[0]))
    writer.writerows(list(row.values()) for row in rows)
    markdown = selector_markdown(data)  # everything is built before the first file is written
    write_json_atomic(directory / SELECTORS_FILE, data)
    write_text_atomic(directory / "selectors.csv", table.getvalue())
    path = directory / "selectors.md"
    write_text_atomic(path, markdown)
    return path


CAVEATS = [
    "Each run is one prompt under one setting, measured on the device and dtype stated above; nothing here measures "
    "speed at matched quality or end-to-end throughput, and the timing fields (names ending in _s) were taken on a "
    "machine that may have been running other work.",
    "The model (the built-in aliases are dequantised 4-bit GGUF weights), corpus and prompts differ from the "
    "reference study's (Qwen2-0.5B, fp16, WikiText-2): agreement or disagreement with it is qualitative, not a "
    "replication of its numbers.",
]
SWEEP_CAVEATS = [
    "Teacher-forced ΔPPL is measured on the dense model's own greedy continuation, not on text the sparse model "
    "produced, nor on held-out human text; a small ΔPPL does not mean free-running output stays close.",
    "A few prompts per condition: medians and ranges are descriptive; there are no confidence intervals, and a "
    "single bad prefix can move a condition.",
    "Greedy decoding only; sampling, batch > 1, other selectors, reuse intervals and window sizes are not covered "
    "unless listed in the conditions.",
    "The 70% teacher-forced-match line is the reference study's observation, used as a warning, not a threshold "
    "with any guarantee.",
]
RETRIEVAL_CAVEATS = [
    "Retrieval: passkey exact match with a few trials per cell on a small model says little about other retrieval "
    "tasks or longer contexts; a model that fails densely tells nothing about the selector.",
    "Captured-mass ratios are averages over steps, layers and heads and can hide the one head that matters; the "
    "relation to success is observed on these trials, not a general law.",
]


def _problem(error: BaseException) -> str:
    """What a malformed input file lacks or holds, in a few words."""
    if isinstance(error, KeyError):
        return f"a field {error.args[0]!r} is missing"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:160]}" if lines else type(error).__name__


def read_retrieval(path: Path) -> dict:
    """The parsed ``retrieval.json`` at ``path``: an object with a ``spec`` object and a list of ``trials`` objects."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise SparseDecodeError(f"cannot read retrieval results {path}: {error.strerror or error}") from error
    except ValueError as error:  # invalid JSON or invalid UTF-8
        raise SparseDecodeError(
            f"{path} is not valid JSON ({_problem(error)}); rerun `sparsedecode retrieval`"
        ) from error
    if not isinstance(data, dict) or not isinstance(data.get("spec"), dict) or not isinstance(data.get("trials"), list):
        raise SparseDecodeError(
            f"{path} is not a retrieval result (expected an object with 'spec' and a list of 'trials'); "
            "rerun `sparsedecode retrieval`"
        )
    if not all(isinstance(trial, dict) for trial in data["trials"]):
        raise SparseDecodeError(f"{path} holds a trial that is not a JSON object; rerun `sparsedecode retrieval`")
    from ..protocol.results import upgrade_audit_fields

    return {**data, "trials": [upgrade_audit_fields(trial) for trial in data["trials"]]}


_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError)
"""What rendering rows that lack a field or hold a value of the wrong type raises."""


def write_report(directory: Path, *, retrieval: Path | None = None) -> Path:
    """Write ``report.md`` (with CSVs and PNGs) into ``directory``; returns its path.

    ``directory`` holds a sweep (``sweep.json``), retrieval results (``retrieval.json``), or both; ``retrieval``
    points at a retrieval result file or folder elsewhere. A folder holding only a selector comparison
    (``selectors.json``) is rendered by :func:`write_selector_comparison` instead (``selectors.md``).
    """
    directory = Path(directory)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is a file, not a results folder"
        raise SparseDecodeError(f"{directory} {what}: give a sweep, retrieval or selector-comparison folder")
    has_sweep = (directory / SPEC_FILE).exists()
    if retrieval is None:
        for candidate in (directory / RETRIEVAL_FILE, directory / "retrieval" / RETRIEVAL_FILE):
            if candidate.exists():
                retrieval = candidate
                break
    elif Path(retrieval).is_dir():
        retrieval = Path(retrieval) / RETRIEVAL_FILE
    if retrieval is not None and not Path(retrieval).exists():
        raise SparseDecodeError(f"retrieval results {retrieval} not found")
    if not has_sweep and retrieval is None and (directory / SELECTORS_FILE).exists():
        return write_selector_comparison(directory)
    if not has_sweep and retrieval is None:
        raise SparseDecodeError(
            f"{directory} holds neither a sweep ({SPEC_FILE}), an evaluation (eval.json), retrieval results "
            f"({RETRIEVAL_FILE}) nor a selector comparison ({SELECTORS_FILE})"
        )
    out: list[str] = []
    if has_sweep:  # read and check every input before writing anything
        meta, rows = load_sweep(directory)
    if retrieval is not None:
        data = read_retrieval(Path(retrieval))
    before = set(directory.iterdir())
    source = directory / RUNS_FILE
    try:
        if has_sweep:
            _sweep_section(directory, meta, rows, out)
        if retrieval is not None:
            source = Path(retrieval)
            _retrieval_section(directory, data, out)
    except Exception as error:
        for path in set(directory.iterdir()) - before:  # the CSVs and plots written so far: nothing half-done
            if path.is_file():
                path.unlink()
        if isinstance(error, SparseDecodeError) or not isinstance(error, _MALFORMED):
            raise
        raise SparseDecodeError(
            f"{source} does not hold what a report needs ({_problem(error)}); was it written by another version "
            "of sparsedecode?"
        ) from error
    caveats = CAVEATS + (SWEEP_CAVEATS if has_sweep else []) + (RETRIEVAL_CAVEATS if retrieval is not None else [])
    out += ["# What these numbers do not establish", "", *[f"- {line}" for line in caveats], ""]
    files = sorted(p.name for p in directory.iterdir() if p.suffix in {".csv", ".png"} or p.name in (RUNS_FILE,))
    out += ["Files: " + ", ".join(f"[{name}]({name})" for name in files), ""]
    path = directory / REPORT_FILE
    write_text_atomic(path, "\n".join(out))
    return path
