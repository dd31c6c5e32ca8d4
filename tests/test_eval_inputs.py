"""Bad input to ``sparsedecode eval`` (and to ``report`` / ``merge`` of evaluation folders): one line on stderr,
exit status 2, no traceback, nothing written or changed, refused before the model loads wherever the input alone
decides, and argument-format errors answered without importing torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input import one_line_exit_2, sweep_folder
from test_cli_inputs import (
    HELP_AND_ERRORS,
    contents,
    no_model_load,  # noqa: F401 - a fixture, used by name
)

from sparsedecode.errors import SparseDecodeError
from sparsedecode.experiments.evaluate import RUNS_FILE, SPEC_FILE, load_eval, merge_evals

pytestmark = pytest.mark.xdist_group("eval-inputs")  # one parallel worker builds the module's fixtures

ARGS = ["--tasks", "vt", "--context", "600", "--samples", "1", "--support", "97", "--answer-tokens", "3"]
"""A one-sample evaluation of the tiny model: a dense and a sparse run (``runs.jsonl`` holds two rows)."""


def eval_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", "--model", str(model_dir), *ARGS, *extra, "--out", str(out)]


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory) -> Path:
    """A finished evaluation folder; tests change copies of it (:func:`copy_of`)."""
    from sparsedecode.cli import main

    out = tmp_path_factory.mktemp("finished") / "ev"
    assert main(eval_args(tiny_model_dir, out)) == 0
    assert len(load_eval(out)[1]) == 2
    return out


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


@pytest.fixture
def loud_transformers():
    """transformers' progress bars and warnings on, as in a fresh process (another test may have silenced them)."""
    from transformers.utils import logging as hf_logging

    enabled, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.enable_progress_bar()
    hf_logging.set_verbosity_warning()
    yield
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    hf_logging.set_verbosity(verbosity)


# ---- 1. a folder holding another experiment's results ----


@pytest.mark.usefixtures("no_model_load")
def test_eval_into_a_sweep_folder_is_refused_before_the_model_and_leaves_it_unchanged(tiny_model_dir, tmp_path, capsys):
    sweep = sweep_folder(tmp_path / "sw")
    (sweep / RUNS_FILE).write_text(json.dumps({"context": 150, "prompt_index": 0, "support": 97}) + "\n")
    before = contents(sweep)
    err = one_line_exit_2(eval_args(tiny_model_dir, sweep), capsys)
    assert "holds a sweep (sweep.json); write an evaluation into a folder of its own" in err
    assert contents(sweep) == before
    (sweep / "sweep.json").unlink()  # runs of unknown origin, without any description
    err = one_line_exit_2(eval_args(tiny_model_dir, sweep), capsys)
    assert "holds runs.jsonl but no eval.json" in err and sorted(p.name for p in sweep.iterdir()) == [RUNS_FILE]


@pytest.mark.usefixtures("no_model_load")
def test_out_and_export_together_are_refused_as_two(tiny_model_dir, tmp_path, capsys):
    """Both given were answered 'give --out DIR ... or --export DIR ...', as if neither had been."""
    err = one_line_exit_2([*eval_args(tiny_model_dir, tmp_path / "ev"), "--export", str(tmp_path / "ex")], capsys)
    assert "give one of --out DIR" in err and not (tmp_path / "ev").exists() and not (tmp_path / "ex").exists()


def test_merging_evaluations_into_a_sweep_folder_is_refused(finished, tmp_path, capsys):
    sweep = sweep_folder(tmp_path / "sw")
    before = contents(sweep)
    with pytest.raises(SparseDecodeError, match="not an evaluation folder"):
        merge_evals([finished], sweep)
    err = one_line_exit_2(["merge", str(finished), "--out", str(sweep)], capsys)
    assert "holds a sweep (sweep.json); write an evaluation into" in err and contents(sweep) == before


