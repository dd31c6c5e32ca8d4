"""Units of work that another process, or another machine, may run: what ``--backend ray`` distributes.

A sweep, an evaluation and a selector comparison are lists of *units*, each one dense reference and the runs paired
with it: a (context, prompt) group of a sweep (:class:`~.sweep.GroupUnit`), a sample of an evaluation
(:class:`~.evaluate.SampleUnit`), a prompt or a passkey trial of a selector comparison. A unit carries everything it
needs except the model (its prompt is cut by the process that made it, so a worker needs no corpus), runs with
``unit.run(model, tokenizer)``, returns its rows and writes nothing; ``str(unit)`` names it in messages.

An :class:`Executor` runs units elsewhere and hands each unit's rows back, in any order, to the one process that
writes them, so resuming, the settings check and the folder lock work as they do in one process. The library only
defines this protocol and never imports a scheduler; the Ray executor lives in the command-line layer
(:mod:`sparsedecode.cli.ray_backend`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..decoding.loop import Progress

RowCallback = Callable[[dict], None]


class Unit(Protocol):
    """One dense reference and the runs paired with it; ``str(unit)`` names it (``"context 2048, prompt 3"``)."""

    def run(
        self, model, tokenizer, *, progress: Progress | None = None, on_row: RowCallback | None = None
    ) -> list[dict]:
        """The unit's rows, in order; ``on_row(row)`` sees each as soon as it is made. Writes nothing."""
        ...


class Executor(Protocol):
    """Runs units somewhere else (worker processes, other machines)."""

    description: dict
    """Where and how the units run (backend, nodes, workers, threads per worker): kept with the session."""

    def run(self, units: Iterable[Unit], total: int) -> Iterator[tuple[Unit, list[dict]]]:
        """Run the ``total`` units of ``units`` (taken lazily, as workers free up); yield each unit (the object
        passed in) with its rows as soon as it finishes, in any order. Raises
        :class:`~sparsedecode.errors.SparseDecodeError` naming the unit when one cannot be completed."""
        ...
