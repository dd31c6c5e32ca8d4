"""Task accuracy under sparse decoding on tiny models: full support equals dense, kill and resume, shards, merge,
refusals, and the report of an evaluation folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import char_tokenizer, tiny_model

from sparsedecode import SparseDecodeError
from sparsedecode.experiments.evaluate import (
    DENSE,
    RUNS_FILE,
    SPEC_FILE,
    EvalSpec,
    key_of,
    load_eval,
    merge_evals,
    run_eval,
)
from sparsedecode.experiments.ruler import GENERATOR_VERSION, TASK_NAMES
from sparsedecode.experiments.sweep import Shard, locked, parse_rows, without_timings

TWO_TASKS = ("niah_single_noise", "vt")


def one_layer():
    """Decode steps here are one per question token (about 150 with the char tokenizer): one layer keeps it quick."""
    return tiny_model("llama", layers=1, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def loaded():
    return one_layer(), char_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-one-layer")
    one_layer().save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def small_spec(**overrides) -> EvalSpec:
    settings = dict(
        model="tiny",
        tasks=("niah_single_noise",),
        contexts=(600,),
        samples=2,
        selectors=("mean-pooled", "streaming"),
        supports=(97,),
        answer_tokens=4,
    )
    settings.update(overrides)
    return EvalSpec(**settings)


def rows_of(directory: Path) -> list[dict]:
    return parse_rows(directory / RUNS_FILE)


def stripped(rows: list[dict]) -> list[dict]:
    return [without_timings(row) for row in rows]


def test_full_support_equals_dense_on_every_task(tmp_path):
    model = tiny_model("qwen2", layers=1, max_position_embeddings=4096)
    spec = EvalSpec(model="tiny", contexts=(2000,), samples=1, supports=(4096,), answer_tokens=3)  # cwe needs 2000
    outcome = run_eval(spec, tmp_path / "e", loaded=(model, char_tokenizer()))
    rows = rows_of(tmp_path / "e")
    assert outcome.complete and [key_of(r) for r in rows] == spec.keys() and len(rows) == 2 * len(TASK_NAMES)
    dense = {r["task"]: r for r in rows if r["selector"] == DENSE}
    assert set(dense) == set(TASK_NAMES)
    for row in rows:
        d = dense[row["task"]]
        assert 0.99 * 2000 <= row["prompt_tokens"] <= 2000 and row["prompt_sha256"] == d["prompt_sha256"]
        if row["selector"] != DENSE:
            assert row["output_ids"] == d["output_ids"] and row["score"] == d["score"] and row["same_as_dense"]
            assert row["sparse_steps"] == 0 and row["dense_fallback_steps"] > 0 and row["dense_score"] == d["score"]


def test_rows_pair_with_dense_and_a_torn_last_line_is_redone(loaded, tmp_path):
    spec = small_spec()
    outcome = run_eval(spec, tmp_path / "ref", loaded=loaded)
    assert outcome.ran == outcome.total == 2 * 3
    rows = rows_of(tmp_path / "ref")
    assert [key_of(r) for r in rows] == spec.keys()
    for row in rows:
        assert {"answers", "output", "output_ids", "score", "correct", "prompt_format", "run_s"} <= set(row)
        assert row["prompt_format"] == "plain" and len(row["output_ids"]) <= 4
        if row["selector"] != DENSE:
            dense = next(r for r in rows if key_of(r) == (*key_of(row)[:3], DENSE, None))
            assert row["same_as_dense"] == (row["output_ids"] == dense["output_ids"])
            assert row["dense_score"] == dense["score"]
            assert row["sparse_steps"] == row["question_tokens"] + len(row["output_ids"]) - (row["stop"] == "length")
    assert any(not r["same_as_dense"] for r in rows if r["selector"] != DENSE), "S=97 should depart somewhere"
    meta = json.loads((tmp_path / "ref" / SPEC_FILE).read_text())
    assert (
        EvalSpec.from_dict(meta["spec"]) == spec
        and meta["corpus_sha256"]
        and meta["generator_version"] == GENERATOR_VERSION
    )
    killed = tmp_path / "killed"
    killed.mkdir()
    shutil.copy(tmp_path / "ref" / SPEC_FILE, killed / SPEC_FILE)
    lines = (tmp_path / "ref" / RUNS_FILE).read_bytes().splitlines(keepends=True)
    (killed / RUNS_FILE).write_bytes(b"".join(lines[:2]) + lines[2][:50])  # mid-sample, a write cut by SIGKILL
    outcome = run_eval(spec, killed, loaded=loaded)
    assert (outcome.done_before, outcome.ran) == (2, 4)
    assert stripped(rows_of(killed)) == stripped(rows), "the rerun gives the same rows, timings aside"


def test_sigkill_then_rerun_equals_an_uninterrupted_run(model_dir, tmp_path):
    from sparsedecode import load_model

    spec = small_spec(model=str(model_dir), selectors=("mean-pooled",), answer_tokens=6)
    script = (
        "import sys; from sparsedecode.experiments.evaluate import EvalSpec, run_eval; import json; "
        "run_eval(EvalSpec.from_dict(json.loads(sys.argv[1])), sys.argv[2])"
    )
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(spec.to_dict()), str(killed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    runs = killed / RUNS_FILE
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if runs.exists() and runs.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = len(rows_of(killed))
    total = len(spec.keys())
    assert 2 <= before < total, f"the kill should land mid-run ({before} of {total} rows)"
    loaded = load_model(str(model_dir))
    assert run_eval(spec, killed, loaded=loaded).done_before == before
    run_eval(spec, tmp_path / "whole", loaded=loaded)
    resumed = rows_of(killed)
    assert len({key_of(r) for r in resumed}) == len(resumed) == total, "no row duplicated or missing"
    assert stripped(resumed) == stripped(rows_of(tmp_path / "whole"))


def test_changed_settings_shard_and_concurrent_writer_are_refused(loaded, tmp_path):
    spec = small_spec(samples=1, selectors=("mean-pooled",))
    run_eval(spec, tmp_path / "e", loaded=loaded)
    before = (tmp_path / "e" / RUNS_FILE).read_bytes()
    changed = small_spec(samples=1, selectors=("mean-pooled",), answer_tokens=5, supports=(97, 113))
    with pytest.raises(SparseDecodeError, match=r"supports: \[97\] vs \[97, 113\]; answer_tokens: 4 vs 5"):
        run_eval(changed, tmp_path / "e", loaded=loaded)
    with pytest.raises(SparseDecodeError, match="sparsedecode merge"):
        run_eval(spec, tmp_path / "e", shard=Shard(1, 2), loaded=loaded)
    with locked(tmp_path / "e"), pytest.raises(SparseDecodeError, match="another process"):
        run_eval(spec, tmp_path / "e", loaded=loaded)
    assert (tmp_path / "e" / RUNS_FILE).read_bytes() == before
    assert run_eval(spec, tmp_path / "e", loaded=loaded).ran == 0


def test_resume_refuses_a_dense_answer_that_changed(loaded, tmp_path):
    spec = small_spec(samples=1, selectors=("mean-pooled",))
    run_eval(spec, tmp_path / "ref", loaded=loaded)
    dense = rows_of(tmp_path / "ref")[0]
    dense["output_ids"] = [t + 1 for t in dense["output_ids"]]  # as if made on another machine
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(tmp_path / "ref" / SPEC_FILE, partial / SPEC_FILE)
    (partial / RUNS_FILE).write_text(json.dumps(dense) + "\n")
    before = {p.name: p.read_bytes() for p in partial.iterdir()}
    with pytest.raises(SparseDecodeError, match="dense answer of niah_single_noise, context 600, sample 0 differs"):
        run_eval(spec, partial, loaded=loaded)
    assert {p.name: p.read_bytes() for p in partial.iterdir()} == before, "the refusal left the folder as it was"


def test_shards_partition_samples_and_merge_equals_unsharded(loaded, tmp_path):
    spec = small_spec(samples=3, selectors=("mean-pooled",))
    run_eval(spec, tmp_path / "all", loaded=loaded)  # 3 samples x (dense, S=97)
    shards = [Shard(i, 2) for i in (1, 2)]
    groups = [g for shard in shards for g in shard.groups(spec)]
    assert sorted(groups) == sorted(spec.groups()) and len(set(groups)) == len(groups)
    for shard in shards:
        run_eval(spec, tmp_path / f"shard{shard.index}", shard=shard, loaded=loaded)
    sources = [tmp_path / "shard2", tmp_path / "shard1", tmp_path / "shard1"]
    outcome = merge_evals(sources, tmp_path / "merged")
    assert (outcome.rows, outcome.missing) == (len(spec.keys()), 0)
    meta, merged = load_eval(tmp_path / "merged")
    assert stripped(merged) == stripped(rows_of(tmp_path / "all")) and meta["shard"] is None
    assert meta["merged_from"] == ["../shard1", "../shard2"], "relative to the merged folder, no absolute path"
    assert run_eval(spec, tmp_path / "merged", loaded=loaded).ran == 0
    # folders that differ only in their grid merge into its union, as sweep folders do (issue 27)
    run_eval(small_spec(samples=1, selectors=("quest",)), tmp_path / "other", loaded=loaded)
    outcome = merge_evals([tmp_path / "shard1", tmp_path / "other"], tmp_path / "m2")
    union = small_spec(samples=3, selectors=("mean-pooled", "quest"))
    assert EvalSpec.from_dict(load_eval(tmp_path / "m2")[0]["spec"]) == union
    assert (outcome.rows, outcome.duplicates, outcome.missing) == (4 + 2 - 1, 1, len(union.keys()) - 5)
    run_eval(small_spec(samples=1, selectors=("quest",), answer_tokens=3), tmp_path / "third", loaded=loaded)
    with pytest.raises(SparseDecodeError, match=r"differ outside the grid \(answer_tokens: 4 vs 3"):
        merge_evals([tmp_path / "shard1", tmp_path / "third"], tmp_path / "m4")
    assert not (tmp_path / "m4").exists()
    with pytest.raises(SparseDecodeError, match="not an evaluation folder"):
        merge_evals([tmp_path / "shard1", tmp_path / "nothing"], tmp_path / "m3")


def test_bad_specs_are_refused():
    for bad in (
        dict(tasks=("passkey",)),
        dict(tasks=()),
        dict(contexts=(700, 700)),
        dict(samples=0),
        dict(selectors=("dense",)),
        dict(selectors=("nope",)),
        dict(supports=(50,)),
        dict(template="fancy"),
        dict(answer_tokens=0),
    ):
        with pytest.raises(SparseDecodeError):
            small_spec(**bad)
    with pytest.raises(SparseDecodeError, match="unknown fields"):
        EvalSpec.from_dict({"model": "m", "tokens": 3})
    assert EvalSpec.from_dict(small_spec().to_dict()) == small_spec()


def test_context_beyond_the_model_is_refused_before_writing(tmp_path):
    model, tokenizer = tiny_model("llama"), char_tokenizer()  # 1024 positions
    with pytest.raises(SparseDecodeError, match="exceeds the model's 1024 positions"):
        run_eval(small_spec(contexts=(1022,)), tmp_path / "e", loaded=(model, tokenizer))
    assert not (tmp_path / "e").exists()


def test_report_renders_an_eval_folder(loaded, tmp_path):
    from sparsedecode.reports.evaluation import write_eval_report

    spec = small_spec(tasks=TWO_TASKS, samples=1)
    run_eval(spec, tmp_path / "e", loaded=loaded)
    rows = rows_of(tmp_path / "e")
    # make dense answer the first vt sample, so the report has a sample dense answers and sparse decoding does not
    for row in rows:
        if (row["task"], row["sample"], row["selector"]) == ("vt", 0, DENSE):
            row.update(output=" ".join(row["answers"]), score=1.0, correct=True)
    (tmp_path / "e" / RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = write_eval_report(tmp_path / "e")
    text = path.read_text()
    for heading in ("## Accuracy", "## Paired against dense", "## Where dense fails", "## What this does not"):
        assert heading in text
    assert "| niah_single_noise (dense fails) | 600 | 1 | 0 | 0 | 0 |" in text and "| vt | 600 | 1 | 100 |" in text
    assert "mean-pooled S=97" in text and "streaming S=97" in text and "sparsedecode eval --model tiny" in text
    # dense's imperfect cells, with how many samples it answers fully and how many it scores 0 on (vt is perfect)
    assert "| niah_single_noise | 600 | 1 | 0 | 0 | 1 |" in text and "| vt | 600 | 1 | 100 | 1 | 0 |" not in text
    assert (tmp_path / "e" / "accuracy.png").stat().st_size > 1000
    regressions = (tmp_path / "e" / "regressions.csv").read_text().splitlines()
    assert len(regressions) == 1 + 2 and all(line.startswith("vt,600,0,") for line in regressions[1:])
    accuracy = (tmp_path / "e" / "accuracy.csv").read_text().splitlines()
    assert accuracy[0].startswith("task,context,selector,support,samples,score,correct") and len(accuracy) == 1 + 6


def test_the_accuracy_table_says_where_a_setting_has_run_fewer_samples(loaded, tmp_path):
    """A partial run (dense done, a sparse setting not yet): the table said every column was on the same samples and
    showed the sparse mean over fewer without a word; the cell now gives its count."""
    from sparsedecode.reports.evaluation import write_eval_report

    run_eval(small_spec(selectors=("streaming",)), tmp_path / "e", loaded=loaded)
    rows = [r for r in rows_of(tmp_path / "e") if not (r["selector"] == "streaming" and r["sample"] == 1)]
    (tmp_path / "e" / RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = [
        line
        for line in write_eval_report(tmp_path / "e").read_text().splitlines()
        if "(dense fails) | 600 | 2 |" in line
    ]
    assert len(table) == 1 and table[0].rstrip(" |").endswith("| 0 | 0 (1 of 2)"), table


def test_an_interrupted_eval_report_leaves_the_earlier_report_as_it_was(loaded, tmp_path, monkeypatch):
    """An evaluation report wrote its CSVs, then drew its heat map: an error or an interrupt there left the new
    tables beside the earlier report.md and plot. Now the folder is as it was (as the sweep's report does)."""
    from sparsedecode.reports import plots
    from sparsedecode.reports.evaluation import write_eval_report

    folder = tmp_path / "e"
    run_eval(small_spec(tasks=TWO_TASKS, samples=1), folder, loaded=loaded)
    rows = (folder / RUNS_FILE).read_text().splitlines(keepends=True)
    (folder / RUNS_FILE).write_text("".join(rows[: len(rows) // 2]))
    write_eval_report(folder)
    before = {path.name: path.read_bytes() for path in folder.iterdir() if path.name != RUNS_FILE}
    (folder / RUNS_FILE).write_text("".join(rows))  # the evaluation resumed: every run now

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "heatmap", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_eval_report(folder)
    assert {path.name: path.read_bytes() for path in folder.iterdir() if path.name != RUNS_FILE} == before


def test_cli_runs_export_merge_and_report_of_eval_folders(model_dir, tmp_path, capsys):
    """`sparsedecode eval`, and `merge` / `report` branching to evaluation folders, through the real CLI."""
    from sparsedecode.cli import main

    base = ["eval", "--model", str(model_dir), "--tasks", "vt", "--context", "600", "--samples", "2"]
    base += ["--support", "97", "--answer-tokens", "3"]
    assert main([*base, "--export", str(tmp_path / "x")]) == 0
    assert (tmp_path / "x" / "sparsedecode_vt_600.yaml").exists()
    for shard in ("1/2", "2/2"):
        assert main([*base, "--shard", shard, "--out", str(tmp_path / shard[0])]) == 0
    assert main(["merge", str(tmp_path / "1"), str(tmp_path / "2"), "--out", str(tmp_path / "m")]) == 0
    assert len(rows_of(tmp_path / "m")) == 4
    assert main(["report", str(tmp_path / "m")]) == 0
    assert "| vt (dense fails) | 600 | 2 | 0 |" in (tmp_path / "m" / "report.md").read_text()
    capsys.readouterr()
    assert main(base) == 2 and "--out DIR" in capsys.readouterr().err
    args = [*base, "--selectors", "quest", "--shard", "1/2", "--out", str(tmp_path / "1")]
    assert main(args) == 2 and "selectors: ['mean-pooled'] vs ['quest']" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main([*base, "--out", str(tmp_path / "afile")]) == 2 and "existing file" in capsys.readouterr().err


def test_a_context_a_task_cannot_fit_is_refused_before_writing(loaded, tmp_path):
    with pytest.raises(SparseDecodeError, match="too short for cwe"):
        run_eval(small_spec(tasks=("niah_single_noise", "cwe")), tmp_path / "e", loaded=loaded)
    assert not (tmp_path / "e").exists()


def test_dense_imperfect_cells_count_full_and_zero_answers():
    from sparsedecode.experiments.eval_summary import dense_imperfect

    def row(task, sample, score, selector=DENSE):
        row = {"task": task, "context": 4096, "sample": sample, "selector": selector, "support": None, "score": score}
        return {**row, "correct": score == 1.0}

    rows = [row("cwe", 0, 0.4), row("cwe", 1, 1.0), row("cwe", 2, 0.0), row("vt", 0, 1.0), row("vt", 1, 1.0)]
    rows.append(row("vt", 0, 0.0, selector="streaming"))  # sparse rows do not count
    (cell,) = dense_imperfect(rows)
    assert cell == {
        "task": "cwe",
        "context": 4096,
        "samples": 3,
        "score": pytest.approx(1.4 / 3),  # a float64 mean of three scores: round-off ~1e-16
        "fully_right": 1,
        "zero": 1,
    }


def test_dense_fails_where_it_scores_below_half_or_answers_no_sample_fully():
    """cwe: dense scores 70% but answers no sample fully; fwe: 40%; vt: one of two samples fully. The paired Δ over
    the cells dense does not fail leaves cwe and fwe out."""
    from sparsedecode.experiments.eval_summary import dense_fails, paired

    def row(task, sample, score, selector=DENSE, support=None):
        row = {"task": task, "context": 4096, "sample": sample, "selector": selector, "support": support}
        return {**row, "score": score, "correct": score == 1.0, "output_ids": [sample, int(10 * score)]}

    dense = [row("cwe", 0, 0.6), row("cwe", 1, 0.8), row("fwe", 0, 0.4), row("fwe", 1, 0.4)]
    dense += [row("vt", 0, 1.0), row("vt", 1, 0.5)]
    sparse = [row(r["task"], r["sample"], s, "quest", 193) for r, s in zip(dense, (0.2, 0.2, 1.0, 1.0, 0.0, 0.5))]
    failing = dense_fails(dense + sparse)
    # means of two float64 scores, differences of them: round-off ~1e-16, far inside approx's default 1e-6
    assert [(f["task"], f["score"], f["correct"]) for f in failing] == [
        ("cwe", pytest.approx(0.7), 0.0),
        ("fwe", pytest.approx(0.4), 0.0),
    ]
    (quest,) = paired(dense + sparse)
    assert quest["samples"] == 6 and quest["samples_dense_ok"] == 2
    assert quest["difference_dense_ok"] == pytest.approx(-0.5)  # vt only: (0 - 1 + 0.5 - 0.5) / 2
    assert quest["difference"] == pytest.approx((-0.4 - 0.6 + 0.6 + 0.6 - 1.0 + 0.0) / 6)


def test_a_later_sample_a_task_cannot_fit_is_refused_before_writing(loaded, tmp_path):
    """Found by probing: only each cell's first sample was built up front, so a later one no haystack size fits
    (fwe's sample 1 at 1024 tokens of the char tokenizer, whose coded words add 4 to 7 tokens at a time) stopped the
    run after the earlier samples had run (with SmolLM2, fwe's sample 4 at 1024 tokens)."""
    spec = small_spec(tasks=("fwe",), contexts=(1024,), answer_tokens=2)
    with pytest.raises(SparseDecodeError, match=r"^fwe, context 1024, sample 1: task fwe could not be fitted"):
        run_eval(spec, tmp_path / "e", loaded=loaded)
    assert not (tmp_path / "e").exists()


def test_an_export_refused_for_a_sample_leaves_the_earlier_export_whole(tmp_path):
    """Found by probing: --export wrote each (task, context) as it built it, so a later sample that cannot be
    fitted (fwe's sample 1 at 920 tokens of the char tokenizer) left the earlier export's files overwritten by new
    ones that its export.json does not describe."""
    from sparsedecode.experiments.lm_eval_tasks import export_tasks

    out = tmp_path / "tasks"
    export_tasks(small_spec(contexts=(920,), samples=1), char_tokenizer(), out)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    with pytest.raises(SparseDecodeError, match="task fwe could not be fitted"):
        export_tasks(small_spec(tasks=("niah_single_noise", "fwe"), contexts=(920,)), char_tokenizer(), out)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert not (tmp_path / "new").exists()
    with pytest.raises(SparseDecodeError, match="task fwe could not be fitted"):
        export_tasks(small_spec(tasks=("fwe",), contexts=(920,)), char_tokenizer(), tmp_path / "new")
    assert not (tmp_path / "new").exists(), "nothing made for an export refused"
