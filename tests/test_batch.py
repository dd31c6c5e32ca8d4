"""Batched sparse decoding (issue #12): every sequence of a ragged, left-padded batch is decoded as it would be alone.

The oracle is the same sequence decoded at batch 1 in the same mode: tokens equal, logits within float32 round-off
(batched matrix products add in another order than batch-1 ones, so not bit for bit: conftest.logits_tolerance).
A support that covers every sequence is dense batched decoding exactly. Padding is never selected nor attended:
poisoning the padded cache positions changes nothing.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import logits_tolerance, prompt, roundoff_tolerance, tiny_model

import sparsedecode as sd
from sparsedecode import SparseConfig, SparseDecodeError, sparse_decoding
from sparsedecode.decoding import loop as batching
from sparsedecode.session import prefill_history
from sparsedecode.session.kv_cache import GrowingCache

# lengths differ by more than a block; 60 and 90 start below S = 97 and grow past it while decoding
LENGTHS = (300, 150, 60, 233, 90)
STEPS = 40
POSITIONS = max(LENGTHS) + STEPS  # the longest attention sum, for logits_tolerance
# float32 round-off of the tiny models' logits (below 1) over sums of POSITIONS terms (conftest.logits_tolerance):
# an NLL moves by twice it, a perplexity ratio by four times it relatively (1.2e-3 percent points), a margin (the
# difference of two logits) by twice it; rows of other floats (masses, ratios at most 1) by less
LOGIT_ROUNDOFF = roundoff_tolerance(torch.ones(1), depth=2, width=POSITIONS)
PERCENT_ROUNDOFF = dict(rel=4 * LOGIT_ROUNDOFF, abs=400 * LOGIT_ROUNDOFF)


def ragged(lengths=LENGTHS, vocab: int = 96):
    prompts = [prompt(n, seed=10 + i, vocab=vocab) for i, n in enumerate(lengths)]
    ids, mask = batching.left_pad(prompts)
    return prompts, ids, mask


def generate_logits(model, ids, mask=None, *, steps=STEPS, eos=None):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1).float()


SETTINGS = [
    ("mean-pooled", 1, "auto"),
    ("mean-pooled", 4, "auto"),
    ("mean-pooled", 1, "torch"),
    ("quest", 4, "auto"),
    ("oracle-tokens", 1, "auto"),
    ("streaming", 1, "auto"),
    ("h2o", 4, "auto"),
    ("twilight", 1, "auto"),
    ("sparq", 2, "auto"),
]


@pytest.mark.parametrize("selector, reuse, kernel", SETTINGS)
def test_ragged_batch_equals_batch_one_runs(arch, selector, reuse, kernel):
    model = tiny_model(arch)
    prompts, ids, mask = ragged()
    cfg = SparseConfig(support=97, reuse=reuse, selector=selector, kernel=kernel)
    with sparse_decoding(model, cfg):
        alone = [generate_logits(model, p) for p in prompts]
        tokens, logits = generate_logits(model, ids, mask)
    dense_tokens, _ = generate_logits(model, ids, mask)
    for i, (single_tokens, single_logits) in enumerate(alone):
        assert torch.equal(tokens[i], single_tokens[0]), (i, LENGTHS[i])
        tolerance = logits_tolerance(single_logits[0], model, positions=POSITIONS)
        torch.testing.assert_close(logits[i], single_logits[0], atol=tolerance, rtol=0)
    assert not torch.equal(tokens, dense_tokens)  # the setting departs from dense: the comparison means something


def test_sequence_ending_early_does_not_disturb_the_others(arch):
    model = tiny_model(arch)
    prompts, ids, mask = ragged()
    cfg = SparseConfig(support=97, reuse=2)
    with sparse_decoding(model, cfg):
        alone = [generate_logits(model, p) for p in prompts]
        eos = int(alone[1][0][0, 6])  # sequence 1 emits it at step 7 (maybe earlier, maybe others too)
        tokens, logits = generate_logits(model, ids, mask, eos=eos)
    ended = 0
    for i, (single_tokens, single_logits) in enumerate(alone):
        single = single_tokens[0].tolist()
        stop = single.index(eos) + 1 if eos in single else len(single)
        ended += stop < len(single)
        assert tokens[i, :stop].tolist() == single[:stop]
        tolerance = logits_tolerance(single_logits[0], model, positions=POSITIONS)
        torch.testing.assert_close(logits[i, :stop], single_logits[0, :stop], atol=tolerance, rtol=0)
    assert ended >= 1 and tokens.shape[1] == STEPS  # one stopped early while the batch went on


@pytest.mark.parametrize("selector, reuse", [("mean-pooled", 1), ("mean-pooled", 4), ("h2o", 1)])
def test_one_left_padded_prompt_decodes_as_it_would_unpadded(arch, selector, reuse):
    """A batch of one with padding (model.generate with an attention mask, or sd.generate) is a batch too: before,
    it took the batch-1 path, whose positions come from the position ids (real tokens only), so it read the pads
    and left out the last real positions."""
    model = tiny_model(arch)
    cfg = SparseConfig(support=97, reuse=reuse, selector=selector)
    for length, pad in ((150, 10), (80, 90)):  # 80 + 90: past S padded, while the real length grows past it
        ids = prompt(length)
        padded = torch.cat([torch.zeros(1, pad, dtype=ids.dtype), ids], 1)
        mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(ids)], 1)
        with sparse_decoding(model, cfg) as session:
            alone, alone_logits = generate_logits(model, ids)
            tokens, logits = generate_logits(model, padded, mask)
        assert session.sparse_steps > 0
        assert torch.equal(tokens, alone), (length, pad)
        tolerance = logits_tolerance(alone_logits, model, positions=pad + length + STEPS)
        torch.testing.assert_close(logits, alone_logits, atol=tolerance, rtol=0)
        unpadded = sd.generate(model, ids, cfg, STEPS, mode="sparse").tokens
        assert sd.generate(model, padded, cfg, STEPS, mode="sparse", attention_mask=mask)[0].tokens == unpadded
        assert unpadded == alone[0].tolist()


def test_support_covering_every_sequence_is_dense_batched_decoding(arch):
    model = tiny_model(arch)
    _, ids, mask = ragged()
    dense = generate_logits(model, ids, mask)
    with sparse_decoding(model, SparseConfig(support=1 + 64 + 16 * 18)) as session:  # 353 > 300 + STEPS
        covered = generate_logits(model, ids, mask)
    assert session.sparse_steps == 0 and session.dense_steps > 0
    assert torch.equal(covered[0], dense[0]) and torch.equal(covered[1], dense[1])


@pytest.mark.parametrize("selector", ["mean-pooled", "quest", "oracle-blocks", "oracle-tokens", "h2o"])
def test_padding_is_never_selected_nor_attended(selector):
    """Poison the padded positions of every layer's cache: sparse outputs must not move at all."""
    model = tiny_model("qwen2")
    prompts, ids, mask = ragged()
    pads = (mask.shape[1] - mask.sum(dim=1)).tolist()
    cfg = SparseConfig(support=97, selector=selector)
    histories = [prefill_history(model, p) for p in prompts] if selector == "h2o" else None
    results = []
    for poison in (False, True):
        cache = GrowingCache(config=model.config)
        first = batching.prefill(model, ids, mask=mask, cache=cache)[1].argmax(-1).tolist()
        if poison:
            with torch.no_grad():
                for layer in cache.layers:
                    for i, pad in enumerate(pads):
                        layer.keys[i, :, :pad] = 1e3 * torch.randn_like(layer.keys[i, :, :pad])
                        layer.values[i, :, :pad] = 1e3
        logits = []
        with sparse_decoding(model, cfg) as session:
            if histories is not None:
                session.adopt_batch_history(cache, histories, pads)
            batching.decode_tokens(
                model, cache, first, 20, mask=mask, on_logits=lambda step, x, out=logits: out.append(x)
            )
        assert session.sparse_steps > 0
        results.append(torch.stack(logits))
    assert torch.equal(results[0], results[1])


