"""The command line on a tiny local model: results, JSON, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sparsedecode.cli import main


def run_cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_run_writes_json_with_one_result_per_support(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "result.json"
    code, stdout, _ = run_cli(
        [
            "run",
            "--model",
            str(tiny_model_dir),
            "--context",
            "200",
            "--support",
            "97,1009",
            "--tokens",
            "12",
            "--json",
            str(out),
        ],
        capsys,
    )
    assert code == 0
    data = json.loads(out.read_text())
    assert data["settings"]["supports"] == [97, 1009] and data["settings"]["tokens"] == 12
    sparse, full = data["results"]
    for row in (sparse, full):
        for name in (
            "first_divergence",
            "survives",
            "teacher_forced_match",
            "delta_ppl_percent",
            "dense_ppl",
            "sparse_ppl",
            "mean_unique_distant_positions_per_kv",
            "dense_tokens",
            "sparse_tokens",
        ):
            assert name in row
        assert len(row["dense_tokens"]) == len(row["sparse_tokens"]) == 12
    assert sparse["settings"]["effective_support"] == 97 and sparse["sparse_steps"] > 0
    assert full["survives"] and full["teacher_forced_match"] == 100.0 and full["delta_ppl_percent"] == 0.0
    assert "dense vs sparse, context 200" in stdout
    # the side-by-side continuation marks the first divergence at step t = first_divergence (docs/definitions.md,
    # section 3)
    assert not sparse["survives"], "a sparse run that survives would not test the marker"
    assert f"⟦step {sparse['first_divergence']}⟧" in stdout and stdout.count("⟦step") == 2  # both columns
    assert "sparse steps: C kernel" in " ".join(stdout.split())  # float32, mean-pooled: what auto runs here


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--model", "no-such-alias"], "unknown model"),
        (["run", "--support", "50"], "support 50"),
        (["run", "--tokens", "0"], "--tokens"),
        (["run", "--tokens", "-3"], "--tokens"),
        (["run", "--dtype", "int8"], "invalid choice"),
        (["run", "--context", "abc"], "comma-separated"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    code, _, err = run_cli(args, capsys)
    assert code == 2
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_context_beyond_model_positions_or_corpus(tiny_model_dir, tmp_path, capsys):
    code, _, err = run_cli(["run", "--model", str(tiny_model_dir), "--context", "1020", "--tokens", "8"], capsys)
    assert code == 2 and "exceeds the model's 1024 positions" in err and err.count("\n") == 1
    small = tmp_path / "small.txt"
    small.write_text("just a few words of text")
    out = tmp_path / "never.json"
    code, _, err = run_cli(
        [
            "run",
            "--model",
            str(tiny_model_dir),
            "--corpus",
            str(small),
            "--context",
            "300",
            "--tokens",
            "8",
            "--json",
            str(out),
        ],
        capsys,
    )
    assert code == 2 and "room for 0 prompt" in err and err.count("\n") == 1
    assert not out.exists(), "nothing half-written"


def test_module_entry_point_reports_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "sparsedecode", "run", "--support", "10"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "support 10" in proc.stderr


def test_run_audit_writes_npz_and_layer_tables(tiny_model_dir, tmp_path, capsys):
    from sparsedecode.protocol.diagnostics import load_audit

    out = tmp_path / "audit.json"
    code, stdout, _ = run_cli(
        [
            "run",
            "--model",
            str(tiny_model_dir),
            "--context",
            "250",
            "--support",
            "97",
            "--tokens",
            "10",
            "--audit",
            "--json",
            str(out),
        ],
        capsys,
    )
    assert code == 0
    row = json.loads(out.read_text())["results"][0]
    for name in (
        "identity_residual_max",
        "bound_violations",
        "omitted_mass_mean",
        "selector_recall_mean",
        "captured_mass_ratio_mean",
        "selector_recall_per_head_best_mean",
        "captured_mass_ratio_per_head_best_mean",
        "certified_fraction",
        "flips",
        "certificate_violations",
        "margin_at_divergence",
        "warning_regime",
    ):
        assert name in row
    # float32 round-off of the output relative to its size (see test_diagnostics)
    assert row["identity_residual_max"] <= 1e-5 and row["bound_violations"] == 0
    assert len(row["audit"]["layers"]) == 2
    arrays = load_audit(tmp_path / row["audit"]["arrays"])
    assert arrays["omitted_mass"].shape == (9, 2, 4)
    assert "audit, context 250, S=97" in stdout and "certified" in stdout


def test_probe_mass_writes_heat_map(tiny_model_dir, tmp_path, capsys):
    code, stdout, _ = run_cli(
        [
            "probe",
            "mass",
            "--model",
            str(tiny_model_dir),
            "--context",
            "250",
            "--support",
            "97,1009",
            "--tokens",
            "5",
            "--out",
            str(tmp_path),
        ],
        capsys,
    )
    assert code == 0
    png = tmp_path / "mass-c250-s97.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "mass.json").read_text())
    assert [r["settings"]["support"] for r in data["results"]] == [97]  # S=1009 covers everything
    assert "nothing to audit" in stdout


def test_compare_selectors_writes_a_table_for_every_selector(tiny_model_dir, tmp_path, capsys):
    from conftest import SELECTORS

    code, stdout, _ = run_cli(
        [
            "compare-selectors",
            "--model",
            str(tiny_model_dir),
            "--context",
            "250",
            "--support",
            "97",
            "--prompts",
            "1",
            "--tokens",
            "6",
            "--audit",
            "--out",
            str(tmp_path),
        ],
        capsys,
    )
    assert code == 0
    data = json.loads((tmp_path / "selectors.json").read_text())
    assert [row["selector"] for row in data["summary"]] == list(SELECTORS)
    assert all(row["op_ms"] > 0 and 0 <= row["captured_mass_ratio"] <= 1 + 1e-9 for row in data["summary"])
    markdown = (tmp_path / "selectors.md").read_text()
    assert "sparsedecode compare-selectors" in markdown and "| `quest` | practical |" in markdown
    assert (tmp_path / "selectors.csv").read_text().count("\n") == len(SELECTORS) + 1


def test_probe_mass_heat_map_names_the_layers_it_shows(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """With --dense-layers 0 the map has one row, layer 1's; it was labelled by its row number (0) instead."""
    from sparsedecode.reports import plots

    drawn = []
    real = plots.heatmap
    monkeypatch.setattr(
        plots, "heatmap", lambda matrix, path, **kw: drawn.append((matrix, kw)) or real(matrix, path, **kw)
    )
    args = ["probe", "mass", "--model", str(tiny_model_dir), "--context", "250", "--support", "97", "--tokens", "3"]
    code, _, _ = run_cli([*args, "--dense-layers", "0", "--out", str(tmp_path)], capsys)
    assert code == 0
    ((matrix, kw),) = drawn
    assert matrix.shape == (1, 4) and kw["yticks"] == ["1"]


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a head a layer lacks warned "Mean of empty slice"
def test_probe_mass_heat_map_scale_ignores_heads_a_layer_lacks(tmp_path, monkeypatch):
    """The audit holds NaN for the heads of a layer with fewer query heads than another (as MassAudit documents);
    the map's colour scale was their ``max()``, NaN, which drew every cell in one colour on a -0.1..0.1 scale."""
    from argparse import Namespace

    import numpy as np

    from sparsedecode.cli.probe import _write_maps
    from sparsedecode.experiments.probes import MassProbe
    from sparsedecode.reports import plots

    omitted = np.full((2, 2, 4), 0.25)
    omitted[:, 0, 1] = 0.5
    omitted[:, 1, 2:] = np.nan  # layer 1 has 2 query heads
    probe = MassProbe(128, {"support": 33}, [1, 2, 3], {"omitted_mass": omitted, "layers": np.array([0, 1])},
                      {"audited_steps": 2}, 0.0)  # fmt: skip
    drawn = []
    monkeypatch.setattr(plots, "heatmap", lambda matrix, path, **kw: drawn.append(kw) or path.write_bytes(b""))
    _write_maps(Namespace(out=tmp_path, model="tiny"), 128, probe, [])
    assert drawn[0]["vmax"] == 0.5


