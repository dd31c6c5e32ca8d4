"""Plots (matplotlib, headless). Used by the CLI and reports; the library never imports this module."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..files import atomic_path  # noqa: E402


def heatmap(
    matrix: np.ndarray,
    path: Path,
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    colorbar: str,
    xticks: list[str] | None = None,
    yticks: list[str] | None = None,
    vmin: float | None = 0.0,
    vmax: float | None = None,
    cmap: str = "viridis",
    annotate: bool = False,
) -> Path:
    """Write a labelled heat map of a 2-D array to ``path`` (PNG)."""
    rows, cols = matrix.shape
    longest = max(map(len, xticks or ()), default=0)
    slanted = longest > 6  # long column labels would overlap: slant them and make room below
    width = (0.75 if annotate else 0.5) * cols + 2.5
    height = 0.22 * rows + 1.8 + (0.06 * longest if slanted else 0.0)
    fig, ax = plt.subplots(figsize=(max(4.0, width), max(3.0, height)))
    image = ax.imshow(matrix, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    fig.colorbar(image, ax=ax, label=colorbar)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if xticks is not None:
        if slanted:
            ax.set_xticks(range(cols), xticks, rotation=40, ha="right", rotation_mode="anchor")
        else:
            ax.set_xticks(range(cols), xticks)
    if yticks is not None:
        ax.set_yticks(range(rows), yticks)
    if annotate:
        for (r, c), value in np.ndenumerate(matrix):
            bright = np.isfinite(value) and image.norm(value) > 0.6  # dark text on the colour map's light end
            ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=7, color="black" if bright else "white")
    return _save(fig, path)


def _support_colors(supports: list[int]) -> dict[int, tuple]:
    cmap = plt.get_cmap("viridis")
    return {s: cmap(i / max(len(supports) - 1, 1) * 0.9) for i, s in enumerate(sorted(supports))}


def _save(fig, path: Path) -> Path:
    """Write the figure through a temporary file beside ``path`` and a rename: never half a PNG."""
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:  # its suffix picks the format
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
    return path


def _selectors(rows: list[dict]) -> list[str]:
    """The selectors of the rows, in first-seen order."""
    return list(dict.fromkeys(r["selector"] for r in rows))


def match_vs_delta_ppl(rows: list[dict], path: Path, *, title: str, threshold: float = 70.0) -> Path:
    """Teacher-forced match (%) against delta-PPL (%, symlog) per run, coloured by support, with the 70% line.

    Markers tell the contexts apart, or the selectors when the rows hold several (contexts are then pooled).
    """
    colors = _support_colors(sorted({r["support"] for r in rows}))
    several = len(_selectors(rows)) > 1
    kind = "selector" if several else "context"
    values = _selectors(rows) if several else sorted({r["context"] for r in rows})
    markers = dict(zip(values, "osD^v<>p*"))
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for support, value in sorted({(r["support"], r[kind]) for r in rows}, key=lambda k: (k[0], values.index(k[1]))):
        group = [r for r in rows if (r["support"], r[kind]) == (support, value)]
        ax.scatter(
            [r["teacher_forced_match"] for r in group],
            [r["delta_ppl_percent"] for r in group],
            color=colors[support],
            marker=markers.get(value, "x"),
            label=f"S={support}, {value}" if several else f"S={support}, context {value}",
            alpha=0.8,
            edgecolors="none",
        )
    ax.axvline(threshold, color="red", linestyle="--", linewidth=1, label=f"{threshold:.0f}% match")
    ax.axhline(5, color="grey", linestyle=":", linewidth=1, label="ΔPPL = 5%")
    ax.axhline(100, color="grey", linestyle="-.", linewidth=1, label="ΔPPL = 100%")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("teacher-forced match (% of steps)")
    ax.set_ylabel("ΔPPL (%, symlog)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def delta_ppl_by_support(rows: list[dict], path: Path, *, title: str) -> Path:
    """Delta-PPL (%, symlog) against support, one panel per context: every run as a dot, the median as a line.

    With several selectors each gets its own colour, offset and median line.
    """
    contexts = sorted({r["context"] for r in rows})
    selectors = _selectors(rows)
    several = len(selectors) > 1
    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(contexts), figsize=(3.6 * len(contexts) + 0.8, 3.8), sharey=True, squeeze=False)
    for ax, context in zip(axes[0], contexts):
        group = [r for r in rows if r["context"] == context]
        supports = sorted({r["support"] for r in group})
        for number, selector in enumerate(selectors):
            mine = [r for r in group if r["selector"] == selector]
            shift = (number - (len(selectors) - 1) / 2) * 0.6 / len(selectors) if several else 0.0
            color = cmap(number % 10) if several else "tab:blue"
            positions, medians = [], []
            for i, support in enumerate(supports):
                values = [r["delta_ppl_percent"] for r in mine if r["support"] == support]
                if not values:
                    continue
                spread = 0.12 / len(selectors)
                jitter = np.linspace(-spread, spread, len(values)) if len(values) > 1 else [0.0]
                ax.scatter(i + shift + np.asarray(jitter), values, color=color, alpha=0.6, s=18, edgecolors="none")
                positions.append(i + shift)
                medians.append(float(np.median(values)))
            ax.plot(
                positions,
                medians,
                color=color if several else "black",
                marker="_",
                markersize=14,
                linewidth=1,
                label=f"{selector} (median)" if several else "median",
            )
        ax.axhspan(-5, 5, color="green", alpha=0.08, label="within 5%")
        ax.set_xticks(range(len(supports)), [str(s) for s in supports])
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("support S")
        ax.set_title(f"context {context}", fontsize=10)
    axes[0][0].set_ylabel("ΔPPL (%, symlog)")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def first_divergence_histogram(rows: list[dict], path: Path, *, title: str) -> Path:
    """Histogram of first-divergence steps, stacked by support (by selector when the rows hold several).

    ``first_divergence`` as docs/definitions.md, section 3 defines it (1..T-1 for a divergence); runs that never
    diverge (``T``) sit in a last bin of their own.
    """
    tokens = max(r["tokens"] for r in rows)
    selectors = _selectors(rows)
    if len(selectors) > 1:
        cmap = plt.get_cmap("tab10")
        stacks = [[r["first_divergence"] for r in rows if r["selector"] == s] for s in selectors]
        colors, labels = [cmap(i % 10) for i in range(len(selectors))], selectors
    else:
        supports = sorted({r["support"] for r in rows})
        by_support = _support_colors(supports)
        stacks = [[r["first_divergence"] for r in rows if r["support"] == s] for s in supports]
        colors, labels = [by_support[s] for s in supports], [f"S={s}" for s in supports]
    width = max(1, tokens // 32)
    # divergences 1..T-1 in bins of ``width``; survival (T) in a bin of its own, never shared with step T - 1
    bins = np.append(np.arange(0.5, tokens - 0.5, width), [tokens - 0.5, tokens - 0.5 + width])
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.hist(stacks, bins=bins, stacked=True, color=colors, label=labels)
    ax.set_xlabel(f"first divergence (decode step t of the first s_t != d_t; {tokens} = never diverged)")
    ax.set_ylabel("runs")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path)


def captured_mass_vs_success(trials: list[dict], path: Path, *, title: str) -> Path:
    """Retrieval success (jittered 0/1) against the selector's captured-mass ratio, per support."""
    audited = [t for t in trials if t.get("captured_mass_ratio_mean") is not None]
    supports = sorted({t["support"] for t in audited})
    colors = _support_colors(supports)
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    rng = np.random.default_rng(0)
    for support in supports:
        group = [t for t in audited if t["support"] == support]
        y = np.array([float(t["correct"]) for t in group]) + rng.uniform(-0.08, 0.08, len(group))
        ax.scatter([t["captured_mass_ratio_mean"] for t in group], y, color=colors[support], label=f"S={support}")
    ax.set_yticks([0, 1], ["missed", "found"])
    ax.set_xlabel("captured mass / best reachable b blocks (mean over steps, layers, KV groups)", fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path)


