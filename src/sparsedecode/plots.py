"""Plots (matplotlib, headless). Used by the CLI and reports; the library never imports this module."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


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
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * cols + 2.5), max(3.0, 0.22 * rows + 1.8)))
    image = ax.imshow(matrix, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    fig.colorbar(image, ax=ax, label=colorbar)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if xticks is not None:
        ax.set_xticks(range(cols), xticks)
    if yticks is not None:
        ax.set_yticks(range(rows), yticks)
    if annotate:
        for (r, c), value in np.ndenumerate(matrix):
            ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=7, color="white")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
