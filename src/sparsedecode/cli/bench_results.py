"""What every bench result file holds besides its rows: the machine, when the run started and how long it took, the
selector, and the model as recorded (no absolute path of the machine it ran on)."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

from .conditions import environment
from .display import console, plain
from .outputs import write_json

__all__ = ["recorded_model", "selector_record", "start_clock", "write_result"]


def recorded_model(spec: str) -> str:
    """The model as a result file records it: an alias or hub id as given, a local folder or file by its name only,
    so a committed file names no absolute path of the machine it ran on."""
    path = Path(spec).expanduser()
    return path.name if path.exists() else spec


def start_clock() -> dict:
    """When the command started (UTC, to the second) and its monotonic start, for :func:`write_result`."""
    return {"started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "t0": time.monotonic()}


def selector_record(spec: str) -> dict:
    """The selector of a bench result: its spec, parameters and, for a file, its sha256."""
    from ..selectors import resolve_selector

    return resolve_selector(spec).record()


def write_result(path, clock: dict, *, model=None, **fields) -> None:
    """Write a bench result file: the machine (with ``model``: where its weights lie too), the run itself (when it
    started and how long the whole command took, model loading and prefills included; the rows' timings are
    medians of what is measured, not this), then ``fields``."""
    run = {"started_utc": clock["started_utc"], "wall_s": round(time.monotonic() - clock["t0"], 1)}
    write_json(path, {"machine": environment(model), "run": run, **fields})
    console.print(f"wrote {plain(path)}")
