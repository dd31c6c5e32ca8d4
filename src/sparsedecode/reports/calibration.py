"""``calibration.md``: what ``sparsedecode calibrate`` searched, what it chose and how that held on held-out
prompts beside each uniform support."""

from __future__ import annotations

from pathlib import Path

from ..experiments.calibration_targets import MEASURES
from .tables import markdown_table, write_csv

LABELS = {
    "tf-match": "TF match %",
    "dppl": "ΔPPL %",
    "task-accuracy": "task accuracy %",
    "length-ratio": "answer length, sparse / dense",
}
"""Each measure's column heading and axis label."""


def _interval(value: dict, digits: int = 1) -> str:
    return f"{value['mean']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]"


def measured(row: dict) -> list[str]:
    """The measures a held-out row holds, in :data:`MEASURES` order."""
    return [name for name in MEASURES if name in row]


def cells(row: dict) -> list[str]:
    """A held-out row's measures as ``value [low, high]`` (and dense's value where a target reads it)."""
    out = []
    for name in measured(row):
        text = _interval(row[name], 3 if name == "length-ratio" else 1)
        if f"dense {name}" in row:
            text += f" (dense {row[f'dense {name}']:.1f})"
        out.append(text)
    return out


def write_calibration_report(directory: Path, data: dict) -> str:
    """``trials.csv``, ``front.png`` (trials against the first target's measure), ``supports.png`` (the chosen
    support per layer) in ``directory``; returns the Markdown of :func:`calibration_markdown` that shows them."""
    from .plots import calibration_front, layer_supports_bars

    settings = data["settings"]
    write_csv(directory / "trials.csv", [{k: v for k, v in t.items() if k != "means"} | (t["means"] or {})
                                         for t in data["trials"]])  # fmt: skip
    measure = next(name for name in MEASURES if settings["targets"][0].startswith(name + MEASURES[name].op))
    title = f"{settings['model']}, {settings['selector']}, context {settings['context']}"
    calibration_front(data["trials"], data["held_out"], directory / "front.png", measure=measure,
                      label=LABELS[measure], higher=MEASURES[measure].op == ">=", title=title)  # fmt: skip
    if data["chosen"] is not None:
        layer_supports_bars(data["chosen"], directory / "supports.png", title=f"chosen supports: {title}")
    else:  # nothing chosen: an earlier search's plot is not this one's
        (directory / "supports.png").unlink(missing_ok=True)
    return calibration_markdown(data)


def calibration_markdown(data: dict) -> str:
    """The report of one ``calibration.json`` document."""
    settings, trials, chosen = data["settings"], data["trials"], data["chosen"]
    feasible = [t for t in trials if t["feasible"]]
    pruned = sum(t["state"] == "pruned" for t in trials)
    held = data["held_out"]
    calibration = _units(held[0]["prompts"] and settings["prompts"], held[0].get("samples") and settings["prompts"],
                         settings.get("tasks", []))  # fmt: skip
    lines = [
        f"# Calibration: {settings['model']}, {settings['selector']}",
        "",
        f"Targets {', '.join(f'`{t}`' for t in settings['targets'])} on {calibration} (context "
        f"{settings['context']}, {settings['tokens']} tokens per prompt, corpus {settings['corpus']}); each of the "
        f"{settings['layers']} layers took a support among "
        f"{', '.join(map(str, settings['choices']))}{_reuse_note(settings)}. {len(trials)} trials ({pruned} "
        f"stopped early as hopeless), {len(feasible)} met every target.",
        "",
    ]
    if chosen is None:
        lines += ["No configuration met the targets on the calibration units: no budget was written.", ""]
    else:
        cheapest = min(feasible, key=lambda t: t["cost"])
        lines += [
            f"Chosen (the cheapest that met them, {cheapest['cost']:.1f} positions read per layer and step): "
            f"supports by layer `{','.join(map(str, chosen))}`"
            + (f", at reuse R = {data['chosen_reuse']}" if "chosen_reuse" in data else "")
            + (f", with the selector `{data['chosen_selector']}`" if data.get("chosen_selector") else "")
            + ", in `budget.json` (`--budget budget.json` sets them all).",
            "",
            "![chosen supports per layer](supports.png)",
            "",
        ]
    lines += [
        "Every trial (`trials.csv`), the cost against the first target's measure on the calibration units; the "
        "held-out values of the chosen and uniform configurations marked:",
        "",
        "![trials](front.png)",
        "",
    ]
    tasks = held[0].get("samples") and held[0]["samples"] // max(1, len(settings.get("tasks", [])))
    lines += [
        f"## Held out: {_units(held[0]['prompts'], tasks, settings.get('tasks', []))} the search never saw"
        + _held_out_span(settings),
        "",
        "Values with 95% bootstrap intervals over the units (few units: wide intervals); task accuracy is the mean "
        "RULER score, the answer length the ratio of sparse to dense generated tokens summed over the samples.",
        "",
    ]
    bound = "targets_met_at_bound" in held[0]  # a search judged at the bound: its standard, beside the mean's
    headers = ["configuration", "positions read", *(LABELS[m] for m in measured(held[0])), *held[0]["targets_met"]]
    headers += [f"{name} at the bound" for name in held[0]["targets_met_at_bound"]] if bound else []
    rows = [
        [r["configuration"], f"{r['cost']:.1f}", *cells(r),
         *("yes" if ok else "no" for ok in [*r["targets_met"].values(), *r.get("targets_met_at_bound", {}).values()])]
        for r in held
    ]  # fmt: skip
    lines.append(markdown_table(headers, rows))
    return "\n".join(lines) + "\n"


def _held_out_span(settings: dict) -> str:
    """`` (indices 47-81)``: which held-out units, where they do not follow the calibration ones."""
    if settings.get("split") == "random" and (settings.get("prompt_indices") or {}).get("held_out"):
        return (f" (corpus prompts drawn at random, seed {settings['seed']}, disjoint from the calibration ones: "
                "their indices are in `calibration.json`)")  # fmt: skip
    first = settings.get("held_out_from", settings["prompts"])
    return "" if first == settings["prompts"] else f" (indices {first}-{first + settings['held_out'] - 1})"


def _units(prompts: int, samples_per_task: int, tasks: list[str]) -> str:
    """``4 prompts`` / ``4 samples of each of vt, cwe`` / both."""
    parts = [f"{prompts} prompts"] if prompts else []
    if samples_per_task:
        parts.append(f"{samples_per_task} samples of each of the tasks {', '.join(tasks)}")
    return " and ".join(parts)


def _reuse_note(settings: dict) -> str:
    notes = []
    if settings.get("reuses"):
        notes.append(f", and the trial a reuse interval R among {', '.join(map(str, settings['reuses']))} (its cost "
                     "then adds the block statistics a selection reads, in positions of two vectors, at one step in "
                     "R)")  # fmt: skip
    for name, values in (settings.get("params") or {}).items():
        notes.append(f", and the selector's `{name}` among {', '.join(map(str, values))}")
    if settings.get("feasible") == "bound":
        notes.append("; a trial met a target when the safe end of its 95% bootstrap interval over the calibration "
                     "units did")  # fmt: skip
    return "".join(notes)
