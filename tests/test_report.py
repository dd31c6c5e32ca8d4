"""The paper-like summary (pure functions) and the rendered report of a tiny sweep."""

from __future__ import annotations

import csv
import json

import pytest
from conftest import char_tokenizer, tiny_model

from sparsedecode.cli import main
from sparsedecode.experiments import summary
from sparsedecode.experiments.sweep import RUNS_FILE, SweepSpec, run_sweep
from sparsedecode.reports.sweep import sweep_command, write_report

pytestmark = pytest.mark.xdist_group("report")  # one parallel worker builds the module's fixtures

PNG = b"\x89PNG\r\n\x1a\n"


def row(context, prompt, support, fd, tf, dppl, tokens=128):
    return {
        "context": context,
        "prompt_index": prompt,
        "support": support,
        "effective_support": support,
        "reuse": 1,
        "selector": "mean-pooled",
        "tokens": tokens,
        "first_divergence": fd,
        "survives": fd == tokens,
        "teacher_forced_match": tf,
        "delta_ppl_percent": dppl,
    }


ROWS = [
    row(2048, 0, 97, 3, 60.0, 150.0),
    row(2048, 1, 97, 9, 90.0, 4.0),
    row(2048, 2, 97, 128, 100.0, 0.0),
    row(2048, 0, 193, 20, 95.0, -6.0),
    row(2048, 1, 193, 30, 99.0, 1.0),
    row(2048, 2, 193, 40, 98.0, 2.0),
    row(8192, 0, 193, 2, 50.0, 40.0),
    row(8192, 1, 193, 5, 80.0, 8.0),
    row(8192, 2, 193, 7, 85.0, 6.0),
]


def test_conditions_count_survivors_and_ranges():
    table = summary.conditions(ROWS)
    assert [(c["context"], c["support"]) for c in table] == [(2048, 97), (2048, 193), (8192, 193)]
    first = table[0]
    assert first["runs"] == 3 and first["survived"] == 1 and first["warning_runs"] == 1
    assert (first["first_divergence_median"], first["first_divergence_min"], first["first_divergence_max"]) == (
        9,
        3,
        128,
    )
    assert first["diverged_runs_first_divergence_median"] == 6
    assert first["delta_ppl_percent_median"] == 4.0 and first["teacher_forced_match_min"] == 60.0
    assert table[1]["abs_delta_ppl_percent_median"] == 2.0


def test_a_nan_delta_ppl_gives_the_same_summary_in_any_order():
    """A run whose delta-PPL is NaN (both perplexities infinite) made a condition's median, minimum and maximum, and
    the overview's largest delta-PPL, depend on the rows' order (a sort with a NaN); now NaN in any order."""
    rows = [row(2048, 0, 193, 3, 60.0, float("nan")), row(2048, 1, 193, 9, 90.0, 1.0), row(2048, 2, 193, 5, 80.0, 2.0)]
    results = []
    for order in (rows, rows[::-1], rows[1:] + rows[:1]):
        condition = summary.conditions(order)[0]
        keys = ("delta_ppl_percent_median", "delta_ppl_percent_min", "delta_ppl_percent_max")
        results.append(json.dumps([condition[k] for k in keys] + [summary.overview(order)["max_delta_ppl_percent"]]))
    assert results == [json.dumps([float("nan")] * 4)] * 3


def test_within_tolerance_and_warning_runs():
    tolerance = summary.within_tolerance(ROWS)
    assert tolerance["conditions"] == 2 and tolerance["within"] == 1  # (2048, 193): median ΔPPL +1; (8192, 193): +8
    assert tolerance["within_conditions"] == [(2048, 193, 1, "mean-pooled")]
    assert tolerance["outside_conditions"] == [(8192, 193, 1, "mean-pooled")]
    warnings = summary.warning_runs(ROWS)
    assert [(w["context"], w["support"], w["teacher_forced_match"]) for w in warnings] == [
        (8192, 193, 50.0),
        (2048, 97, 60.0),
    ]
    overview = summary.overview(ROWS)
    assert overview["runs"] == 9 and overview["survived"] == 1 and overview["warning_runs"] == 2
    assert overview["warning_runs_above_100_percent"] == 1 and overview["warning_runs_prompts"] == [
        (2048, 0),
        (8192, 0),
    ]


