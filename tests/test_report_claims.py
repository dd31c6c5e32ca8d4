"""Claims the reports write, checked against the rows they are written from: why runs are set apart as dense by
construction, cells of values that are no number, and which condition a sentence names."""

from __future__ import annotations

from sparsedecode.experiments.specs import SweepSpec
from sparsedecode.reports.survival import sweep_section


def dense_rows(supports: tuple[int, ...]) -> list[dict]:
    """Two prompts per support at context 1024, T = 8, every layer kept dense (no sparse step taken)."""
    return [
        {"context": 1024, "prompt_index": prompt, "support": support, "effective_support": support, "reuse": 1,
         "selector": "mean-pooled", "tokens": 8, "first_divergence": 8, "survives": True, "sparse_steps": 0,
         "teacher_forced_match": 100.0, "delta_ppl_percent": 0.0}
        for support in supports
        for prompt in range(2)
    ]  # fmt: skip


def test_runs_whose_layers_were_all_kept_dense_are_not_said_to_cover_the_cache(tmp_path):
    """A sweep with --dense-layers naming every layer (S = 97 at context 150, T = 6) took no sparse step; the report
    said its runs 'have an effective support S >= context + T - 1: every step attends to the whole cache', and headed
    their table so, beside an effective S of 97 (found by sweeping a 2-layer model with --dense-layers 0,1)."""
    spec = SweepSpec(model="m", contexts=(1024,), supports=(97, 1031), tokens=8, dense_layers=(0, 1))
    text = "\n".join(sweep_section(tmp_path, {"spec": spec.to_dict()}, dense_rows((97,))))
    assert "have an effective support" not in text
    assert "2 run(s) in 1 condition(s) took no sparse step: every layer was kept dense" in text
    assert "Dense by construction (effective S >= context + T - 1, or no sparse step:" in text
    both = "\n".join(sweep_section(tmp_path, {"spec": spec.to_dict()}, dense_rows((97, 1031))))
    assert "4 run(s) in 2 condition(s) are of two kinds (2 have an effective support S >= context + T - 1" in both
    assert "; 2 took no sparse step" in both
    covered = "\n".join(sweep_section(tmp_path, {"spec": spec.to_dict()}, dense_rows((1031,))))
    assert "2 run(s) in 1 condition(s) have an effective support S >= context + T - 1" in covered
    assert "Dense by construction (effective S >= context + T - 1; not counted" in covered


