"""The survival sweep on a tiny model: determinism, kill and resume, refusal of changed settings, shards, merge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import char_tokenizer, tiny_model

from sparsedecode import SparseDecodeError
from sparsedecode.cli import main
from sparsedecode.experiments.sweep import (
    RUNS_FILE,
    Shard,
    SweepSpec,
    key_of,
    load_sweep,
    locked,
    merge_sweeps,
    read_rows,
    run_sweep,
    without_timings,
)

REQUIRED = (
    "context",
    "prompt_index",
    "support",
    "reuse",
    "selector",
    "effective_support",
    "first_divergence",
    "survives",
    "teacher_forced_match",
    "delta_ppl_percent",
    "dense_ppl",
    "sparse_ppl",
    "dense_tokens",
    "sparse_tokens",
)


@pytest.fixture(scope="module")
def loaded():
    return tiny_model("llama"), char_tokenizer()


def small_spec(**overrides) -> SweepSpec:
    settings = dict(model="tiny", contexts=(150, 220), supports=(97, 1000), prompts=2, tokens=10)
    settings.update(overrides)
    return SweepSpec(**settings)


def rows_of(directory: Path) -> list[dict]:
    return read_rows(directory / RUNS_FILE)


def stripped(rows: list[dict]) -> list[dict]:
    return [without_timings(row) for row in rows]


def test_rows_have_the_fields_and_full_support_is_exact(loaded, tmp_path):
    spec = small_spec()
    outcome = run_sweep(spec, tmp_path / "s", loaded=loaded)
    rows = rows_of(tmp_path / "s")
    assert outcome.complete and outcome.ran == len(rows) == 2 * 2 * 2
    assert [key_of(row) for row in rows] == spec.keys()
    for row in rows:
        assert all(name in row for name in REQUIRED)
        assert {"prefill_s", "sparse_decode_s", "teacher_forced_s", "run_s"} <= {n for n in row if n.endswith("_s")}
        assert len(row["dense_tokens"]) == len(row["sparse_tokens"]) == 10
    full = [row for row in rows if row["support"] == 1000]
    assert all(r["survives"] and r["teacher_forced_match"] == 100.0 and r["delta_ppl_percent"] == 0.0 for r in full)
    # one dense reference per (context, prompt): every support of a group sees the same dense run
    for context, prompt in spec.groups():
        group = [r for r in rows if (r["context"], r["prompt_index"]) == (context, prompt)]
        assert len({json.dumps(r["dense_tokens"]) for r in group}) == 1 and len({r["dense_ppl"] for r in group}) == 1


def test_two_runs_give_identical_rows_except_timings(loaded, tmp_path):
    spec = small_spec(supports=(97, 113))
    run_sweep(spec, tmp_path / "a", loaded=loaded)
    run_sweep(spec, tmp_path / "b", loaded=loaded)
    a, b = rows_of(tmp_path / "a"), rows_of(tmp_path / "b")
    assert stripped(a) == stripped(b)
    assert any(not row["survives"] for row in a), "a sweep where nothing diverges would test little"


def test_torn_last_line_is_dropped_and_the_run_redone(loaded, tmp_path):
    spec = small_spec()
    reference = tmp_path / "ref"
    run_sweep(spec, reference, loaded=loaded)
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "sweep.json").write_bytes((reference / "sweep.json").read_bytes())
    lines = (reference / RUNS_FILE).read_bytes().splitlines(keepends=True)
    (killed / RUNS_FILE).write_bytes(b"".join(lines[:3]) + lines[3][:40])  # a write cut by SIGKILL
    assert len(rows_of(killed)) == 3, "the torn line is not a row"
    outcome = run_sweep(spec, killed, loaded=loaded)
    assert outcome.done_before == 3 and outcome.ran == 5
    assert stripped(rows_of(killed)) == stripped(rows_of(reference))


def test_a_finished_group_skips_its_dense_reference(loaded, tmp_path, monkeypatch):
    import sparsedecode.experiments.sweep as sweep

    spec = small_spec(contexts=(150,), prompts=2)
    run_sweep(spec, tmp_path / "s", shard=Shard(1, 2), loaded=loaded)  # group (150, 0)
    calls = []
    real = sweep.dense_reference
    monkeypatch.setattr(sweep, "dense_reference", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    merge_sweeps([tmp_path / "s"], tmp_path / "s")  # now an unsharded folder holding group (150, 0)
    outcome = run_sweep(spec, tmp_path / "s", loaded=loaded)
    assert outcome.done_before == 2 and outcome.ran == 2 and len(calls) == 1


def test_sigkill_then_rerun_equals_an_uninterrupted_run(tiny_model_dir, tmp_path):
    args = [
        "sweep",
        "--model",
        str(tiny_model_dir),
        "--context",
        "150,220",
        "--support",
        "97,113",
        "--prompts",
        "3",
        "--tokens",
        "16",
    ]
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparsedecode", *args, "--out", str(killed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    runs = killed / RUNS_FILE
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if runs.exists() and runs.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = len(rows_of(killed))
    total = 2 * 3 * 2
    assert 2 <= before < total, f"the kill should land mid-sweep ({before} of {total} rows)"
    assert main([*args, "--out", str(killed)]) == 0
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    resumed, whole = rows_of(killed), rows_of(tmp_path / "whole")
    assert len({key_of(row) for row in resumed}) == len(resumed) == total, "no row duplicated or missing"
    assert stripped(resumed) == stripped(whole)


def test_changed_settings_are_refused_with_the_differing_fields(tiny_model_dir, tmp_path, capsys):
    base = ["sweep", "--model", str(tiny_model_dir), "--context", "150", "--support", "97", "--prompts", "1"]
    out = ["--out", str(tmp_path / "s")]
    assert main([*base, "--tokens", "6", *out]) == 0
    before = (tmp_path / "s" / RUNS_FILE).read_bytes()
    capsys.readouterr()
    assert main([*base, "--tokens", "8", "--support", "97,113", *out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokens: 6 vs 8" in err and "supports: [97] vs [97, 113]" in err
    assert main([*base, "--tokens", "6", "--shard", "1/2", *out]) == 2
    assert "sparsedecode merge" in capsys.readouterr().err
    assert (tmp_path / "s" / RUNS_FILE).read_bytes() == before, "nothing written by a refused run"
    assert main([*base, "--tokens", "6", *out]) == 0  # same settings: resumes (nothing left to do)
    assert (tmp_path / "s" / RUNS_FILE).read_bytes() == before


def test_shards_partition_groups_and_merge_equals_unsharded(loaded, tmp_path):
    spec = small_spec(contexts=(150, 220), prompts=3, supports=(97, 113))
    run_sweep(spec, tmp_path / "all", loaded=loaded)
    shards = [Shard(i, 3) for i in (1, 2, 3)]
    groups = [g for shard in shards for g in shard.groups(spec)]
    assert sorted(groups) == sorted(spec.groups()) and len(set(groups)) == len(groups)
    for shard in shards:
        run_sweep(spec, tmp_path / f"shard{shard.index}", shard=shard, loaded=loaded)
    # merging the shards in any order, twice over, yields the unsharded rows once each
    sources = [tmp_path / "shard3", tmp_path / "shard1", tmp_path / "shard2", tmp_path / "shard1", tmp_path / "all"]
    outcome = merge_sweeps(sources, tmp_path / "merged")
    assert outcome.rows == 12 and outcome.missing == 0 and outcome.duplicates == 12  # a folder listed twice counts once
    meta, merged = load_sweep(tmp_path / "merged")
    assert stripped(merged) == stripped(rows_of(tmp_path / "all"))
    assert meta["shard"] is None and SweepSpec.from_dict(meta["spec"]) == spec
    # a merged folder resumes like an unsharded one
    assert run_sweep(spec, tmp_path / "merged", loaded=loaded).ran == 0


def test_merge_refuses_another_spec(loaded, tmp_path):
    run_sweep(small_spec(contexts=(150,), prompts=1), tmp_path / "a", loaded=loaded)
    run_sweep(small_spec(contexts=(150,), prompts=1, tokens=8), tmp_path / "b", loaded=loaded)
    with pytest.raises(SparseDecodeError, match="tokens: 10 vs 8"):
        merge_sweeps([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    with pytest.raises(SparseDecodeError, match="not a sweep directory"):
        merge_sweeps([tmp_path / "a", tmp_path / "nothing"], tmp_path / "m")


def test_concurrent_writer_is_refused(loaded, tmp_path):
    with locked(tmp_path / "s"), pytest.raises(SparseDecodeError, match="another process"):
        run_sweep(small_spec(contexts=(150,), prompts=1), tmp_path / "s", loaded=loaded)


def test_corrupt_middle_line_and_bad_specs(tmp_path):
    path = tmp_path / RUNS_FILE
    path.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(SparseDecodeError, match="line 2"):
        read_rows(path)
    for bad in (dict(supports=(97, 97)), dict(supports=(50,)), dict(prompts=0), dict(tokens=1), dict(reuse=())):
        with pytest.raises(SparseDecodeError):
            small_spec(**bad)
    for text in ("0/2", "3/2", "a/b", "1"):
        with pytest.raises(SparseDecodeError):
            Shard.parse(text)
    assert SweepSpec.from_dict({"model": "m"}) == SweepSpec(model="m")


def test_too_few_prompts_in_the_corpus(loaded, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("x" * 400)
    with pytest.raises(SparseDecodeError, match="fewer than --prompts 2"):
        run_sweep(small_spec(corpus=str(small), contexts=(150,)), tmp_path / "s", loaded=loaded)
    assert not (tmp_path / "s").exists(), "nothing written for a refused sweep"


def test_resume_refuses_a_dense_reference_that_changed(loaded, tmp_path):
    spec = small_spec(contexts=(150,), prompts=1)
    run_sweep(spec, tmp_path / "ref", loaded=loaded)
    first = rows_of(tmp_path / "ref")[0]
    first["dense_tokens"] = [t + 1 for t in first["dense_tokens"]]  # as if made with another thread count
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "sweep.json").write_bytes((tmp_path / "ref" / "sweep.json").read_bytes())
    (partial / RUNS_FILE).write_text(json.dumps(first) + "\n")
    with pytest.raises(SparseDecodeError, match="dense reference of context 150, prompt 0 differs"):
        run_sweep(spec, partial, loaded=loaded)
    assert len(rows_of(partial)) == 1


# --- several selectors: one more dimension of the grid ---------------------------------------------------------

TWO = ("mean-pooled", "streaming")


def test_several_selectors_share_each_dense_reference_and_resume(loaded, tmp_path, monkeypatch):
    import sparsedecode.experiments.sweep as sweep

    spec = small_spec(contexts=(150,), prompts=2, selectors=TWO)
    assert spec.keys() == [(150, p, s, 1, sel) for p in (0, 1) for sel in TWO for s in (97, 1000)]
    calls = []
    real = sweep.dense_reference
    monkeypatch.setattr(sweep, "dense_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_sweep(spec, tmp_path / "whole", loaded=loaded)
    rows = rows_of(tmp_path / "whole")
    assert [key_of(r) for r in rows] == spec.keys() and len(calls) == 2, "one dense reference per group"
    for group in spec.groups():
        mine = [r for r in rows if (r["context"], r["prompt_index"]) == group]
        assert len({json.dumps(r["dense_tokens"]) for r in mine}) == 1
    assert all(r["survives"] and r["delta_ppl_percent"] == 0.0 for r in rows if r["support"] == 1000)
    at_97 = {r["selector"]: r["sparse_ppl"] for r in rows if (r["prompt_index"], r["support"]) == (0, 97)}
    assert at_97["mean-pooled"] != at_97["streaming"], "each run used its own selector"
    # killed after 3 of 8 rows (the middle of group 0), torn line included: the rerun adds exactly the rest
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "sweep.json").write_bytes((tmp_path / "whole" / "sweep.json").read_bytes())
    lines = (tmp_path / "whole" / RUNS_FILE).read_bytes().splitlines(keepends=True)
    (killed / RUNS_FILE).write_bytes(b"".join(lines[:3]) + lines[3][:30])
    outcome = run_sweep(spec, killed, loaded=loaded)
    assert (outcome.done_before, outcome.ran) == (3, 5)
    assert stripped(rows_of(killed)) == stripped(rows)
    # and with a selector list in another order the spec differs: refused, not silently mixed
    with pytest.raises(SparseDecodeError, match=r"selectors: \['mean-pooled', 'streaming'\] vs \['streaming'"):
        run_sweep(small_spec(contexts=(150,), prompts=2, selectors=TWO[::-1]), killed, loaded=loaded)


def test_shards_of_a_several_selector_sweep_merge_into_the_unsharded_one(loaded, tmp_path):
    spec = small_spec(contexts=(150,), prompts=2, supports=(97,), tokens=6, selectors=("random-blocks", "quest"))
    run_sweep(spec, tmp_path / "all", loaded=loaded)
    for index in (1, 2):
        run_sweep(spec, tmp_path / f"shard{index}", shard=Shard(index, 2), loaded=loaded)
    outcome = merge_sweeps([tmp_path / "shard2", tmp_path / "shard1"], tmp_path / "merged")
    assert (outcome.rows, outcome.missing) == (4, 0)
    meta, merged = load_sweep(tmp_path / "merged")
    assert stripped(merged) == stripped(rows_of(tmp_path / "all"))
    assert meta["spec"]["selectors"] == ["random-blocks", "quest"] and SweepSpec.from_dict(meta["spec"]) == spec


def legacy(directory: Path) -> dict:
    """Rewrite a one-selector sweep.json as the versions before ``selectors`` wrote it: ``"selector": name``."""
    meta = json.loads((directory / "sweep.json").read_text())
    meta["spec"]["selector"] = meta["spec"].pop("selectors")[0]
    (directory / "sweep.json").write_text(json.dumps(meta))
    return meta


def test_a_one_selector_folder_of_the_old_format_loads_and_resumes(tiny_model_dir, tmp_path, capsys):
    base = ["sweep", "--model", str(tiny_model_dir), "--context", "150", "--support", "97,113", "--prompts", "1"]
    out = tmp_path / "old"
    assert main([*base, "--tokens", "6", "--selector", "quest", "--out", str(out)]) == 0
    whole = rows_of(out)
    assert legacy(out)["spec"]["selector"] == "quest"
    (out / RUNS_FILE).write_bytes((out / RUNS_FILE).read_bytes().splitlines(keepends=True)[0])  # stopped after 1
    meta, rows = load_sweep(out)
    assert SweepSpec.from_dict(meta["spec"]).selectors == ("quest",) and len(rows) == 1
    capsys.readouterr()
    assert main([*base, "--tokens", "6", "--selector", "quest", "--out", str(out)]) == 0
    assert "resuming" in capsys.readouterr().out
    assert stripped(rows_of(out)) == stripped(whole)
    assert json.loads((out / "sweep.json").read_text())["spec"]["selector"] == "quest", "the stored spec is kept"
    # the same folder named through --selectors resumes too (nothing left); another selector is refused
    assert main([*base, "--tokens", "6", "--selectors", "quest", "--out", str(out)]) == 0
    assert main([*base, "--tokens", "6", "--out", str(out)]) == 2
    assert "selectors: ['quest'] vs ['mean-pooled']" in capsys.readouterr().err


def test_the_committed_qwen_sweep_still_loads():
    directory = Path(__file__).parents[1] / "docs" / "reports" / "qwen2.5-coder-0.5b"
    meta, rows = load_sweep(directory)
    assert "selector" in meta["spec"], "written before selectors"
    spec = SweepSpec.from_dict(meta["spec"])
    assert spec.selectors == ("mean-pooled",) and {key_of(r) for r in rows} <= set(spec.keys()) and rows


def test_cli_selectors_list_and_the_one_line_refusal_of_both_flags(tiny_model_dir, tmp_path, capsys):
    base = ["sweep", "--model", str(tiny_model_dir), "--context", "150", "--support", "97", "--prompts", "1"]
    out = tmp_path / "s"
    assert main([*base, "--tokens", "5", "--selectors", "streaming, oracle-tokens", "--out", str(out)]) == 0
    assert [r["selector"] for r in rows_of(out)] == ["streaming", "oracle-tokens"]
    assert json.loads((out / "sweep.json").read_text())["spec"]["selectors"] == ["streaming", "oracle-tokens"]
    capsys.readouterr()
    bogus = ["sweep", "--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "t")]
    assert main([*bogus, "--selector", "quest", "--selectors", "quest,h2o"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--selector NAME or --selectors A,B,C, not both" in err
    assert main([*bogus, "--selectors", "quest,nope"]) == 2
    assert "unknown selector 'nope'" in capsys.readouterr().err
    assert main([*bogus, "--selectors", "quest,quest"]) == 2
    assert "selectors lists a selector twice" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_selectors_spec_validation():
    from sparsedecode.config import SELECTORS

    assert small_spec(selectors="quest").selectors == ("quest",)
    assert SweepSpec.from_dict(small_spec(selectors=SELECTORS).to_dict()).selectors == SELECTORS
    for bad in ((), ("quest", "quest"), ("nope",), (1,)):
        with pytest.raises(SparseDecodeError):
            small_spec(selectors=bad)
    with pytest.raises(SparseDecodeError, match="both 'selector' and 'selectors'"):
        SweepSpec.from_dict({"model": "m", "selector": "quest", "selectors": ["quest"]})
