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
        ("[]", "(expected a JSON object with fields spec, corpus_sha256, generator_version, shard, sessions, got a "),
        ("null", "(expected a JSON object with fields spec, corpus_sha256, generator_version, shard, sessions, got nu"),
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
