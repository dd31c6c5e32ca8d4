"""Results folders from users' selectors and users' hands (issue #42, cases 3, 8, 11, 13): ``merge`` keeps one version
per selector file and records them; a hand-edited comparison, sweep or evaluation folder is one line and exit 2 in
``merge`` and ``report``, never a traceback or a run counted twice; a folder's selectors are taken as stored, so a
resume from another directory continues it and a report needs no selector file."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest

from sparsedecode.cli import main
from sparsedecode.errors import SparseDecodeError
from sparsedecode.experiments import bench_operator
from sparsedecode.experiments.eval_spec import EvalSpec
from sparsedecode.experiments.evaluate import merge_evals
from sparsedecode.experiments.specs import adopt_stored
from sparsedecode.experiments.sweep import RUNS_FILE, SPEC_FILE, SweepSpec, merge_sweeps, read_meta
from sparsedecode.selectors import parse_selector

SELECTOR = '''
from dataclasses import dataclass

import torch

import sparsedecode


@dataclass(frozen=True)
class Ramp(sparsedecode.BlockSelector):
    """The latest blocks first (SIGN = 1) or the earliest (SIGN = -1)."""

    def score_blocks(self, queries, keys, layout):
        return SIGN * torch.arange(layout.n_blocks, dtype=torch.float32).expand(keys.shape[0], -1)
'''


def one_line_exit_2(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def write_selector(folder, sign: int):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ramp.py").write_text(f"SIGN = {sign}\n{SELECTOR}")
    return folder / "ramp.py"


SWEEP = ["--context", "150", "--support", "97", "--tokens", "4", "--prompts", "2"]


# ---- case 3: merge keeps one version of a selector file, and records it ----


def test_merge_refuses_shards_of_two_versions_of_one_selector_file(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_selector(tmp_path / "sel", 1)
    common = ["sweep", "--model", str(tiny_model_dir), *SWEEP, "--selectors", "quest,sel/ramp.py:Ramp"]
    assert main([*common, "--shard", "1/2", "--out", "one"]) == 0
    assert main([*common, "--shard", "2/2", "--out", "two"]) == 0
    assert main(["merge", "one", "two", "--out", "same"]) == 0
    merged = read_meta(tmp_path / "same")
    assert merged["selector_files"] == read_meta(tmp_path / "one")["selector_files"]  # kept, as the shards had it
    assert merged["selector_paths"] == {"sel/ramp.py:Ramp": str(tmp_path / "sel" / "ramp.py")}

    write_selector(tmp_path / "sel", -1)  # the file edited, then the second shard run again elsewhere
    assert main([*common, "--shard", "2/2", "--out", "edited"]) == 0
    capsys.readouterr()
    err = one_line_exit_2(["merge", "one", "edited", "--out", "mixed"], capsys)
    assert "selector sel/ramp.py:Ramp ran from two versions of its file" in err and not (tmp_path / "mixed").exists()
    with pytest.raises(SparseDecodeError, match="two versions"):
        merge_sweeps([tmp_path / "same", tmp_path / "edited"], tmp_path / "same")
    assert read_meta(tmp_path / "same") == merged  # a refused merge into a source changes nothing


def _eval_folder(path, digest: str, rows: list[dict] | None = None):
    spec = EvalSpec(model="tiny", tasks=("vt",), contexts=(512,), samples=1, supports=(97,))
    meta = {"spec": {**spec.to_dict(), "selectors": ["sel.py:Ramp"]}, "selector_files": {"sel.py:Ramp": digest}}
    path.mkdir()
    (path / "eval.json").write_text(json.dumps(meta))
    (path / RUNS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows or []))
    return path


def test_an_evaluation_merge_follows_the_same_rule(tmp_path):
    """Folders of a selector file that is not here (taken as stored), one version each: refused; one version: kept."""
    one, two = _eval_folder(tmp_path / "one", "a" * 64), _eval_folder(tmp_path / "two", "b" * 64)
    with pytest.raises(SparseDecodeError, match="ran from two versions of its file") as raised:
        merge_evals([one, two], tmp_path / "out")
    assert "\n" not in str(raised.value) and not (tmp_path / "out").exists()
    merge_evals([one, _eval_folder(tmp_path / "three", "a" * 64)], tmp_path / "out")
    assert json.loads((tmp_path / "out" / "eval.json").read_text())["selector_files"] == {"sel.py:Ramp": "a" * 64}


# ---- case 13: stored selectors are not imported; a resume from elsewhere continues the folder ----


def test_a_sweep_resumed_from_another_directory_continues_its_rows(tiny_model_dir, tmp_path, monkeypatch, capsys):
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    write_selector(home / "sel", 1)
    elsewhere.mkdir()
    monkeypatch.chdir(home)
    common = ["sweep", "--model", str(tiny_model_dir), *SWEEP[:-1]]
    assert main([*common, "1", "--selectors", "quest,sel/ramp.py:Ramp", "--out", "out"]) == 0
    monkeypatch.chdir(elsewhere)
    write_selector(elsewhere / "sel", -1)  # another file under the same relative path: never read for the folder
    assert read_meta(home / "out")["spec"]["selectors"] == ["quest", "sel/ramp.py:Ramp"]
    assert main([*common, "2", "--selectors", "quest,../home/sel/ramp.py:Ramp", "--out", "../home/out"]) == 0
    rows = [json.loads(line) for line in (home / "out" / RUNS_FILE).read_text().splitlines()]
    assert [(r["prompt_index"], r["selector"]) for r in rows] == [
        (p, s) for p in (0, 1) for s in ("quest", "sel/ramp.py:Ramp")
    ]
    assert len({r["selector_sha256"] for r in rows if "ramp" in r["selector"]}) == 1
    capsys.readouterr()
    err = one_line_exit_2([*common, "2", "--selectors", "quest,sel/ramp.py:Ramp", "--out", "../home/out"], capsys)
    assert "sha256" in err  # the other file under the stored name: its content differs, refused
    # the adopted spec carries the file under its stored name, pickled too (--backend ray's units): its configs read
    # that file, not the other one this directory holds at the stored relative path
    meta = read_meta(home / "out")
    requested = SweepSpec(model="m", contexts=(150,), supports=(97,), selectors=("../home/sel/ramp.py:Ramp",))
    adopted = pickle.loads(pickle.dumps(adopt_stored(requested, meta, home / "out")))
    (cfg,) = adopted.configs()
    assert (
        cfg.selector_name == "sel/ramp.py:Ramp" and cfg.selector.source[1] == meta["selector_files"][cfg.selector_name]
    )
    assert parse_selector("sel/ramp.py:Ramp").source[1] != cfg.selector.source[1]  # nothing else reads it so


def test_a_report_needs_no_selector_file(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_selector(tmp_path / "sel", 1)
    args = ["sweep", "--model", str(tiny_model_dir), *SWEEP, "--selectors", "sel/ramp.py:Ramp,quest", "--out", "s"]
    assert main(args) == 0
    shutil.rmtree(tmp_path / "sel")
    assert main(["report", "s"]) == 0, capsys.readouterr().err
    assert "sel/ramp.py:Ramp" in (tmp_path / "s" / "report.md").read_text()
    evaluation = _eval_folder(tmp_path / "e", "a" * 64)
    assert main(["report", str(evaluation)]) == 0, capsys.readouterr().err
    assert SweepSpec.from_dict({"model": "m", "selectors": ["gone/nowhere.py:Cls"]}).selectors == (
        "gone/nowhere.py:Cls",
    )


# ---- cases 8 and 11: hand-edited comparison folders ----


@pytest.fixture(scope="module")
def comparisons(tiny_model_dir, tmp_path_factory):
    """Two comparisons of other selectors, same settings (op timing without the bandwidth measurement)."""
    root = tmp_path_factory.mktemp("comparisons")
    base = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "150", "--support", "97"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_operator, "read_bandwidth_gbs", lambda *a, **k: 12.5)
        for name, selectors in (("a", "quest"), ("b", "streaming")):
            args = [*base, "--prompts", "1", "--tokens", "4", "--selectors", selectors, "--out", str(root / name)]
            assert main(args) == 0
    return root


EDITS = {
    "a run without dense_tokens": (lambda d: d["runs"][0].pop("dense_tokens"), "run 1 lacks field 'dense_tokens'"),
    "a run without prompt_index": (lambda d: d["runs"][0].pop("prompt_index"), "run 1 lacks field 'prompt_index'"),
    "runs not a list": (lambda d: d.update(runs="oops"), "its runs should be a list, not a string"),
    "a context not in the settings": (lambda d: d["runs"][0].update(context=999), "run 1 is at context 999"),
    "selectors a string": (lambda d: d["settings"].update(selectors="quest"), "its settings field 'selectors'"),
    "a duplicated run": (lambda d: d["runs"].append(dict(d["runs"][0])), "run 2 repeats run 1"),
    "a selector without runs": (lambda d: d["settings"]["selectors"].append("h2o"), "no run of selector h2o"),
    "a trial not an object": (lambda d: d.update(retrieval=[3]), "passkey trial 1 is a number, not a JSON object"),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_hand_edited_comparison_is_one_line_in_merge_and_report(comparisons, tmp_path, capsys, edit):
    change, message = EDITS[edit]
    edited = tmp_path / "edited"
    shutil.copytree(comparisons / "a", edited)
    data = json.loads((edited / "selectors.json").read_text())
    change(data)
    (edited / "selectors.json").write_text(json.dumps(data))
    before = {path.name: path.read_bytes() for path in edited.iterdir()}
    for args in (["merge", str(comparisons / "b"), str(edited), "--out", str(tmp_path / "m")], ["report", str(edited)]):
        err = one_line_exit_2(args, capsys)
        assert "selectors.json is not a selector comparison" in err and message in err, err
    assert not (tmp_path / "m").exists()
    assert {path.name: path.read_bytes() for path in edited.iterdir()} == before, "nothing half-written"


def _third_comparison(tiny_model_dir, folder, monkeypatch):
    """A comparison of the settings of ``comparisons`` and a selector neither of them ran."""
    monkeypatch.setattr(bench_operator, "read_bandwidth_gbs", lambda *a, **k: 12.5)
    args = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "150", "--support", "97"]
    assert main([*args, "--prompts", "1", "--tokens", "4", "--selectors", "random-blocks", "--out", str(folder)]) == 0
    return json.loads((folder / "selectors.json").read_text())


def test_a_comparison_merged_into_a_folder_of_another_keeps_that_ones_selectors(
    comparisons, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """``merge A B --out C``, C holding a comparison of another selector, replaced C's comparison by A's and B's: its
    runs were lost unasked (found by probing merges into existing folders). C's comparison is merged too now, as a
    sweep or evaluation merge keeps the rows of its --out."""
    third = tmp_path / "c"
    held = _third_comparison(tiny_model_dir, third, monkeypatch)
    assert main(["merge", str(comparisons / "a"), str(comparisons / "b"), "--out", str(third)]) == 0
    assert "merged 3 comparison(s)" in capsys.readouterr().out
    merged = json.loads((third / "selectors.json").read_text())
    assert merged["settings"]["selectors"] == ["random-blocks", "quest", "streaming"]
    kept = [run["sparse_tokens"] for run in merged["runs"] if run["selector"] == "random-blocks"]
    assert kept == [run["sparse_tokens"] for run in held["runs"]]
    assert main(["merge", str(comparisons / "a"), "--out", str(third)]) == 2  # quest is in --out already
    assert f"already in --out {third}, which a merge keeps (give another --out" in capsys.readouterr().err
    before = (third / "selectors.json").read_bytes()  # merging the same sources into it again: refused, named so
    assert main(["merge", str(comparisons / "a"), str(comparisons / "b"), "--out", str(third)]) == 2
    assert "which a merge keeps" in capsys.readouterr().err and (third / "selectors.json").read_bytes() == before


def test_merging_a_merged_comparison_keeps_the_parts_it_was_merged_from(
    comparisons, tiny_model_dir, tmp_path, monkeypatch
):
    """A merged comparison merged again became one part with its first folder's environment: the selectors of its
    other folders were said to have run at the first one's revision (the committed comparisons, merged twice, say so
    of block-top-p, sparq and sink-streaming). Its parts are kept as they were now."""
    _third_comparison(tiny_model_dir, tmp_path / "c", monkeypatch)
    assert main(["merge", str(comparisons / "a"), str(comparisons / "b"), "--out", str(tmp_path / "ab")]) == 0
    first = json.loads((tmp_path / "ab" / "selectors.json").read_text())["settings"]["parts"]
    assert main(["merge", str(tmp_path / "ab"), str(tmp_path / "c"), "--out", str(tmp_path / "abc")]) == 0
    parts = json.loads((tmp_path / "abc" / "selectors.json").read_text())["settings"]["parts"]
    assert [part["selectors"] for part in parts] == [["quest"], ["streaming"], ["random-blocks"]]
    assert parts[:2] == first
    assert "`quest` at revision" in (tmp_path / "abc" / "selectors.md").read_text()


# ---- the same family in sweep folders: a row without a field is one line in merge and resume ----


@pytest.mark.parametrize("field", ["dense_tokens", "prompt_index"])
def test_a_sweep_row_without_a_field_is_one_line_in_merge_and_resume(tiny_model_dir, tmp_path, capsys, field):
    sweep = ["sweep", "--model", str(tiny_model_dir), *SWEEP[:-1], "1", "--out", str(tmp_path / "s")]
    assert main(sweep) == 0
    rows = [json.loads(line) for line in (tmp_path / "s" / RUNS_FILE).read_text().splitlines()]
    del rows[0][field]
    (tmp_path / "s" / RUNS_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    capsys.readouterr()
    for args in (
        ["merge", str(tmp_path / "s"), "--out", str(tmp_path / "m")],
        [*sweep[:-2], "--prompts", "2", *sweep[-2:]],
    ):
        err = one_line_exit_2(args, capsys)
        assert f"runs.jsonl run 1 lacks field '{field}'" in err, err
    assert not (tmp_path / "m").exists() and (tmp_path / "s" / SPEC_FILE).exists()


def test_a_description_the_code_cannot_read_is_never_advised_away(tmp_path, capsys):
    """A description written by a newer version holds its runs' settings: fix it or use that version, never remove."""
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / SPEC_FILE).write_text(json.dumps({"spec": {"model": "m", "newer_field": 1}}))
    (folder / RUNS_FILE).write_text("")
    with pytest.raises(SparseDecodeError, match="not a valid sweep description") as raised:
        read_meta(folder)
    assert "remove" not in str(raised.value) and "use the sparsedecode that wrote it" in str(raised.value)
