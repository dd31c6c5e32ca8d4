"""What reports and commands print of names they do not choose: paths and selector specs with spaces, ``|``,
backticks or ``*`` give commands that run as pasted and Markdown tables that keep their columns."""

from __future__ import annotations

import shlex

from sparsedecode.cli import build_parser

ODD_MODEL = "/tmp/my models/tiny|1 ü"
ODD_OUT = "runs/out dir*|x"

SELECTOR_FILE = """
from dataclasses import dataclass

import sparsedecode


@dataclass(frozen=True)
class Cls(sparsedecode.BlockSelector):
    tag: str = "a"

    def score_blocks(self, queries, keys, layout):
        return keys.new_zeros(keys.shape[0], layout.n_blocks)
"""


def odd_selector(tmp_path) -> str:
    """A selector file in a folder whose name holds a space, a `|` and a backtick, as a selector spec."""
    folder = tmp_path / "my sel|`x"
    folder.mkdir()
    (folder / "sel*1.py").write_text(SELECTOR_FILE)
    return f"{folder}/sel*1.py:Cls"


def test_printed_commands_are_shell_quoted(tmp_path):
    """Every command a report prints to reproduce its folder parses back, as a shell would split it, to the same
    model, selectors and output folder (it printed them unquoted: a path with a space split in two, a `|` piped)."""
    from sparsedecode.cli.probe import _check_retrieval_args, _retrieval_command
    from sparsedecode.experiments.evaluate import EvalSpec
    from sparsedecode.experiments.specs import RetrievalSpec, SweepSpec
    from sparsedecode.reports.evaluation import eval_command
    from sparsedecode.reports.selector_comparison import _selectors_command
    from sparsedecode.reports.survival import sweep_command

    parser = build_parser()
    selector = odd_selector(tmp_path)
    sweep = SweepSpec(model=ODD_MODEL, corpus="my corpus.txt", contexts=(1024,), supports=(97,), selectors=(selector,))
    args = parser.parse_args(shlex.split(sweep_command(sweep, ODD_OUT))[1:])
    assert (args.model, args.corpus, str(args.out)) == (ODD_MODEL, "my corpus.txt", ODD_OUT)
    assert args.selector == selector
    several = SweepSpec(model=ODD_MODEL, contexts=(1024,), supports=(97,), selectors=(selector, "quest"))
    assert parser.parse_args(shlex.split(sweep_command(several, ODD_OUT))[1:]).selectors == (selector, "quest")

    evaluation = EvalSpec(model=ODD_MODEL, selectors=(selector,), corpus="my corpus.txt")
    args = parser.parse_args(shlex.split(eval_command(evaluation, ODD_OUT))[1:])
    assert (args.model, args.corpus, str(args.out), args.selectors) == (
        ODD_MODEL,
        "my corpus.txt",
        ODD_OUT,
        (selector,),
    )

    retrieval = RetrievalSpec(model=ODD_MODEL, contexts=(300,), supports=(97,), haystack="my hay.txt")
    args = parser.parse_args(shlex.split(_retrieval_command(retrieval, ODD_OUT))[1:])
    assert _check_retrieval_args(args) == retrieval and str(args.out) == ODD_OUT

    settings = {"model": ODD_MODEL, "context": [1024], "support": [97], "prompts": 1, "tokens": 8}
    args = parser.parse_args(shlex.split(_selectors_command({**settings, "selectors": [selector]}))[1:])
    assert (args.model, args.selectors) == (ODD_MODEL, (selector,))


def odd_rows(selector: str) -> list[dict]:
    """Rows of a two-selector sweep (context 1024, S = 97), one run per selector below 70% teacher-forced match."""
    rows = []
    for name in (selector, "quest"):
        for prompt, (fd, tf, dppl) in enumerate([(2, 60.0, 150.0), (8, 95.0, 1.0)]):
            rows.append(
                {"context": 1024, "prompt_index": prompt, "support": 97, "effective_support": 97, "reuse": 1,
                 "selector": name, "tokens": 8, "first_divergence": fd, "survives": False,
                 "teacher_forced_match": tf, "delta_ppl_percent": dppl}
            )  # fmt: skip
    return rows


def markdown_cells(text: str) -> list[list[str]]:
    """The rendered cells of every table row in the Markdown ``text`` (markdown-it's GFM tables), code spans as
    written."""
    from markdown_it import MarkdownIt

    rows, cells, inside = [], [], None
    for token in MarkdownIt("commonmark").enable("table").parse(text):
        if token.type == "tr_open":
            cells = []
        elif token.type == "inline" and cells is not None and inside:
            cells.append("".join(child.content for child in token.children or []))
        elif token.type in ("td_open", "th_open"):
            inside = True
        elif token.type in ("td_close", "th_close"):
            inside = False
        elif token.type == "tr_close":
            rows.append(cells)
    return rows


