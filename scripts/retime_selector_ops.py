"""Re-measure the `op ms` column of a `compare-selectors` output folder (selectors.json, .csv, .md) in place.

    python scripts/retime_selector_ops.py docs/selectors/qwen2.5-coder-0.5b-8k [more folders]

The op column is one sparse decode-attention call on synthetic data of the model's shape; it does not depend on
the decoding runs, so it can be re-measured alone: after a fix to how it is measured, or to time every folder on
a quiet machine with the same kernels. The folder is then rewritten by `sparsedecode report`'s renderer (the
summary recomputed from the stored runs with today's code); the markdown says when and how the column was
re-measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sparsedecode.experiments.environment import environment
from sparsedecode.experiments.selector_comparison import _op_times, rebuild
from sparsedecode.models.catalog import attention_shape, load_model
from sparsedecode.reports.sweep import write_selector_comparison


def retime(folder: Path) -> None:
    data = json.loads((folder / "selectors.json").read_text())
    settings, summary = data["settings"], data["summary"]
    times = _op_times(
        attention_shape(load_model(settings["model"])[0].config),
        tuple(settings["context"]),
        tuple(settings["support"]),
        settings["selectors"],
    )
    for row in summary:
        row["op_ms"] = times.get((row["context"], row["selector"], row["support"]))
    settings["op_ms_remeasured"] = {"by": "scripts/retime_selector_ops.py", "environment": environment()}
    write_selector_comparison(folder, rebuild(data))  # the markdown says when and how the column was re-measured
    print(f"{folder}: {sum(ms is not None for ms in times.values())} op times")


if __name__ == "__main__":
    folders = sys.argv[1:]
    if not folders or folders[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if folders else 2)
    missing = [f for f in folders if not (Path(f) / "selectors.json").is_file()]
    if missing:
        raise SystemExit(f"not a compare-selectors folder (no selectors.json): {', '.join(missing)}")
    for path in folders:
        retime(Path(path))