# ---- 2. a run (row of runs.jsonl) that lacks fields or holds the wrong kind of value ----


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda row: {"task": "vt"}, "run 3 lacks fields 'context', 'sample', 'selector', 'support' and 7 more"),
        (lambda row: {"task": "vt", "context": 600, "correct": "yes"}, "run 3 lacks fields 'sample', 'selector'"),
        (lambda row: {k: v for k, v in row.items() if k != "output_ids"}, "run 3 lacks field 'output_ids'"),
        (lambda row: {**row, "correct": "yes"}, "run 3 field 'correct' should be true or false, not \"yes\""),
        (lambda row: {**row, "context": "600"}, "run 3 field 'context' should be an integer, not \"600\""),
        (lambda row: {**row, "answers": [1]}, "run 3 field 'answers' should be a list of strings"),
    ],
)
@pytest.mark.usefixtures("no_model_load")
def test_a_malformed_run_is_one_line_naming_the_file_and_the_run(
    finished, tiny_model_dir, tmp_path, capsys, change, message
):
    folder = copy_of(finished, tmp_path)
    runs = folder / RUNS_FILE
    first = json.loads(runs.read_text().splitlines()[0])
    first.update(sample=5)  # a run the grid does not hold: only its fields are wrong
    with runs.open("a") as handle:
        handle.write(json.dumps(change(first)) + "\n")
    before = contents(folder)
    for args in (
        eval_args(tiny_model_dir, folder),  # resume: refused before the model loads
        ["report", str(folder)],
        ["merge", str(folder), "--out", str(tmp_path / "merged")],
    ):
        err = one_line_exit_2(args, capsys)
        assert f"{runs} {message}" in err, err
        assert contents(folder) == before, "nothing written or changed"
    assert not (tmp_path / "merged").exists()


# ---- 3. transformers' "Loading weights" bar ----


@pytest.mark.usefixtures("loud_transformers")
def test_eval_prints_no_transformers_progress_bar(finished, tiny_model_dir, tmp_path, capsys):
    capsys.readouterr()
    err = one_line_exit_2(["eval", "--model", str(tiny_model_dir), "--context", "1022", "--tasks", "vt",
                           "--support", "97", "--out", str(tmp_path / "e")], capsys)  # fmt: skip
    assert "exceeds the model's 1024 positions" in err and not (tmp_path / "e").exists()  # found after loading
    from sparsedecode.cli import main

    folder = copy_of(finished, tmp_path)
    assert main(eval_args(tiny_model_dir, folder)) == 0  # nothing left to run
    assert main(["eval", "--model", str(tiny_model_dir), *ARGS, "--export", str(tmp_path / "x")]) == 0
    assert capsys.readouterr().err == ""


# ---- 4. eval.json that is not an evaluation description ----


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "[]",
            "(expected a JSON object with fields spec, corpus_sha256, weights_sha256, generator_version, shard, "
            "sessions, got a ",
        ),
        (
            "null",
            "(expected a JSON object with fields spec, corpus_sha256, weights_sha256, generator_version, shard, "
            "sessions, got nu",
        ),
        ("{}", "(lacks field 'spec')"),
        ('{"spec": []}', "(field 'spec' should be a JSON object of the evaluation's settings, got a list)"),
        ('{"spec": {}}', "(its spec lacks field 'model')"),
        ('{"spec": {"model": "m", "contexts": 600}}', "(contexts must be a non-empty list of positive integers, got"),
        ('{"spec": {"model": "m", "tasks": 5}}', "(tasks must be a list of names, got 5)"),
        ('{"spec": {"model": 5}}', "(model must be a string, got 5)"),
        ('{"spec": {"model": "m"}, "sessions": 3}', "(field 'sessions' should be a list, got a number)"),
        ("{broken", "is not valid JSON"),
        (b"\xff\xfe{}", "is not valid JSON (not UTF-8 text)"),
    ],
)
@pytest.mark.usefixtures("no_model_load")
def test_a_malformed_eval_json_says_what_is_wrong(finished, tiny_model_dir, tmp_path, capsys, text, message):
    folder = copy_of(finished, tmp_path)
    path = folder / SPEC_FILE
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    before = contents(folder)
    for args in (eval_args(tiny_model_dir, folder), ["report", str(folder)]):
        err = one_line_exit_2(args, capsys)
        assert str(path) in err and message in err, err
        assert "TypeError" not in err and "KeyError" not in err
        assert contents(folder) == before


