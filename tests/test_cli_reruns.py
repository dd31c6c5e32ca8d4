"""What a command does with what is already there: earlier results of other settings in its folder, a corpus named by
another path, a selector that calls ``sys.exit``, a default that the other options rule out."""

from __future__ import annotations

import json

import pytest
from test_bad_input import one_line_exit_2

from sparsedecode import SparseConfig, compare
from sparsedecode.cli import main
from sparsedecode.errors import SparseDecodeError

EXITS = """
import sys

import sparsedecode as sd


class Exits(sd.BlockSelector):
    def score_blocks(self, queries, keys, layout):
        sys.exit(0)
"""


def test_a_selector_calling_sys_exit_is_one_line_not_a_silent_exit(tmp_path, tiny_model_dir, capsys):
    """``sys.exit(0)`` inside a selector ended a command silently with status 0 (a folder half-written)."""
    from conftest import prompt, tiny_model

    (tmp_path / "exits.py").write_text(EXITS)
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(SparseDecodeError, match=r"failed in score_blocks: called sys.exit\(0\)"):
        compare(
            tiny_model("llama"), None, prompt(200), SparseConfig(support=97, selector=f"{tmp_path}/exits.py:Exits"), 3
        )
    model = ["--model", str(tiny_model_dir), "--context", "200", "--support", "97", "--tokens", "3"]
    capsys.readouterr()
    err = one_line_exit_2(["run", *model, "--selector", f"{tmp_path}/exits.py:Exits"], capsys)
    assert "called sys.exit(0)" in err
    err = one_line_exit_2(["run", *model, "--selector", f"{tmp_path}/exits_on_import.py:Exits"], capsys)
    assert "failed to import: called sys.exit(0)" in err
    err = one_line_exit_2(["run", *model, "--selector", f"{tmp_path}:Exits"], capsys)
    assert "is a folder, not a Python file" in err or "unknown selector" in err


@pytest.mark.parametrize("command", ["compare-selectors", "probe mass"])
def test_earlier_results_of_other_settings_are_not_replaced_unasked(command, tmp_path, tiny_model_dir, capsys):
    """A command that cannot resume replaces its folder's results only on a rerun of the same settings; other
    settings are refused (compare-selectors replaced 22 runs silently; probe mass left the earlier heat maps beside
    a mass.json that did not name them)."""
    out = tmp_path / "out"
    base = [*command.split(), "--model", str(tiny_model_dir), "--context", "200", "--tokens", "3", "--out", str(out)]
    first = [*base, "--support", "97"] + (
        ["--prompts", "1", "--selectors", "streaming"] if "compare" in command else []
    )
    assert main(first) == 0, capsys.readouterr().err
    marker = out / ("selectors.json" if "compare" in command else "mass.json")
    assert main(first) == 0, capsys.readouterr().err  # the same settings: replaced
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    other = [*first[: first.index("--support")], "--support", "113", *first[first.index("--support") + 2 :]]
    capsys.readouterr()
    err = one_line_exit_2(other, capsys)
    assert "of other settings (support" in err and "remove" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and marker.name in before


def test_a_merged_or_retimed_comparison_is_replaced_by_a_rerun_of_its_settings(tmp_path, tiny_model_dir, capsys):
    """A merged comparison holds its ``parts`` and ``scripts/retime_selector_ops.py`` adds ``op_ms_remeasured``: a rerun
    of the very settings was refused naming them, their environments in the line (hundreds of characters), and a
    rerun of other selectors named ``parts`` rather than the selectors (found by probing reruns into merged folders).
    They say how the comparison was made, not what it compares."""
    import json

    base = ["compare-selectors", "--model", str(tiny_model_dir), "--context", "200", "--support", "97"]
    base += ["--prompts", "1", "--tokens", "3"]
    a, b, merged = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    assert main([*base, "--selectors", "streaming", "--out", str(a)]) == 0
    assert main([*base, "--selectors", "random-blocks", "--out", str(b)]) == 0
    assert main(["merge", str(a), str(b), "--out", str(merged)]) == 0
    capsys.readouterr()
    err = one_line_exit_2([*base, "--selectors", "streaming", "--out", str(merged)], capsys)
    assert "of other settings (selectors: ['streaming', 'random-blocks'] there, ['streaming'] now)" in err, err
    data = json.loads((merged / "selectors.json").read_text())
    data["settings"]["op_ms_remeasured"] = {"by": "scripts/retime_selector_ops.py", "environment": {"threads": 2}}
    (merged / "selectors.json").write_text(json.dumps(data))
    assert main([*base, "--selectors", "streaming,random-blocks", "--out", str(merged)]) == 0, capsys.readouterr().err
    settings = json.loads((merged / "selectors.json").read_text())["settings"]
    assert "parts" not in settings and "op_ms_remeasured" not in settings