def test_library_entry_points_take_batches(arch):
    model = tiny_model(arch)
    prompts, ids, mask = ragged()
    cfg = SparseConfig(support=97, reuse=4)
    singles = [sd.generate(model, p, cfg, 24, mode="sparse").tokens for p in prompts]
    assert [g.tokens for g in sd.generate(model, prompts, cfg, 24, mode="sparse")] == singles
    assert [g.tokens for g in sd.generate(model, ids, cfg, 24, mode="sparse", attention_mask=mask)] == singles
    dense = [sd.generate(model, p, None, 24, mode="dense").tokens for p in prompts]
    assert [g.tokens for g in sd.generate(model, prompts, None, 24, mode="dense")] == dense
    alone = [sd.compare(model, None, p, cfg, 24) for p in prompts]
    together = sd.compare(model, None, prompts, cfg, 24)
    for a, b in zip(alone, together):
        assert (a.dense_tokens, a.sparse_tokens, a.teacher_forced_tokens) == (
            b.dense_tokens,
            b.sparse_tokens,
            b.teacher_forced_tokens,
        )
        assert (a.first_divergence, a.teacher_forced_match, a.sparse_steps, a.dense_fallback_steps) == (
            b.first_divergence,
            b.teacher_forced_match,
            b.sparse_steps,
            b.dense_fallback_steps,
        )
        assert (a.centroid_cache_bytes, a.mean_unique_distant_positions_per_kv) == (
            b.centroid_cache_bytes,
            b.mean_unique_distant_positions_per_kv,
        )
        assert b.delta_ppl_percent == pytest.approx(a.delta_ppl_percent, **PERCENT_ROUNDOFF)
        assert b.margins == pytest.approx(a.margins, abs=2 * LOGIT_ROUNDOFF)


