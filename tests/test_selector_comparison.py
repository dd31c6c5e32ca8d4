"""compare-selectors with the passkey retrieval column, on a tiny random model (no downloads)."""

from __future__ import annotations

import csv
import json

import pytest
from conftest import char_tokenizer, tiny_model

from sparsedecode import SparseDecodeError
from sparsedecode.cli import main
from sparsedecode.experiments import selector_comparison
from sparsedecode.experiments.selector_comparison import compare_selectors, retrieval_depths

FULL = 1009  # 1 + W + 59 B: covers a 300-token prompt plus question and answer, so sparse reads everything


@pytest.fixture(scope="module")
def loaded():
    return tiny_model("llama"), char_tokenizer()


def run(loaded, **overrides):
    """compare_selectors on one short prompt (T = 3) of the python-docs corpus."""
    settings = dict(
        corpus="python-docs", contexts=(300,), supports=(97,), prompts=1, tokens=3, selectors=("streaming",)
    )
    settings.update(overrides)
    return compare_selectors(*loaded, **settings)


def test_retrieval_depths_spread_from_start_to_question():
    assert retrieval_depths(0) == () and retrieval_depths(1) == (0.5,)
    assert retrieval_depths(3) == (0.0, 0.5, 1.0) and retrieval_depths(5)[1] == 0.25


def test_retrieval_is_off_by_default(loaded):
    rows, _, trials = run(loaded, contexts=(200,))
    assert trials == []
    assert [
        (r.retrieval_trials, r.retrieval_correct, r.retrieval_accuracy, r.dense_retrieval_correct) for r in rows
    ] == [(0, None, None, None)]


def test_every_selector_answers_the_same_passkey_trials_and_full_support_answers_like_dense(loaded):
    selectors = ("mean-pooled", "streaming", "oracle-tokens")
    rows, runs, trials = run(loaded, supports=(97, FULL), selectors=selectors, retrieval=2)
    assert len(runs) == len(selectors) * 2
    assert len(trials) == 2 * (1 + len(selectors) * 2)  # per trial: dense + every (selector, support)
    dense = {t["trial"]: t for t in trials if t["mode"] == "dense"}
    assert [dense[i]["depth"] for i in (0, 1)] == [0.0, 1.0] and dense[0]["passkey"] != dense[1]["passkey"]
    sparse = [t for t in trials if t["mode"] == "sparse"]
    assert sorted((t["selector"], t["support"], t["trial"]) for t in sparse) == sorted(
        (s, S, i) for s in selectors for S in (97, FULL) for i in (0, 1)
    )
    for t in sparse:
        assert t["passkey"] == dense[t["trial"]]["passkey"], "every selector answers the dense trial's prompt"
        if t["support"] == FULL:
            assert t["answer_ids"] == dense[t["trial"]]["answer_ids"] and t["sparse_steps"] == 0
        else:
            assert t["sparse_steps"] > 0 and t["captured_mass_ratio_mean"] is not None
    dense_correct = sum(t["correct"] for t in dense.values())
    for row in rows:
        assert row.retrieval_trials == 2 and row.dense_retrieval_correct == dense_correct
        mine = [t["correct"] for t in sparse if (t["selector"], t["support"]) == (row.selector, row.support)]
        assert row.retrieval_correct == sum(mine) and row.retrieval_accuracy == sum(mine) / 2
        if row.support == FULL:
            assert row.retrieval_correct == dense_correct


