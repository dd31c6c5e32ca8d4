"""Benchmark mechanics (fields, bytes accounting, JSON); timings are never asserted."""

from __future__ import annotations

import json
import math
import os
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
from conftest import prompt, tiny_model

from sparsedecode import SparseDecodeError
from sparsedecode.cli import main
from sparsedecode.config import SparseConfig
from sparsedecode.experiments import bench, bench_batch, bench_end_to_end, bench_operator, bench_operator_inputs
from sparsedecode.experiments.bench import (
    SHAPE_LAYERS,
    SHAPES,
    bench_e2e,
    bench_op,
    plan_layers,
)
from sparsedecode.experiments.bench_operator_inputs import op_bytes, op_layer_bytes
from sparsedecode.layout import BlockLayout

STUB_BANDWIDTH_GBS = 12.5


@pytest.fixture(autouse=True)
def stub_bandwidth(request, monkeypatch):
    """These tests check the rows' structure, not speed: the read-bandwidth measurement (a 512 MB buffer summed for a
    second, in every bench_op) is replaced by a fixed figure, except in the test of the measurement itself."""
    if request.function is not test_read_bandwidth_is_measured_and_reported:
        monkeypatch.setattr(bench_operator, "read_bandwidth_gbs", lambda *a, **k: STUB_BANDWIDTH_GBS)
        monkeypatch.setattr(bench_end_to_end, "read_bandwidth_gbs", lambda *a, **k: STUB_BANDWIDTH_GBS)


def test_read_bandwidth_is_measured_and_reported():
    measured = bench.read_bandwidth_gbs()
    assert math.isfinite(measured) and measured > 0
    rows, bandwidth = bench_op("smollm2-135m", (512,), (97,), budget_s=0.001, layers=1, kernels=("c",))
    assert math.isfinite(bandwidth) and bandwidth > 0 and rows[0].bandwidth_gbs == bandwidth


OP_FIELDS = (
    "shape",
    "context",
    "support",
    "selector",
    "dense_ms",
    "sparse_ms",
    "select_ms",
    "attend_ms",
    "bytes_dense",
    "bytes_sparse",
    "bandwidth_gbs",
    "speedup",
    "bound_ratio",
)
E2E_FIELDS = ("model", "mode", "context", "support", "prefill_s", "decode_tokens_per_s", "peak_rss_mb")


def test_bytes_accounting():
    cfg = SparseConfig(support=193)
    dense, sparse = op_bytes(cfg, 131072, 2, 14, 64, 4)
    assert dense == 2 * 2 * 131072 * 64 * 4 + 14 * 64 * 4
    blocks = (131072 - 64 - 1) // 16
    expected = 2 * blocks * 64 * 4 + 15 * 2 * 64 * 4 + 2 * 2 * 193 * 64 * 4 + 14 * 64 * 4  # centroids, tail, support, q
    assert sparse == expected
    assert sparse < dense / 25


def test_bench_op_rows_are_consistent():
    rows, bandwidth = bench_op("smollm2-135m", (512,), (97, 193), budget_s=0.001, layers=3)
    assert bandwidth == STUB_BANDWIDTH_GBS and [(r.support, r.kernel) for r in rows] == [
        (97, "torch"),
        (97, "c"),
        (193, "torch"),
        (193, "c"),
    ]
    for row in rows:
        assert row.speedup == row.dense_ms / row.sparse_ms
        assert row.bound_ratio == row.sparse_ms / 1e3 / (row.bytes_sparse / (row.bandwidth_gbs * 1e9))
        assert row.bytes_sparse < row.bytes_dense
        assert (row.layers, row.layers_requested, row.layers_note) == (3, 3, None)
        assert row.working_set_mb == 3 * row.bytes_sparse / 1e6
        assert row.dense_working_set_mb == 3 * row.bytes_dense / 1e6


@pytest.mark.parametrize("selector", ["streaming", "h2o", "oracle-tokens"])
def test_bench_op_times_token_level_selectors_with_torch(selector):
    """Token-level selectors run as torch operations: the default kernels are torch alone for them (the C kernel
    beside torch made every such run fail once SparseConfig refused kernel="c" for them); asking for a fused kernel
    is refused as SparseConfig refuses it."""
    rows, _ = bench_op("smollm2-135m", (512,), (97,), selector=selector, budget_s=0.001, layers=1)
    assert [(r.kernel, r.support) for r in rows] == [("torch", 97)]
    with pytest.raises(SparseDecodeError, match="serves block selectors only"):
        bench_op("smollm2-135m", (512,), (97,), selector=selector, budget_s=0.001, layers=1, kernels=("c",))