def test_probe_mass_leaves_no_maps_without_the_mass_json_listing_them(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """An interrupted probe mass left its first heat maps and no mass.json; a later run of other settings was then
    accepted and the folder mixed two runs. Now the maps are written after every probe (an interrupt leaves the folder
    as it was), removed if writing them fails, and a folder of maps without their mass.json is refused."""
    from sparsedecode.cli import probe

    out = tmp_path / "pm"
    args = ["probe", "mass", "--model", str(tiny_model_dir), "--context", "200", "--tokens", "3", "--out", str(out)]
    calls = []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*a, **k)

    original = probe._write_maps
    monkeypatch.setattr(probe, "_write_maps", interrupted)
    assert main([*args, "--support", "97,113"]) == 130  # interrupted while writing the second map
    assert len(calls) == 2
    assert not out.exists() or not any(out.iterdir())  # the first support's maps removed again
    monkeypatch.setattr(probe, "_write_maps", original)
    out.mkdir(exist_ok=True)
    (out / "mass-c200-s97.png").write_bytes(b"left by a run killed before its mass.json")
    capsys.readouterr()
    err = one_line_exit_2([*args, "--support", "113"], capsys)
    assert "mass-c200-s97.png" in err and "no mass.json" in err
    (out / "mass-c200-s97.png").unlink()
    assert main([*args, "--support", "113"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["mass-c200-s113.npz", "mass-c200-s113.png", "mass.json"]


def test_an_interrupted_rerun_of_probe_mass_keeps_the_maps_its_mass_json_lists(tmp_path, tiny_model_dir, monkeypatch):
    """A rerun of the same settings interrupted while writing its maps removed the maps it had rewritten, which the
    earlier mass.json still listed: the folder named heat maps it no longer held (found reading its clean-up).
    A rerun's maps replace the listed ones, so they stay."""
    import json

    from sparsedecode.cli import probe

    out = tmp_path / "pm"
    args = ["probe", "mass", "--model", str(tiny_model_dir), "--context", "200", "--tokens", "3", "--out", str(out)]
    args += ["--support", "97,113"]
    assert main(args) == 0
    original, calls = probe._write_maps, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*a, **k)

    monkeypatch.setattr(probe, "_write_maps", interrupted)
    assert main(args) == 130  # interrupted while writing the second map
    listed = [row["png"] for row in json.loads((out / "mass.json").read_text())["results"]]
    assert listed == ["mass-c200-s97.png", "mass-c200-s113.png"]
    assert all((out / name).is_file() and (out / name).with_suffix(".npz").is_file() for name in listed)


def test_a_sweep_or_evaluation_refuses_rows_of_other_weights_under_the_same_name(tmp_path, capsys, monkeypatch):
    """A checkpoint folder replaced in place between two sweep runs merged rows of two models silently (only the
    model's name was recorded); its weights' fingerprint is now recorded and compared."""
    from conftest import char_tokenizer, tiny_model

    monkeypatch.chdir(tmp_path)
    tiny_model("llama").save_pretrained("ckpt")
    char_tokenizer().save_pretrained("ckpt")
    args = ["sweep", "--model", "ckpt", "--context", "200", "--tokens", "3", "--support", "97", "--out", "sw"]
    assert main([*args, "--prompts", "1"]) == 0, capsys.readouterr().err
    recorded = json.loads((tmp_path / "sw" / "sweep.json").read_text())["weights_sha256"]
    tiny_model("llama", seed=5).save_pretrained("ckpt")  # another model under the same name
    capsys.readouterr()
    err = one_line_exit_2([*args, "--prompts", "2"], capsys)
    assert "other weights" in err
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["weights_sha256"] == recorded
    assert len((tmp_path / "sw" / "runs.jsonl").read_text().splitlines()) == 1


def test_a_corpus_named_by_another_path_to_the_same_file_resumes(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corp.txt").write_text("The quick brown fox jumps over the lazy dog. " * 400)
    args = ["sweep", "--model", str(tiny_model_dir), "--context", "200", "--prompts", "1", "--tokens", "3"]
    assert main([*args, "--corpus", "corp.txt", "--support", "97", "--out", "sw"]) == 0, capsys.readouterr().err
    assert main([*args, "--corpus", "./corp.txt", "--support", "97,113", "--out", "sw"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["spec"]["corpus"] == "corp.txt"
    assert len((tmp_path / "sw" / "runs.jsonl").read_text().splitlines()) == 2


def test_lossless_drafts_what_the_tokens_leave_by_default(tmp_path, tiny_model_dir, capsys):
    """The default draft length (4) within --tokens - 1: ``--tokens 2`` was refused for a value nobody gave."""
    out = tmp_path / "run.json"
    args = ["run", "--model", str(tiny_model_dir), "--context", "150", "--support", "97", "--mode", "lossless"]
    assert main([*args, "--tokens", "2", "--json", str(out)]) == 0, capsys.readouterr().err
    assert out.is_file()
    # strict JSON (found by probing: the dense record's acceptance rates were written as NaN)
    json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON file"))


def test_run_records_the_weights_and_dtype_that_ran(tmp_path, tiny_model_dir, capsys):
    """``--weights bfloat16`` alone decodes in bfloat16: the settings said float32 (the default --dtype)."""
    out = tmp_path / "run.json"
    args = ["run", "--model", str(tiny_model_dir), "--context", "150", "--support", "97", "--tokens", "3"]
    assert main([*args, "--weights", "bfloat16", "--json", str(out)]) == 0, capsys.readouterr().err
    settings = json.loads(out.read_text())["settings"]
    assert settings["dtype"] == "bfloat16" and settings["weights"] == "bfloat16"
    assert settings["weights_loaded"] == "bfloat16"
    assert main([*args, "--weights", "int8", "--json", str(out)]) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["settings"]["weights_loaded"].startswith("int8")


def test_quantized_weights_no_layer_takes_are_refused(tmp_path):
    """A model whose every linear layer has inputs not in groups of 32 ran float weights recorded as int4."""
    from conftest import char_tokenizer, tiny_model

    from sparsedecode.models.catalog import load_model

    folder = tmp_path / "odd"
    tiny_model("llama", hidden_size=48, intermediate_size=80, head_dim=12).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    with pytest.raises(SparseDecodeError, match="none of .* linear layers takes them"):
        load_model(str(folder), weights="int4")


def test_lossless_with_audit_is_refused_not_ignored(tiny_model_dir, capsys):
    args = ["run", "--model", str(tiny_model_dir), "--context", "150", "--support", "97", "--tokens", "4"]
    err = one_line_exit_2([*args, "--mode", "lossless", "--audit"], capsys)
    assert "--audit applies to --mode compare only" in err