def test_retrieval_accuracy_is_counted_per_context_selector_and_support(loaded, monkeypatch):
    """A random model finds no passkey, so the aggregation is checked on trials whose outcome is fixed here."""
    outcome = {  # (context, selector, support) -> correct answers of trial 0, 1, 2; None: dense
        (300, None, None): [True, True, False],
        (300, "streaming", 97): [True, False, False],
        (300, "streaming", 113): [True, True, False],
        (300, "quest", 97): [False, False, False],
        (300, "quest", 113): [True, True, True],
        (320, None, None): [False, False, False],
        (320, "streaming", 97): [False, True, False],
        (320, "streaming", 113): [False, False, False],
        (320, "quest", 97): [True, False, False],
        (320, "quest", 113): [False, False, True],
    }

    def fake_trial(model, tokenizer, prompt, configs, *, trial, answer_tokens):
        expected = [(s, S) for s in ("streaming", "quest") for S in (97, 113)]
        assert [(c.selector_name, c.support) for c in configs] == expected
        trials = []
        for cfg in [None, *configs]:
            selector, support = (None, None) if cfg is None else (cfg.selector_name, cfg.support)
            mode = "dense" if cfg is None else "sparse"
            correct = outcome[prompt.context, selector, support][trial]
            trials.append(
                {
                    "context": prompt.context,
                    "mode": mode,
                    "selector": selector,
                    "support": support,
                    "trial": trial,
                    "correct": correct,
                }
            )
        return trials

    monkeypatch.setattr(selector_comparison, "run_trial", fake_trial)
    rows, _, trials = run(
        loaded, contexts=(300, 320), supports=(97, 113), selectors=("streaming", "quest"), retrieval=3
    )
    assert len(trials) == 2 * 3 * 5
    got = {(r.context, r.selector, r.support): (r.retrieval_correct, r.retrieval_trials) for r in rows}
    assert got == {key: (sum(found), 3) for key, found in outcome.items() if key[1] is not None}
    assert {r.context: r.dense_retrieval_correct for r in rows} == {300: 2, 320: 0}
    assert next(r for r in rows if (r.context, r.selector, r.support) == (320, "quest", 97)).retrieval_accuracy == 1 / 3


def test_bad_retrieval_counts_and_too_short_contexts_are_refused_before_any_run(loaded, monkeypatch):
    monkeypatch.setattr(selector_comparison, "dense_reference", lambda *a, **k: pytest.fail("ran before refusing"))
    with pytest.raises(SparseDecodeError, match="retrieval must be an integer >= 0"):
        run(loaded, retrieval=-1)
    with pytest.raises(SparseDecodeError, match="too short for the passkey prompt"):
        run(loaded, contexts=(150,), retrieval=1)


def test_cli_writes_the_retrieval_column(tiny_model_dir, tmp_path, capsys):
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "300", "--support", f"97,{FULL}"]
    args += ["--prompts", "1", "--tokens", "3", "--selectors", "streaming,random-blocks", "--out", str(tmp_path)]
    assert main([*args, "--retrieval", "2"]) == 0
    stdout = capsys.readouterr().out
    data = json.loads((tmp_path / "selectors.json").read_text())
    assert data["settings"]["retrieval"] == 2 and len(data["retrieval"]) == 2 * (1 + 2 * 2)
    assert all(row["retrieval_trials"] == 2 and 0 <= row["retrieval_accuracy"] <= 1 for row in data["summary"])
    with open(tmp_path / "selectors.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["selector"], r["support"], r["retrieval_trials"]) for r in table] == [
        ("streaming", "97", "2"),
        ("streaming", str(FULL), "2"),
        ("random-blocks", "97", "2"),
        ("random-blocks", str(FULL), "2"),
    ]
    markdown = (tmp_path / "selectors.md").read_text()
    assert "--retrieval 2`" in markdown and "| passkey found |" in markdown
    header = next(line for line in markdown.splitlines() if "| context |" in line)
    lines = [line.split(" | ") for line in markdown.splitlines() if line.startswith("| 300 |")]
    column, selector, support = (header.split(" | ").index(c) for c in ("passkey found", "selector", "S"))
    dense = sum(t["correct"] for t in data["retrieval"] if t["mode"] == "dense")
    assert {(cells[selector], int(cells[support])): cells[column] for cells in lines} == {
        (row["selector"], row["support"]): f"{row['retrieval_correct']}/2" for row in data["summary"]
    }
    assert f"Dense attention found the passkey in {dense}/2 at context 300" in markdown
    assert "Dense attention found the passkey" in stdout