def test_odd_selector_names_keep_the_report_tables_whole(tmp_path):
    """A selector spec holding `|`, a backtick, `*` and spaces shows in every table of the sweep report as one cell
    that reads as written (it split the cell at each `|`, the backtick ended the code span early)."""
    from sparsedecode.experiments.specs import SweepSpec
    from sparsedecode.reports.survival import sweep_section

    selector = odd_selector(tmp_path) + ":tag=x|*y"
    spec = SweepSpec(model=ODD_MODEL, contexts=(1024,), supports=(97,), selectors=(selector, "quest"), tokens=8)
    text = "\n".join(sweep_section(tmp_path, {"spec": spec.to_dict()}, odd_rows(selector)))
    rows = markdown_cells(text)
    named = [row for row in rows if selector in row]
    assert len(named) == 3, "the per-selector, per-condition and warning tables each name the selector once"
    for row in named:
        header = next(r for r in reversed(rows[: rows.index(row)]) if "selector" in r)
        assert len(row) == len(header)
    assert f"model {ODD_MODEL}," in text.replace("``", "").replace("`", "")


def test_report_leaves_no_plot_of_an_earlier_report(tiny_model_dir, tmp_path, capsys):
    """A folder reported with one retrieval result and then another (or none) keeps no heat map of the first: they
    were left behind and listed under Files, beside results the report no longer shows. Files of the user's own
    stay."""
    from sparsedecode.cli import main

    for support in ("97", "113"):
        args = ["probe", "retrieval", "--model", str(tiny_model_dir), "--context", "300", "--depths", "0"]
        args += ["--trials", "1", "--support", support, "--answer-tokens", "2", "--out", str(tmp_path / support)]
        assert main(args) == 0, capsys.readouterr().err
    shown = tmp_path / "shown"
    shown.mkdir()
    (shown / "notes.csv").write_text("mine\n")
    assert main(["report", str(shown), "--retrieval", str(tmp_path / "97")]) == 0
    assert (shown / "retrieval_s97.png").is_file()
    assert main(["report", str(shown), "--retrieval", str(tmp_path / "113")]) == 0
    assert (shown / "retrieval_s113.png").is_file() and not (shown / "retrieval_s97.png").exists()
    files = next(line for line in (shown / "report.md").read_text().splitlines() if line.startswith("Files:"))
    assert "retrieval_s113.png" in files and "retrieval_s97.png" not in files and "notes.csv" not in files
    assert (shown / "notes.csv").read_text() == "mine\n"


def test_reports_are_written_in_utf8_whatever_the_locale(tmp_path):
    """Under a locale whose encoding is not UTF-8 (here ASCII, with Python's UTF-8 coercion off), writing a report
    or CSV holding `Δ` raised UnicodeEncodeError, a traceback (and a Latin-1 locale wrote bytes every reader, which
    reads UTF-8, refuses)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import sparsedecode

    target = tmp_path / "report.md"
    code = r"import sys; from sparsedecode.files import write_text_atomic as w; w(sys.argv[1], '\u0394 \u00fc\u2026')"
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "PYTHONIOENCODING": "utf-8"}
    env["PYTHONPATH"] = str(Path(sparsedecode.__file__).parents[1])
    done = subprocess.run([sys.executable, "-c", code, str(target)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert target.read_text(encoding="utf-8") == "Δ ü…"


def test_a_shard_folders_command_names_its_shard(tmp_path):
    """The report of a shard folder (``--shard 1/2``) printed a command without ``--shard``, which that folder
    refuses ("holds shard 1/2 of this sweep, not 1/1"); it names the shard now, and an unsharded folder's does not."""
    from sparsedecode.experiments.evaluate import EvalSpec
    from sparsedecode.experiments.specs import SweepSpec
    from sparsedecode.reports.evaluation import eval_command
    from sparsedecode.reports.survival import sweep_section

    spec = SweepSpec(model="m", contexts=(1024,), supports=(97,), selectors=("mean-pooled", "quest"), tokens=8)
    for shard, expected in (("1/2", "1/2"), ("1/1", None), (None, None)):
        meta = {"spec": spec.to_dict(), **({"shard": shard} if shard else {})}
        lines = sweep_section(tmp_path, meta, odd_rows("mean-pooled")[:2])
        command = next(line for line in lines if line.startswith("sparsedecode sweep"))
        assert build_parser().parse_args(shlex.split(command)[1:]).shard == expected
    command = eval_command(EvalSpec(model="m"), "out", "2/3")
    assert build_parser().parse_args(shlex.split(command)[1:]).shard == "2/3"


