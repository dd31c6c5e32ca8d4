"""``SparseConfig.dense_layers``: the layers it names decode dense at every step on every path (the session, a
padded batch, the compiled step), the others sparse as before; rows store it; bad values are refused in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import prompt, tiny_model
from test_attention import greedy_loop
from test_compiled import PROMPT, SMALL_CFG, _prompt, _session_run, _static_run

from sparsedecode import SparseConfig, SparseDecodeError, compare, sparse_decoding
from sparsedecode.compiled.decoder import CompiledDecoder
from sparsedecode.decoding.loop import decode_tokens, prefill
from sparsedecode.session.kv_cache import GrowingCache


def _layers_seen(model, ids, cfg, steps=12):
    seen = []
    with sparse_decoding(model, cfg) as session:
        session.observers.append(lambda view: seen.append(view.layer))
        tokens, logits = greedy_loop(model, ids, steps)
    return tokens, logits, session, sorted(set(seen))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_layer_dense_is_dense_decoding_exactly(arch):
    model = tiny_model(arch)
    layers = model.config.num_hidden_layers
    ids = prompt(300)
    dense_tokens, dense_logits = greedy_loop(model, ids, 12)
    cfg = SparseConfig(support=97, dense_layers=tuple(range(layers)))
    tokens, logits, session, seen = _layers_seen(model, ids, cfg)
    assert seen == [] and session.sparse_steps == 0 and session.dense_steps == 12 * layers
    assert tokens == dense_tokens and torch.equal(logits, dense_logits)


def test_named_layers_never_step_sparse_and_the_rest_do():
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    assert layers >= 2, "a model of one layer would test little"
    ids = prompt(300)
    _, plain_logits, plain, everywhere = _layers_seen(model, ids, SparseConfig(support=97))
    tokens, logits, session, seen = _layers_seen(model, ids, SparseConfig(support=97, dense_layers="0"))
    assert everywhere == list(range(layers)) and seen == list(range(1, layers))
    assert session.sparse_steps == plain.sparse_steps - 12 and session.dense_steps == plain.dense_steps + 12
    assert not torch.equal(logits, plain_logits), "a dense first layer changes what the later layers see"


def test_the_compiled_step_keeps_the_named_layers_dense():
    model = tiny_model("llama")
    ids = _prompt(5)
    cfg = SparseConfig(**SMALL_CFG, dense_layers=(0,))
    eager_tokens, eager_logits = _session_run(model, ids, cfg, steps=16)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 17, backend="aot_eager")
    assert sorted(decoder.states) == list(range(1, model.config.num_hidden_layers))  # kept by layer index
    tokens, logits = _static_run(decoder, ids, steps=16, compiled=False)
    assert tokens == eager_tokens
    assert torch.allclose(logits, eager_logits, rtol=0, atol=1e-4)
    plain_tokens, plain_logits = _session_run(model, ids, SparseConfig(**SMALL_CFG), steps=16)
    assert not torch.equal(plain_logits, eager_logits)


def test_rows_store_the_dense_layers():
    model = tiny_model("llama")
    result = compare(model, None, prompt(300), SparseConfig(support=97, dense_layers="1,0"), 6)
    assert result.settings["dense_layers"] == (0, 1) or result.settings["dense_layers"] == [0, 1]
    assert SparseConfig(support=97, dense_layers=[1, 0]) == SparseConfig(support=97, dense_layers="0, 1")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0,x", "comma-separated list of layer indices"),
        ((-1,), "integers >= 0"),
        ((True,), "integers >= 0"),
        ("1,1", "names a layer twice"),
        (3.0, "list of layer indices"),
    ],
)
def test_bad_dense_layers_are_refused_in_one_line(value, message):
    with pytest.raises(SparseDecodeError, match=message) as raised:
        SparseConfig(support=97, dense_layers=value)
    assert "\n" not in str(raised.value)


def test_a_layer_the_model_lacks_is_refused_when_decoding_starts():
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    cfg = SparseConfig(support=97, dense_layers=(0, layers))
    with pytest.raises(SparseDecodeError, match=f"the model has {layers} attention layers"):
        with sparse_decoding(model, cfg):
            pass
    with pytest.raises(SparseDecodeError, match=f"the model has {layers} attention layers"):
        CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 4, backend="aot_eager")


def test_run_and_compare_selectors_take_dense_layers(tiny_model_dir, tmp_path, capsys):
    import json

    from sparsedecode.cli import main

    out = tmp_path / "run.json"
    base = ["--model", str(tiny_model_dir), "--context", "200", "--support", "97", "--tokens", "6"]
    assert main(["run", *base, "--dense-layers", "0", "--json", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["settings"]["dense_layers"] == [0]
    assert all(r["settings"]["dense_layers"] == [0] for r in data["results"])
    folder = tmp_path / "selectors"
    args = ["compare-selectors", *base[:-2], "--tokens", "4", "--prompts", "1", "--selectors", "quest"]
    assert main([*args, "--dense-layers", "0", "--out", str(folder)]) == 0, capsys.readouterr().err
    comparison = json.loads((folder / "selectors.json").read_text())
    assert comparison["settings"]["dense_layers"] == [0]
    assert all(r["settings"]["dense_layers"] == [0] for r in comparison["runs"])
    assert "--dense-layers 0" in (folder / "selectors.md").read_text()


@pytest.mark.parametrize(("value", "message"), [("0,a", "comma-separated"), ("9", "the model has 2 attention layers")])
def test_the_command_line_refuses_bad_dense_layers_in_one_line(value, message, tiny_model_dir, tmp_path, capsys):
    from sparsedecode.cli import main

    out = tmp_path / "run.json"
    args = ["run", "--model", str(tiny_model_dir), "--context", "200", "--support", "97", "--tokens", "4"]
    assert main([*args, "--dense-layers", value, "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not out.exists()


def test_sweep_eval_and_bench_e2e_take_dense_layers(tiny_model_dir, tmp_path, capsys):
    import json

    from sparsedecode.cli import main

    model = ["--model", str(tiny_model_dir)]
    sweep = ["sweep", *model, "--context", "200", "--support", "97", "--prompts", "1", "--tokens", "4"]
    sweep += ["--selectors", "quest,mean-pooled", "--out", str(tmp_path / "s")]
    assert main([*sweep, "--dense-layers", "0"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["spec"]["dense_layers"] == [0]
    rows = [json.loads(line) for line in (tmp_path / "s" / "runs.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["dense_layers"] == [0] for row in rows)
    capsys.readouterr()
    assert main([*sweep, "--dense-layers", "1"]) == 2  # another setting: not the same sweep
    assert "dense_layers" in capsys.readouterr().err
    evaluation = ["eval", *model, "--tasks", "vt", "--context", "600", "--samples", "1", "--support", "97"]
    evaluation += ["--answer-tokens", "3", "--selectors", "twilight", "--dense-layers", "1"]
    assert main([*evaluation, "--out", str(tmp_path / "e")]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "e" / "runs.jsonl").read_text().splitlines()]
    assert [row.get("dense_layers") for row in rows] == [None, [1]]  # the dense row, then twilight's
    assert all(row["output_tokens"] == len(row["output_ids"]) >= 1 for row in rows)  # answer lengths, #41
    assert main(["report", str(tmp_path / "e")]) == 0
    ratio = f"{len(rows[1]['output_ids']):.1f} / {len(rows[0]['output_ids']):.1f}"
    assert "answer tokens sparse / dense" in (tmp_path / "e" / "report.md").read_text()
    assert ratio in (tmp_path / "e" / "report.md").read_text()
    e2e = ["bench", "e2e", *model, "--context", "300", "--support", "97", "--tokens", "4", "--repeats", "1"]
    assert main([*e2e, "--dense-layers", "0", "--json", str(tmp_path / "b.json")]) == 0, capsys.readouterr().err
    written = json.loads((tmp_path / "b.json").read_text())
    assert written["dense_layers"] == [0] and written["machine"]["weights_gathered"] is True


def test_folders_written_before_the_published_methods_keep_their_variants():
    """A spec stored before issue #39 (no dense_layers field) names the group-mean variants its rows ran."""
    from sparsedecode.experiments.eval_spec import EvalSpec
    from sparsedecode.experiments.specs import RetrievalSpec, SweepSpec

    old = SweepSpec.from_dict({"model": "m", "selectors": ["quest", "sparq:rank=4", "top-p", "mean-pooled"]})
    assert old.selectors == ("quest:grouping=mean-query", "sparq:rank=4,grouping=mean-query", "block-top-p",
                             "mean-pooled")  # fmt: skip
    new = SweepSpec.from_dict({**SweepSpec(model="m", selectors=("quest",)).to_dict()})
    assert new.selectors == ("quest",) and new.dense_layers == ()
    assert EvalSpec.from_dict({"model": "m", "selectors": ["quest"]}).selectors == ("quest:grouping=mean-query",)
    assert RetrievalSpec.from_dict({"model": "m", "selector": "sparq"}).selector == "sparq:grouping=mean-query"


def test_the_compiled_decoders_tally_counts_the_named_layers_steps_dense_as_a_session_does():
    """Found by probing: ``CompiledDecoder.tally()`` left out the steps of ``dense_layers`` (layers without step
    state), so its ``dense_steps`` read 0 where the session's counters on the same configuration counted them."""
    model = tiny_model("llama")
    ids = _prompt(5)
    cfg = SparseConfig(**SMALL_CFG, dense_layers=(0,))
    with sparse_decoding(model, cfg) as session:
        cache, logits = prefill(model, ids, cache=GrowingCache(config=model.config))
        decode_tokens(model, cache, logits.argmax(dim=-1).tolist(), 8)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 9, backend="aot_eager")
    _static_run(decoder, ids, steps=8)
    tally = decoder.tally()
    assert (tally["sparse_steps"], tally["dense_steps"]) == (session.sparse_steps, session.dense_steps) == (8, 8)
