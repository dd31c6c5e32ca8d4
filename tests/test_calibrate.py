"""``sparsedecode calibrate``: the search finds the cheapest per-layer supports whose calibration means meet the
targets (checked against the paired protocol run again here), writes a budget the library loads, resumes its study,
and reports the held-out prompts beside every uniform support; bad input is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import char_tokenizer, tiny_model

from sparsedecode import SparseConfig, SparseDecodeError
from sparsedecode.cli import main
from sparsedecode.config import read_budget
from sparsedecode.experiments import calibrate, calibration_units
from sparsedecode.experiments.corpus import prompt_count, prompt_ids
from sparsedecode.models.catalog import load_model
from sparsedecode.protocol.paired import compare


def test_targets_parse_and_bad_ones_are_refused():
    parse = calibrate.parse_target
    for text in ("tf-match>=99", "dppl<=1", "task-accuracy>=90", "task-accuracy>=dense-2", "length-ratio<=1.05"):
        assert str(parse(text)) == text
    assert parse("dppl <= 1.5") == calibrate.Target("dppl", 1.5)
    assert parse("task-accuracy >= dense - 2.5") == calibrate.Target("task-accuracy", -2.5, relative=True)
    assert str(parse("task-accuracy>=dense")) == "task-accuracy>=dense" and str(parse("task-accuracy>=dense+1"))
    assert calibrate.Target("tf-match", 90).slack(95) == 5 and calibrate.Target("dppl", 1).slack(3) == -2
    assert parse("task-accuracy>=dense-2").slack(79.0, dense=80.0) == 1.0  # 79 >= 80 - 2
    assert parse("task-accuracy>=dense-2").slack(77.0, dense=80.0) == -1.0
    assert parse("length-ratio<=1.05").slack(1.1) < 0 <= parse("length-ratio<=1.05").slack(1.05)
    bad_ones = ["tf-match<=99", "accuracy>=3", "dppl<=x", "dppl<=nan", "", "length-ratio>=1", "tf-match>=dense-1"]
    bad_ones += ["length-ratio<=dense", "task-accuracy>=dense2", "task-accuracy>=densely", "task-accuracy<=dense-2"]
    for bad in bad_ones:
        with pytest.raises(SparseDecodeError, match="a target is one of .*task-accuracy>=dense-X.*length-ratio<=X"):
            parse(bad)


def test_a_hopeless_trial_is_one_no_later_unit_can_save():
    hopeless, parse = calibrate.hopeless, calibrate.parse_target
    four = [{}] * 4
    assert hopeless([parse("tf-match>=90")], [{"teacher_forced_match": 50.0}], four[1:])  # at best 87.5
    assert not hopeless([parse("tf-match>=90")], [{"teacher_forced_match": 70.0}], four[1:])  # at best 92.5
    assert not hopeless([parse("dppl<=1")], [{"delta_ppl_percent": 500.0}], four[1:])  # no bound
    wrong = [{"score": 0.0, "dense_score": 1.0, "output_tokens": 30, "dense_tokens": 10}]
    pending = [{"score": 1.0, "output_tokens": 10}] * 3
    assert hopeless([parse("task-accuracy>=80")], wrong, pending)  # at best 75
    assert not hopeless([parse("task-accuracy>=75")], wrong, pending)
    assert hopeless([parse("task-accuracy>=dense-10")], wrong, pending, dense=90.0)  # 75 < 80
    assert not hopeless([parse("task-accuracy>=dense-20")], wrong, pending, dense=90.0)
    assert hopeless([parse("length-ratio<=0.7")], wrong, pending)  # 30 of 40 dense tokens already
    assert not hopeless([parse("length-ratio<=0.75")], wrong, pending)
    low, high = calibrate.bootstrap_interval([1.0, 2.0, 3.0, 10.0])
    assert 1.0 <= low <= 4.0 <= high <= 10.0 and calibrate.bootstrap_interval([7.0]) == (7.0, 7.0)


def test_a_target_against_dense_is_judged_at_the_bound_of_the_paired_difference():
    """Found by probing: with --feasible bound, a target against dense compared the low end of the configuration's
    own accuracy with dense's mean, so a configuration answering exactly as dense on every sample missed
    ``task-accuracy>=dense`` (and ``>=dense-5``) at the bound whenever dense's scores varied."""
    from sparsedecode.experiments.calibration_targets import constraints, interval_row, judged_at_bound, summary

    targets = [calibrate.parse_target("task-accuracy>=dense"), calibrate.parse_target("task-accuracy>=dense-5")]
    scores = [1.0, 0.0, 1.0, 0.5, 1.0, 0.0, 1.0, 1.0]
    as_dense = {"tasks": [{"score": s, "dense_score": s, "output_tokens": 3, "dense_tokens": 3} for s in scores]}
    row = interval_row(targets, as_dense, bound=True)
    assert row["targets_met_at_bound"] == {"task-accuracy>=dense": True, "task-accuracy>=dense-5": True}
    assert row["task-accuracy - dense"] == {"mean": 0.0, "low": 0.0, "high": 0.0}
    values = summary(targets, as_dense)
    assert all(c <= 0 for c in constraints(targets, judged_at_bound(targets, row, values)))  # what the search judges
    worse = {"tasks": [dict(r, score=r["score"] * 0.9) for r in as_dense["tasks"]]}  # 10% of each answer lost
    row = interval_row(targets, worse, bound=True)
    assert row["task-accuracy - dense"]["low"] < row["task-accuracy - dense"]["mean"] < 0
    assert row["targets_met"] == {"task-accuracy>=dense": False, "task-accuracy>=dense-5": False}
    assert not any(row["targets_met_at_bound"].values())
    lenient = [calibrate.parse_target("task-accuracy>=dense-20")]
    assert interval_row(lenient, worse, bound=True)["targets_met_at_bound"] == {"task-accuracy>=dense-20": True}


