"""``SparseConfig.layer_supports``: a layer named there reads its own support on every path (the session, a padded
batch, the compiled step), the others ``support``; a budget file carries them; bad values are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import prompt, tiny_model
from test_attention import greedy_loop
from test_compiled import PROMPT, SMALL_CFG, _prompt, _session_run, _static_run

from sparsedecode import SparseConfig, SparseDecodeError, sparse_decoding
from sparsedecode.compiled.decoder import CompiledDecoder
from sparsedecode.config import read_budget


def _run(model, ids, cfg, steps=10):
    seen = {}
    with sparse_decoding(model, cfg) as session:
        session.observers.append(lambda view: seen.setdefault(view.layer, set()).add(view.index.shape[1]))
        tokens, logits = greedy_loop(model, ids, steps)
    return tokens, logits, session, seen


def test_each_layer_reads_its_own_support():
    model = tiny_model("llama")
    ids = prompt(400)
    cfg = SparseConfig(support=97, layer_supports={1: 193})
    _, _, _, seen = _run(model, ids, cfg)
    assert seen == {0: {97}, 1: {193}}
    assert cfg.for_layer(0) is cfg and cfg.for_layer(1).support == 193 and cfg.for_layer(1) is cfg.for_layer(1)
    assert cfg.supports_by_layer(2) == [97, 193]


def test_a_layer_support_covering_the_context_is_that_layer_dense():
    """A layer whose own support covers every position decodes dense: the tokens and logits of ``dense_layers``."""
    model = tiny_model("qwen2")
    ids = prompt(300)
    covered = _run(model, ids, SparseConfig(support=97, layer_supports="0:1009"))
    dense_first = _run(model, ids, SparseConfig(support=97, dense_layers=(0,)))
    uniform = _run(model, ids, SparseConfig(support=97, layer_supports={0: 97, 1: 97}))
    plain = _run(model, ids, SparseConfig(support=97))
    assert covered[0] == dense_first[0] and torch.equal(covered[1], dense_first[1])
    assert covered[3] == {1: {97}} and covered[2].dense_steps == dense_first[2].dense_steps
    assert uniform[0] == plain[0] and torch.equal(uniform[1], plain[1])
    assert not torch.equal(plain[1], covered[1])


def test_the_compiled_step_reads_each_layers_support():
    model = tiny_model("llama")
    ids = _prompt(7)
    cfg = SparseConfig(**SMALL_CFG, layer_supports={1: 193})
    eager_tokens, eager_logits = _session_run(model, ids, cfg, steps=16)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 17, backend="aot_eager")
    assert sorted(state.cfg.support for state in decoder.states.values()) == [97, 193]
    tokens, logits = _static_run(decoder, ids, steps=16, compiled=False)
    assert tokens == eager_tokens
    assert torch.allclose(logits, eager_logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("2:x", "LAYER:SUPPORT"),
        ("1:97,1:193", "names a layer twice"),
        ({-1: 97}, "integer >= 0"),
        ({3: 40}, "layer_supports, layer 3: support 40 is smaller than anchor"),  # which layer's (it named none)
        ({0: 97.0}, "layer 0: support must be an integer"),
        ([(0, 97, 1)], "pairs"),
    ],
)
def test_bad_layer_supports_are_refused_in_one_line(value, message):
    with pytest.raises(SparseDecodeError, match=message) as raised:
        SparseConfig(support=97, layer_supports=value)
    assert "\n" not in str(raised.value)


def test_a_layer_both_dense_and_budgeted_or_past_the_model_is_refused():
    with pytest.raises(SparseDecodeError, match="in dense_layers and has a support"):
        SparseConfig(support=97, dense_layers=(1,), layer_supports={1: 193})
    model = tiny_model("llama")
    with pytest.raises(SparseDecodeError, match="layer_supports names layer 5; the model has 2 attention layers"):
        with sparse_decoding(model, SparseConfig(support=97, layer_supports={5: 193})):
            pass


def test_a_budget_file_carries_dense_layers_and_layer_supports(tmp_path):
    path = tmp_path / "budget.json"
    path.write_text(json.dumps({"dense_layers": [0], "layer_supports": {"1": 193}}))
    budget = read_budget(path)
    cfg = SparseConfig(support=97, **budget)
    assert cfg.dense_layers == (0,) and cfg.layer_supports == ((1, 193),)
    for text, message in [
        ("[1, 2]", "a JSON object"),
        ('{"support": 97}', "unknown field"),
        ('{"layer_supports": {"1": "a"}}', "support must be an integer"),
        ("{", "not valid JSON"),
    ]:
        path.write_text(text)
        with pytest.raises(SparseDecodeError, match=message):
            SparseConfig(support=97, **read_budget(path))
    with pytest.raises(SparseDecodeError, match="no such file"):
        read_budget(tmp_path / "missing.json")
    path.write_bytes(b'\xff\xfe{"dense_layers": [1]}')  # UTF-16's mark: read as UTF-8, a bare UnicodeDecodeError
    with pytest.raises(SparseDecodeError, match="not UTF-8 text"):
        read_budget(path)


def test_the_command_line_takes_layer_supports_or_a_budget_file(tiny_model_dir, tmp_path, capsys):
    from sparsedecode.cli import main

    base = ["--model", str(tiny_model_dir), "--context", "300", "--support", "97", "--tokens", "4"]
    out = tmp_path / "run.json"
    assert main(["run", *base, "--layer-supports", "1:193", "--json", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["settings"]["layer_supports"] == {"1": 193}
    assert data["results"][0]["settings"]["layer_supports"] == [[1, 193]]
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"dense_layers": [0], "layer_supports": {"1": 193}}))
    sweep = ["sweep", *base[:-2], "--tokens", "4", "--prompts", "1", "--budget", str(budget)]
    assert main([*sweep, "--out", str(tmp_path / "s")]) == 0, capsys.readouterr().err
    spec = json.loads((tmp_path / "s" / "sweep.json").read_text())["spec"]
    assert spec["dense_layers"] == [0] and spec["layer_supports"] == [[1, 193]]
    rows = [json.loads(line) for line in (tmp_path / "s" / "runs.jsonl").read_text().splitlines()]
    assert rows and all(r["dense_layers"] == [0] and r["layer_supports"] == [[1, 193]] for r in rows)
    capsys.readouterr()
    both = ["run", *base, "--budget", str(budget), "--dense-layers", "1", "--json", str(tmp_path / "no.json")]
    assert main(both) == 2 and "not both" in capsys.readouterr().err and not (tmp_path / "no.json").exists()
    assert main(["run", *base, "--layer-supports", "1:x"]) == 2 and "LAYER:SUPPORT" in capsys.readouterr().err


def test_a_budget_file_may_carry_the_reuse_and_selector_a_calibration_chose(tmp_path):
    path = tmp_path / "budget.json"
    path.write_text(json.dumps({"layer_supports": {"1": 193}, "reuse": 2, "selector": "block-top-p:p=0.8"}))
    budget = read_budget(path)
    assert budget["reuse"] == 2 and budget["selector"] == "block-top-p:p=0.8"
    cfg = SparseConfig(support=97, **budget)  # the library takes the file's fields as they are
    assert cfg.reuse == 2 and cfg.selector.p == 0.8 and cfg.layer_supports == ((1, 193),)
    path.write_text(json.dumps({"layer_supports": {}}))
    assert set(read_budget(path)) == {"dense_layers", "layer_supports"}  # none named: the command's own hold
    for data, message in [
        ({"reuse": 0}, "reuse is an integer R >= 1"),
        ({"reuse": True}, "reuse is an integer R >= 1"),
        ({"selector": 3}, "selector is a spec string"),
        ({"selector": "no-such-selector"}, "no-such-selector"),
        ({"selector": "block-top-p:q=1"}, "no parameter 'q'"),
    ]:
        path.write_text(json.dumps(data))
        with pytest.raises(SparseDecodeError, match=message):
            read_budget(path)


def test_a_budget_files_reuse_and_selector_set_the_commands_unless_given_otherwise(tmp_path):
    from sparsedecode.cli import build_parser
    from sparsedecode.cli.parser import apply_budget_file

    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"layer_supports": {"1": 193}, "reuse": 2, "selector": "quest"}))

    def parsed(*argv):
        args = build_parser().parse_args(list(argv))
        apply_budget_file(args)
        return args

    run = parsed("run", "--budget", str(budget))
    assert (run.reuse, run.selector) == (2, "quest")
    same = parsed("run", "--budget", str(budget), "--reuse", "2", "--selector", "quest")
    assert (same.reuse, same.selector) == (2, "quest")
    assert parsed("sweep", "--budget", str(budget), "--out", str(tmp_path / "s")).reuse == [2]
    assert parsed("run", "--reuse", "3").reuse == 3  # no budget: the options as given
    for argv, message in [
        (["run", "--budget", str(budget), "--reuse", "1"], "--reuse 1 differs from budget file"),
        (["run", "--budget", str(budget), "--selector", "mean-pooled"], "--selector mean-pooled differs"),
        (["sweep", "--budget", str(budget), "--reuse", "1,2", "--out", str(tmp_path / "s")], "--reuse 1,2 differs"),
        (["bench", "e2e", "--budget", str(budget)], "sets reuse 2, which this command does not take"),
    ]:
        with pytest.raises(SparseDecodeError, match=message):
            parsed(*argv)
    budget.write_text(json.dumps({"selector": "quest"}))
    assert parsed("compare-selectors", "--budget", str(budget), "--out", str(tmp_path / "c")).selectors == ("quest",)
    assert parsed("eval", "--budget", str(budget), "--out", str(tmp_path / "e")).selectors == ("quest",)
    with pytest.raises(SparseDecodeError, match="--selectors mean-pooled,streaming differs from budget file"):
        parsed("eval", "--budget", str(budget), "--selectors", "mean-pooled,streaming", "--out", str(tmp_path / "e"))
