"""What ``report``, a resume and ``merge`` do with rows a sweep folder should not hold (hand-edited: a run listed
twice, a run outside the grid), a report that fails halfway, and how the tables show medians of steps."""

from __future__ import annotations

import json
import shutil

import pytest
from test_bad_input import one_line_exit_2

from sparsedecode.cli import main
from sparsedecode.experiments.summary import dense_by_construction
from sparsedecode.reports.tables import format_range, format_value


@pytest.fixture(scope="module")
def swept(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("swept") / "sweep"
    args = ["sweep", "--model", str(tiny_model_dir), "--context", "200", "--support", "97,129", "--prompts", "2"]
    assert main([*args, "--tokens", "8", "--out", str(out)]) == 0
    return out, args


def _copy(swept, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(swept[0], folder)
    return folder


def test_a_run_listed_twice_is_refused_by_report_resume_and_merge(swept, tmp_path, capsys):
    folder = _copy(swept, tmp_path)
    runs = folder / "runs.jsonl"
    runs.write_text(runs.read_text() + runs.read_text().splitlines(keepends=True)[0])
    capsys.readouterr()
    assert "twice" in one_line_exit_2(["report", str(folder)], capsys)
    assert not (folder / "report.md").exists()
    assert "twice" in one_line_exit_2([*swept[1], "--tokens", "8", "--out", str(folder)], capsys)
    assert "twice" in one_line_exit_2(["merge", str(folder), "--out", str(tmp_path / "merged")], capsys)


def test_an_evaluation_run_listed_twice_is_refused(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    args = ["eval", "--model", str(tiny_model_dir), "--tasks", "vt", "--context", "600", "--samples", "1"]
    args += ["--support", "97", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    runs = out / "runs.jsonl"
    runs.write_text(runs.read_text() + runs.read_text().splitlines(keepends=True)[0])
    capsys.readouterr()
    assert "twice" in one_line_exit_2(["report", str(out)], capsys)
    assert "twice" in one_line_exit_2(args, capsys)


def test_a_run_outside_the_grid_is_refused_by_report(swept, tmp_path, capsys):
    folder = _copy(swept, tmp_path)
    runs = folder / "runs.jsonl"
    row = json.loads(runs.read_text().splitlines()[0])
    row["support"] = row["effective_support"] = 113
    runs.write_text(runs.read_text() + json.dumps(row) + "\n")
    capsys.readouterr()
    assert "not part of its sweep spec" in one_line_exit_2(["report", str(folder)], capsys)


def test_a_report_that_fails_leaves_the_earlier_report_as_it_was(swept, tmp_path, capsys):
    """The sweep's tables are written before the retrieval section is rendered: a retrieval trial lacking a field
    fails the report after them, and every file is as the earlier report left it."""
    folder = _copy(swept, tmp_path)
    assert main(["report", str(folder)]) == 0
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    runs = folder / "runs.jsonl"
    runs.write_text("".join(runs.read_text().splitlines(keepends=True)[:2]))  # fewer runs: other tables
    trial = {"context": 200, "depth": 0.5, "trial": 0, "mode": "dense", "selector": None, "support": None}
    (folder / "retrieval.json").write_text(json.dumps({"spec": {}, "trials": [trial]}))
    capsys.readouterr()
    one_line_exit_2(["report", str(folder)], capsys)
    after = {p.name: p.read_bytes() for p in folder.iterdir() if p.name not in ("runs.jsonl", "retrieval.json")}
    assert after == {name: data for name, data in before.items() if name != "runs.jsonl"}


def test_medians_of_steps_keep_their_half():
    """A median of an even number of first divergences may end in .5: shown as it is, not rounded to even."""
    entry = {"first_divergence_median": 11.5, "first_divergence_min": 2, "first_divergence_max": 27}
    assert format_range(entry, "first_divergence", None) == "11.5 [2, 27]"
    assert format_value(2.5, None) == "2.5" and format_value(12.0, None) == "12"


def test_a_run_without_a_sparse_step_is_dense_by_construction():
    """Every layer kept dense (--dense-layers, --layer-supports): nothing sparse was tested, whatever S is."""
    row = {"context": 256, "tokens": 32, "support": 97, "effective_support": 97}
    assert not dense_by_construction({**row, "sparse_steps": 31})
    assert dense_by_construction({**row, "sparse_steps": 0})


def test_a_run_with_a_sparse_layer_is_not_dense_by_construction():
    """S covers context + T - 1, but a layer of a smaller support (--layer-supports 1:97) read sparsely: the run
    was tested (its tokens may differ from dense), so it counts."""
    row = {"context": 300, "tokens": 8, "support": 401, "effective_support": 401, "layer_supports": [[1, 97]]}
    assert not dense_by_construction({**row, "sparse_steps": 7})
    assert dense_by_construction({**row, "support": 97, "effective_support": 97, "sparse_steps": 0})