def calibration_front(
    trials: list[dict], held: list[dict], path: Path, *, measure: str, label: str, higher: bool, title: str
) -> Path:
    """A calibration's trials, positions read per layer and step against their calibration value of ``measure``
    (axis ``label``; ``higher`` when more is better; feasible ones filled, the cheapest feasible at each cost
    joined: the front), beside the held-out values of the uniform supports and the chosen configuration."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    done = [t for t in trials if t.get("means") and t.get("cost") is not None]
    for feasible, style in ((False, dict(facecolors="none", edgecolors="0.55")), (True, dict(color="C0"))):
        group = [t for t in done if t["feasible"] == feasible]
        legend = "trial, targets met" if feasible else "trial, targets missed"
        ax.scatter([t["cost"] for t in group], [t["means"][measure] for t in group], s=18, label=legend, **style)
    front, best = [], None
    for t in sorted((t for t in done if t["feasible"]), key=lambda t: t["cost"]):
        value = t["means"][measure]
        if best is None or (value > best if higher else value < best):
            best = value
            front.append((t["cost"], value))
    if front:
        ax.plot(*zip(*front), color="C0", linewidth=1)
    for row in held:
        marker, color = ("*", "C3") if row["configuration"] == "calibrated" else ("s", "C2")
        ax.scatter([row["cost"]], [row[measure]["mean"]], marker=marker, s=60, color=color, zorder=3)
        ax.annotate(f"{row['configuration']} (held out)", (row["cost"], row[measure]["mean"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")  # fmt: skip
    ax.set_xlabel("positions read per layer and decode step (mean over layers)")
    ax.set_ylabel(label)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path)


def layer_supports_bars(supports: list[int], path: Path, *, title: str) -> Path:
    """The chosen support of every layer, one bar per layer."""
    fig, ax = plt.subplots(figsize=(max(4.0, 0.22 * len(supports) + 2.0), 3.2))
    ax.bar(range(len(supports)), supports, color="C0")
    ax.set_xlabel("layer")
    ax.set_ylabel("support S (positions)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    return _save(fig, path)