def test_batched_audit_is_per_sequence():
    model = tiny_model("llama")
    prompts, _, _ = ragged((300, 200))
    cfg = SparseConfig(support=97, audit=True)
    alone = [sd.compare(model, None, p, cfg, 16) for p in prompts]
    together = sd.compare(model, None, prompts, cfg, 16)
    for a, b in zip(alone, together):
        assert b.audit["audited_steps"] == a.audit["audited_steps"] > 0
        # masses are softmax weights (at most 1) of scores that batching rounds differently: float32 round-off of
        # sums over at most 340 positions, sqrt(340) * 2**-23 = 2.2e-6, with room for the scores' own round-off
        assert b.omitted_mass_mean == pytest.approx(a.omitted_mass_mean, abs=1e-5)
        # recall counts the same chosen positions: equal up to float64 round-off of the mean
        assert b.selector_recall_mean == pytest.approx(a.selector_recall_mean, abs=1e-9)


def test_batches_refused_where_not_supported():
    model = tiny_model("llama")
    prompts, ids, mask = ragged((120, 100))
    with pytest.raises(SparseDecodeError, match="lossless generation runs one sequence at a time"):
        sd.generate(model, prompts, SparseConfig(support=97), 8, mode="lossless")
    with pytest.raises(SparseDecodeError, match="one unpadded \\(1, length\\) prompt without attention_mask"):
        sd.generate(model, ids[1:], SparseConfig(support=97), 8, mode="lossless", attention_mask=mask[1:])
    # a list of one prompt was told to drop the padding and the mask it did not have (found by probing lossless inputs)
    with pytest.raises(SparseDecodeError, match="one \\(1, length\\) prompt, not a list of prompts: pass the prompt"):
        sd.generate(model, prompts[:1], SparseConfig(support=97), 8, mode="lossless")
    right_padded = mask.flip(1)
    with pytest.raises(SparseDecodeError, match="left padding"):
        sd.generate(model, ids, SparseConfig(support=97), 8, mode="sparse", attention_mask=right_padded)
    holes = mask.clone()
    holes[0, 50] = 0
    with pytest.raises(SparseDecodeError, match="left padding"), sparse_decoding(model, SparseConfig(support=97)):
        model.generate(ids, attention_mask=holes, max_new_tokens=4, do_sample=False)


