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
    union_spec,
    upgrade_rows_file,
    without_timings,
)
from sparsedecode.protocol.results import FIRST_DIVERGENCE_CONVENTION

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


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM])
def test_a_kill_then_rerun_equals_an_uninterrupted_run(tiny_model_dir, tmp_path, stop):
    """SIGKILL mid-sweep, or SIGTERM (what kill, timeout and SLURM send first), then a rerun: the rows of an
    uninterrupted sweep. SIGTERM cleans up as Ctrl-C does: exit 143, one line, no lock file left (found by probing:
    an empty .lock was left)."""
    from sparsedecode.experiments.sweep_folder import LOCK_FILE

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
    import torch

    # the killed run sums in the order this process does: its thread count (a parallel worker runs one)
    threads = str(torch.get_num_threads())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": threads}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparsedecode", *args, "--out", str(killed)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    runs = killed / RUNS_FILE
    deadline = time.monotonic() + 300  # a loaded machine imports slowly; it stops at 2 rows
    while time.monotonic() < deadline and proc.poll() is None:
        if runs.exists() and runs.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.005)
    os.kill(proc.pid, stop)
    err = proc.communicate()[1]
    if stop == signal.SIGTERM:
        assert proc.returncode == 143 and err.strip() == "sparsedecode: terminated", err[-500:]
        assert not (killed / LOCK_FILE).exists()
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
    assert "extending" not in capsys.readouterr().out
    assert main([*base, "--tokens", "6", "--support", "97,113", *out]) == 0  # more supports: the grid grows
    assert "extending the grid of" in capsys.readouterr().out and "supports: [97] -> [97, 113]" in " ".join(
        json.loads((tmp_path / "s" / "sweep.json").read_text())["sessions"][-1]["extended"]
    )
    assert (tmp_path / "s" / RUNS_FILE).read_bytes().startswith(before) and len(rows_of(tmp_path / "s")) == 2


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
    # a folder listed twice counts its rows twice, as two copies would: 12 of "all" and shard1's 4 again
    assert outcome.rows == 12 and outcome.missing == 0 and outcome.duplicates == 16
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
    spec = SweepSpec.from_dict(meta["spec"])
    assert spec.selectors == ("mean-pooled",) and {key_of(r) for r in rows} == set(spec.keys())
    assert spec.contexts == (2048, 8192, 16384), "the reference study's three contexts"
    # committed results are stored in the current first_divergence convention, not only upgraded when read
    stored = [json.loads(line) for line in (directory / RUNS_FILE).read_text().splitlines()]
    selector_runs = [
        run
        for path in sorted((directory.parents[1] / "selectors").glob("*/selectors.json"))
        for run in json.loads(path.read_text())["runs"]
    ]
    assert stored == rows and selector_runs
    assert all(r["first_divergence_convention"] == FIRST_DIVERGENCE_CONVENTION for r in stored + selector_runs)


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
    assert "quest given twice" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_selectors_spec_validation():
    from conftest import SELECTORS

    assert small_spec(selectors="quest").selectors == ("quest",)
    assert SweepSpec.from_dict(small_spec(selectors=SELECTORS).to_dict()).selectors == SELECTORS
    for bad in ((), ("quest", "quest"), ("nope",), (1,)):
        with pytest.raises(SparseDecodeError):
            small_spec(selectors=bad)
    with pytest.raises(SparseDecodeError, match="both 'selector' and 'selectors'"):
        SweepSpec.from_dict({"model": "m", "selector": "quest", "selectors": ["quest"]})


# --- the first_divergence convention of stored rows ---------------------------------------------------------


def as_convention_1(row: dict) -> dict:
    """A row as versions before ``first_divergence_convention`` wrote it (1-based, the shared token counted)."""
    old = {k: v for k, v in row.items() if k != "first_divergence_convention"}
    old["first_divergence"] = row["first_divergence"] + (0 if row["survives"] else 1)
    return old