def test_within_five_percent_is_the_median_of_the_signed_changes():
    """The reference study counts conditions whose median ΔPPL is within 5% of dense (the band the plot draws around
    the medians); the count used the median of |ΔPPL|, which calls -8, +1, +9 outside (its median size is 8)."""
    mixed = [row(4096, p, 385, 10, 90.0, d) for p, d in enumerate((-8.0, 1.0, 9.0))]
    shifted = [row(4096, p, 769, 10, 90.0, d) for p, d in enumerate((-9.0, -6.0, 7.0))]
    tolerance = summary.within_tolerance(mixed + shifted)
    assert tolerance["within_conditions"] == [(4096, 385, 1, "mean-pooled")]
    assert tolerance["outside_conditions"] == [(4096, 769, 1, "mean-pooled")]
    assert summary.conditions(mixed)[0]["abs_delta_ppl_percent_median"] == 8.0


def test_conditions_dense_by_construction_are_left_out_of_every_count():
    # S >= context + T - 1: the last step attends to context + T - 1 positions, so no step is sparse
    assert summary.dense_by_construction(row(2048, 0, 2175, 128, 100.0, 0.0))
    assert not summary.dense_by_construction(row(2048, 0, 2174, 3, 90.0, 1.0))
    assert summary.dense_by_construction(
        {"context": 100, "tokens": 8, "support": 200, "settings": {"effective_support": 113}}
    )
    dense = [row(2048, p, 2200, 128, 100.0, 0.0) for p in range(3)] + [row(2048, 0, 4000, 128, 100.0, 0.0)]
    rows = ROWS + dense
    table = summary.conditions(rows)
    assert [(c["support"], c["dense_by_construction"]) for c in table if c["context"] == 2048] == [
        (97, False),
        (193, False),
        (2200, True),
        (4000, True),
    ]
    tolerance = summary.within_tolerance(rows)
    assert (tolerance["conditions"], tolerance["within"], tolerance["dense_conditions"]) == (2, 1, 2)
    overview = summary.overview(rows)
    assert overview == {**summary.overview(ROWS), "dense_by_construction_runs": 4}
    assert summary.overview(ROWS)["dense_by_construction_runs"] == 0
    assert summary.warning_runs(rows + [{**dense[0], "teacher_forced_match": 10.0}]) == summary.warning_runs(ROWS)
    (by,) = summary.by_selector(rows)
    assert by == {**summary.by_selector(ROWS)[0], "dense_by_construction_runs": 4} and by["runs"] == 9


def test_report_shows_dense_by_construction_conditions_apart(tmp_path, monkeypatch):
    from sparsedecode.reports import plots

    plotted = {}
    for name in ("match_vs_delta_ppl", "delta_ppl_by_support", "first_divergence_histogram"):
        monkeypatch.setattr(plots, name, lambda rows, path, *, title, name=name: plotted.setdefault(name, rows))
    # at context 150 and T = 8, S = 193 covers every position (150 + 7 <= 193); at 220 it does not
    spec = SweepSpec(model="tiny-llama", contexts=(150, 220), supports=(97, 193), prompts=1, tokens=8)
    run_sweep(spec, tmp_path, loaded=(tiny_model("llama"), char_tokenizer()))
    text = write_report(tmp_path).read_text()
    assert "1 run(s) in 1 condition(s) have an effective support S >= context + T - 1" in text
    assert "of 3 runs stayed identical" in text and "of the 1 conditions with S >= 193" in text
    main_table = text[text.index("| context | S | survived |") : text.index("Dense by construction (")]
    assert "| 150 | 193 |" not in main_table and "| 220 | 193 |" in main_table and "| 150 | 97 |" in main_table
    apart = text[text.index("Dense by construction (") : text.index("CSV: [conditions.csv]")]
    assert "| 150 | 193 | 193 | 1/1 | +0.00 |" in apart and "| 220 |" not in apart
    assert all(
        len(rows) == 3 and (150, 193) not in {(r["context"], r["support"]) for r in rows} for rows in plotted.values()
    )
    assert len(plotted) == 3 and "Runs that are dense by construction are left out." in text
    with open(tmp_path / "conditions.csv") as handle:
        flags = {(c["context"], c["support"]): c["dense_by_construction"] for c in csv.DictReader(handle)}
    assert flags == {("150", "97"): "False", ("150", "193"): "True", ("220", "97"): "False", ("220", "193"): "False"}


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sweep")
    spec = SweepSpec(model="tiny-llama", contexts=(150, 220), supports=(97, 113), prompts=2, tokens=12)
    run_sweep(spec, directory, loaded=(tiny_model("llama"), char_tokenizer()))
    return directory