@pytest.mark.realmodel
def test_ragged_batch_on_real_model(smollm2):
    model = smollm2[0]
    vocab = model.config.vocab_size
    prompts, ids, mask = ragged((330, 180, 70, 250), vocab=vocab)
    for reuse in (1, 4):
        with sparse_decoding(model, SparseConfig(support=97, reuse=reuse)):
            alone = [generate_logits(model, p, steps=24) for p in prompts]
            tokens, logits = generate_logits(model, ids, mask, steps=24)
        for i, (single_tokens, single_logits) in enumerate(alone):
            assert torch.equal(tokens[i], single_tokens[0]), (reuse, i)
            depth, width = model.config.num_hidden_layers, model.config.hidden_size
            tolerance = roundoff_tolerance(single_logits[0], depth=depth, width=width)
            torch.testing.assert_close(logits[i], single_logits[0], atol=tolerance, rtol=0)
    dense = generate_logits(model, ids, mask, steps=24)
    with sparse_decoding(model, SparseConfig(support=1 + 64 + 16 * 20)):
        covered = generate_logits(model, ids, mask, steps=24)
    assert torch.equal(covered[0], dense[0]) and torch.equal(covered[1], dense[1])


# --- sweep and compare-selectors with --batch: the rows of batch 1, apart from timings and float32 round-off ---


def assert_rows_match(batch_one: list[dict], batched: list[dict]) -> None:
    """Same keys, order, tokens, integers and flags; floats (perplexities, margins) to float32 round-off."""
    from sparsedecode.experiments.sweep import without_timings

    assert len(batch_one) == len(batched)
    for a, b in zip(batch_one, batched):
        a, b = without_timings(a), without_timings(b)
        assert a.keys() == b.keys()
        for name in a:
            if isinstance(a[name], float) and isinstance(b[name], float):
                assert b[name] == pytest.approx(a[name], **PERCENT_ROUNDOFF), name  # percent points at most
            else:
                assert a[name] == b[name], name


def test_sweep_batch_rows_equal_batch_one_rows(tmp_path):
    from conftest import char_tokenizer

    from sparsedecode.experiments.sweep import RUNS_FILE, SweepSpec, key_of, load_sweep, read_rows, run_sweep

    loaded = tiny_model("llama"), char_tokenizer()
    spec = SweepSpec(
        model="tiny", contexts=(150, 220), supports=(97, 113, 1000), reuse=(1, 3), prompts=3, tokens=12, audit=True
    )
    run_sweep(spec, tmp_path / "one", loaded=loaded)
    outcome = run_sweep(spec, tmp_path / "four", loaded=loaded, batch=4)
    one, four = read_rows(tmp_path / "one" / RUNS_FILE), read_rows(tmp_path / "four" / RUNS_FILE)
    four.sort(key=lambda row: spec.keys().index(key_of(row)))  # completion order differs: a batch goes by context
    assert outcome.complete and len(four) == 2 * 3 * 3 * 2
    assert_rows_match(one, four)
    assert any(not row["survives"] for row in one), "a sweep where nothing diverges would test little"
    assert load_sweep(tmp_path / "four")[0]["sessions"][-1]["batch"] == 4


