"""What a command shows while it runs: the console, progress bars, one line per finished row and the per-layer table."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

__all__ = ["console", "layer_table", "plain", "progress_bars", "progress_lines", "run_hooks"]

console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)


def plain(value) -> str:
    """``value`` (a path, a model or selector name the user gave) as console text that shows as written: a ``[`` in
    it is not taken for rich markup (``[/]`` in a path raised an error, ``[red]`` vanished)."""
    return escape(str(value))


def run_hooks(progress, out, row_line):
    """``(on_start, on_row)`` for a resumable run into ``out`` (sweep, eval): say what a resume finds, print one line
    per finished row with ``row_line(row)``, and move the ``runs`` bar of ``progress``."""

    def started(done: int, total: int) -> None:
        if done:
            console.print(f"resuming {plain(out)}: {done} of {total} runs already done")
        progress("runs", done, total)

    def finished(row: dict, done: int, total: int) -> None:
        console.print(row_line(row))
        progress("runs", done, total)

    return started, finished


@contextlib.contextmanager
def progress_bars(speed_estimate_period: float = 30.0, *, piped_lines: bool | tuple[str, ...] = False) -> Iterator:
    """A ``progress(stage, done, total, note="")`` callback drawing one rich bar per stage (``note`` after it).

    The ETA of a bar comes from its progress over the last ``speed_estimate_period`` seconds. Where the console is
    not a terminal rich draws nothing; ``piped_lines``: then one line on stderr per stage begun and ended
    (:func:`progress_lines`), of the stages it names if it is a tuple (the outer ones of many short runs).
    """
    if piped_lines and not console.is_terminal:
        lines = progress_lines(sys.stderr)
        if piped_lines is True:
            yield lines
        else:
            yield lambda stage, *rest, **note: lines(stage, *rest, **note) if stage in piped_lines else None
        return
    bars = Progress(
        TextColumn("{task.description:>16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
        console=console,
        transient=True,
        speed_estimate_period=speed_estimate_period,
    )
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int, note: str = "") -> None:
        if stage not in tasks:
            tasks[stage] = bars.add_task(stage, total=total, completed=done, note=note)  # work done before: no speed
        bars.update(tasks[stage], completed=done, total=total, note=note)
        if done >= total:
            bars.remove_task(tasks.pop(stage))

    with bars:
        yield update


HEARTBEAT_S = 30.0
"""Off a terminal, a stage still under way says where it is at most this often."""


def progress_lines(out) -> Callable[..., None]:
    """A ``progress(stage, done, total, note="")`` callback writing one line to ``out`` when a stage begins and one
    when it ends, with its seconds, and between them where it is after each :data:`HEARTBEAT_S` seconds (for output
    that is not a terminal: a log, a pipe)."""
    import time

    begun: dict[str, float] = {}
    said: dict[str, float] = {}

    def update(stage: str, done: int, total: int, note: str = "") -> None:
        now = time.perf_counter()
        if stage not in begun:
            begun[stage] = said[stage] = now
            print(f"{stage}: {done}/{total} ...", file=out, flush=True)
        if done >= total:
            seconds = now - begun.pop(stage)
            said.pop(stage)
            print(f"{stage}: {total}/{total} in {seconds:.1f} s{' ' + note if note else ''}", file=out, flush=True)
        elif now - said[stage] >= HEARTBEAT_S:
            said[stage] = now
            print(f"{stage}: {done}/{total} after {now - begun[stage]:.0f} s ...", file=out, flush=True)

    return update


def layer_table(title: str, summary: dict) -> Table:
    """The per-layer audit table of ``run`` and ``probe mass``: omitted mass, where the mass lies, recall, bounds."""
    table = Table(title=title, title_justify="left")
    columns = (
        "layer",
        "omitted ε",
        "anchor",
        "window",
        "blocks",
        "recall",
        "captured/best",
        "max |residual|",
        "bound viol.",
    )
    for name in columns:
        table.add_column(name, justify="right")
    for row in summary["layers"]:
        table.add_row(
            str(row["layer"]),
            f"{row['omitted_mass_mean']:.4f}",
            f"{row['mass_anchor_mean']:.3f}",
            f"{row['mass_window_mean']:.3f}",
            f"{row['mass_blocks_mean']:.3f}",
            f"{row['selector_recall_mean']:.3f}",
            f"{row['captured_mass_ratio_mean']:.3f}",
            f"{row['identity_residual_max']:.1e}",
            str(row["bound_violations"]),
        )
    return table