def test_report_renders_tables_csv_and_plots(sweep_dir):
    path = write_report(sweep_dir)
    text = path.read_text()
    for needle in (
        "# Survival sweep: tiny-llama",
        "8 of the 8 runs of the grid",
        "dtype float32",
        "device cpu",
        "corpus `python-docs`",
        "## Per condition",
        "Runs with teacher-forced match below 70%",
        "conditions with S >= 193",
        "What these numbers do not establish",
        "sparsedecode sweep --model tiny-llama --context 150,220 --support 97,113 --reuse 1 --prompts 2 --tokens 12",
    ):
        assert needle in text, needle
    for name in ("match_vs_delta_ppl.png", "delta_ppl_by_support.png", "first_divergence.png"):
        assert (sweep_dir / name).read_bytes()[:8] == PNG, name
        assert f"]({name})" in text
    with open(sweep_dir / "conditions.csv") as handle:
        conditions = list(csv.DictReader(handle))
    assert [(c["context"], c["support"]) for c in conditions] == [
        ("150", "97"),
        ("150", "113"),
        ("220", "97"),
        ("220", "113"),
    ]
    with open(sweep_dir / "runs.csv") as handle:
        assert len(list(csv.DictReader(handle))) == 8
    assert (sweep_dir / "warning_runs.csv").exists()
    assert "## Per selector" not in text and not (sweep_dir / "selectors.csv").exists(), "one selector: no table"
    assert "| context | S | survived |" in text and "selector mean-pooled (the same dense references)" in text


def test_report_says_how_much_of_the_grid_a_partial_sweep_covers(sweep_dir, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "sweep.json").write_bytes((sweep_dir / "sweep.json").read_bytes())
    lines = (sweep_dir / RUNS_FILE).read_text().splitlines(keepends=True)
    (partial / RUNS_FILE).write_text("".join(lines[:3]))
    text = write_report(partial).read_text()
    assert "3 of the 8 runs of the grid" in text and "missing runs were not measured" in text


def test_an_interrupted_report_leaves_the_earlier_report_as_it_was(sweep_dir, tmp_path, monkeypatch):
    """A report of a folder whose runs had grown, interrupted (Ctrl-C, SIGTERM) while drawing its plots, left its new
    tables beside the earlier report.md and plots (an error restored them; an interrupt did not). Found reading
    write_report. Now an interrupt restores them as an error does, and the command exits 130."""
    from sparsedecode.reports import plots

    folder = tmp_path / "grown"
    folder.mkdir()
    (folder / "sweep.json").write_bytes((sweep_dir / "sweep.json").read_bytes())
    lines = (sweep_dir / RUNS_FILE).read_text().splitlines(keepends=True)
    (folder / RUNS_FILE).write_text("".join(lines[:3]))
    assert main(["report", str(folder)]) == 0
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    (folder / RUNS_FILE).write_text("".join(lines))  # the sweep resumed: every run now

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "first_divergence_histogram", interrupted)
    assert main(["report", str(folder)]) == 130
    after = {path.name: path.read_bytes() for path in folder.iterdir() if path.name != RUNS_FILE}
    assert after == {name: data for name, data in before.items() if name != RUNS_FILE}


def test_the_retrieval_command_keeps_every_digit_of_a_depth():
    """The command a retrieval report prints wrote depths to six digits (``f"{d:g}"``): ``--depths 0.1234567`` came
    back as 0.123457, another probe, which its folder then refused as other settings (found reading it)."""
    import shlex

    from sparsedecode.cli import build_parser
    from sparsedecode.cli.probe import _check_retrieval_args, _retrieval_command
    from sparsedecode.experiments.specs import RetrievalSpec

    spec = RetrievalSpec(model="m", contexts=(300,), depths=(0.0, 0.1234567, 0.5, 1.0), trials=1, supports=(97,))
    command = _retrieval_command(spec, "out")
    assert "--depths 0,0.1234567,0.5,1 " in command
    assert _check_retrieval_args(build_parser().parse_args(shlex.split(command)[1:])) == spec