def test_calibrate_finds_the_cheapest_feasible_supports_and_resumes(tiny_model_dir, tmp_path, capsys, monkeypatch):
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
    drawn = data["settings"]["prompt_indices"]  # --split random (the default): the prompts drawn from the corpus
    order = calibrate.drawn_prompts(prompt_count(tokenizer, "python-docs", 300, 6), 0)
    assert drawn == {"calibration": order[:2], "held_out": order[2:4]} and order[:4] != [0, 1, 2, 3]
    for index in drawn["calibration"]:
        ids = prompt_ids(tokenizer, "python-docs", 300, index, 6)
        assert compare(model, None, ids, cfg, 6).teacher_forced_match == 100.0
    held = {row["configuration"]: row for row in data["held_out"]}
    assert set(held) == {"calibrated", "uniform S=97", "uniform S=1009"} and held["calibrated"]["prompts"] == 2
    markdown = (out / "calibration.md").read_text()
    assert "Held out: 2 prompts the search never saw" in markdown and "![trials](front.png)" in markdown
    assert all((out / name).stat().st_size > 0 for name in ("front.png", "supports.png", "trials.csv"))
    assert len((out / "trials.csv").read_text().splitlines()) == 1 + 6
    # what the budget was chosen for travels with it (found by probing: used at another W or B, or on a model of
    # another layer count, it ran without a word, the missing layers at --support)
    written = json.loads((out / "budget.json").read_text())
    assert (written["window"], written["block_size"], written["layers"]) == (64, 16, 2)
    budget_run = ["run", "--model", str(tiny_model_dir), "--context", "300", "--support", "97", "--tokens", "3"]
    capsys.readouterr()
    assert main([*budget_run, "--window", "32", "--budget", str(out / "budget.json")]) == 2
    assert "--window 32 differs from budget file" in capsys.readouterr().err
    other = json.loads(written_text := (out / "budget.json").read_text()) | {"layers": 3}
    (tmp_path / "three.json").write_text(json.dumps(other))
    assert main([*budget_run, "--budget", str(tmp_path / "three.json")]) == 2
    assert "made for a model of 3 attention layers" in capsys.readouterr().err
    two = [*budget_run[:-3], "97,113", *budget_run[-2:]]  # --support 97,113: both labels one configuration
    assert main([*two, "--budget", str(out / "budget.json")]) == 2
    assert "one configuration under 2 labels" in capsys.readouterr().err
    assert written_text == (out / "budget.json").read_text()
    built = []
    build = calibration_units.UnitsSpec.build
    monkeypatch.setattr(calibration_units.UnitsSpec, "build", lambda spec, *a, **k: built.append(spec.first) or
                        build(spec, *a, **k))  # fmt: skip
    assert main([*args, "--held-out-from", "3", "--trials", "8"]) == 0  # resumed: six trials kept, two more run
    assert built == [0, 3]  # the calibration prompts from 0, the held-out ones from 3
    again = json.loads((out / "calibration.json").read_text())
    assert len(again["trials"]) == 8 and again["trials"][:6] == trials and again["settings"]["held_out_from"] == 3
    assert again["settings"]["prompt_indices"]["held_out"] == order[3:5]
    assert (
        "Held out: 2 prompts the search never saw (corpus prompts drawn at random"
        in (out / "calibration.md").read_text()
    )
    built.clear()
    assert main([*args, "--held-out-from", "3", "--trials", "8"]) == 0  # no trial left: the held-out check alone
    assert built == [3], "a resumed study with no trial left builds no calibration references"
    capsys.readouterr()
    assert main([*args[:-4], "--tokens", "5", "--out", str(out), "--trials", "8"]) == 2
    assert "holds a search of other settings (tokens differ)" in capsys.readouterr().err
    assert main([*args, "--split", "order", "--trials", "8"]) == 2  # a study drawn at random is not resumed in order
    assert "holds a search of other settings (split differ)" in capsys.readouterr().err
    ordered = [*args[:-1], str(tmp_path / "ordered"), "--split", "order", "--held-out-from", "3", "--trials", "2"]
    assert main(ordered) == 0  # in the corpus's order: prompts 0-1, held out 3-4
    data = json.loads((tmp_path / "ordered" / "calibration.json").read_text())
    assert data["settings"]["prompt_indices"] == {"calibration": None, "held_out": None}
    assert "never saw (indices 3-4)" in (tmp_path / "ordered" / "calibration.md").read_text()


def test_a_search_choosing_nothing_leaves_no_earlier_budget(tiny_model_dir, tmp_path, capsys):
    """Found by probing: a search that met no target left an earlier search's budget.json and supports.png in the
    folder, which --budget then ran as this folder's choice."""
    out = tmp_path / "c"
    out.mkdir()
    (out / "budget.json").write_text('{"layer_supports": {"0": 1009, "1": 1009}}')
    (out / "supports.png").write_bytes(b"an earlier plot")
    args = ["calibrate", "--model", str(tiny_model_dir), "--context", "300", "--choices", "97,113"]
    args += ["--target", "tf-match>=100", "--prompts", "2", "--held-out", "2", "--tokens", "6", "--out", str(out)]
    assert main([*args, "--trials", "2"]) == 0, capsys.readouterr().err
    assert json.loads((out / "calibration.json").read_text())["chosen"] is None
    assert not (out / "budget.json").exists() and not (out / "supports.png").exists()


