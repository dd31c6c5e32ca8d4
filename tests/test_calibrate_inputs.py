"""Calibrate's inputs, found by probing after issue #41: targets written back exactly and percentages kept in range,
a study file that is none refused in one line, a resume with another corpus or dtype refused, a refused command
leaving no study behind, ``--out`` neither an input nor another command's results; per-layer supports on the command
line in whole blocks, as ``--support`` is."""

from __future__ import annotations

import json
import sqlite3

import pytest

from sparsedecode import SparseDecodeError
from sparsedecode.cli import main
from sparsedecode.experiments import calibrate
from sparsedecode.experiments.calibration_targets import parse_target


def test_targets_are_written_back_exactly_and_percentages_stay_in_range():
    for text in ("tf-match>=90.47619", "tf-match>=90", "length-ratio<=1.0000004", "task-accuracy>=dense-2.5"):
        assert str(parse_target(text)) == text and str(parse_target(str(parse_target(text)))) == text
    for text in ("tf-match>=150", "tf-match>=-5", "task-accuracy>=100.5"):
        with pytest.raises(SparseDecodeError, match="is a percentage, between 0 and 100"):
            parse_target(text)
    for text in ("dppl<=-100", "dppl<=-1000", "length-ratio<=-0.5"):  # a whole search ran for these, none could pass
        with pytest.raises(SparseDecodeError, match="can never hold"):
            parse_target(text)
    assert [str(parse_target(t)) for t in ("dppl<=-99.5", "length-ratio<=0")] == ["dppl<=-99.5", "length-ratio<=0"]


def _search(**changes):
    settings = dict(model="m", selector="mean-pooled", context=300, tokens=4, prompts=2, choices=(97, 1009),
                    targets=("tf-match>=50",), layers=2)  # fmt: skip
    return calibrate.Search(**{**settings, **changes})


def test_a_study_file_that_is_none_is_one_line(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_text("junk\n")
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE studies(x int)")
    for path in (junk, foreign):
        with pytest.raises(SparseDecodeError, match="is not a calibration study") as raised:
            calibrate.open_study(path, _search())
        assert "\n" not in str(raised.value)


def test_a_resume_with_another_corpus_or_dtype_is_refused(tmp_path):
    calibrate.open_study(tmp_path / "s.db", _search())
    for change, name in ((dict(corpus="my-notes.txt"), "corpus"), (dict(dtype="bfloat16"), "dtype")):
        with pytest.raises(SparseDecodeError, match=f"other settings \\({name} differ\\)"):
            calibrate.open_study(tmp_path / "s.db", _search(**change))
    calibrate.open_study(tmp_path / "s.db", _search())  # the same settings resume


def test_a_refused_calibration_leaves_no_study_and_out_is_checked(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "c"
    args = ["calibrate", "--model", str(tiny_model_dir), "--choices", "97,1009", "--prompts", "2", "--held-out", "1"]
    args += ["--tokens", "4", "--trials", "2", "--target", "tf-match>=50", "--out", str(out)]
    assert main([*args, "--context", "5000"]) == 2  # refused while building the calibration prompts
    assert capsys.readouterr().err.count("\n") == 1
    assert not (out / "study.db").exists()
    assert main([*args, "--context", "300"]) == 0, capsys.readouterr().err  # the corrected command runs
    assert json.loads((out / "calibration.json").read_text())["settings"]["targets"] == ["tf-match>=50"]
    fewer = [*args[:11], "--trials", "1", *args[13:], "--context", "300"]
    assert main(fewer) == 0  # resumed, asking for fewer trials than it holds
    settings = json.loads((out / "calibration.json").read_text())["settings"]
    assert (settings["trials"], settings["trials_asked"]) == (2, 1)  # what the study holds, and what was asked
    capsys.readouterr()
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}")
    for where, message in ((str(tiny_model_dir), "is the input --model"), (str(sweep), "holds a sweep")):
        assert main([*args[:-1], where, "--context", "300"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (sweep / "study.db").exists()


def test_per_layer_supports_on_the_command_line_are_whole_blocks(tiny_model_dir, capsys):
    run = ["run", "--model", str(tiny_model_dir), "--context", "200", "--support", "97", "--tokens", "2"]
    assert main([*run, "--layer-supports", "0:100,1:97"]) == 2
    assert "layer 0's support 100 is not 1 + W + b*B" in capsys.readouterr().err


def test_supports_decoding_sparse_in_part_of_the_steps_are_refused_where_reads_are_measured(
    tiny_model_dir, tmp_path, capsys
):
    """Found by probing: quest's cost is what its sparse layers read, measured over all of them together; a layer at
    321 with context 300 and 64 tokens decodes sparse once a step passes 321, and its reads were counted as the other
    layers' (cost 193.7 for 97,97,97,321 where those 97-layers read 121 each: 165.75)."""
    base = [
        "calibrate",
        "--model",
        str(tiny_model_dir),
        "--context",
        "300",
        "--tokens",
        "64",
        "--target",
        "tf-match>=50",
    ]
    for selector, choices in (("quest", "97,321"), ("block-top-p", "97,305,1009"), ("quest", "97,353")):
        assert main([*base, "--selector", selector, "--choices", choices, "--out", str(tmp_path / "c")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "decodes sparse in part of the steps only" in err, err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "vt,,cwe"], "--tasks: expected comma-separated tasks (or all) without empty items"),
        (["--tasks", "vt,"], "without empty items"),
        (["--tasks", "vt, vt"], "--tasks: vt given twice"),
        (["--selector", "block-top-p", "--search-param", "p=0.8,,0.9"], "values of p without empty items"),
        (["--selector", "block-top-p", "--search-param", "p=0.8,0.9,"], "without empty items"),
    ],
)
def test_calibrate_lists_with_empty_items_are_refused(extra, message, tmp_path, capsys, monkeypatch):
    """Found by probing: calibrate's ``--tasks vt,,cwe`` and ``--search-param p=0.8,,0.9`` dropped the empty items and
    ran (a whole search), where every other list option refuses them."""
    from sparsedecode.models import catalog

    monkeypatch.setattr(catalog, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    out = tmp_path / "c"
    args = ["calibrate", "--context", "300", "--choices", "97,113", "--target", "tf-match>=50", "--out", str(out)]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()