def test_by_selector_totals_and_tolerance_per_selector():
    rows = ROWS + [{**r, "selector": "streaming", "delta_ppl_percent": 2 * r["delta_ppl_percent"]} for r in ROWS[3:]]
    table = summary.by_selector(rows)
    assert [t["selector"] for t in table] == ["mean-pooled", "streaming"]
    mean_pooled, streaming = table
    assert (mean_pooled["runs"], mean_pooled["survived"], mean_pooled["warning_runs"]) == (9, 1, 2)
    assert (mean_pooled["conditions_min_support"], mean_pooled["conditions_within_tolerance"]) == (2, 1)
    assert (streaming["runs"], streaming["survived"], streaming["delta_ppl_percent_median"]) == (6, 0, 8.0)
    assert (streaming["conditions_min_support"], streaming["conditions_within_tolerance"]) == (
        2,
        1,
    )  # medians |ΔPPL| 4% and 16%
    assert summary.within_tolerance(rows)["conditions"] == 4, "conditions are per selector"
    warnings = summary.warning_runs(rows)
    assert [(w["selector"], w["teacher_forced_match"]) for w in warnings[:2]] == [
        ("mean-pooled", 50.0),
        ("streaming", 50.0),
    ]


@pytest.fixture(scope="module")
def selectors_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("selectors")
    spec = SweepSpec(
        model="tiny-llama", contexts=(150,), supports=(97, 113), selectors=("streaming", "quest"), prompts=2, tokens=8
    )
    run_sweep(spec, directory, loaded=(tiny_model("llama"), char_tokenizer()))
    return directory