def test_bad_calibrations_are_refused_in_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    base = ["calibrate", "--model", str(tiny_model_dir), "--context", "300", "--out", str(tmp_path / "c")]
    for extra, message in [
        (["--target", "tf-match>=90", "--held-out", "0"], "never saw"),
        (["--target", "tf-match>=90", "--choices", "97"], "two or more distinct supports"),
        (["--target", "tf-match>=90", "--choices", "97,100"], "support 100"),
        (["--target", "speed>=2"], "a target is one of"),
        (["--target", "tf-match>=90", "--prompts", "4000", "--held-out", "4000"], "need 8000"),  # before measuring
        (["--target", "tf-match>=90", "--held-out-from", "5000"], "--held-out-from 5000 and --held-out 4 need 5004"),
        (["--target", "tf-match>=90", "--prompts", "3", "--held-out-from", "2"], "would hold out calibration prompts"),
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


def _fake_measure(model, units, cfg, targets=(), *, prune=False):
    """Rows that depend on the supports alone (a support under 385 costs match), so a search runs in milliseconds."""
    import optuna

    layers = len(cfg.layer_supports)
    loss = sum(4.0 * (cfg.for_layer(i).support < 385) + 2.0 * (cfg.for_layer(i).support < 193) for i in range(layers))
    rows = []
    for index in range(len(units.prompts)):
        row = {"teacher_forced_match": 100.0 - loss - index, "delta_ppl_percent": loss / 2, "first_divergence": 0}
        rows.append(row)
        if prune and calibrate.hopeless(targets, rows, units.prompts[len(rows) :]):
            raise optuna.TrialPruned()
    return {"corpus": rows, "tasks": []}


def _search_trials(study) -> list:
    return [(t.params, t.state.name, t.value, t.user_attrs.get("means")) for t in calibrate.finished(study)]


def test_a_trial_left_running_or_waiting_is_failed_and_the_search_goes_on_as_if_never_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "measure", _fake_measure)
    search = calibrate.Search(
        model="fake", selector="mean-pooled", context=4096, tokens=8, prompts=2, choices=(97, 193, 385, 769),
        targets=("tf-match>=90",), layers=6, seed=3,
    )  # fmt: skip
    base, units = SparseConfig(support=97), calibrate.Units(prompts=[{}, {}], references=[None, None])
    whole = calibrate.open_study(tmp_path / "whole.db", search)
    best = calibrate.run_search(None, units, base, search, whole, 16)
    for stop in (2, 11):  # among the uniform trials, and after TPE's 8 random ones
        study = calibrate.open_study(tmp_path / f"stopped{stop}.db", search)
        calibrate.run_search(None, units, base, search, study, stop)
        study.ask()  # what a SIGKILL mid-trial leaves: one trial running ...
        study.enqueue_trial({f"layer_{i}": 769 for i in range(6)})  # ... and one waiting
        resumed = calibrate.open_study(tmp_path / f"stopped{stop}.db", search)
        again = calibrate.run_search(None, units, base, search, resumed, 16)
        assert [t.state.name for t in resumed.trials].count("FAIL") == 2
        assert _search_trials(resumed) == _search_trials(whole)
        assert again.params == best.params and again.value == best.value
    trials = _search_trials(whole)
    assert [t[0]["layer_0"] for t in trials[:4]] == [97, 193, 385, 769]  # the uniform supports first
    assert len({json.dumps(t[0], sort_keys=True) for t in trials}) > 8, "the sampler proposed different supports"
    reseeded = calibrate.Search(**{**search.record(), "seed": 4})
    other = calibrate.open_study(tmp_path / "seed4.db", reseeded)
    calibrate.run_search(None, units, base, reseeded, other, 16)
    assert _search_trials(other) != trials, "the seed decides the proposals"


def test_a_configuration_proposed_again_is_told_what_it_measured_without_measuring_again(tmp_path, monkeypatch):
    measured = []

    def counting(model, units, cfg, targets=(), *, prune=False):
        measured.append([cfg.for_layer(i).support for i in range(2)])
        return _fake_measure(model, units, cfg, targets, prune=prune)

    monkeypatch.setattr(calibrate, "measure", counting)
    search = calibrate.Search(
        model="fake", selector="mean-pooled", context=4096, tokens=8, prompts=3, choices=(193, 385),
        targets=("tf-match>=95",), layers=2, seed=1, groups=1,
    )  # fmt: skip
    base, units = SparseConfig(support=97), calibrate.Units(prompts=[{}] * 3, references=[None] * 3)
    study = calibrate.open_study(tmp_path / "s.db", search)
    best = calibrate.run_search(None, units, base, search, study, 6)  # two configurations exist: four repeats
    assert sorted(measured) == [[193, 193], [385, 385]]
    trials = calibrate.finished(study)
    assert [t.user_attrs.get("repeat_of") for t in trials[:2]] == [None, None]
    for trial in trials[2:]:
        earlier = trials[trial.user_attrs["repeat_of"]]
        assert trial.params == earlier.params and trial.state == earlier.state and trial.value == earlier.value
        assert trial.user_attrs.get("means") == earlier.user_attrs.get("means")
        assert trial.user_attrs.get("constraints") == earlier.user_attrs.get("constraints")
    # 193 matches 92 and 91 on its first two prompts, out of the target's reach: pruned, and so are its repeats
    assert {t.params["group_0"]: t.state.name for t in trials} == {193: "PRUNED", 385: "COMPLETE"}
    assert best.params == {"group_0": 385} and best.number == 1


class _Rounds:
    """An executor of :func:`calibrate.run_search` in this process: each trial's rows from :func:`_fake_measure`,
    handed back in reverse order (Ray's come back as they finish); ``fail_at`` raises at that unit, as a driver
    killed mid-round stops."""

    def __init__(self, workers: int, units, fail_at: int | None = None):
        self.description, self.units, self.fail_at, self.seen = {"workers": workers}, units, fail_at, 0

    def run(self, work, total):
        import optuna

        results = []
        for unit in work:
            self.seen += 1
            if self.seen == self.fail_at:
                raise KeyboardInterrupt
            targets = [calibrate.parse_target(t) for t in unit.targets]
            try:
                rows = _fake_measure(None, self.units, unit.config, targets, prune=True)
            except optuna.TrialPruned:
                rows = None
            results.append((unit, [{"number": unit.number, "pruned": rows is None, "rows": rows}]))
        yield from reversed(results)