def test_rows_of_the_old_convention_are_upgraded_on_load_and_rewritten_before_a_resume(loaded, tmp_path):
    spec = small_spec(contexts=(150,), supports=(97, 113, 1000))
    run_sweep(spec, tmp_path / "new", loaded=loaded)
    new_bytes = (tmp_path / "new" / RUNS_FILE).read_bytes()
    rows = rows_of(tmp_path / "new")
    assert all(r["first_divergence_convention"] == FIRST_DIVERGENCE_CONVENTION for r in rows)
    diverged = [r for r in rows if not r["survives"]]
    assert diverged and any(r["survives"] for r in rows), "both kinds of run are needed"
    for r in diverged:
        t = r["first_divergence"]
        assert 1 <= t < r["tokens"] and r["sparse_tokens"][:t] == r["dense_tokens"][:t]
        assert r["sparse_tokens"][t] != r["dense_tokens"][t]
    old = tmp_path / "old"
    old.mkdir()
    (old / "sweep.json").write_bytes((tmp_path / "new" / "sweep.json").read_bytes())
    lines = [json.dumps(as_convention_1(r), separators=(",", ":")) + "\n" for r in rows]
    (old / RUNS_FILE).write_text("".join(lines))
    assert load_sweep(old)[1] == rows, "upgraded on load, the file left alone"
    assert b"first_divergence_convention" not in (old / RUNS_FILE).read_bytes()
    # a resume after a kill (3 old rows on disk) rewrites them first: the file never mixes conventions
    (old / RUNS_FILE).write_text("".join(lines[:3]))
    outcome = run_sweep(spec, old, loaded=loaded)
    assert (outcome.done_before, outcome.ran) == (3, len(rows) - 3)
    assert stripped(rows_of(old)) == stripped(rows)
    assert all(b'"first_divergence_convention":2}' in line for line in (old / RUNS_FILE).read_bytes().splitlines())
    # upgrading a whole old file in place gives back the bytes the new code writes
    (old / RUNS_FILE).write_text("".join(lines))
    assert upgrade_rows_file(old / RUNS_FILE) == len(rows) and upgrade_rows_file(old / RUNS_FILE) == 0
    assert (old / RUNS_FILE).read_bytes() == new_bytes
    # merge writes upgraded rows too
    (old / RUNS_FILE).write_text("".join(lines))
    merge_sweeps([old], tmp_path / "merged")
    assert (tmp_path / "merged" / RUNS_FILE).read_bytes() == new_bytes


# --- growing the grid: resume with more, merge folders of different grids -----------------------------------


def test_a_resume_may_add_to_the_grid(loaded, tmp_path):
    small = small_spec(contexts=(150,), prompts=1, supports=(97,))
    run_sweep(small, tmp_path / "s", loaded=loaded)
    big = small_spec(contexts=(150, 220), prompts=2, supports=(97, 113), selectors=("mean-pooled", "streaming"))
    outcome = run_sweep(big, tmp_path / "s", loaded=loaded)
    assert (outcome.done_before, outcome.ran, outcome.total) == (1, 15, 16) and outcome.complete
    assert [line.split(": ", 1)[1] for line in outcome.extended] == [
        "contexts: [150] -> [150, 220]",
        "supports: [97] -> [97, 113]",
        "selectors: ['mean-pooled'] -> ['mean-pooled', 'streaming']",
        "prompts: 1 -> 2",
    ]
    meta, rows = load_sweep(tmp_path / "s")
    assert SweepSpec.from_dict(meta["spec"]) == big and meta["sessions"][-1]["extended"] == outcome.extended
    assert "extended" not in meta["sessions"][0]
    run_sweep(big, tmp_path / "whole", loaded=loaded)
    by_key = {key_of(r): r for r in stripped(rows)}
    assert by_key == {key_of(r): r for r in stripped(rows_of(tmp_path / "whole"))}
    assert run_sweep(big, tmp_path / "s", loaded=loaded).extended == [], "now the stored spec"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(contexts=(150, 220), tokens=8), "tokens: 10 vs 8"),  # a field outside the grid
        (dict(contexts=(220,)), r"contexts: \[150\] vs \[220\]"),  # a stored context missing
        (dict(prompts=1, supports=(97, 113)), "prompts: 2 vs 1"),  # fewer prompts
        (dict(supports=(113, 97)), r"supports: \[97, 113\] vs \[113, 97\]"),  # reordered: not an extension
    ],
)
def test_a_resume_that_is_no_grid_extension_is_refused(loaded, tmp_path, change, message):
    stored = small_spec(contexts=(150,), prompts=2, supports=(97, 113), tokens=10)
    (tmp_path / "s").mkdir()
    meta = {"spec": stored.to_dict(), "corpus_sha256": None, "shard": "1/1", "sessions": []}
    (tmp_path / "s" / "sweep.json").write_text(json.dumps(meta))
    with pytest.raises(SparseDecodeError, match=message):
        run_sweep(small_spec(**{**stored.to_dict(), **change}), tmp_path / "s", loaded=loaded)
    assert json.loads((tmp_path / "s" / "sweep.json").read_text()) == meta
    assert not (tmp_path / "s" / RUNS_FILE).exists()


def test_a_sharded_folder_does_not_grow(loaded, tmp_path):
    spec = small_spec(contexts=(150,), prompts=2, supports=(97,))
    run_sweep(spec, tmp_path / "s", shard=Shard(1, 2), loaded=loaded)
    with pytest.raises(SparseDecodeError, match="cannot grow shard by shard"):
        run_sweep(
            small_spec(contexts=(150,), prompts=3, supports=(97,)), tmp_path / "s", shard=Shard(1, 2), loaded=loaded
        )
    run_sweep(small_spec(contexts=(150,), prompts=1, supports=(97,)), tmp_path / "u", loaded=loaded)
    with pytest.raises(SparseDecodeError, match="cannot grow shard by shard"):
        run_sweep(
            small_spec(contexts=(150,), prompts=2, supports=(97,)), tmp_path / "u", shard=Shard(1, 2), loaded=loaded
        )