def test_bench_op_cycles_through_the_shapes_layers_by_default(monkeypatch):
    """Cold by default: one distinct per-layer cache per decoder layer, each call on the next one (0, 1, ..., 0)."""
    seen = []
    step = bench_operator.fresh_step

    def counted(session, state, *rest):
        seen.append(state.layer)
        return step(session, state, *rest)

    monkeypatch.setattr(bench_operator, "fresh_step", counted)
    rows, _ = bench_op("smollm2-135m", (300,), (97,), budget_s=0.001, kernels=("c",))
    assert SHAPE_LAYERS["smollm2-135m"] == 30 and rows[0].layers == rows[0].layers_requested == 30
    assert len(seen) >= 11 and seen == [i % 30 for i in range(len(seen))], "calls take the layers in turn"
    four = bench_op((9, 3, 64, 4), (300,), (97,), budget_s=0.001, kernels=("c",))[0][0]
    assert (four.shape, four.layers) == ("smollm2-135m", 4), "a shape tuple may carry its layer count"


def test_bench_op_caps_layers_to_the_memory_available(monkeypatch):
    layout = BlockLayout(n=512, window=64, block_size=16)
    per_layer = op_layer_bytes(512, SHAPES["smollm2-135m"], 4, "mean-pooled", layout)

    def half(device="cpu"):  # half of it: 2 layers
        return 5 * per_layer

    monkeypatch.setattr(bench_operator_inputs, "available_memory_bytes", half)
    monkeypatch.setattr(bench_operator, "available_memory_bytes", half)
    row = bench_op("smollm2-135m", (512,), (97,), budget_s=0.001, kernels=("c",))[0][0]
    assert (row.layers, row.layers_requested) == (2, 30)
    assert row.layers_note.startswith("2 of 30 layers") and "available" in row.layers_note
    assert row.working_set_mb == 2 * row.bytes_sparse / 1e6


def test_plan_layers():
    assert plan_layers(24, 100, None) == (24, None)
    assert plan_layers(24, 100, 4800) == (24, None)
    layers, note = plan_layers(24, 100, 1000)
    assert layers == 5 and note.startswith("5 of 24 layers")
    assert plan_layers(24, 10**9, 10)[0] == 1, "at least one layer, with the note"