def _round_search():
    """A fake search in rounds of three trials: ``(search, base config, units)``."""
    search = calibrate.Search(
        model="fake", selector="mean-pooled", context=4096, tokens=8, prompts=2, choices=(97, 193, 385, 769),
        targets=("tf-match>=90",), layers=6, seed=3, batch=3,
    )  # fmt: skip
    return search, SparseConfig(support=97), calibrate.Units(prompts=[{}, {}], references=[None, None])


def test_rounds_of_trials_resume_to_the_uninterrupted_search(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "measure", _fake_measure)  # the local search's, for the batch of one below
    search, base, units = _round_search()
    whole = calibrate.open_study(tmp_path / "whole.db", search)
    best = calibrate.run_search(None, None, base, search, whole, 16, execute=_Rounds(3, units))
    trials = _search_trials(whole)
    assert len(trials) == 16 and [t[0]["layer_0"] for t in trials[:4]] == [97, 193, 385, 769]
    assert len({json.dumps(t[0], sort_keys=True) for t in trials}) > 8, "the sampler proposed different supports"
    for fail_at in (2, 14):  # in the first round, and in a later one
        study = calibrate.open_study(tmp_path / f"stopped{fail_at}.db", search)
        with pytest.raises(KeyboardInterrupt):
            calibrate.run_search(None, None, base, search, study, 16, execute=_Rounds(3, units, fail_at))
        resumed = calibrate.open_study(tmp_path / f"stopped{fail_at}.db", search)
        again = calibrate.run_search(None, None, base, search, resumed, 16, execute=_Rounds(3, units))
        assert _search_trials(resumed) == trials and again.params == best.params
    single = calibrate.Search(**{**search.record(), "batch": 1})
    one = calibrate.open_study(tmp_path / "one.db", single)
    calibrate.run_search(None, None, base, single, one, 16, execute=_Rounds(1, units))
    local = calibrate.open_study(tmp_path / "local.db", single)
    calibrate.run_search(None, units, base, single, local, 16)
    assert _search_trials(one) == _search_trials(local), "rounds of one trial are the local search's trials"
    assert _search_trials(one)[:4] == trials[:4] and _search_trials(one) != trials
    with pytest.raises(SparseDecodeError, match="batch differ"):
        calibrate.open_study(tmp_path / "whole.db", single)


def test_a_round_stopped_while_its_trials_are_told_resumes_to_the_uninterrupted_search(tmp_path, monkeypatch):
    """Found by probing: a stop after some of a round's trials were told (the told ones finished, the rest running)
    proposed the rest again after their round-mates had finished, so the resumed search drew other trials than one
    never stopped; they are now measured with the parameters they were proposed with."""
    monkeypatch.setattr(calibrate, "measure", _fake_measure)
    search, base, units = _round_search()
    whole = calibrate.open_study(tmp_path / "whole.db", search)
    calibrate.run_search(None, None, base, search, whole, 16, execute=_Rounds(3, units))
    told, stopped = calibrate.conclude, calibrate.open_study(tmp_path / "stopped.db", search)

    def stop_mid_round(study, *args):
        if len(calibrate.finished(study)) >= 9 and len(calibrate.finished(study)) % 3:
            raise KeyboardInterrupt  # a round partly told
        told(study, *args)

    monkeypatch.setattr(calibrate, "conclude", stop_mid_round)
    with pytest.raises(KeyboardInterrupt):
        calibrate.run_search(None, None, base, search, stopped, 16, execute=_Rounds(3, units))
    assert len(calibrate.finished(stopped)) % 3, "the stop should leave a round partly told"
    monkeypatch.setattr(calibrate, "conclude", told)
    resumed = calibrate.open_study(tmp_path / "stopped.db", search)
    calibrate.run_search(None, None, base, search, resumed, 16, execute=_Rounds(3, units))
    assert _search_trials(resumed) == _search_trials(whole)


def _finished_and_running(db: Path) -> tuple[int, int]:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=0.1) as connection:
            states = [state for (state,) in connection.execute("SELECT state FROM trials")]
    except sqlite3.Error:  # not made yet, or being written
        return 0, 0
    return sum(s in ("COMPLETE", "PRUNED") for s in states), states.count("RUNNING")


