"""``calibration.md``: what ``sparsedecode calibrate`` searched, what it chose and how that held on held-out
prompts beside each uniform support."""

from __future__ import annotations

from pathlib import Path

from .tables import markdown_table, write_csv


def _interval(value: dict) -> str:
    return f"{value['mean']:.1f} [{value['low']:.1f}, {value['high']:.1f}]"


def write_calibration_report(directory: Path, data: dict) -> str:
    """``trials.csv``, ``front.png`` (trials against the first target's measure), ``supports.png`` (the chosen
    support per layer) in ``directory``; returns the Markdown of :func:`calibration_markdown` that shows them."""
    from .plots import calibration_front, layer_supports_bars

    settings = data["settings"]
    write_csv(directory / "trials.csv", [{k: v for k, v in t.items() if k != "means"} | (t["means"] or {})
                                         for t in data["trials"]])  # fmt: skip
    measure = settings["targets"][0].split(">=")[0].split("<=")[0]
    title = f"{settings['model']}, {settings['selector']}, context {settings['context']}"
    calibration_front(data["trials"], data["held_out"], directory / "front.png", measure=measure, title=title)
    if data["chosen"] is not None:
        layer_supports_bars(data["chosen"], directory / "supports.png", title=f"chosen supports: {title}")
    return calibration_markdown(data)


def calibration_markdown(data: dict) -> str:
    """The report of one ``calibration.json`` document."""
    settings, trials, chosen = data["settings"], data["trials"], data["chosen"]
    feasible = [t for t in trials if t["feasible"]]
    pruned = sum(t["state"] == "pruned" for t in trials)
    lines = [
        f"# Calibration: {settings['model']}, {settings['selector']}",
        "",
        f"Targets {', '.join(f'`{t}`' for t in settings['targets'])} on the mean over {settings['prompts']} "
        f"calibration prompts (context {settings['context']}, {settings['tokens']} tokens, corpus "
        f"{settings['corpus']}); each of the {settings['layers']} layers took a support among "
        f"{', '.join(map(str, settings['choices']))}. {len(trials)} trials ({pruned} stopped early as hopeless), "
        f"{len(feasible)} met every target.",
        "",
    ]
    if chosen is None:
        lines += ["No configuration met the targets on the calibration prompts: no budget was written.", ""]
    else:
        cheapest = min(feasible, key=lambda t: t["cost"])
        lines += [
            f"Chosen (the cheapest that met them, {cheapest['cost']:.1f} positions read per layer and step): "
            f"supports by layer `{','.join(map(str, chosen))}`, in `budget.json` (`--budget budget.json`).",
            "",
            "![chosen supports per layer](supports.png)",
            "",
        ]
    lines += [
        "Every trial (`trials.csv`), the cost against the first target's measure on the calibration prompts; the "
        "held-out means of the chosen and uniform configurations marked:",
        "",
        "![trials](front.png)",
        "",
    ]
    held = data["held_out"]
    lines += [
        f"## Held out: {held[0]['prompts']} prompts the search never saw",
        "",
        "Means with 95% bootstrap intervals over the prompts (few prompts: wide intervals).",
        "",
    ]
    headers = ["configuration", "positions read", "TF match %", "ΔPPL %", *held[0]["targets_met"]]
    rows = [
        [r["configuration"], f"{r['cost']:.1f}", _interval(r["tf-match"]), _interval(r["dppl"]),
         *("yes" if ok else "no" for ok in r["targets_met"].values())]
        for r in held
    ]  # fmt: skip
    lines.append(markdown_table(headers, rows))
    return "\n".join(lines) + "\n"