def test_probe_mass_with_every_layer_dense_does_not_blame_the_support(tiny_model_dir, tmp_path, capsys):
    """Every layer in --dense-layers: nothing is audited, and the support (97 of 250 positions) is not what covered
    the context, as the message said."""
    args = ["probe", "mass", "--model", str(tiny_model_dir), "--context", "250", "--support", "97", "--tokens", "3"]
    code, stdout, _ = run_cli([*args, "--dense-layers", "0,1", "--out", str(tmp_path)], capsys)
    assert code == 0 and "nothing to audit" in stdout
    assert "the support covers the context" not in " ".join(stdout.split())
    assert json.loads((tmp_path / "mass.json").read_text())["results"] == []


@pytest.mark.parametrize(
    "command",
    [
        ["run", "--context", "150", "--support", "97", "--tokens", "4"],
        ["probe", "mass", "--context", "150", "--support", "97", "--tokens", "4"],
    ],
)
@pytest.mark.parametrize("flag", [("--dense-layers", "0,7"), ("--layer-supports", "9:193")])
def test_layers_the_model_lacks_are_refused_before_any_prefill(
    tiny_model_dir, tmp_path, capsys, monkeypatch, command, flag
):
    """``--dense-layers`` / ``--layer-supports`` naming a layer past the model's are refused as it loads, in one line,
    before a prefill or a dense reference is spent (the session refused them only as it opened, after them)."""
    from sparsedecode.decoding import loop

    def no_prefill(*args, **kwargs):
        raise AssertionError("a prefill ran before the layers were checked")

    monkeypatch.setattr(loop, "prefill", no_prefill)
    args = [*command, "--model", str(tiny_model_dir), *flag]
    out = ["--out", str(tmp_path / "mass")] if command[0] == "probe" else ["--json", str(tmp_path / "r.json")]
    code, _, err = run_cli([*args, *out], capsys)
    assert code == 2 and err.count("\n") == 1 and "the model has 2 attention layers" in err, err
    assert not any(tmp_path.iterdir())