def test_sweep_batch_resumes_a_partial_folder_without_duplicates(tmp_path):
    from conftest import char_tokenizer

    from sparsedecode.experiments.sweep import RUNS_FILE, SweepSpec, key_of, read_rows, run_sweep

    loaded = tiny_model("qwen2"), char_tokenizer()
    spec = SweepSpec(model="tiny", contexts=(150,), supports=(97, 113), prompts=3, tokens=8)
    run_sweep(spec, tmp_path / "ref", loaded=loaded)
    rows = read_rows(tmp_path / "ref" / RUNS_FILE)
    partial = tmp_path / "partial"
    run_sweep(spec, partial, loaded=loaded)
    kept = [rows[0], rows[3]]  # prompt 0 at S = 97, prompt 1 at S = 113: both batched conditions are half done
    (partial / RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert run_sweep(spec, partial, loaded=loaded, batch=3).ran == len(rows) - 2
    resumed = sorted(read_rows(partial / RUNS_FILE), key=lambda r: spec.keys().index(key_of(r)))
    assert_rows_match(rows, resumed)


def test_compare_selectors_batch_equals_batch_one():
    from conftest import char_tokenizer

    from sparsedecode.experiments.selector_comparison import compare_selectors

    model, tokenizer = tiny_model("qwen2"), char_tokenizer()
    common = dict(corpus="python-docs", contexts=(150,), supports=(97,), prompts=3, tokens=10)
    selectors = ("mean-pooled", "h2o", "oracle-tokens")
    _, one, _ = compare_selectors(model, tokenizer, selectors=selectors, **common)
    _, three, _ = compare_selectors(model, tokenizer, selectors=selectors, batch=2, **common)
    strip = [{k: v for k, v in r.items() if k not in ("certificate", "audit", "settings")} for r in one]
    strip3 = [{k: v for k, v in r.items() if k not in ("certificate", "audit", "settings")} for r in three]
    assert_rows_match(strip, strip3)


# --- bench e2e --batch ---


def test_bench_e2e_batch_rows(tiny_model_dir, tmp_path):
    from sparsedecode.cli import main

    out = tmp_path / "batch.json"
    args = ["bench", "e2e", "--model", str(tiny_model_dir), "--context", "300", "--support", "97", "--tokens", "12"]
    assert main([*args, "--batch", "1,3", "--repeats", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["run"]["started_utc"].endswith("+00:00") and data["run"]["wall_s"] >= 0
    assert data["machine"]["weights_gathered"] is True  # load_model put the weights on huge pages (models/arena.py)
    rows = data["rows"]
    assert {r["model"] for r in rows} == {tiny_model_dir.name}, "the model's name, not the path it was loaded from"
    assert [(r["batch"], r["mode"], r["support"]) for r in rows] == [
        (1, "dense", None),
        (1, "sparse", 97),
        (3, "dense", None),
        (3, "sparse", 97),
    ]
    for r in rows:  # the float64 quotients each row was built from, recomputed: equal to an ulp or two
        assert r["tokens_equal_to_batch1"] is True
        assert r["aggregate_tokens_per_s"] == pytest.approx(r["batch"] * 12 / r["decode_s"])
        assert r["step_ms"] == pytest.approx(1000 * r["decode_s"] / 12)
        assert r["peak_rss_mb"] > 0 and r["kv_cache_mb"] > 0
    best = max(r["aggregate_tokens_per_s"] for r in rows if r["mode"] == "dense")
    assert max(r["speedup_vs_best_dense"] for r in rows if r["mode"] == "dense") == pytest.approx(1.0)
    assert rows[3]["speedup_vs_best_dense"] == pytest.approx(rows[3]["aggregate_tokens_per_s"] / best)


def test_bench_e2e_batch_dense_dtype_adds_dense_rows_and_takes_the_best_dense_over_both(tiny_model_dir, tmp_path):
    """``--dense-dtype``: the same prompts decoded dense with the model in another dtype, after the ``--dtype`` runs;
    "vs best dense" of every row over both dtypes' dense rows, each row naming its dtype."""
    from sparsedecode.cli import main

    out = tmp_path / "batch.json"
    args = ["bench", "e2e", "--model", str(tiny_model_dir), "--context", "300", "--support", "97", "--tokens", "6"]
    assert main([*args, "--batch", "1,2", "--repeats", "1", "--dense-dtype", "bfloat16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["batch"], r["mode"]) for r in rows] == [
        ("float32", 1, "dense"),
        ("float32", 1, "sparse"),
        ("float32", 2, "dense"),
        ("float32", 2, "sparse"),
        ("bfloat16", 1, "dense"),
        ("bfloat16", 2, "dense"),
    ]
    best = max(r["aggregate_tokens_per_s"] for r in rows if r["mode"] == "dense")
    for r in rows:
        assert r["speedup_vs_best_dense"] == pytest.approx(r["aggregate_tokens_per_s"] / best)
        assert r["tokens_equal_to_batch1"] is True
    assert max(r["speedup_vs_best_dense"] for r in rows) >= 1.0


def test_bench_e2e_batch_dense_dtype_beside_float_weights_decodes_in_the_dense_dtype(tiny_model_dir, tmp_path, capsys):
    """A float ``--weights`` is the dtype the model decodes in: ``--weights bfloat16 --dense-dtype float32`` was
    refused as the same dtype as ``--dtype float32``, ``--weights float32 --dense-dtype bfloat16`` failed as
    disagreeing dtypes after the whole first run (the second model kept ``--weights float32``), and ``--weights
    bfloat16 --dense-dtype bfloat16`` repeated the bfloat16 rows as its dense dtype's. Found by probing ``--weights``
    through ``bench e2e``."""
    from test_bad_input import one_line_exit_2

    from sparsedecode.cli import main

    out = tmp_path / "batch.json"
    args = ["bench", "e2e", "--model", str(tiny_model_dir), "--context", "300", "--support", "97", "--tokens", "4"]
    args += ["--batch", "1", "--repeats", "1"]
    for weights, dense in (("bfloat16", "float32"), ("float32", "bfloat16")):
        assert main([*args, "--weights", weights, "--dense-dtype", dense, "--json", str(out)]) == 0
        rows = json.loads(out.read_text())["rows"]
        assert [(r["dtype"], r["mode"]) for r in rows] == [(weights, "dense"), (weights, "sparse"), (dense, "dense")]
        assert [r["weights"] for r in rows] == [weights, weights, dense]
    capsys.readouterr()
    err = one_line_exit_2([*args, "--weights", "bfloat16", "--dense-dtype", "bfloat16"], capsys)
    assert "a dtype other than --weights bfloat16" in err


def test_bench_e2e_batch_compile_adds_compiled_rows_that_equal_batch_one(monkeypatch):
    """``bench e2e --batch --compile``: every batch size again with the compiled step, from copies of the same
    prefilled caches; each batch's tokens equal each prompt's compiled batch-1 run, ratios against the faster dense."""
    from sparsedecode.compiled import decoder as compiled
    from sparsedecode.experiments.bench import bench_e2e_batch

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")  # capture without inductor's C++ build
    prompts = [prompt(300, seed=20 + i) for i in range(3)]
    rows = bench_e2e_batch(tiny_model("llama"), "tiny", prompts, (1, 3), (97,), tokens=8, repeats=1, compile=True)
    session, static = "growing", "static, compiled"
    assert [(r.batch, r.mode, r.cache) for r in rows] == [
        (1, "dense", session), (1, "sparse", session), (3, "dense", session), (3, "sparse", session),
        (1, "dense", static), (1, "sparse", static), (3, "dense", static), (3, "sparse", static),
    ]  # fmt: skip
    assert all(r.tokens_equal_to_batch1 for r in rows)
    assert all((r.compile_s is not None) == (r.cache == static) for r in rows)
    assert all(r.compile_backend == ("aot_eager" if r.cache == static else None) for r in rows)  # what compiled it
    best = max(r.aggregate_tokens_per_s for r in rows if r.mode == "dense")
    for r in rows:
        same_batch = max(d.aggregate_tokens_per_s for d in rows if d.mode == "dense" and d.batch == r.batch)
        assert r.speedup_vs_best_dense == pytest.approx(r.aggregate_tokens_per_s / best)
        assert r.speedup_vs_dense_same_batch == pytest.approx(r.aggregate_tokens_per_s / same_batch)


def test_bench_e2e_batch_that_does_not_fit_is_refused_before_prefill(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from sparsedecode.cli import main
    from sparsedecode.experiments import bench_batch

    monkeypatch.setattr(bench_batch, "available_memory_bytes", lambda device="cpu": 10_000)
    monkeypatch.setattr(bench_batch, "prefill", lambda *a, **k: pytest.fail("prefill ran"))
    out = tmp_path / "batch.json"
    args = ["bench", "e2e", "--model", str(tiny_model_dir), "--context", "300", "--batch", "1,8", "--json", str(out)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "batch 8 at context 300 needs about" in err and "GiB" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    assert main([*args[:-2], "--mode", "lossless"]) == 2
    assert "lossless runs batch 1 only" in capsys.readouterr().err


def test_bench_e2e_batch_names_quantized_weights(tiny_model_dir, tmp_path, capsys):
    from sparsedecode.cli import main

    out = tmp_path / "batch.json"
    args = ["bench", "e2e", "--model", str(tiny_model_dir), "--context", "300", "--support", "97", "--tokens", "4"]
    assert main([*args, "--batch", "1,2", "--repeats", "1", "--weights", "int8", "--json", str(out)]) == 0
    assert "int8 weights, float32 activations" in " ".join(capsys.readouterr().out.split())
    rows = json.loads(out.read_text())["rows"]
    assert {r["weights"] for r in rows} == {"int8"} and all(r["tokens_equal_to_batch1"] for r in rows)


def test_bench_e2e_batch_checks_every_repeat_against_batch_one(monkeypatch):
    """A batch whose tokens leave the batch-1 run in one repeat but not the last is not "equal to batch 1" (each
    repeat's tokens are checked, not only the last one's), in the session's modes and the compiled ones."""
    from sparsedecode.compiled import decoder as compiled
    from sparsedecode.experiments import bench_batch
    from sparsedecode.experiments.bench import bench_e2e_batch

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    decode, compiled_decode, calls = bench_batch.decode_tokens, bench_batch.compiled_decode, {"eager": 0, "compiled": 0}

    def off_once(outs: list[list[int]], kind: str, batched: bool) -> list[list[int]]:
        if batched:
            calls[kind] += 1
            if calls[kind] == 1:  # the batch's first repeat of its first mode: one token changed
                outs = [[*outs[0][:-1], outs[0][-1] + 1], *outs[1:]]
        return outs

    def decode_off(model, cache, firsts, *args, mask=None, **kwargs):
        outs, rest = decode(model, cache, firsts, *args, mask=mask, **kwargs)
        return off_once(outs, "eager", mask is not None and len(firsts) > 1), rest

    def compiled_off(model, decoder, context, heads, *args):
        seconds, outs = compiled_decode(model, decoder, context, heads, *args)
        return seconds, off_once(outs, "compiled", len(heads) > 1)

    monkeypatch.setattr(bench_batch, "decode_tokens", decode_off)
    monkeypatch.setattr(bench_batch, "compiled_decode", compiled_off)
    prompts = [prompt(300, seed=40 + i) for i in range(2)]
    rows = bench_e2e_batch(tiny_model("llama"), "tiny", prompts, (1, 2), (97,), tokens=6, repeats=2, compile=True)
    assert calls == {"eager": 4, "compiled": 4}, "each batched mode ran twice"
    flagged = {(r.batch, r.mode, r.cache) for r in rows if not r.tokens_equal_to_batch1}
    assert flagged == {(2, "dense", "growing"), (2, "dense", "static, compiled")}


def test_h2o_in_a_padded_batch_on_a_sliding_window_model_names_the_cause():
    """Found by probing: a sliding-window layer's cache shifts by the padded batch's length, so a shorter row's H2O
    history no longer lines up with it; the refusal told to run the prefill inside the session (which it was) and
    now names this cause and the way out. Each prompt alone decodes."""
    from conftest import tiny_family

    model = tiny_family("mistral", sliding_window=128)
    cfg = SparseConfig(support=97, selector="h2o")
    prompts = [prompt(100, seed=4), prompt(90, seed=5)]
    assert all(len(sd.generate(model, p, cfg, 30, mode="sparse").tokens) == 30 for p in prompts)
    with pytest.raises(SparseDecodeError, match="sliding-window layer shifted a padded batch's cache"):
        sd.generate(model, prompts, cfg, 30, mode="sparse")