# ---- 5. an empty or binary corpus, before the model loads ----


@pytest.mark.parametrize("data, message", [(b"", "holds no text"), (b" \n\t\n", "holds no text"), (b"a\0b", "binary")])
@pytest.mark.usefixtures("no_model_load")
def test_a_corpus_without_text_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, capsys, data, message):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(data)
    err = one_line_exit_2(eval_args(tiny_model_dir, tmp_path / "e", "--corpus", str(corpus)), capsys)
    assert message in err and not (tmp_path / "e").exists()
    err = one_line_exit_2(["eval", *ARGS, "--corpus", str(corpus), "--export", str(tmp_path / "x")], capsys)
    assert message in err and not (tmp_path / "x").exists()


# ---- 6. argument-format errors answer without importing torch ----


def test_argument_format_errors_import_no_torch(tmp_path):
    file = tmp_path / "afile"
    file.write_text("keep me")
    out = str(tmp_path / "never")
    cases = [
        ["eval", "--shard", "3/2", "--out", out],
        ["eval", "--shard", "0/2", "--out", out],
        ["eval", "--shard", "1-2", "--out", out],
        ["eval", "--shard", "1/2/3", "--out", out],
        ["eval", "--out", str(file)],
        ["eval", "--export", str(file)],
        ["eval", "--shard", "1/2", "--export", out],
        ["eval", "--out", ""],
        ["eval", "--model", str(tmp_path), "--out", str(tmp_path / "e")],
        ["eval", "--corpus", str(tmp_path / "missing.txt"), "--out", out],
        ["eval", "--tasks", "vt,,qa_1", "--out", out],
        ["eval", "--tasks", "vt,vt", "--out", out],
        ["eval", "--selectors", " , ", "--out", out],
        ["eval", "--selectors", "quest,mean-pooled,quest", "--out", out],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", HELP_AND_ERRORS.format(cases=cases)], capture_output=True, text=True, check=True
    )
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert done == {"codes": [2] * len(cases), "heavy": []}, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == len(cases) and "Traceback" not in proc.stderr, proc.stderr
    for line, expected in zip(
        lines,
        [
            "argument --shard: need 1 <= i <= n in i/n, got '3/2'",
            "argument --shard: need 1 <= i <= n in i/n, got '0/2'",
            "argument --shard: expected i/n such as 1/4, got '1-2'",
            "argument --shard: expected i/n such as 1/4, got '1/2/3'",
            "is an existing file, not a folder",
            "is an existing file, not a folder",
            "--shard applies to runs, not to --export",
            "argument --out: expected a path",
            "is inside the input --model",
            "unknown corpus",
            "--tasks: expected comma-separated tasks (or all) without empty items, got 'vt,,qa_1'",
            "--tasks: vt given twice in 'vt,vt'",
            "--selectors: expected at least one of the comma-separated selectors (or all)",
            "--selectors: quest given twice",
        ],
        strict=True,
    ):
        assert line.startswith("sparsedecode: error: ") and expected in line, line
    assert file.read_text() == "keep me" and not (tmp_path / "never").exists()


# ---- issue 27: bad input on the newer surfaces ----


def export_args(model_dir: Path, out: Path, *extra: str, tasks: str = "vt") -> list[str]:
    return ["eval", "--model", str(model_dir), *ARGS[2:], "--tasks", tasks, *extra, "--export", str(out)]


