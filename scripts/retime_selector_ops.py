"""Re-measure the `op ms` column of a `compare-selectors` output folder (selectors.json, .csv, .md) in place.

    python scripts/retime_selector_ops.py docs/selectors/qwen2.5-coder-0.5b-8k [more folders]

The op column is one sparse decode-attention call on synthetic data of the model's shape; it does not depend on
the decoding runs, so it can be re-measured alone: after a fix to how it is measured, or to time every folder on
a quiet machine with the same kernels. Everything else in the folder is left as the CLI wrote it; the markdown
gets a line saying when and how the column was re-measured.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from sparsedecode.experiments.bench import model_shape
from sparsedecode.experiments.environment import environment
from sparsedecode.experiments.selector_comparison import _op_times
from sparsedecode.models import load_model


def retime(folder: Path) -> None:
    data = json.loads((folder / "selectors.json").read_text())
    settings, summary = data["settings"], data["summary"]
    times = _op_times(
        model_shape(load_model(settings["model"])[0].config),
        tuple(settings["context"]),
        tuple(settings["support"]),
        settings["selectors"],
    )
    for row in summary:
        row["op_ms"] = times.get((row["context"], row["selector"], row["support"]))
    env = environment()
    settings["op_ms_remeasured"] = {"by": "scripts/retime_selector_ops.py", "environment": env}
    (folder / "selectors.json").write_text(json.dumps(data, indent=1))
    with open(folder / "selectors.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(list(summary[0]))
        writer.writerows(list(row.values()) for row in summary)
    lines = (folder / "selectors.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| context |"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    op, sel, sup, ctx = (columns.index(c) for c in ("op ms", "selector", "S", "context"))
    end = next((i for i in range(header + 2, len(lines)) if not lines[i].startswith("|")), len(lines))
    for i in range(header + 2, end):
        cells = [c.strip() for c in lines[i].strip("|").split("|")]
        ms = times.get((int(cells[ctx]), cells[sel], int(cells[sup])))
        cells[op] = "-" if ms is None else f"{ms:.3f}"
        lines[i] = "| " + " | ".join(cells) + " |"
    note = (
        f"The op ms column was re-measured alone by `scripts/retime_selector_ops.py` (torch {env['torch']}, "
        f"{env['threads']} threads, revision {env['revision']}) with the kernel decoding uses (`kernel=auto`)."
    )
    if lines[end + 1].startswith("The op ms column was re-measured"):
        lines[end + 1] = note
    else:
        lines[end:end] = ["", note]
    (folder / "selectors.md").write_text("\n".join(lines) + "\n")
    print(f"{folder}: {sum(ms is not None for ms in times.values())} op times")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        retime(Path(path))