def test_a_comparison_whose_layers_were_all_kept_dense_says_so(tiny_model_dir, tmp_path, capsys):
    from sparsedecode.cli import main

    out = tmp_path / "c"
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "150", "--support", "97"]
    args += ["--prompts", "1", "--tokens", "6", "--selectors", "streaming", "--dense-layers", "0,1", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    assert "or no sparse step: every layer kept dense" in capsys.readouterr().out.replace("\n", " ")
    text = (out / "selectors.md").read_text()
    assert "every step attends to the whole cache" not in text
    assert "Dense by construction (effective S >= context + T - 1, T = 6, or no sparse step" in text


def test_a_nan_delta_ppl_gives_a_comparison_the_same_median_in_any_order(tiny_model_dir, tmp_path, capsys):
    """compare-selectors' summary took statistics.median over the runs' ΔPPL: with one NaN (two infinite
    perplexities) among three prompts the median was +0.22, NaN or +2.82 depending on the order of the runs in
    selectors.json, printed '+nan' when NaN (found by permuting the runs of a comparison and reporting each; the sweep's
    summary had this fixed already). Now NaN in any order, shown as '-'."""
    import itertools
    import json

    from sparsedecode.cli import main

    out = tmp_path / "c"
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "220", "--support", "97"]
    args += ["--prompts", "3", "--tokens", "6", "--selectors", "streaming", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    data = json.loads((out / "selectors.json").read_text())
    data["runs"][0]["delta_ppl_percent"] = float("nan")
    cells = set()
    for number, order in enumerate(itertools.permutations(data["runs"])):
        folder = tmp_path / f"order{number}"
        folder.mkdir()
        (folder / "selectors.json").write_text(json.dumps({**data, "runs": list(order)}))
        assert main(["report", str(folder)]) == 0
        (row,) = [line for line in (folder / "selectors.md").read_text().splitlines() if "| streaming |" in line]
        cells.add(row.split(" | ")[7])
    assert cells == {"-"}


def test_a_delta_ppl_of_no_number_shows_as_a_dash_in_every_sweep_table(tmp_path):
    """The warning table and the dense-by-construction table printed a NaN ΔPPL as '+nan' (every other cell shows
    '-'), and the findings said 'largest ΔPPL of any run -%' (found reporting hand-edited rows with a NaN ΔPPL)."""
    rows = [
        {"context": 1024, "prompt_index": prompt, "support": support, "effective_support": support, "reuse": 1,
         "selector": "mean-pooled", "tokens": 8, "first_divergence": 2, "survives": False,
         "teacher_forced_match": 50.0, "delta_ppl_percent": float("nan")}
        for support in (97, 1031)
        for prompt in range(2)
    ]  # fmt: skip
    spec = SweepSpec(model="m", contexts=(1024,), supports=(97, 1031), tokens=8)
    text = "\n".join(sweep_section(tmp_path, {"spec": spec.to_dict()}, rows))
    assert "+nan" not in text and "-%" not in text
    assert "| 1024 | 0 | 97 | 1 | 50.0 | - | 2 |" in text and "| 1024 | 1031 | 1031 | 0/2 | - |" in text
    assert "largest ΔPPL of any run - (a run's ΔPPL is NaN)." in text
    dense = "\n".join(sweep_section(tmp_path, {"spec": spec.to_dict()}, dense_rows((97,))))
    assert "largest ΔPPL of any run - (no run)." in dense


def test_positions_read_name_the_context_of_each_figure(tiny_model_dir, tmp_path, capsys):
    """selectors.md listed the positions read per KV head as '`quest` at S = 97: mean 118.7 ...; `quest` at S = 97:
    mean 118.4 ...' for a comparison of two contexts: two figures for what read as one condition (found checking
    a two-context comparison's sentence against its runs)."""
    import json
    import re

    from sparsedecode.cli import main

    out = tmp_path / "c"
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "220,260", "--support", "97"]
    args += ["--prompts", "1", "--tokens", "6", "--selectors", "quest", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    text = (out / "selectors.md").read_text()
    named = re.findall(r"`quest` at context (\d+), S = 97: mean ([\d.]+)", text)
    summary = json.loads((out / "selectors.json").read_text())["summary"]
    assert named == [(str(r["context"]), f"{r['support_read_mean']:.1f}") for r in summary]


def test_the_committed_reports_are_what_report_writes_today(tmp_path, monkeypatch):
    """The committed evaluation report was rendered before issue #39 and the answer-length column: it named the
    group-mean variant it ran `quest` (today's name of the per-query-head method), printed a command running that
    other method, and lacked a column today's report has; the retrieval CSVs lacked the dense-by-construction counts
    (found rendering each committed folder again and comparing). Each is rendered again into a copy here."""
    import shutil
    from pathlib import Path

    from sparsedecode.cli import main

    root = Path(__file__).resolve().parent.parent
    names = ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-eval", "smollm2-135m-retrieval")
    for name in names:
        shutil.copytree(root / "docs" / "reports" / name, tmp_path / "docs" / "reports" / name)
    monkeypatch.chdir(tmp_path)  # the reports print their folder as the command gave it
    for name in names:
        folder = Path("docs") / "reports" / name
        assert main(["report", str(folder)]) == 0
        for path in sorted(folder.glob("*.[mc][ds]*")):  # report.md, README.md and the CSVs
            assert path.read_bytes() == (root / path).read_bytes(), path


def test_a_selector_spec_shows_as_written_in_the_comparison_table(tiny_model_dir, tmp_path, capsys):
    """selectors.md wrote a selector spec into its table as plain text: a file at 'my sel|`x/sel*1.py' with a
    parameter 'tag=*y*' rendered as '...sel1.py...' in italics, its asterisks read as emphasis and the backtick as a
    code span (found rendering a comparison of a selector file with Markdown's characters in its path)."""
    from test_report_text import markdown_cells, odd_selector

    from sparsedecode.cli import main

    selector = odd_selector(tmp_path) + ":tag=*y*"
    out = tmp_path / "compared"
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "128", "--support", "97"]
    args += ["--prompts", "1", "--tokens", "4", "--selectors", f"{selector},quest", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    rows = markdown_cells((out / "selectors.md").read_text())
    assert [row[1] for row in rows if row[0] == "128"] == [selector, "quest"]


def test_a_selector_spec_shows_as_written_in_the_evaluation_tables(tiny_model_dir, tmp_path, capsys):
    """The evaluation report wrote its modes ('SPEC S=97') into the accuracy table's header and the paired table as
    plain text: a selector file's '*' and backticks were read as Markdown, the spec shown as another (found with the
    comparison table's case, rendering an evaluation of the same selector file)."""
    from test_report_text import markdown_cells, odd_selector

    from sparsedecode.cli import main

    selector = odd_selector(tmp_path) + ":tag=*y*"
    out = tmp_path / "evaluated"
    args = ["eval", "--model", str(tiny_model_dir), "--tasks", "vt", "--context", "600", "--samples", "1"]
    args += ["--selectors", selector, "--support", "97", "--answer-tokens", "2", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    assert main(["report", str(out)]) == 0
    rows = markdown_cells((out / "report.md").read_text())
    assert rows[0][-1] == f"{selector} S=97"  # the accuracy table's last column
    assert [row[0] for row in rows if row[-1].endswith(")")] == [f"{selector} S=97"]  # the paired table's setting