@pytest.mark.usefixtures("no_model_load")
def test_an_export_is_a_kind_of_results_of_its_own(finished, tiny_model_dir, tmp_path, capsys):
    from sparsedecode.cli import main

    folder = copy_of(finished, tmp_path)
    before = contents(folder)
    err = one_line_exit_2(export_args(tiny_model_dir, folder), capsys)
    assert "holds an evaluation (eval.json); write exported lm-eval tasks into a folder of its own" in err
    assert contents(folder) == before
    export = tmp_path / "x"
    assert main(export_args(tiny_model_dir, export)) == 0  # a tokenizer only: no model load
    before = contents(export)
    for args, kind in (
        (eval_args(tiny_model_dir, export), "an evaluation"),
        (["sweep", "--model", str(tiny_model_dir), "--out", str(export)], "a sweep"),
        (["probe", "retrieval", "--model", str(tiny_model_dir), "--out", str(export)], "retrieval results"),
    ):
        err = one_line_exit_2(args, capsys)
        assert f"holds exported lm-eval tasks (export.json); write {kind} into a folder of its own" in err, err
        assert contents(export) == before


def test_exporting_again_replaces_the_earlier_exports_tasks(tiny_model_dir, tmp_path, capsys):
    from sparsedecode.cli import main
    from sparsedecode.experiments.lm_eval_tasks import TAG

    export = tmp_path / "x"
    assert main(export_args(tiny_model_dir, export, tasks="vt,niah_single_noise")) == 0
    (export / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(export_args(tiny_model_dir, export, tasks="niah_single_noise")) == 0
    assert "removed 1 task(s) of the previous export that this one does not hold: sparsedecode_vt_600" in (
        capsys.readouterr().out.replace("\n", " ")
    )
    listed = json.loads((export / "export.json").read_text())["tasks"]
    tagged = sorted(p.stem for p in export.glob("*.yaml") if f"tag: {TAG}" in p.read_text())
    assert listed == tagged == ["sparsedecode_niah_single_noise_600"], "--tasks sparsedecode_ruler runs only these"
    assert sorted(p.name for p in export.iterdir()) == [
        "export.json",
        "notes.txt",
        "sparsedecode_niah_single_noise_600.jsonl",
        "sparsedecode_niah_single_noise_600.yaml",
        "sparsedecode_ruler_utils.py",
    ]
    (export / "export.json").write_text('{"tasks": ["../notes"]}')  # names no task of ours: refused, nothing removed
    before = contents(export)
    err = one_line_exit_2(export_args(tiny_model_dir, export), capsys)
    assert "export.json is not an export description" in err and contents(export) == before


def test_an_interrupted_export_leaves_the_earlier_export_as_it_was(tiny_model_dir, tmp_path, monkeypatch):
    """Found by probing Ctrl-C: an export wrote each task's files as its samples were made, so one interrupted at
    its second task left the first task's files beside the earlier export.json (which described other samples), or,
    in a fresh folder, task files without any export.json. Every sample is made first, then the files written."""
    from sparsedecode.cli import main
    from sparsedecode.experiments import lm_eval_tasks

    export = tmp_path / "x"
    assert main(export_args(tiny_model_dir, export, tasks="vt,niah_single_noise")) == 0
    before = contents(export)
    real = lm_eval_tasks.sample_of

    def interrupted(spec, tokenizer, key):
        if key[0] == "niah_single_noise":
            raise KeyboardInterrupt
        return real(spec, tokenizer, key)

    monkeypatch.setattr(lm_eval_tasks, "sample_of", interrupted)
    again = export_args(tiny_model_dir, export, tasks="vt,niah_single_noise")
    assert main([*again, "--seed", "7"]) == 130
    assert contents(export) == before, "the earlier export is whole"
    fresh = tmp_path / "fresh"
    assert main(export_args(tiny_model_dir, fresh, tasks="vt,niah_single_noise")) == 130
    assert not fresh.exists(), "no folder of task files without their export.json"


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--backend", "ray"], "--backend ray"),
        (["--workers", "2"], "--workers"),
        (["--address", "127.0.0.1:1"], "--address"),
        (["--worker-threads", "1"], "--worker-threads"),
    ],
)
@pytest.mark.usefixtures("no_model_load")
def test_ray_options_with_export_are_refused(tiny_model_dir, tmp_path, capsys, extra, named):
    err = one_line_exit_2(export_args(tiny_model_dir, tmp_path / "x", *extra), capsys)
    assert f"{named} applies to runs, not to --export" in err and not (tmp_path / "x").exists()