def test_cli_without_retrieval_shows_a_dash_and_refuses_a_negative_count(tiny_model_dir, tmp_path, capsys):
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "200", "--support", "97"]
    args += ["--prompts", "1", "--tokens", "3", "--selectors", "streaming", "--out", str(tmp_path)]
    assert main(args) == 0
    markdown = (tmp_path / "selectors.md").read_text()
    (line,) = [line for line in markdown.splitlines() if line.startswith("| 200 |")]
    header = next(line for line in markdown.splitlines() if "| context |" in line)
    assert line.split(" | ")[header.split(" | ").index("passkey found")] == "-"
    produced = next(line for line in markdown.splitlines() if line.startswith("Produced by"))
    assert "Dense attention found the passkey" not in markdown and "--retrieval" not in produced
    capsys.readouterr()
    assert main([*args, "--retrieval", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--retrieval must be >= 0" in err


def test_op_time_only_where_the_support_is_sparse(tiny_model_dir, tmp_path, capsys):
    """At S >= context decoding reads everything densely: no sparse call to time (and none is attempted)."""
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "200,300", "--support", "97,257"]
    args += ["--prompts", "1", "--tokens", "3", "--selectors", "streaming,mean-pooled", "--out", str(tmp_path)]
    assert main(args) == 0
    summary = json.loads((tmp_path / "selectors.json").read_text())["summary"]
    timed = {(r["context"], r["selector"], r["support"]): r["op_ms"] for r in summary}
    assert len(timed) == 8
    assert all((ms is not None and ms > 0) == (context > support) for (context, _, support), ms in timed.items())


def test_op_times_are_matched_to_their_support_and_use_the_decoding_kernel(monkeypatch):
    """bench_op may return several kernels per support; each (context, support) must get its own auto-kernel time."""
    from sparsedecode.experiments import selector_comparison
    from sparsedecode.experiments.bench import bench_op as real_bench_op

    asked = []

    def fake_bench_op(shape, contexts, supports, **kwargs):
        asked.append(kwargs.get("kernels"))
        rows, bandwidth = real_bench_op(shape, contexts, supports, budget_s=0.001, kernels=kwargs.get("kernels"))
        for row in rows:
            row.sparse_ms = (
                row.context + row.support / 1000
            )  # effective support, a value that says which row it came from
        return list(reversed(rows)), bandwidth  # order must not matter

    monkeypatch.setattr(selector_comparison, "bench_op", fake_bench_op)
    times = selector_comparison._op_times((4, 2, 16, 2), (300, 400), (97, 200), ("mean-pooled",))
    assert asked == [("auto",)]
    effective = {97: 97, 200: 193}  # 200 is floored to whole blocks: 1 + 64 + 8 * 16
    assert times == {(n, "mean-pooled", s): n + effective[s] / 1000 for n in (300, 400) for s in (97, 200)}


def test_captured_best_column_is_against_the_best_reachable_set(loaded):
    rows, runs, _ = run(loaded, selectors=("oracle-blocks", "mean-pooled"), audit=True, tokens=4)
    by = {r.selector: r for r in rows}
    # oracle-blocks picks the group's best blocks, so it captures all of the best reachable mass ...
    assert by["oracle-blocks"].captured_mass_ratio == pytest.approx(1.0, abs=1e-12)  # float64 ratio of equal sums
    # ... but not all of each query head's own best, which a set shared by the group cannot reach
    assert by["oracle-blocks"].captured_mass_ratio_per_head_best < 1 - 1e-6
    for row in rows:
        mine = [r for r in runs if r["selector"] == row.selector]
        # the same float64 means, averaged in another order: approx's default 1e-6 relative is far above that
        assert row.captured_mass_ratio == pytest.approx(sum(r["captured_mass_ratio_mean"] for r in mine) / len(mine))
        assert 0 < row.captured_mass_ratio <= 1 + 1e-12 and 0 < row.captured_mass_ratio_per_head_best <= 1 + 1e-12


def test_dense_by_construction_rows_stand_apart_and_old_comparisons_are_rebuilt(tiny_model_dir, tmp_path, capsys):
    from sparsedecode.reports.sweep import write_report

    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "300", "--support", f"97,{FULL}"]
    args += ["--prompts", "2", "--tokens", "12", "--selectors", "streaming,quest", "--out", str(tmp_path)]
    assert main(args) == 0
    assert "dense by construction" in capsys.readouterr().out
    data = json.loads((tmp_path / "selectors.json").read_text())
    assert {(r["support"], r["dense_by_construction"]) for r in data["summary"]} == {(97, False), (FULL, True)}
    assert all(r["first_divergence_convention"] == 2 for r in data["runs"])
    markdown = (tmp_path / "selectors.md").read_text()
    main_table, apart = markdown.split("Dense by construction (effective S >= context + T - 1, T = 12)")
    assert "| 97 |" in main_table and f"| {FULL} |" not in main_table
    assert f"| 300 | streaming | yes | {FULL} | 2/2 | 12 |" in apart and "| 97 |" not in apart.split("What each")[0]
    saved = {name: (tmp_path / name).read_bytes() for name in ("selectors.json", "selectors.csv", "selectors.md")}
    # a comparison written under the old first_divergence convention (no mark, one more on diverged runs)
    diverged = [r for r in data["runs"] if not r["survives"]]
    assert diverged, "a comparison where nothing diverges would test little"
    for run in data["runs"]:
        del run["first_divergence_convention"]
        run["first_divergence"] += 0 if run["survives"] else 1
    for row in data["summary"]:
        row["median_first_divergence"] += 0.5
        del row["dense_by_construction"]
    (tmp_path / "selectors.json").write_text(json.dumps(data, indent=1))
    (tmp_path / "selectors.md").write_text("stale")
    assert write_report(tmp_path) == tmp_path / "selectors.md"
    assert {name: (tmp_path / name).read_bytes() for name in saved} == saved, "rebuilt exactly as written now"
    (tmp_path / "selectors.json").write_text("{}")
    assert main(["report", str(tmp_path)]) == 2
    assert "is not a selector comparison" in capsys.readouterr().err


