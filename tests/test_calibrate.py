"""``sparsedecode calibrate``: the search finds the cheapest per-layer supports whose calibration means meet the
targets (checked against the paired protocol run again here), writes a budget the library loads, resumes its study,
and reports the held-out prompts beside every uniform support; bad input is refused in one line."""

from __future__ import annotations

import json
import sys

import pytest

from sparsedecode import SparseConfig, SparseDecodeError
from sparsedecode.cli import main
from sparsedecode.config import read_budget
from sparsedecode.experiments import calibrate
from sparsedecode.experiments.corpus import prompt_ids
from sparsedecode.models.catalog import load_model
from sparsedecode.protocol.paired import compare


def test_targets_parse_and_bad_ones_are_refused():
    assert str(calibrate.parse_target("tf-match>=99")) == "tf-match>=99"
    assert calibrate.parse_target("dppl <= 1.5") == calibrate.Target("dppl", 1.5)
    assert calibrate.Target("tf-match", 90).slack(95) == 5 and calibrate.Target("dppl", 1).slack(3) == -2
    for bad in ("tf-match<=99", "accuracy>=3", "dppl<=x", "dppl<=nan", ""):
        with pytest.raises(SparseDecodeError, match="a target is one of"):
            calibrate.parse_target(bad)


def test_a_hopeless_trial_is_one_no_later_prompt_can_save():
    target = [calibrate.Target("tf-match", 90)]
    assert calibrate.hopeless(target, [{"teacher_forced_match": 50.0}], 4)  # at best (50 + 300) / 4 = 87.5
    assert not calibrate.hopeless(target, [{"teacher_forced_match": 70.0}], 4)  # at best 92.5
    assert not calibrate.hopeless([calibrate.Target("dppl", 1)], [{"delta_ppl_percent": 500.0}], 4)
    low, high = calibrate.bootstrap_interval([1.0, 2.0, 3.0, 10.0])
    assert 1.0 <= low <= 4.0 <= high <= 10.0 and calibrate.bootstrap_interval([7.0]) == (7.0, 7.0)


def test_calibrate_finds_the_cheapest_feasible_supports_and_resumes(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "c"
    args = ["calibrate", "--model", str(tiny_model_dir), "--context", "300", "--choices", "97,1009"]
    args += ["--target", "tf-match>=100", "--prompts", "2", "--held-out", "2", "--tokens", "6", "--out", str(out)]
    assert main([*args, "--trials", "6"]) == 0, capsys.readouterr().err
    data = json.loads((out / "calibration.json").read_text())
    trials = data["trials"]
    assert len(trials) == 6 and data["chosen"] is not None
    assert [t["supports"] for t in trials[:2]] == [[97, 97], [1009, 1009]]  # the uniform supports first
    feasible = [t for t in trials if t["feasible"]]
    assert min(t["cost"] for t in feasible) == min(t["cost"] for t in trials if t["supports"] == data["chosen"])
    # the chosen supports meet the target when the paired protocol runs again here
    model, tokenizer = load_model(str(tiny_model_dir))
    cfg = SparseConfig(support=97, **read_budget(out / "budget.json"))
    assert [cfg.for_layer(i).support for i in range(2)] == data["chosen"]
    for index in range(2):
        ids = prompt_ids(tokenizer, "python-docs", 300, index, 6)
        assert compare(model, None, ids, cfg, 6).teacher_forced_match == 100.0
    held = {row["configuration"]: row for row in data["held_out"]}
    assert set(held) == {"calibrated", "uniform S=97", "uniform S=1009"} and held["calibrated"]["prompts"] == 2
    markdown = (out / "calibration.md").read_text()
    assert "Held out: 2 prompts the search never saw" in markdown and "![trials](front.png)" in markdown
    assert all((out / name).stat().st_size > 0 for name in ("front.png", "supports.png", "trials.csv"))
    assert len((out / "trials.csv").read_text().splitlines()) == 1 + 6
    assert main([*args, "--trials", "8"]) == 0  # resumed: six trials kept, two more run
    again = json.loads((out / "calibration.json").read_text())["trials"]
    assert len(again) == 8 and again[:6] == trials
    capsys.readouterr()
    assert main([*args[:-4], "--tokens", "5", "--out", str(out), "--trials", "8"]) == 2
    assert "holds a search of other settings (tokens differ)" in capsys.readouterr().err


def test_bad_calibrations_are_refused_in_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    base = ["calibrate", "--model", str(tiny_model_dir), "--context", "300", "--out", str(tmp_path / "c")]
    for extra, message in [
        (["--target", "tf-match>=90", "--held-out", "0"], "never saw"),
        (["--target", "tf-match>=90", "--choices", "97"], "two or more distinct supports"),
        (["--target", "tf-match>=90", "--choices", "97,100"], "support 100"),
        (["--target", "speed>=2"], "a target is one of"),
        ([], "give at least one --target"),
    ]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    monkeypatch.setitem(sys.modules, "optuna", None)  # not installed
    assert main([*base, "--target", "tf-match>=90"]) == 2
    assert "pip install optuna" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_the_cost_is_what_a_step_reads_at_the_context():
    cfg = calibrate.layer_config(SparseConfig(support=97), [97, 1009])
    assert calibrate.cost(cfg, 2, 300) == (97 + 300) / 2
    assert calibrate.cost(cfg, 2, 4000) == (97 + 1009) / 2
