"""compare-selectors on a tiny random model (no downloads)."""

from __future__ import annotations

import json

from sparsedecode.cli import main


def test_op_time_only_where_the_support_is_sparse(tiny_model_dir, tmp_path, capsys):
    """At S >= context decoding reads everything densely: no sparse call to time (and none is attempted)."""
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "200,300", "--support", "97,250"]
    args += ["--prompts", "1", "--tokens", "3", "--selectors", "streaming,mean-pooled", "--out", str(tmp_path)]
    assert main(args) == 0
    summary = json.loads((tmp_path / "selectors.json").read_text())["summary"]
    timed = {(r["context"], r["selector"], r["support"]): r["op_ms"] for r in summary}
    assert len(timed) == 8
    assert all((ms is not None and ms > 0) == (context > support) for (context, _, support), ms in timed.items())