@pytest.mark.parametrize(
    "contexts, supports, options, message",
    [
        ((0,), (97,), {}, "positive integers"),
        ((), (97,), {}, "at least one context"),
        ((97,), (97,), {}, "support 97 >= context 97"),
        ((2048, 150), (97, 193), {}, "support 193 >= context 150"),
        ((512,), (97,), {"budget_s": 0}, "above 0"),
        ((512,), (97,), {"budget_s": -1.0}, "above 0"),
        ((512,), (97,), {"budget_s": math.nan}, "number of seconds"),
        ((512,), (97,), {"layers": 0}, "layers must be"),
        ((512,), (50,), {}, "support 50"),
    ],
)
def test_bench_op_refuses_before_any_work(monkeypatch, contexts, supports, options, message):
    def measured(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(bench_operator, "read_bandwidth_gbs", measured)
    with pytest.raises(SparseDecodeError, match=message):
        bench_op("smollm2-135m", contexts, supports, **{"budget_s": 0.001, **options})


def test_bench_e2e_times_every_mode_as_often_as_dense(monkeypatch):
    calls = {"dense/sparse": 0, "lossless": 0}
    greedy, lossless = bench_end_to_end.decode_tokens, bench_end_to_end.lossless_decode

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(bench_end_to_end, "decode_tokens", counted("dense/sparse", greedy))
    monkeypatch.setattr(bench_end_to_end, "lossless_decode", counted("lossless", lossless))
    rows = bench_e2e(tiny_model("qwen2"), "tiny", prompt(200), (97,), tokens=4, lossless=(2,), repeats=3)
    assert [(r.mode, r.cache, r.runs) for r in rows] == [
        ("dense", "dynamic", 3),
        ("dense", "growing", 3),
        ("sparse", "growing", 3),
        ("lossless", "growing", 3),
    ]
    assert calls == {"dense/sparse": 3 * 3, "lossless": 3}
    assert rows[3].tokens_equal_to_dense == 4
    with pytest.raises(SparseDecodeError, match="repeats"):
        bench_e2e(tiny_model("qwen2"), "tiny", prompt(200), (97,), tokens=4, repeats=0)


def test_bench_e2e_decodes_h2o_from_the_prompts_history_alone_and_in_batches(monkeypatch):
    """h2o ranks positions by the attention they received, the prompt's included. ``bench e2e`` (and ``--batch``)
    prefill outside any session, so, as ``compare`` and ``generate`` do, they record that history with one more dense
    prefill and hand it over: the sparse run decodes ``generate``'s tokens. It had none: every h2o run stopped at its
    first sparse step, telling the user to run the prefill inside a session (found probing H2O's prefill history)."""
    from sparsedecode import generate

    sparse_runs = []
    greedy = bench_end_to_end.decode_tokens

    def recorded(*args, **kwargs):
        out = greedy(*args, **kwargs)
        if kwargs["stage"].startswith("sparse"):
            sparse_runs.append(out[0][0])
        return out

    monkeypatch.setattr(bench_end_to_end, "decode_tokens", recorded)
    model, ids = tiny_model("llama"), prompt(200)
    rows = bench_e2e(model, "tiny", ids, (97,), tokens=6, lossless=(2,), repeats=1, selector="h2o")
    assert [(r.mode, r.support) for r in rows][2:] == [("sparse", 97), ("lossless", 97)]
    assert rows[3].tokens_equal_to_dense == 6  # lossless: dense's tokens
    assert sparse_runs == [generate(model, ids, SparseConfig(support=97, selector="h2o"), 7, mode="sparse").tokens[1:]]
    prompts = [prompt(200, seed=seed) for seed in (1, 2)]
    batched = bench_batch.bench_e2e_batch(model, "tiny", prompts, (1, 2), (97,), tokens=4, repeats=1, selector="h2o")
    assert [(r.mode, r.batch, r.tokens_equal_to_batch1) for r in batched if r.mode == "sparse"] == [
        ("sparse", 1, True),
        ("sparse", 2, True),
    ]


def test_bench_e2e_with_h2o_decodes_as_generate_does(monkeypatch):
    """``bench e2e --selector h2o`` (batch 1, lossless rows and ``--batch`` alike) failed after the prefill and the
    dense runs, telling to run the prefill inside the session: the bench prefills outside any session and never gave
    the session H2O's history. Found by probing the bench's lossless and batched rows with every selector. It now
    records each prompt's history as ``generate`` does: the sparse row's tokens are ``generate``'s, the lossless row's
    dense decoding's, each prompt's batch-1 run ``generate``'s, every batch's its batch-1 runs'."""
    from sparsedecode.decoding.generate import generate
    from sparsedecode.experiments.bench import bench_e2e_batch

    model, ids, tokens = tiny_model("llama"), prompt(200), 6
    cfg = SparseConfig(support=97, selector="h2o")
    dense = generate(model, ids, None, tokens + 1, mode="dense").tokens
    sparse = generate(model, ids, cfg, tokens + 1, mode="sparse").tokens
    leading = next((i for i, (a, b) in enumerate(zip(dense[1:], sparse[1:])) if a != b), tokens)
    assert leading < tokens, "S = 97 must depart from dense here, or the sparse row proves little"
    rows = bench_e2e(model, "tiny", ids, (97,), tokens=tokens, lossless=(2,), repeats=1, selector="h2o")
    by_mode = {r.mode: r for r in rows}
    assert by_mode["sparse"].tokens_equal_to_dense == leading
    assert by_mode["lossless"].tokens_equal_to_dense == tokens
    alone, real_alone = {}, bench_batch._alone
    monkeypatch.setattr(bench_batch, "_alone", lambda *a, **k: alone.update(real_alone(*a, **k)) or alone)
    prompts = [prompt(200, seed=s) for s in (0, 6, 11)]  # the last two decode otherwise with the first's history
    batched = bench_e2e_batch(model, "tiny", prompts, (1, 3), (97,), tokens=tokens, repeats=1, selector="h2o")
    assert [(r.batch, r.mode) for r in batched] == [(1, "dense"), (1, "sparse"), (3, "dense"), (3, "sparse")]
    assert all(r.tokens_equal_to_batch1 for r in batched)
    assert alone["sparse", 97] == [generate(model, p, cfg, tokens + 1, mode="sparse").tokens[1:] for p in prompts]


def test_bench_e2e_compile_adds_compiled_modes_with_dense_tokens(monkeypatch):
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")  # capture without inductor's C++ build
    rows = bench_e2e(tiny_model("llama"), "tiny", prompt(200), (97, 2048), tokens=6, repeats=1, compile=True)
    assert [(r.mode, r.cache, r.support) for r in rows] == [
        ("dense", "dynamic", None),
        ("dense", "growing", None),
        ("sparse", "growing", 97),
        ("sparse", "growing", 2048),
        ("dense", "static, compiled", None),
        ("sparse", "static, compiled", 97),
        ("sparse", "static, compiled", 2048),
    ]
    by_mode = {(r.mode, r.cache, r.support): r for r in rows}
    assert all((r.compile_s is not None) == (r.cache == "static, compiled") for r in rows)
    assert by_mode[("dense", "static, compiled", None)].tokens_equal_to_dense == 6
    assert by_mode[("sparse", "static, compiled", 2048)].tokens_equal_to_dense == 6  # support >= N: dense
    sparse, compiled_sparse = by_mode[("sparse", "growing", 97)], by_mode[("sparse", "static, compiled", 97)]
    assert compiled_sparse.tokens_equal_to_dense == sparse.tokens_equal_to_dense
    fastest = min(r.decode_s for r in rows if r.mode == "dense")
    assert all(r.speedup_vs_best_dense == pytest.approx(fastest / r.decode_s) for r in rows)


def test_bench_e2e_compile_with_lossless_adds_compiled_lossless_rows(monkeypatch):
    """--mode lossless --compile: a lossless row per support and k drafting with the compiled step, dense tokens,
    drafting and accepting as the session's lossless row does; its compile time is its sparse step's."""
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = tiny_model("llama")
    rows = bench_e2e(model, "tiny", prompt(200), (97,), tokens=8, repeats=1, lossless=(2, 4), compile=True)
    by_mode = {(r.mode, r.cache, r.draft_tokens): r for r in rows}
    for k in (2, 4):
        session, static = by_mode[("lossless", "growing", k)], by_mode[("lossless", "static, compiled", k)]
        assert static.tokens_equal_to_dense == session.tokens_equal_to_dense == 8
        assert static.acceptance_rate == session.acceptance_rate and static.mean_accepted == session.mean_accepted
        assert static.compile_s == by_mode[("sparse", "static, compiled", None)].compile_s


def test_bench_e2e_native_adds_the_native_steps_rows_beside_the_compiled_ones(monkeypatch):
    """--native: dense, sparse and lossless rows over the same static cache with the native step, the compiled
    rows' tokens (float32: the same model to round-off), their own build seconds; and a model the native step does
    not compute refused before the prefill, in one line."""
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = tiny_model("qwen2")
    rows = bench_e2e(model, "tiny", prompt(200), (97,), tokens=8, repeats=1, lossless=(2,), compile=True, native=True)
    by_mode = {(r.mode, r.cache, r.support): r for r in rows}
    for mode, support in (("dense", None), ("sparse", 97), ("lossless", 97)):
        native, static = by_mode[(mode, "static, native", support)], by_mode[(mode, "static, compiled", support)]
        assert native.tokens_equal_to_dense == static.tokens_equal_to_dense and native.compile_s is not None
    assert by_mode[("dense", "static, native", None)].tokens_equal_to_dense == 8
    # found by probing: nothing in a row said which backend compiled it (aot_eager generates no code: no speed)
    backends = {r.cache: r.compile_backend for r in rows}
    assert backends == {"dynamic": None, "growing": None, "static, compiled": "aot_eager", "static, native": "native"}
    half = tiny_model("qwen2", dtype=torch.bfloat16)
    with pytest.raises(SparseDecodeError, match="native decode step.*float32"):
        bench_e2e(half, "tiny", prompt(200), (97,), tokens=4, repeats=1, native=True)


FAKES = Path(__file__).parent / "fakes"


def fake_llama_cpp(monkeypatch, tmp_path, behaviour: str = "greedy") -> Path:
    """``llama_cpp`` is tests/fakes/llama_cpp here and in the engine processes started afresh (their ``sys.path``
    and environment are this process's), behaving as ``behaviour`` says; the log of what it was made with and
    handed."""
    monkeypatch.syspath_prepend(str(FAKES))
    monkeypatch.delitem(sys.modules, "llama_cpp", raising=False)
    monkeypatch.setenv("FAKE_LLAMA_CPP", behaviour)
    log = tmp_path / "llama.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_CPP_LOG", str(log))
    return log


