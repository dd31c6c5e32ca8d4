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
        ({0: 40}, "smaller than anchor"),
        ({0: 97.0}, "support must be an integer"),
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