def test_a_search_killed_mid_trial_resumes_to_the_uninterrupted_result(tmp_path, capsys):
    """SIGKILL a real ``calibrate`` process while a trial runs, after TPE's random trials: the rerun fails that
    trial, runs the rest and ends with the trials and the choice of a search never stopped."""
    model_dir = tmp_path / "tiny4"
    tiny_model("llama", layers=4).save_pretrained(model_dir)
    char_tokenizer().save_pretrained(model_dir)
    args = ["calibrate", "--model", str(model_dir), "--context", "300", "--choices", "97,193,1009", "--tokens", "8"]
    args += ["--target", "tf-match>=90", "--prompts", "2", "--held-out", "1", "--trials", "14", "--seed", "1"]
    import torch

    killed = tmp_path / "killed"
    threads = str(torch.get_num_threads())  # the killed run sums in the order this process does
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": threads}
    proc = subprocess.Popen([sys.executable, "-m", "sparsedecode", *args, "--out", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    deadline, state = time.monotonic() + 300, (0, 0)
    while time.monotonic() < deadline and proc.poll() is None:
        state = _finished_and_running(killed / "study.db")
        if state[0] >= 10 and state[1] == 1:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done, running = _finished_and_running(killed / "study.db")
    assert 10 <= done < 14 and running == 1, f"the kill should land in a trial ({done} finished, {running} running)"
    assert main([*args, "--out", str(killed)]) == 0
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0, capsys.readouterr().err
    resumed, whole = (json.loads((tmp_path / n / "calibration.json").read_text()) for n in ("killed", "whole"))
    assert len(resumed["failed_trials"]) == 1 and whole["failed_trials"] == []

    def kept(trial):
        return {k: v for k, v in trial.items() if k != "number"}  # a failed trial took a number

    assert [kept(t) for t in resumed["trials"]] == [kept(t) for t in whole["trials"]]
    assert resumed["chosen"] == whole["chosen"] and resumed["chosen"] is not None
    assert resumed["held_out"] == whole["held_out"]


TWO_TASKS = ("niah_single_noise", "vt")


@pytest.fixture(scope="module")
def ended_model_dir(tmp_path_factory):
    """A tiny Llama whose end token is the one its dense answers settle into after a few tokens (id 26), so answers
    end, and end later where sparse decoding wanders."""
    path = tmp_path_factory.mktemp("tiny-ended")
    model = tiny_model("llama")
    model.generation_config.eos_token_id = 26
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def _eval_route(model, tokenizer, samples, cfg) -> list[dict]:
    """The samples answered by ``eval``'s own code (a prefill of its own per sample): its rows for ``cfg``."""
    from sparsedecode.experiments.eval_sample import run_sample

    rows = []
    for sample in samples:
        key = (sample.task, sample.context, sample.index, "mean-pooled", 97)
        rows += run_sample(model, tokenizer, sample, [key], {("mean-pooled", 97): cfg})
    return rows


def test_calibrate_meets_task_targets_measured_as_eval_measures_them(ended_model_dir, tmp_path, capsys):
    from sparsedecode.experiments.calibration_tasks import task_samples

    out = tmp_path / "c"
    args = ["calibrate", "--model", str(ended_model_dir), "--context", "600", "--choices", "97,1009", "--tokens", "4"]
    args += ["--tasks", ",".join(TWO_TASKS), "--target", "task-accuracy>=dense-0", "--target", "length-ratio<=1.05"]
    args += ["--prompts", "2", "--held-out", "1", "--trials", "4", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    data = json.loads((out / "calibration.json").read_text())
    assert data["settings"]["tasks"] == list(TWO_TASKS)
    model, tokenizer = load_model(str(ended_model_dir))
    samples = task_samples(tokenizer, TWO_TASKS, 600, range(2))
    assert sum(t["state"] == "complete" for t in data["trials"]) >= 2
    for trial in data["trials"]:
        if trial["state"] == "complete":  # each finished trial's values are eval's on the calibration samples
            cfg = calibrate.layer_config(SparseConfig(support=97), trial["supports"])
            rows = _eval_route(model, tokenizer, samples, cfg)
            assert set(trial["means"]) == {"task-accuracy", "length-ratio", "dense task-accuracy"}
            assert trial["means"]["task-accuracy"] == pytest.approx(100 * sum(r["score"] for r in rows) / 4)
            assert trial["means"]["dense task-accuracy"] == pytest.approx(100 * sum(r["dense_score"] for r in rows) / 4)
            dense = [r["output_tokens"] for r in _eval_route(model, tokenizer, samples, SparseConfig(support=4096))]
            ratio = sum(r["output_tokens"] for r in rows) / sum(dense)
            assert trial["means"]["length-ratio"] == pytest.approx(ratio)
            assert trial["feasible"] == (
                ratio <= 1.05 and trial["means"]["task-accuracy"] >= trial["means"]["dense task-accuracy"]
            )
    uniform = {tuple(t["supports"]): t for t in data["trials"][:2]}
    assert not uniform[(97, 97)]["feasible"], "support 97 answers longer than dense on these samples"
    assert uniform[(1009, 1009)]["feasible"] and uniform[(1009, 1009)]["means"]["length-ratio"] == 1.0
    assert data["chosen"] is not None and data["chosen"] != [97, 97]
    held = {row["configuration"]: row for row in data["held_out"]}
    assert held["calibrated"]["samples"] == 2 and held["calibrated"]["prompts"] == 0
    assert held["uniform S=1009"]["length-ratio"] == {"mean": 1.0, "low": 1.0, "high": 1.0}
    assert set(held["uniform S=97"]["targets_met"]) == {"task-accuracy>=dense", "length-ratio<=1.05"}
    markdown = (out / "calibration.md").read_text()
    assert "answer length, sparse / dense" in markdown and "1 samples of each of the tasks" in markdown


def test_bad_task_targets_are_refused_in_one_line(tiny_model_dir, tmp_path, capsys):
    base = ["calibrate", "--model", str(tiny_model_dir), "--context", "600", "--out", str(tmp_path / "c")]
    for extra, message in [
        (["--target", "length-ratio<=1.05", "--tasks", "vt"], "this model and tokenizer name none"),  # no end token
        (["--target", "task-accuracy>=dense-2", "--tasks", "vt,nope"], "unknown task(s) nope"),
        (["--target", "task-accuracy>=dense-2", "--tasks", "vt", "--answer-tokens", "0"], "--answer-tokens must"),
        (["--target", "task-accuracy>=dense-2", "--tasks", "vt", "--context", "1000"], "exceeds the model's 1024"),
        (["--target", "length-ratio>=1"], "a target is one of"),
    ]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "c").exists()


def test_a_reuse_search_costs_the_selection_at_one_step_in_r():
    mean, quest = SparseConfig(support=193, reuse=2), SparseConfig(support=193, selector="quest")
    blocks = (4096 - 1 - 64) // 16  # complete distant blocks at context 4096 (window 64, blocks of 16)
    assert calibrate.selection_cost(mean, 4096) == blocks * 1 / 2 / 2  # one mean per block, two vectors a position
    assert calibrate.selection_cost(quest, 4096) == blocks * 2 / 2  # min and max per block, R = 1
    assert calibrate.selection_cost(SparseConfig(support=1009), 300) == 0.0  # reads the whole context: no selection
    cfg = calibrate.layer_config(SparseConfig(support=97, reuse=4), [97, 1009])
    assert calibrate.cost(cfg, 2, 300) == (97 + 300) / 2  # the supports alone, as without a reuse search
    assert calibrate.cost(cfg, 2, 300, selection=True) == (97 + (300 - 65) // 16 / 8 + 300) / 2
    for selector in ("random-blocks", "streaming", "h2o"):
        with pytest.raises(SparseDecodeError, match=f"{selector} keeps none"):
            calibrate.check_reuse_search(SparseConfig(support=97, selector=selector), (1, 2))
    with pytest.raises(SparseDecodeError, match="distinct intervals R >= 1"):
        calibrate.check_reuse_search(SparseConfig(support=97), (2, 2))


def test_calibrate_searches_the_reuse_interval(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "c"
    args = ["calibrate", "--model", str(tiny_model_dir), "--context", "300", "--choices", "97,1009", "--tokens", "8"]
    args += ["--target", "tf-match>=90", "--prompts", "2", "--held-out", "1", "--trials", "8"]
    assert main([*args, "--search-reuse", "1,4", "--out", str(out)]) == 0, capsys.readouterr().err
    data = json.loads((out / "calibration.json").read_text())
    assert data["settings"]["reuses"] == [1, 4]
    assert [(t["supports"], t["reuse"]) for t in data["trials"][:2]] == [([97, 97], 1), ([1009, 1009], 1)]
    assert any(t["reuse"] == 4 and t["state"] == "complete" for t in data["trials"]), "the sampler tried R = 4"
    model, tokenizer = load_model(str(tiny_model_dir))
    for trial in data["trials"]:
        cfg = calibrate.layer_config(SparseConfig(support=97, reuse=trial["reuse"]), trial["supports"])
        if trial["state"] == "complete":  # its cost counts the selection, its match is the paired protocol's at its R
            assert trial["cost"] == calibrate.cost(cfg, 2, 300, selection=True)
            drawn = data["settings"]["prompt_indices"]["calibration"]  # drawn at random (--split random)
            ids = [prompt_ids(tokenizer, "python-docs", 300, index, 8) for index in drawn]
            tf = [compare(model, None, one, cfg, 8).teacher_forced_match for one in ids]
            assert trial["means"]["tf-match"] == pytest.approx(sum(tf) / 2)
    best = min((t for t in data["trials"] if t["feasible"]), key=lambda t: t["cost"])
    assert (data["chosen"], data["chosen_reuse"]) == (best["supports"], best["reuse"])
    held = {row["configuration"]: row for row in data["held_out"]}
    assert held["calibrated"]["reuse"] == best["reuse"] and held["uniform S=97"]["reuse"] == 1
    assert f"at reuse R = {best['reuse']}" in (out / "calibration.md").read_text()
    budget = read_budget(out / "budget.json")  # the chosen R travels with the supports
    assert budget["reuse"] == best["reuse"] and budget["selector"] == "mean-pooled"
    assert main([*args, "--out", str(out)]) == 2  # the same folder without the reuse search: other settings
    assert "reuses differ" in capsys.readouterr().err
    assert main([*args, "--selector", "h2o", "--search-reuse", "1,2", "--out", str(tmp_path / "d")]) == 2
    assert "h2o keeps none" in capsys.readouterr().err


def test_calibrate_searches_a_selector_parameter_costing_an_adaptive_one_by_what_it_read(
    tiny_model_dir, tmp_path, capsys
):
    out = tmp_path / "c"
    args = ["calibrate", "--model", str(tiny_model_dir), "--context", "300", "--choices", "97,1009", "--tokens", "6"]
    args += ["--target", "tf-match>=80", "--prompts", "2", "--held-out", "1", "--trials", "7"]
    args += ["--selector", "block-top-p", "--search-param", "p=0.3,0.99"]
    assert main([*args, "--out", str(out)]) == 0, capsys.readouterr().err
    data = json.loads((out / "calibration.json").read_text())
    assert data["settings"]["params"] == {"p": [0.3, 0.99]}
    assert {t["params"]["p"] for t in data["trials"]} == {0.3, 0.99}, "the sampler tried both values"
    model, tokenizer = load_model(str(tiny_model_dir))
    drawn = data["settings"]["prompt_indices"]["calibration"]  # drawn at random (--split random)
    ids = [prompt_ids(tokenizer, "python-docs", 300, index, 6) for index in drawn]
    for trial in (t for t in data["trials"] if t["state"] == "complete"):
        # the cost of an adaptive selector is what its sparse layers read on the calibration prompts
        cfg = calibrate.layer_config(SparseConfig(support=97, selector=f"block-top-p:p={trial['params']['p']}"),
                                     trial["supports"])  # fmt: skip
        results = [compare(model, None, one, cfg, 6) for one in ids]
        rows = [{"support_read_mean": r.support_read_mean} for r in results]
        assert trial["cost"] == pytest.approx(calibrate.measured_cost(cfg, 2, 300, rows, selection=False))
        assert trial["means"]["tf-match"] == pytest.approx(sum(r.teacher_forced_match for r in results) / 2)
        sparse = [s for s in trial["supports"] if s < 300]
        if sparse:  # a sparse layer reads at most its support
            assert trial["cost"] <= calibrate.cost(cfg, 2, 300)
    best = min((t for t in data["trials"] if t["feasible"]), key=lambda t: t["cost"])
    budget = read_budget(out / "budget.json")
    assert budget["selector"] == data["chosen_selector"] == f"block-top-p:p={best['params']['p']}"
    assert f"with the selector `{budget['selector']}`" in (out / "calibration.md").read_text()
    ran = tmp_path / "run.json"  # the budget's selector and supports are what run decodes with
    run = ["run", "--model", str(tiny_model_dir), "--context", "300", "--support", "97", "--tokens", "4"]
    assert main([*run, "--budget", str(out / "budget.json"), "--json", str(ran)]) == 0, capsys.readouterr().err
    settings = json.loads(ran.read_text())["results"][0]["settings"]
    assert settings["selector"] == budget["selector"]
    assert settings["layer_supports"] == [[i, s] for i, s in enumerate(data["chosen"])]
    capsys.readouterr()
    for extra, message in [
        (["--search-param", "q=1,2"], "no parameter 'q'"),
        (["--search-param", "p=0.5"], "two or more distinct values"),
        (["--search-param", "p=0.5,x"], "parameter p='x' is not float"),
        (["--search-param", "p=0.5,0.6", "--search-param", "p=0.7,0.8"], "names a parameter twice"),
        (["--search-param", "p"], "NAME=V1,V2"),
    ]:
        assert main([*args[:-2], *extra, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    tasks = ["calibrate", "--model", str(tiny_model_dir), "--selector", "block-top-p", "--out", str(tmp_path / "t")]
    assert main([*tasks, "--target", "task-accuracy>=50"]) == 2
    assert "add a tf-match or dppl target" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "t").exists()


def test_the_measured_cost_counts_dense_and_covering_layers_whole():
    cfg = SparseConfig(support=193, selector="block-top-p", dense_layers=(0,), layer_supports={2: 1009})
    rows = [{"support_read_mean": 100.0}, {"support_read_mean": 120.0}, {"support_read_mean": None}]
    assert calibrate.measured_cost(cfg, 4, 300, rows, selection=False) == (300 + 110 + 300 + 110) / 4
    assert calibrate.measured_cost(cfg, 4, 300, [], selection=False) == calibrate.cost(cfg, 4, 300)
    assert calibrate.cost(cfg, 4, 300) == (300 + 193 + 300 + 193) / 4  # a dense layer reads the context


def test_a_selector_whose_reads_vary_is_costed_by_what_it_read_and_needs_a_corpus_target():
    vary = calibrate.reads_vary
    assert vary(SparseConfig(selector="quest")) and vary(SparseConfig(selector="block-top-p"))
    assert not vary(SparseConfig(selector="quest:grouping=mean-query")) and not vary(SparseConfig())
    search = calibrate.Search(model="m", selector="quest", context=300, tokens=4, prompts=1, choices=(97, 1009),
                              targets=("tf-match>=90",), layers=2)  # fmt: skip
    quest = calibrate.layer_config(SparseConfig(support=97, selector="quest"), [97, 1009])
    rows = {"corpus": [{"support_read_mean": 130.0}], "tasks": []}  # the union of a group's query heads' positions
    assert search.cost(quest, rows) == (130 + 300) / 2 and search.cost(quest) == (97 + 300) / 2
    mean = calibrate.layer_config(SparseConfig(support=97), [97, 1009])
    assert search.cost(mean, rows) == (97 + 300) / 2  # one support per KV head: its reads are the support
    calibrate.check_costable(SparseConfig(selector="quest"), [calibrate.parse_target("dppl<=5")])
    with pytest.raises(SparseDecodeError, match="quest reads a support per query head.*add a tf-match or dppl"):
        calibrate.check_costable(SparseConfig(selector="quest"), [calibrate.parse_target("task-accuracy>=50")])
    grouped, tasks = SparseConfig(selector="quest:grouping=mean-query"), [calibrate.parse_target("task-accuracy>=50")]
    assert calibrate.check_param_search(grouped, {}, tasks) == {}
    with pytest.raises(SparseDecodeError, match="reads a support per query head"):  # one of the values would
        calibrate.check_param_search(grouped, {"grouping": ["mean-query", "per-head"]}, tasks)


def test_the_front_plot_names_its_measure_on_the_axis(tmp_path, monkeypatch):
    from sparsedecode.reports import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    trials = [{"cost": 97.0, "means": {"tf-match": 90.0}, "feasible": False},
              {"cost": 193.0, "means": {"tf-match": 95.0}, "feasible": True}]  # fmt: skip
    held = [{"configuration": "uniform S=97", "cost": 97.0, "tf-match": {"mean": 91.0}}]
    plots.calibration_front(trials, held, tmp_path / "front.png", measure="tf-match", label="TF match %", higher=True,
                            title="t")  # fmt: skip
    axes = figures[0].axes[0]
    assert axes.get_ylabel() == "TF match %"
    assert [text.get_text() for text in axes.get_legend().get_texts()] == [
        "trial, targets missed",
        "trial, targets met",
    ]


def test_a_search_judged_at_the_bound_needs_the_intervals_safe_end_to_meet_the_target(tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate, "measure", _fake_measure)  # prompt i matches i points less: the units differ
    base, units = SparseConfig(support=97), calibrate.Units(prompts=[{}] * 4, references=[None] * 4)
    met = {}
    for feasible in ("mean", "bound"):
        search = calibrate.Search(
            model="fake", selector="mean-pooled", context=4096, tokens=8, prompts=4, choices=(97, 193, 385, 769),
            targets=("tf-match>=98",), layers=2, seed=3, feasible=feasible,
        )  # fmt: skip
        study = calibrate.open_study(tmp_path / f"{feasible}.db", search)
        calibrate.run_search(None, units, base, search, study, 4)  # the uniform supports
        complete = [t for t in calibrate.finished(study) if t.state.name == "COMPLETE"]
        assert [t.params["layer_0"] for t in complete] == [385, 769]  # 100, 99, 98, 97 per prompt: mean 98.5
        met[feasible] = [all(c <= 0 for c in t.user_attrs["constraints"]) for t in complete]
        if feasible == "bound":
            low = calibrate.bootstrap_interval([100.0, 99.0, 98.0, 97.0])[0]
            assert 97.0 <= low < 98.0 and all(t.user_attrs["bounds"] == {"tf-match": low} for t in complete)
    assert met == {"mean": [True, True], "bound": [False, False]}
    # the held-out check says both: met by the mean, not at the bound (the search's own standard)
    monkeypatch.setattr(calibration_units, "measure", _fake_measure)
    targets = [calibrate.parse_target("tf-match>=98")]
    (row,) = calibrate.held_out(
        None, units, {"uniform S=385": calibrate.layer_config(base, [385, 385])}, targets, search
    )
    assert row["targets_met"] == {"tf-match>=98": True} and row["targets_met_at_bound"] == {"tf-match>=98": False}


def test_a_search_by_groups_of_layers_gives_each_run_of_layers_one_support(
    tmp_path, monkeypatch, tiny_model_dir, capsys
):
    monkeypatch.setattr(calibrate, "measure", _fake_measure)
    base, units = SparseConfig(support=97), calibrate.Units(prompts=[{}] * 2, references=[None] * 2)
    search = calibrate.Search(
        model="fake", selector="mean-pooled", context=4096, tokens=8, prompts=2, choices=(97, 193, 385, 769),
        targets=("tf-match>=90",), layers=7, seed=1, groups=3,
    )  # fmt: skip
    assert search.names() == ["group_0", "group_1", "group_2"]
    study = calibrate.open_study(tmp_path / "groups.db", search)
    calibrate.run_search(None, units, base, search, study, 12)
    for trial in calibrate.finished(study):
        assert set(trial.params) == {"group_0", "group_1", "group_2"}
        supports = search.supports(trial.params)  # layers 0-2, 3-4, 5-6 (i * 3 // 7)
        assert supports == [trial.params[f"group_{g}"] for g in (0, 0, 0, 1, 1, 2, 2)]
        cfg = search.config(base, trial.params)
        assert [cfg.for_layer(i).support for i in range(7)] == supports
    assert len({tuple(search.supports(t.params)) for t in calibrate.finished(study)}) > 4  # the groups vary
    with pytest.raises(SparseDecodeError, match="groups differ"):
        calibrate.open_study(tmp_path / "groups.db", dataclasses.replace(search, groups=2))
    out = ["calibrate", "--model", str(tiny_model_dir), "--context", "300", "--target", "tf-match>=90"]
    assert main([*out, "--groups", "3", "--out", str(tmp_path / "c")]) == 2  # the tiny model has 2 layers
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at most 2 groups" in err


def test_a_study_made_before_a_setting_existed_resumes_with_its_default(tmp_path):
    """Studies stored without ``feasible`` and ``groups`` (added later) had their defaults: they resume."""
    search = calibrate.Search(
        model="m", selector="mean-pooled", context=2048, tokens=64, prompts=8, choices=(97, 193),
        targets=("tf-match>=90",), layers=30,
    )  # fmt: skip
    study = calibrate.open_study(tmp_path / "old.db", search)
    old = {k: v for k, v in search.record().items() if k not in ("feasible", "groups")}
    study.set_user_attr("search", old)
    calibrate.open_study(tmp_path / "old.db", search)  # resumed
    with pytest.raises(SparseDecodeError, match="feasible differ"):
        calibrate.open_study(tmp_path / "old.db", dataclasses.replace(search, feasible="bound"))


def test_a_task_study_of_an_older_task_generator_is_not_resumed(tmp_path):
    """A search over task samples records the generators' version: a study made before it was recorded (version 1,
    whose cwe samples differ) is refused rather than resumed with other samples; one without task targets resumes."""
    from sparsedecode.experiments.ruler import GENERATOR_VERSION

    common = dict(model="fake", selector="mean-pooled", context=4096, tokens=8, prompts=2, choices=(97, 193),
                  layers=2)  # fmt: skip
    tasks = calibrate.Search(**common, targets=("task-accuracy>=90",), tasks=("cwe",), generator=GENERATOR_VERSION)
    corpus = calibrate.Search(**common, targets=("tf-match>=90",))
    for search, resumes in ((tasks, False), (corpus, True)):
        path = tmp_path / f"{search.targets[0][:4]}.db"
        study = calibrate.open_study(path, search)
        older = {k: v for k, v in search.record().items() if k != "generator"}  # as a study made before it recorded
        study.set_user_attr("search", older)
        if resumes:
            calibrate.open_study(path, search)
        else:
            with pytest.raises(SparseDecodeError, match=r"other settings \(generator differ\)"):
                calibrate.open_study(path, search)


def test_a_held_out_sample_that_cannot_be_built_is_refused_before_the_search(ended_model_dir, tmp_path, capsys):
    """Found by probing: the held-out task samples were built only after the search, so one that no haystack size
    fits (fwe's sample 1 at 920 tokens of the char tokenizer; with SmolLM2, fwe's sample 4 at 1024) stopped the command
    after every trial had run, and again on every rerun."""
    out = tmp_path / "c"
    args = ["calibrate", "--model", str(ended_model_dir), "--context", "920", "--tasks", "fwe", "--answer-tokens", "2"]
    args += ["--target", "task-accuracy>=dense", "--choices", "97,1009", "--prompts", "1", "--held-out", "1"]
    assert main([*args, "--trials", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fwe, context 920, sample 1: task fwe could not be fitted" in err, err
    assert not (out / "study.db").exists(), "refused before any trial"