def test_a_folder_listed_twice_counts_its_rows_as_duplicates(finished, tmp_path, capsys):
    from sparsedecode.cli import main

    twin = copy_of(finished, tmp_path / "twin")
    for sources in ([finished, finished], [finished, twin]):
        out = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        assert main(["merge", *map(str, sources), "--out", str(out)]) == 0
        assert "2 runs, 2 duplicate(s) dropped" in " ".join(capsys.readouterr().out.split())
    folder = copy_of(finished, tmp_path)
    assert merge_evals([folder, twin], folder).duplicates == 2, "--out among the sources: its own rows read once"


@pytest.mark.usefixtures("no_model_load")
def test_report_on_a_folder_without_results_names_every_kind(tmp_path, capsys):
    err = one_line_exit_2(["report", str(tmp_path)], capsys)
    assert "holds neither a sweep (sweep.json), an evaluation (eval.json), retrieval results" in err
    assert "probe mass" not in err
    (tmp_path / "mass.json").write_text("{}")  # a probe mass folder: said so, not only what it lacks
    assert "a probe mass folder: its mass.json and heat maps are its results" in one_line_exit_2(
        ["report", str(tmp_path)], capsys
    )
    (tmp_path / "mass.json").unlink()
    (tmp_path / "calibration.json").write_text("{}")  # a calibration folder: where its report is
    err = one_line_exit_2(["report", str(tmp_path)], capsys)
    assert "a calibration folder: calibrate writes its report, calibration.md, itself" in err and "mass" not in err


def _report_of(folder: Path, rows: list[dict]) -> str:
    from sparsedecode.cli import main

    (folder / RUNS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["report", str(folder)]) == 0
    return (folder / "report.md").read_text()


def test_an_eval_report_says_only_what_its_rows_show(finished, tmp_path):
    folder = copy_of(finished, tmp_path)
    dense, sparse = (json.loads(line) for line in (folder / RUNS_FILE).read_text().splitlines())
    right = {"score": 1.0, "correct": True}
    report = _report_of(folder, [])
    assert "No run is stored yet" in report and "No dense run is stored yet" in report
    assert "in every cell" not in report and "Dense answers every sample fully" not in report
    assert "wherever dense answered fully" not in report
    # the dense row of one task, only the sparse row of another (of the folder's grid: a row outside is refused)
    meta = json.loads((folder / SPEC_FILE).read_text())
    meta["spec"]["tasks"] = [*meta["spec"]["tasks"], "niah_single_noise"]
    (folder / SPEC_FILE).write_text(json.dumps(meta))
    other = {**sparse, **right, "task": "niah_single_noise", "dense_score": 1.0}
    report = _report_of(folder, [{**dense, **right}, other])
    assert "in every cell." not in report and "Dense answers every sample fully" not in report
    assert "in every cell where it has run (1 of 2)" in report
    assert "No dense run yet in 1 of 2 cells (niah_single_noise at 600)" in report
    assert "1 sample(s) with sparse runs have no dense run yet" in report
    # every cell with its dense row: the claims hold and are made
    report = _report_of(folder, [{**dense, **right}, {**sparse, **right, "dense_score": 1.0}])
    assert "answers some sample fully in every cell." in report and "Dense answers every sample fully." in report
    assert "No dense run yet" not in report