def test_h2o_answers_retrieval_trials_with_its_prefill_history(loaded):
    rows, _, trials = run(loaded, supports=(97,), selectors=("h2o",), retrieval=1)
    assert [r.retrieval_trials for r in rows] == [1]
    assert any(t["selector"] == "h2o" and t["sparse_steps"] > 0 for t in trials)


def _comparable(data):
    """A comparison without what differs between processes: timings (fields ending in _s, op ms), environments."""

    def strip(row):
        return {k: v for k, v in row.items() if not k.endswith("_s") and k != "op_ms"}

    return [strip(r) for r in data["summary"]], [strip(r) for r in data["runs"]], [strip(t) for t in data["retrieval"]]


def test_merged_comparisons_equal_one_comparison_of_every_selector(tiny_model_dir, tmp_path, capsys):
    """Selectors run in two comparisons and merged give the rows one comparison of all of them gives; comparisons
    of other settings, of a shared selector or against another dense reference are refused, nothing written."""
    base = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "300", "--support", "97"]
    base += ["--prompts", "2", "--tokens", "4", "--retrieval", "2", "--batch", "2"]
    folders = {}
    for name, selectors in (("all", "streaming,block-top-p,quest"), ("a", "streaming"), ("b", "block-top-p,quest")):
        folders[name] = tmp_path / name
        assert main([*base, "--selectors", selectors, "--out", str(folders[name])]) == 0
    assert main(["merge", str(folders["a"]), str(folders["b"]), "--out", str(tmp_path / "merged")]) == 0
    assert "merged 2 comparison(s)" in capsys.readouterr().out
    merged = json.loads((tmp_path / "merged" / "selectors.json").read_text())
    whole = json.loads((folders["all"] / "selectors.json").read_text())
    assert merged["settings"]["selectors"] == ["streaming", "block-top-p", "quest"]
    assert [p["selectors"] for p in merged["settings"]["parts"]] == [["streaming"], ["block-top-p", "quest"]]
    assert _comparable(merged) == _comparable(whole)
    markdown = (tmp_path / "merged" / "selectors.md").read_text()
    assert "Merged by `sparsedecode merge` from 2 comparisons" in markdown
    top_p = [r for r in merged["summary"] if r["selector"] == "block-top-p"]
    assert top_p and all(r["support_read_min"] <= r["support_read_mean"] <= r["support_read_max"] <= 97 for r in top_p)
    other = [r for r in merged["summary"] if r["support_read_mean"] is not None and r["support_read_mean"] != 97]
    assert ("Positions read per KV head and sparse step" in markdown) == bool(other)
    per_head = [r for r in merged["summary"] if r["selector"] == "quest"]  # a KV head reads its query heads' union
    assert per_head and all(97 <= r["support_read_mean"] <= r["support_read_max"] for r in per_head)

    other = tmp_path / "other"
    assert main([*base[:-4], "--tokens", "5", "--selectors", "h2o", "--out", str(other)]) == 0
    changed = tmp_path / "changed"
    changed.mkdir()
    data = json.loads((folders["b"] / "selectors.json").read_text())
    data["runs"][0]["dense_tokens"][1] += 1
    (changed / "selectors.json").write_text(json.dumps(data))
    capsys.readouterr()
    for sources, message in (
        ([folders["a"], other], "differ from"),
        ([folders["all"], folders["b"]], "already in an earlier folder"),
        ([folders["a"], changed], "the dense continuation of prompt 0 at context 300 differs"),
    ):
        out = tmp_path / "refused"
        assert main(["merge", *map(str, sources), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        assert not out.exists()


def test_a_comparison_written_before_the_published_methods_merges_beside_them(tiny_model_dir, tmp_path, capsys):
    """A comparison of ``quest`` written before issue #39 (its runs without the selector's parameters) ran the
    group-mean variant: read, re-rendered and merged it is ``quest:grouping=mean-query``, beside today's ``quest``."""
    from sparsedecode.reports.sweep import write_report

    base = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "300", "--support", "97"]
    base += ["--prompts", "1", "--tokens", "4", "--retrieval", "1"]
    old, new = tmp_path / "old", tmp_path / "new"
    assert main([*base, "--selectors", "quest:grouping=mean-query", "--out", str(old)]) == 0
    assert main([*base, "--selectors", "quest", "--out", str(new)]) == 0
    data = json.loads((old / "selectors.json").read_text())
    variant = [r["sparse_tokens"] for r in data["runs"]]
    for record in (data["settings"], *data["summary"], *data["runs"], *data["retrieval"]):
        if record.get("selector") == "quest:grouping=mean-query":
            record["selector"] = "quest"  # as the selector was named then
    for run in data["runs"]:
        del run["settings"]["selector_params"]  # runs stored no parameters then
        run["settings"]["selector"] = "quest"
    data["settings"]["selectors"] = ["quest"]
    (old / "selectors.json").write_text(json.dumps(data))
    assert write_report(old) == old / "selectors.md"
    assert "| 300 | quest:grouping=mean-query |" in (old / "selectors.md").read_text()
    assert main(["merge", str(old), str(new), "--out", str(tmp_path / "merged")]) == 0, capsys.readouterr().err
    merged = json.loads((tmp_path / "merged" / "selectors.json").read_text())
    assert merged["settings"]["selectors"] == ["quest:grouping=mean-query", "quest"]
    assert [r["sparse_tokens"] for r in merged["runs"] if r["selector"] == "quest:grouping=mean-query"] == variant
    trials = {t["selector"] for t in merged["retrieval"] if t.get("selector")}
    assert trials == {"quest:grouping=mean-query", "quest"}