def test_merge_of_folders_of_different_grids_gives_their_union(loaded, tmp_path):
    base = small_spec(contexts=(150,), prompts=2, supports=(97, 113))
    run_sweep(base, tmp_path / "committed", loaded=loaded)
    more = small_spec(contexts=(220,), prompts=2, supports=(97, 113))  # the new context in a folder of its own
    run_sweep(more, tmp_path / "new", loaded=loaded)
    union = small_spec(contexts=(150, 220), prompts=2, supports=(97, 113))
    run_sweep(union, tmp_path / "whole", loaded=loaded)
    outcome = merge_sweeps([tmp_path / "new"], tmp_path / "committed")  # into the committed folder
    assert (outcome.rows, outcome.duplicates, outcome.missing) == (8, 0, 0)
    meta, rows = load_sweep(tmp_path / "committed")
    assert SweepSpec.from_dict(meta["spec"]) == union and meta["merged_from"] == ["../new"], "relative to the folder"
    assert stripped(rows) == stripped(rows_of(tmp_path / "whole")), "the order of an unsharded sweep of the union"
    assert merge_sweeps([tmp_path / "new"], tmp_path / "committed").duplicates == 4, "again: identical overlap is fine"
    assert run_sweep(union, tmp_path / "committed", loaded=loaded).ran == 0
    # a field outside the grid differs: refused, nothing written
    run_sweep(small_spec(contexts=(220,), prompts=1, supports=(97,), tokens=8), tmp_path / "t8", loaded=loaded)
    before = (tmp_path / "committed" / RUNS_FILE).read_bytes()
    with pytest.raises(SparseDecodeError, match="outside the grid.*tokens: 10 vs 8"):
        merge_sweeps([tmp_path / "t8"], tmp_path / "committed")
    # the same run with other results in folders of different grids: refused
    other = tmp_path / "other"
    other.mkdir()
    meta = json.loads((tmp_path / "new" / "sweep.json").read_text())
    meta["spec"]["supports"] = [97]
    (other / "sweep.json").write_text(json.dumps(meta))
    row = next(r for r in rows_of(tmp_path / "new") if r["support"] == 97)
    (other / RUNS_FILE).write_text(json.dumps({**row, "teacher_forced_match": 1.0}) + "\n")
    with pytest.raises(SparseDecodeError, match="other results"):
        merge_sweeps([other], tmp_path / "committed")
    # or paired with another dense reference
    (other / RUNS_FILE).write_text(json.dumps({**row, "dense_tokens": [t + 1 for t in row["dense_tokens"]]}) + "\n")
    with pytest.raises(SparseDecodeError, match="different dense references"):
        merge_sweeps([other], tmp_path / "committed")
    assert (tmp_path / "committed" / RUNS_FILE).read_bytes() == before
    assert union_spec([base, more]) == union and union_spec([more, base]).contexts == (220, 150)


@pytest.mark.parametrize("name", ["eval.json", RUNS_FILE])
def test_the_library_refuses_a_folder_holding_another_experiments_runs(loaded, tmp_path, name):
    """run_sweep and merge_sweeps, not only the command line: a folder without sweep.json that holds an evaluation
    (eval.json) or runs of its own is refused before anything is written there."""
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / name).write_text("{}\n")
    sweep = tmp_path / "sweep"
    run_sweep(small_spec(contexts=(150,), supports=(97,), prompts=1), sweep, loaded=loaded)
    for act in (
        lambda: run_sweep(small_spec(), folder, loaded=loaded),
        lambda: merge_sweeps([folder], tmp_path / "merged"),
        lambda: merge_sweeps([sweep], folder),
    ):
        with pytest.raises(SparseDecodeError, match="holds runs that are not a sweep's"):
            act()
    assert sorted(p.name for p in folder.iterdir()) == [name]


def test_an_interrupt_at_a_rows_fsync_keeps_the_whole_row_and_a_failed_fsync_undoes_it(tmp_path, monkeypatch):
    """SIGTERM (a KeyboardInterrupt here) arriving in ``fsync`` after the whole line was written undid that row, so a
    sweep killed there lost a finished run (the kill-and-rerun test saw 1 row where it had waited for 2); an fsync
    that fails (the row may not be on disk) still undoes it."""
    from sparsedecode.experiments import sweep_rows

    path = tmp_path / RUNS_FILE
    sweep_rows.append_row(path, {"run": 0})
    for error, kept in ((KeyboardInterrupt(), True), (OSError(5, "Input/output error"), False)):

        def failing(fd, error=error):
            raise error

        monkeypatch.setattr(sweep_rows.os, "fsync", failing)
        with pytest.raises(type(error)):
            sweep_rows.append_row(path, {"run": 1})
        monkeypatch.undo()
        assert [row["run"] for row in sweep_rows.parse_rows(path)] == ([0, 1] if kept else [0])
        path.write_text('{"run":0}\n')