def notes(log: Path, kind: str) -> list:
    return [e[kind] for e in map(json.loads, log.read_text().splitlines()) if kind in e]


def _gguf_file(path: Path) -> Path:
    """A small GGUF file holding one Q4_1 tensor (what llama.cpp's rows name as their weights)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    data = gguf.quants.quantize(np.ones((8, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q4_1)
    writer.add_tensor("blk.0.attn_q.weight", data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("budget", [{"dense_layers": (0,)}, {"layer_supports": ((1, 81),)}])
def test_bench_e2e_bytes_per_token_follow_the_dense_layers_and_per_layer_supports(monkeypatch, tmp_path, budget):
    """A sparse row's MB/token counts what each layer reads: a dense layer every key and value, a layer with a support
    of its own that support (found recomputing MB/token by hand: every layer was counted at the row's support)."""
    from sparsedecode.experiments.baseline import LLAMA_CPP
    from sparsedecode.experiments.llama_engine import LlamaCpp
    from sparsedecode.models.quantized import weight_bytes

    fake_llama_cpp(monkeypatch, tmp_path)
    monkeypatch.setattr(bench_end_to_end, "read_bandwidth_gbs", lambda *a, **k: 10.0)
    model = tiny_model("qwen2", layers=3)
    engines = {LLAMA_CPP: LlamaCpp(_gguf_file(tmp_path / "model.gguf"), 220, 1)}
    rows = bench_e2e(model, "tiny", prompt(200), (97,), tokens=4, repeats=1, baseline=engines, **budget)
    for engine in engines.values():
        engine.close()
    sparse = next(r for r in rows if r.mode == "sparse")
    n, kv_heads, d = 200 + 4 // 2, 2, 16  # the run's mean context; tiny_model's KV heads and head dim
    dense_layer = 2 * kv_heads * n * d * 4  # every key and value, float32

    def sparse_layer(support):  # the support's keys and values, and a float32 mean of the keys per block of 16
        return 2 * kv_heads * support * d * 4 + kv_heads * (n // 16) * d * 4

    layers = (
        [dense_layer, sparse_layer(97), sparse_layer(97)]
        if "dense_layers" in budget
        else [sparse_layer(97), sparse_layer(81), sparse_layer(97)]
    )
    assert sparse.bytes_per_token_mb * 1e6 == pytest.approx(weight_bytes(model) + sum(layers), abs=1)
    assert sparse.bound_tokens_per_s == pytest.approx(10e9 / (weight_bytes(model) + sum(layers)))


def test_bench_e2e_baseline_runs_llama_cpp_in_the_rotation(monkeypatch, tmp_path):
    from sparsedecode.experiments.baseline import LLAMA_CPP, LLAMA_CPP_FLASH
    from sparsedecode.experiments.llama_engine import LlamaCpp

    log = fake_llama_cpp(monkeypatch, tmp_path)
    reads = iter([10.0, 8.0])  # before the timed runs, then after: the bound takes the better (structure, not speed)
    monkeypatch.setattr(bench_end_to_end, "read_bandwidth_gbs", lambda *a, **k: next(reads))
    gguf = _gguf_file(tmp_path / "model.gguf")
    engines = {LLAMA_CPP: LlamaCpp(gguf, 220, 2), LLAMA_CPP_FLASH: LlamaCpp(gguf, 220, 2, flash_attn=True)}
    ids = prompt(200)
    heard = []
    rows = bench_e2e(
        tiny_model("qwen2"),
        "tiny",
        ids,
        (97,),
        tokens=4,
        repeats=2,
        baseline=engines,
        progress=lambda *a: heard.append(a),
    )
    assert ("dense, llama.cpp (run 2/2), prefill and decode", 4, 4) in heard  # where it is while llama.cpp works
    assert [(r.mode, r.cache) for r in rows][-2:] == [("dense", LLAMA_CPP), ("dense", LLAMA_CPP_FLASH)]
    llama = rows[-2]
    fastest = min(r.decode_s for r in rows[-2:])  # llama.cpp's faster mode is the reference
    assert llama.runs == 2 and max(r.vs_llama_cpp for r in rows[-2:]) == 1.0
    assert all(r.vs_llama_cpp == pytest.approx(fastest / r.decode_s) for r in rows)
    assert llama.bytes_per_token_mb * 1e6 > 1000  # the GGUF file plus its float16 KV cache reads
    assert llama.weights == "gguf Q4_1" and rows[0].weights == "float32"  # each engine's weights named
    sparse = next(r for r in rows if r.mode == "sparse")
    dense = rows[0]
    assert sparse.bytes_per_token_mb < dense.bytes_per_token_mb
    assert dense.bound_tokens_per_s == pytest.approx(10e9 / (dense.bytes_per_token_mb * 1e6))
    assert next(reads, None) is None  # both reads made
    assert notes(log, "prompt")[-1] == ids[0].tolist()  # llama.cpp was handed the same token ids
    made = notes(log, "made")
    assert [m["flash_attn"] for m in made] == [False, True]
    assert [m["pid"] for m in made] == [engine._process.pid for engine in engines.values()] != [os.getpid()] * 2
    # started afresh, not forked: a forked engine inherits torch's OpenMP pool, whose barrier llama.cpp then waits on
    assert notes(log, "torch") == [False, False] and "torch" in sys.modules
    for engine in engines.values():
        engine.close()
        assert not engine._process.is_alive()


def assert_run_record(run: dict) -> None:
    """A result file says when its command started (UTC) and how long it took in all."""
    started = datetime.fromisoformat(run["started_utc"])
    assert started.utcoffset() == timedelta(0)
    assert abs((datetime.now(timezone.utc) - started).total_seconds()) < 600
    assert 0 <= run["wall_s"] < 600


def test_bench_cli_writes_json(tiny_model_dir, tmp_path, capsys):
    op = tmp_path / "op.json"
    assert (
        main(
            [
                "bench",
                "op",
                "--shape",
                "smollm2-135m",
                "--context",
                "512",
                "--support",
                "97",
                "--budget",
                "0.001",
                "--json",
                str(op),
            ]
        )
        == 0
    )
    data = json.loads(op.read_text())
    assert set(OP_FIELDS) <= set(data["rows"][0]) and data["machine"]["torch"]
    assert_run_record(data["run"])
    e2e = tmp_path / "e2e.json"
    assert (
        main(
            [
                "bench",
                "e2e",
                "--model",
                str(tiny_model_dir),
                "--context",
                "300",
                "--support",
                "97,1009",
                "--tokens",
                "6",
                "--mode",
                "lossless",
                "--draft-tokens",
                "2",
                "--json",
                str(e2e),
            ]
        )
        == 0
    )
    data = json.loads(e2e.read_text())
    assert_run_record(data["run"])
    rows = data["rows"]
    assert [(r["mode"], r["cache"], r["support"]) for r in rows] == [
        ("dense", "dynamic", None),
        ("dense", "growing", None),
        ("sparse", "growing", 97),
        ("sparse", "growing", 1009),
        ("lossless", "growing", 97),
        ("lossless", "growing", 1009),
    ]
    for row in rows:
        assert set(E2E_FIELDS) <= set(row)
        assert row["model"] == tiny_model_dir.name, "a local model is recorded by its name, not its absolute path"
    assert rows[1]["tokens_equal_to_dense"] == 6, "the in-place cache decodes exactly like DynamicCache"
    assert rows[3]["tokens_equal_to_dense"] == 6, "a support covering everything is dense"
    assert rows[4]["tokens_equal_to_dense"] == 6 and rows[4]["draft_tokens"] == 2, "lossless output is dense output"
    assert 0 <= rows[4]["acceptance_rate"] <= 1
    assert "end to end" in capsys.readouterr().out


def test_bench_op_cli_layers_one_is_the_warm_figure(tmp_path, capsys):
    out = tmp_path / "warm.json"
    args = ["bench", "op", "--shape", "smollm2-135m", "--context", "512", "--support", "97", "--budget", "0.001"]
    assert main([*args, "--layers", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["layers"], r["layers_requested"]) for r in rows} == {(1, 1)}
    assert all(r["working_set_mb"] == r["bytes_sparse"] / 1e6 for r in rows)
    assert "cycle through the layers" in capsys.readouterr().out.replace("\n", " ")
    assert main([*args, "--json", str(out)]) == 0
    assert {r["layers"] for r in json.loads(out.read_text())["rows"]} == {30}, "cold (the shape's layers) by default"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--context", "0", "--support", "97"], "positive integers"),
        (["--context", "150", "--support", "193"], "support 193 >= context 150"),
        (["--context", "512", "--support", "97", "--budget", "0"], "above 0"),
        (["--context", "512", "--support", "97", "--budget", "-1"], "above 0"),
        (["--context", "512", "--support", "97", "--layers", "0"], "--layers: expected an integer >= 1"),
        (["--context", "512", "--support", "97", "--budget", "nan"], "finite number of seconds"),
        (["--context", "512", "--support", "97", "--device", "tpu"], "expected cpu or cuda"),
        (["--context", "100000000", "--support", "97", "--layers", "1"], "for one layer's cache, more than"),
    ],
)
def test_bench_op_cli_refuses_bad_input(tmp_path, capsys, monkeypatch, options, message):
    monkeypatch.setattr(
        bench_operator, "read_bandwidth_gbs", lambda *a, **k: pytest.fail("work started before the checks")
    )
    out = tmp_path / "op.json"
    assert main(["bench", "op", "--shape", "smollm2-135m", *options, "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and len(captured.err.strip().splitlines()) == 1 and "Traceback" not in captured.err
    assert captured.out == "" and not out.exists()


def test_bench_e2e_cli_refuses_repeats_below_one(tiny_model_dir, capsys):
    assert main(["bench", "e2e", "--model", str(tiny_model_dir), "--context", "300", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--baseline", "llama.cpp"], "is not one"),  # a model folder has no GGUF it came from
        (["--baseline", "llama.cpp", "--batch", "1,2"], "--baseline runs batch 1 only"),
        (["--native", "--batch", "1,2"], "--native runs batch 1 only"),
        (["--compile", "--batch", "1", "--selector", "h2o"], "bench e2e --batch --compile: h2o keeps the attention"),
        (["--compile", "--selector", "h2o"], "bench e2e --compile: h2o keeps the attention"),
        (["--dense-dtype", "bfloat16"], "--dense-dtype compares batched dense decoding in another dtype"),
        (["--dense-dtype", "float32", "--batch", "1"], "a dtype other than --dtype float32"),
    ],
)
def test_bench_e2e_cli_refuses_a_baseline_or_compile_it_cannot_run(tiny_model_dir, capsys, monkeypatch, extra, message):
    for module in (bench_end_to_end, bench_batch):
        monkeypatch.setattr(module, "prefill", lambda *a, **k: pytest.fail("refused after the prefill"))
    assert main(["bench", "e2e", "--model", str(tiny_model_dir), "--context", "300", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_bench_e2e_cli_says_how_to_install_llama_cpp(monkeypatch, capsys):
    from sparsedecode.experiments import baseline

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed: importing it raises ImportError
    monkeypatch.setattr(baseline, "gguf_of", lambda name: pytest.fail("fetched before the check"))
    assert main(["bench", "e2e", "--model", "smollm2-135m", "--context", "300", "--baseline", "llama.cpp"]) == 2
    err = capsys.readouterr().err
    assert "needs llama-cpp-python" in err and "CMAKE_ARGS" in err


def test_bytes_accounting_of_a_support_per_query_head():
    """Per-head quest attends each query head over its own S positions (G kernel calls a KV head): its support K/V
    were counted once per KV head, as mean-query quest's, so its bytes and bandwidth were understated G-fold there."""
    per_head, mean_query = (
        SparseConfig(support=193, selector=f"quest:grouping={g}") for g in ("per-head", "mean-query")
    )
    (_, heads), (_, shared) = (op_bytes(cfg, 131072, 2, 14, 64, 4) for cfg in (per_head, mean_query))
    assert heads - shared == 2 * (14 - 2) * 193 * 64 * 4


def test_bytes_accounting_of_two_byte_elements():
    """bfloat16 or float16 caches: keys, values, the tail block's keys and the query at 2 bytes an element, the
    float32 centroids at 4 (the cache keeps them in float32 whatever the keys' dtype)."""
    cfg = SparseConfig(support=193)
    dense, sparse = op_bytes(cfg, 131072, 2, 14, 64, 2)
    assert dense == 2 * 2 * 131072 * 64 * 2 + 14 * 64 * 2
    blocks = (131072 - 64 - 1) // 16
    assert sparse == 2 * blocks * 64 * 4 + 15 * 2 * 64 * 2 + 2 * 2 * 193 * 64 * 2 + 14 * 64 * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_bench_op_times_the_c_kernel_in_half_precision(dtype):
    """The default kernels on the CPU are torch and the C kernel in half precision too, its bytes at 2 an element."""
    rows, _ = bench_op("smollm2-135m", (512,), (97,), dtype=dtype, budget_s=0.001, layers=1)
    name = str(dtype).removeprefix("torch.")
    assert [(r.kernel, r.dtype) for r in rows] == [("torch", name), ("c", name)]
    assert rows[1].bytes_sparse == op_bytes(SparseConfig(support=97), 512, 3, 9, 64, 2)[1]


def test_a_llama_cpp_build_for_another_cpu_is_named_as_the_cause(monkeypatch, tmp_path):
    """llama.cpp's process dying of signal 4 (an AVX-512 build on an AVX2-only CPU) is said to be the build."""
    from sparsedecode.experiments.llama_engine import LlamaCpp

    fake_llama_cpp(monkeypatch, tmp_path, "illegal")
    with pytest.raises(SparseDecodeError, match=r"illegal instruction \(signal 4\).*docs/setup.md"):
        LlamaCpp(tmp_path / "model.gguf", 220, 2)


def test_a_llama_cpp_engine_that_cannot_load_is_refused_in_one_line(monkeypatch, tmp_path):
    from sparsedecode.experiments.llama_engine import LlamaCpp

    fake_llama_cpp(monkeypatch, tmp_path, "broken")
    with pytest.raises(SparseDecodeError, match=r"llama.cpp: cannot load .*model.gguf: not a GGUF file"):
        LlamaCpp(tmp_path / "model.gguf", 220, 2)


def test_progress_off_a_terminal_is_one_line_per_stage_begun_and_ended():
    """bench e2e's progress where output is not a terminal (a log, a pipe): lines on stderr, not rich's bars."""
    import io

    from sparsedecode.cli.display import progress_lines

    out = io.StringIO()
    progress = progress_lines(out)
    for done in (0, 4, 8):
        progress("sparse S=97 (run 1/1)", done, 8)
    lines = out.getvalue().splitlines()
    assert lines[0] == "sparse S=97 (run 1/1): 0/8 ..." and len(lines) == 2
    assert lines[1].startswith("sparse S=97 (run 1/1): 8/8 in ") and lines[1].endswith(" s")


def test_progress_off_a_terminal_says_where_a_long_stage_is(monkeypatch):
    """A stage under way longer than HEARTBEAT_S gets a line in between (compare-selectors ran 78 s silent)."""
    import io

    from sparsedecode.cli import display

    clock = iter([0.0, 10.0, 31.0, 40.0, 62.0, 70.0])
    monkeypatch.setattr("time.perf_counter", lambda: next(clock))
    out = io.StringIO()
    progress = display.progress_lines(out)
    for done in range(6):
        progress("runs", done, 5)
    assert out.getvalue().splitlines() == [
        "runs: 0/5 ...", "runs: 2/5 after 31 s ...", "runs: 4/5 after 62 s ...", "runs: 5/5 in 70.0 s"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "cpuinfo, expected",
    [
        (
            "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC\n"
            "stepping\t: 0\nflags\t\t: fpu sse avx f16c fma avx2 bmi2\n\nprocessor\t: 1\ncpu family\t: 99\n",
            ("AMD EPYC", "AuthenticAMD family 23 model 49 stepping 0", ["avx", "avx2", "fma", "f16c"]),
        ),
        (
            "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
            "model name\t: Intel(R) Xeon(R) Platinum 8481C\nstepping\t: 8\n"
            "flags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_int8\n",
            (
                "Intel(R) Xeon(R) Platinum 8481C",
                "GenuineIntel family 6 model 143 stepping 8",
                ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_int8"],
            ),
        ),
        (
            "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd asimddp i8mm\n",
            (None, None, ["asimd", "asimddp", "i8mm"]),
        ),
    ],
)
def test_the_machine_record_names_the_cpus_generation_and_flags(cpuinfo, expected):
    """A virtual machine's model name can hide the generation ("AMD EPYC" from Zen 2 to Zen 4); vendor, family,
    model and stepping name it. The first processor's fields are taken."""
    from sparsedecode.experiments.environment import cpu_record

    record = cpu_record(cpuinfo)
    assert (record["cpu_model"], record["cpu_id"], record["cpu_flags"]) == expected


def test_the_machine_record_counts_cores_not_threads(tmp_path):
    """Two CPUs on one core's two threads count one core; on two cores, two; an unreadable topology, None."""
    from sparsedecode.experiments.environment import cpu_cores

    def topology(cpu: int, package: int, core: int) -> None:
        folder = tmp_path / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text(f"{package}\n")
        (folder / "core_id").write_text(f"{core}\n")

    topology(0, 0, 0)
    topology(1, 0, 0)  # cpu1: cpu0's sibling
    topology(2, 0, 1)
    topology(3, 1, 0)  # core 0 of another package
    assert cpu_cores([0, 1], tmp_path) == 1
    assert cpu_cores([0, 2], tmp_path) == 2 and cpu_cores([0, 1, 2, 3], tmp_path) == 3
    assert cpu_cores([0, 4], tmp_path) is None
    assert cpu_cores() is None or 1 <= cpu_cores() <= (os.cpu_count() or 1)


def test_llama_cpp_whose_prefill_chose_another_token_has_no_token_the_same(monkeypatch, tmp_path):
    """llama.cpp's "same tokens" counts from its prefill's token: one that differs from ours leaves none the same,
    even where its later tokens happen to be ours (they compared its tokens after its own first token with ours after
    ours, and counted them all)."""
    from sparsedecode.decoding.loop import decode_tokens, prefill
    from sparsedecode.experiments.baseline import LLAMA_CPP
    from sparsedecode.experiments.llama_engine import LlamaCpp

    fake_llama_cpp(monkeypatch, tmp_path)
    monkeypatch.setattr(bench_end_to_end, "read_bandwidth_gbs", lambda *a, **k: 10.0)
    model, ids = tiny_model("qwen2"), prompt(200)
    cache, logits = prefill(model, ids)
    first = int(logits.argmax())
    (ours,), _ = decode_tokens(model, cache, [first], 4, nll=False)
    for head, same in ((first, 4), ((first + 1) % 96, 0)):
        monkeypatch.setenv("FAKE_LLAMA_CPP_TOKENS", ",".join(map(str, [head, *ours])))
        engines = {LLAMA_CPP: LlamaCpp(_gguf_file(tmp_path / "model.gguf"), 220, 1)}
        rows = bench_e2e(model, "tiny", ids, (97,), tokens=4, repeats=1, baseline=engines)
        engines[LLAMA_CPP].close()
        assert next(r for r in rows if r.cache == LLAMA_CPP).tokens_equal_to_dense == same