def test_an_eval_folder_grows_as_a_sweep_folder_does(finished, tiny_model_dir, tmp_path, capsys):
    from sparsedecode.cli import main

    folder = copy_of(finished, tmp_path)
    before = (folder / RUNS_FILE).read_bytes()
    grown = [a if a != "97" else "97,113" for a in eval_args(tiny_model_dir, folder)]
    assert main(grown) == 0
    assert "extending the grid of" in " ".join(capsys.readouterr().out.split())
    meta, rows = load_eval(folder)
    assert meta["spec"]["supports"] == [97, 113] and len(rows) == 3
    assert meta["sessions"][-1]["extended"] == [f"extending the grid of {folder}: supports: [97] -> [97, 113]"]
    assert (folder / RUNS_FILE).read_bytes().startswith(before), "the stored rows stay as they were"
    # dropping or reordering a stored value is no extension, nor is a change outside the grid
    before = contents(folder)
    for args, named in (
        ([a if a != "97" else "113" for a in eval_args(tiny_model_dir, folder)], "supports: [97, 113] vs [113]"),
        ([*grown, "--seed", "1"], "seed: 0 vs 1"),
    ):
        err = one_line_exit_2(args, capsys)
        assert named in err and "only add to its grid (more tasks, contexts, samples, selectors or supports" in err
        assert contents(folder) == before
    # a shard's grid cannot grow
    shard = tmp_path / "shard"
    assert main(eval_args(tiny_model_dir, shard, "--samples", "2", "--shard", "1/2")) == 0
    more = [*eval_args(tiny_model_dir, shard, "--samples", "2", "--shard", "1/2"), "--support", "97,113"]
    assert "cannot grow shard by shard" in one_line_exit_2(more, capsys)


def test_eval_folders_of_different_grids_merge_into_their_union(finished, tiny_model_dir, tmp_path, capsys):
    from sparsedecode.cli import main

    other = tmp_path / "other"
    assert main([a if a != "97" else "113" for a in eval_args(tiny_model_dir, other)]) == 0
    merged = tmp_path / "merged"
    assert main(["merge", str(finished), str(other), "--out", str(merged)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "3 runs, 1 duplicate(s) dropped, 0 run(s) of the grid still missing" in out
    meta, rows = load_eval(merged)
    assert meta["spec"]["supports"] == [97, 113]
    assert [(r["selector"], r["support"]) for r in rows] == [("dense", None), ("mean-pooled", 97), ("mean-pooled", 113)]
    err = one_line_exit_2(eval_args(tiny_model_dir, merged), capsys)  # the merged spec holds both supports
    assert "supports: [97, 113] vs [97]" in err
    assert main([a if a != "97" else "97,113" for a in eval_args(tiny_model_dir, merged)]) == 0
    assert "0 runs now, 3 before: 3 of 3" in " ".join(capsys.readouterr().out.split()), "nothing left to run"
    outside = tmp_path / "outside"
    assert main([*eval_args(tiny_model_dir, outside), "--seed", "1"]) == 0
    err = one_line_exit_2(["merge", str(finished), str(outside), "--out", str(tmp_path / "m2")], capsys)
    assert "their settings differ outside the grid (seed: 0 vs 1" in err and not (tmp_path / "m2").exists()


@pytest.mark.usefixtures("no_model_load")
def test_several_supports_beside_a_budget_setting_every_layer_are_refused(tiny_model_dir, tmp_path, capsys):
    """Found by probing: ``eval``, ``sweep``, ``compare-selectors`` and ``bench e2e`` with ``--budget`` naming every
    layer and ``--support 97,113`` ran the same configuration under two labels (identical answers in two columns),
    which ``run`` refuses."""
    from sparsedecode.cli import main

    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"layer_supports": {"0": 97, "1": 113}, "layers": 2}))
    common = ["--model", str(tiny_model_dir), "--support", "97,113", "--budget", str(budget)]
    for command in (
        ["eval", *common, "--tasks", "vt", "--context", "600", "--samples", "1", "--out", str(tmp_path / "e")],
        ["sweep", *common, "--context", "300", "--tokens", "4", "--prompts", "1", "--out", str(tmp_path / "s")],
        ["compare-selectors", *common, "--context", "300", "--tokens", "4", "--prompts", "1"],
        ["bench", "e2e", *common, "--context", "300", "--tokens", "4"],
    ):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "would run one configuration under 2 labels" in err, err
    assert not (tmp_path / "e").exists() and not (tmp_path / "s").exists()