def test_report_of_several_selectors_has_a_selector_table_and_column(selectors_dir):
    text = write_report(selectors_dir).read_text()
    for needle in (
        "8 of the 8 runs of the grid** (1 contexts x 2 prompts x 2 selectors x 2 supports x 1 reuse intervals)",
        "selectors streaming, quest (the same dense references)",
        "--selectors streaming,quest",
        "## Per selector",
        "| context | S | selector | survived |",
        "stacked by selector",
    ):
        assert needle in text, needle
    with open(selectors_dir / "selectors.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [(t["selector"], t["runs"]) for t in table] == [("streaming", "4"), ("quest", "4")]
    section = text[text.index("## Per selector") : text.index("## Per condition")]
    assert "| `streaming` |" in section and "| `quest` |" in section
    with open(selectors_dir / "conditions.csv") as handle:
        conditions = list(csv.DictReader(handle))
    assert [(c["support"], c["selector"], c["runs"]) for c in conditions] == [
        ("97", "quest", "2"),
        ("97", "streaming", "2"),
        ("113", "quest", "2"),
        ("113", "streaming", "2"),
    ]
    for name in ("match_vs_delta_ppl.png", "delta_ppl_by_support.png", "first_divergence.png"):
        assert (selectors_dir / name).read_bytes()[:8] == PNG, name


def test_report_of_a_sweep_folder_written_before_selectors(sweep_dir, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    meta = json.loads((sweep_dir / "sweep.json").read_text())
    meta["spec"]["selector"] = meta["spec"].pop("selectors")[0]
    (old / "sweep.json").write_text(json.dumps(meta))
    (old / RUNS_FILE).write_bytes((sweep_dir / RUNS_FILE).read_bytes())
    text = write_report(old).read_text()
    assert "8 of the 8 runs of the grid" in text and "selector mean-pooled" in text and "--selector" not in text


def test_sweep_command_round_trips_non_defaults():
    spec = SweepSpec(model="m", dtype="bfloat16", contexts=(1024,), supports=(97,), window=32, audit=True)
    command = sweep_command(spec, "out")
    assert "--dtype bfloat16" in command and "--window 32" in command and "--audit" in command
    assert "--block-size" not in command and "--selector" not in command and command.endswith("--out out")
    assert "--selector quest " in sweep_command(SweepSpec(model="m", selectors=("quest",)), "out")
    assert "--selectors h2o,quest " in sweep_command(SweepSpec(model="m", selectors=("h2o", "quest")), "out")
    # per-layer settings change every number: the command that reproduces the folder names them
    layered = SweepSpec(model="m", dense_layers=(0, 1), layer_supports=((5, 385),))
    assert "--dense-layers 0,1 --layer-supports 5:385 --out out" in sweep_command(layered, "out")


def test_retrieval_and_eval_commands_round_trip_non_defaults():
    """The command a retrieval report or an evaluation report prints reproduces the spec it ran, every setting that
    changes a result included (selector, reuse, passkey, per-layer settings)."""
    import shlex

    from sparsedecode.cli import build_parser
    from sparsedecode.cli.probe import _check_retrieval_args, _retrieval_command
    from sparsedecode.experiments.evaluate import EvalSpec
    from sparsedecode.experiments.specs import RetrievalSpec
    from sparsedecode.reports.evaluation import eval_command

    spec = RetrievalSpec(
        model="m", contexts=(300,), depths=(0.5,), trials=1, supports=(97,), reuse=2, selector="quest", digits=3,
        answer_tokens=4, seed=5, dense_layers=(1,), layer_supports=((0, 113),),
    )  # fmt: skip
    command = _retrieval_command(spec, "out")
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert _check_retrieval_args(args) == spec
    layered = EvalSpec(model="m", dense_layers=(0,), layer_supports=((2, 385),))
    assert "--dense-layers 0 --layer-supports 2:385 --out out" in eval_command(layered, "out")


def test_report_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a sweep" in err


def test_rows_audited_under_the_per_head_normaliser_are_kept_apart():
    from sparsedecode.protocol.results import upgrade_audit_fields, upgrade_row

    old = {"selector_recall_mean": 0.5, "captured_mass_ratio_mean": 0.7, "first_divergence_convention": 2}
    new = upgrade_row(old)
    assert new["captured_mass_ratio_mean"] is None and new["selector_recall_mean"] is None
    assert new["captured_mass_ratio_per_head_best_mean"] == 0.7 and new["selector_recall_per_head_best_mean"] == 0.5
    current = {**new, "captured_mass_ratio_mean": 0.9}
    assert upgrade_audit_fields(current) == current, "rows written now carry both figures and stay as they are"
    unaudited = {"captured_mass_ratio_mean": None}
    assert upgrade_audit_fields(unaudited) == unaudited


def test_committed_comparisons_show_no_captured_figure_of_the_old_normaliser():
    import json
    from pathlib import Path

    docs = Path(__file__).parents[1] / "docs"
    for path in sorted(docs.glob("selectors/*/selectors.json")):
        data = json.loads(path.read_text())
        # a figure of the old normaliser comes without the per-head field (or, upgraded, as that field alone); the
        # reachable-best normaliser writes both
        for run in data["runs"]:
            if run["captured_mass_ratio_mean"] is not None:
                assert run.get("captured_mass_ratio_per_head_best_mean") is not None, path
            elif run.get("captured_mass_ratio_per_head_best_mean") is not None:  # upgraded: shown as "-"
                assert all(row["captured_mass_ratio"] is None for row in data["summary"]), path
        audited = any(r["captured_mass_ratio_mean"] is not None for r in data["runs"])
        assert all((row["captured_mass_ratio"] is not None) == audited for row in data["summary"]), path


def test_environment_lines_name_a_backend_sessions_workers_not_the_drivers_threads():
    from sparsedecode.reports.environment import environment_lines

    env = {"device": "cpu", "threads": 2, "cpu_count": 2, "processor": "x86_64", "torch": "t", "revision": "abc"}
    ray = {"backend": "ray", "nodes": 1, "cpus": 2, "workers": 2, "threads_per_worker": 1}
    meta = {
        "sessions": [
            {"started": "a", "environment": {**env, "threads": 1}},
            {"started": "b", "environment": env, "backend": ray},
            {"started": "c", "environment": env, "backend": ray},  # same environment and backend: one line
        ]
    }
    lines = environment_lines(meta)
    assert len(lines) == 3 and lines[-1] == "- 3 session(s) wrote this folder, the first started a"
    assert lines[0].startswith("- device cpu, 1 threads (2 CPUs, x86_64); Python")
    assert lines[1].startswith("- device cpu, ray: 2 worker(s) x 1 thread(s) on 1 node(s), 2 CPUs; Python")
    assert "2 threads" not in lines[1] and lines[1].endswith("(source abc)")