def test_selector_comparison_command_names_its_dtype_and_corpus():
    """selectors.md's "Produced by" command left out a dtype and corpus other than the defaults: pasted, it compared
    float32 on python-docs instead of what the table holds."""
    from sparsedecode.reports.selector_comparison import _selectors_command

    settings = {"model": "m", "context": [1024], "support": [97], "prompts": 1, "tokens": 8, "selectors": ["quest"]}
    odd = {**settings, "dtype": "bfloat16", "corpus": "my corpus.txt"}
    args = build_parser().parse_args(shlex.split(_selectors_command(odd))[1:])
    assert (args.dtype, args.corpus) == ("bfloat16", "my corpus.txt")
    plain = _selectors_command({**settings, "dtype": "float32", "corpus": "python-docs"})
    assert "--dtype" not in plain and "--corpus" not in plain


def test_a_selector_without_sparse_runs_shows_no_nan(tmp_path):
    """In a sweep of several selectors whose runs are all dense by construction, the per-selector table printed the
    median ΔPPL of no run as `+nan` (its other medians as `-`); a range of no value likewise."""
    from sparsedecode.experiments.specs import SweepSpec
    from sparsedecode.reports.survival import sweep_section
    from sparsedecode.reports.tables import format_range

    spec = SweepSpec(model="m", contexts=(1024,), supports=(97,), selectors=("mean-pooled", "quest"), tokens=8)
    rows = [{**row, "sparse_steps": 0} for row in odd_rows("mean-pooled")]
    text = "\n".join(sweep_section(tmp_path, {"spec": spec.to_dict()}, rows))
    assert "nan" not in text.lower()
    assert "| `quest` | 0/0 | - | - | - | 0/0 | 0 |" in text
    nan = float("nan")
    assert format_range({"x_median": nan, "x_min": nan, "x_max": nan}, "x", 2, "+") == "- [-, -]"


def test_paths_with_brackets_print_as_written(tiny_model_dir, tmp_path, capsys):
    """An --out holding `[/]` made the sweep end in a rich MarkupError traceback after its runs, and `[red]` vanished
    from the paths printed (`wrote rkx/report.md`): paths print as written now."""
    from sparsedecode.cli import main

    for name in ("a[/]b", "c[red]d"):
        out = tmp_path / name
        args = ["sweep", "--model", str(tiny_model_dir), "--context", "128", "--support", "97", "--prompts", "1"]
        assert main([*args, "--tokens", "4", "--out", str(out)]) == 0, capsys.readouterr().err
        printed = " ".join(capsys.readouterr().out.split())  # lines wrap at the console's width
        assert f"`sparsedecode report {shlex.quote(str(out))}` summarises them" in printed
        assert main(["report", str(out)]) == 0
        assert f"wrote {out / 'report.md'}" in " ".join(capsys.readouterr().out.split())


def test_row_lines_show_model_output_and_selectors_as_written():
    """The line a sweep or an evaluation prints per finished run went through rich markup: a model answer or a
    selector parameter holding `[/]` raised MarkupError mid-run (a traceback, the command dead), `[red]` vanished."""
    import io

    from rich.console import Console

    from sparsedecode.cli.eval import _row_line as eval_line
    from sparsedecode.cli.sweep import _row_line as sweep_line

    row = {"task": "vt", "context": 500, "sample": 0, "selector": "mean-pooled", "support": 97, "correct": False,
           "score": 0.0, "output": "x [/] y [red]z", "run_s": 0.1}  # fmt: skip
    sweep_row = {"context": 128, "prompt_index": 0, "selector": "f.py:C:tag=[/]", "support": 97, "reuse": 1,
                 "survives": True, "first_divergence": 8, "teacher_forced_match": 100.0, "delta_ppl_percent": 0.0,
                 "run_s": 0.1, "sparse_s": 0.1}  # fmt: skip
    for line, written in ((eval_line(row), "'x [/] y [red]z'"), (sweep_line(sweep_row), "f.py:C:tag=[/]")):
        shown = io.StringIO()
        Console(file=shown, width=300).print(line)
        assert written in shown.getvalue()


def test_compare_selectors_table_shows_a_bracketed_selector(tiny_model_dir, tmp_path, capsys):
    """compare-selectors printed its table through rich markup: a selector parameter holding `[/]` raised
    MarkupError after every run was done and before anything was written, losing the whole comparison."""
    from sparsedecode.cli import main

    selector = odd_selector(tmp_path) + ":tag=[/]y"
    out = tmp_path / "compared"
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "128", "--support", "97"]
    args += ["--prompts", "1", "--tokens", "4", "--selectors", f"{selector},quest", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    assert (out / "selectors.json").is_file() and "quest" in capsys.readouterr().out
