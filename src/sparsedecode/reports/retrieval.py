"""The passkey-retrieval section of ``report.md``: accuracy per context and depth, and captured attention mass
against success.

Renders ``retrieval.json`` (see :mod:`sparsedecode.experiments.retrieval`) as Markdown, writes beside it
``retrieval_accuracy.csv``, ``mass_vs_retrieval.csv``, ``retrieval_trials.csv``, one heat map per mode and, for an
audited probe, the captured-mass plot. :func:`sparsedecode.reports.sweep.write_report` reads and checks the file and
puts this section after the sweep's.
"""

from __future__ import annotations

from pathlib import Path

from .tables import code, format_value, markdown_table, write_csv


def retrieval_section(directory: Path, data: dict) -> list[str]:
    """The section's Markdown lines for the retrieval results ``data``; its CSVs and plots go into ``directory``."""
    spec, trials = data["spec"], data["trials"]
    return [
        *_conditions_lines(spec, data.get("environment", {}), data.get("command")),
        *_accuracy_lines(directory, spec, trials),
        *_mass_lines(directory, spec, trials),
    ]


def _conditions_lines(spec: dict, env: dict, command: str | None) -> list[str]:
    """The title, what the probe ran (model, grid, sparse settings, machine) and the command that reproduces it."""
    lines = [
        f"# Passkey retrieval: {spec['model']}",
        "",
        f"- model {code(spec['model'])}, dtype {spec['dtype']}; haystack {code(spec['haystack'])}; contexts "
        f"{spec['contexts']}; depths {spec['depths']}; {spec['trials']} trial(s) per cell; {spec['digits']}-digit "
        f"passkeys (seed {spec['seed']}); {spec['answer_tokens']} answer tokens; supports {spec['supports']}, "
        f"W = {spec['window']}, B = {spec['block_size']}, R = {spec['reuse']}, selector {spec['selector']}",
        f"- device {env.get('device')}, {env.get('threads')} threads; torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}",
        "- the prompt before the question is prefilled densely; the question is fed token by token under the mode "
        "tested, then the answer is decoded greedily; success = the passkey appears in the answer as a whole number "
        "(not inside a longer run of digits)",
    ]
    if command:
        lines += ["", "```sh", command, "```"]
    return lines


def _accuracy_lines(directory: Path, spec: dict, trials: list[dict]) -> list[str]:
    """Exact-match accuracy per mode as a context x depth table and a heat map (``retrieval_<mode>.png``), with
    ``retrieval_accuracy.csv``."""
    import numpy as np

    from ..experiments.retrieval import accuracy
    from . import plots

    table = accuracy(trials)
    write_csv(directory / "retrieval_accuracy.csv", table)
    modes = list(dict.fromkeys(row["mode"] for row in table))
    contexts = sorted({row["context"] for row in table})
    depths = sorted({row["depth"] for row in table})
    cell = {(r["mode"], r["context"], r["depth"]): r for r in table}
    lines = ["", "Exact-match accuracy (correct / trials), per context (rows) and depth (columns):", ""]
    for mode in modes:
        rows = [
            [
                str(c),
                *[_cell(cell[mode, c, d]) if (mode, c, d) in cell else "-" for d in depths],
            ]
            for c in contexts
        ]
        lines += [f"**{mode}**", "", markdown_table(["context", *[f"depth {d:g}" for d in depths]], rows), ""]
    if any(row["dense_by_construction"] for row in table):
        lines += [
            "(dense): every trial of the cell was dense by construction (its question and answer fit the support), "
            "a dense result; left out of the table below.",
            "",
        ]
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
        lines += [f"![retrieval {mode}]({name})", ""]
    return lines + ["CSV: [retrieval_accuracy.csv](retrieval_accuracy.csv)", ""]


MASS_HEADER = [
    "S",
    "trials",
    "accuracy",
    "captured mass (found)",
    "captured mass (missed)",
    "missed with captured >= 0.9",
    "missed where dense found it",
    "needle read (found)",
    "needle read (missed)",
]
"""The columns of the captured-mass table, one row per support."""


def _cell(row: dict) -> str:
    return f"{row['correct']}/{row['trials']}" + (" (dense)" if row["dense_by_construction"] else "")


def _mass_lines(directory: Path, spec: dict, trials: list[dict]) -> list[str]:
    """Whether the trials that missed the passkey had captured less attention mass (``mass_vs_retrieval.csv``, the
    per-trial ``retrieval_trials.csv`` and, for an audited probe, ``mass_vs_retrieval.png``)."""
    from ..experiments.retrieval import dense_by_construction, mass_vs_success
    from . import plots

    mass = mass_vs_success(trials)
    write_csv(directory / "mass_vs_retrieval.csv", mass)
    rows = [
        [
            str(m["support"]),
            str(m["trials"]),
            format_value(m["accuracy"], 2),
            format_value(m["captured_mass_correct_mean"], 3),
            format_value(m["captured_mass_failed_mean"], 3),
            str(m["failed_with_high_mass"]),
            str(m["failed_where_dense_succeeded"]),
            format_value(m["needle_read_correct_mean"], 3),
            format_value(m["needle_read_failed_mean"], 3),
        ]
        for m in mass
    ]
    lines = [
        "## Captured attention mass vs retrieval",
        "",
        "Per sparse trial, the omitted-mass audit measures the selector's captured-mass ratio (mass of the chosen "
        "blocks over that of the best b blocks by the KV-head group's summed mass, the best a selector sharing one "
        "set per group can reach; mean over the question and answer steps, layers and heads) and the share of "
        "passkey positions inside the support. If captured mass were a retrieval guarantee, "
        "failures would have low captured mass.",
        "",
        markdown_table(MASS_HEADER, rows),
        "",
        "CSV: [mass_vs_retrieval.csv](mass_vs_retrieval.csv), per trial: [retrieval_trials.csv](retrieval_trials.csv)",
        "",
    ]
    left_out = sum(dense_by_construction(t) for t in trials)
    if left_out:
        lines += [f"{left_out} sparse trial(s) dense by construction (no sparse step) are left out of this table.", ""]
    older = sum(
        t.get("captured_mass_ratio_mean") is None and t.get("captured_mass_ratio_per_head_best_mean") is not None
        for t in trials
    )
    if older:
        lines += [
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
        lines += ["![captured mass vs retrieval](mass_vs_retrieval.png)", ""]
    return lines
