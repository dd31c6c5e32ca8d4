"""Benchmark mechanics (fields, bytes accounting, JSON); timings are never asserted."""

from __future__ import annotations

import json

from sparsedecode.cli import main
from sparsedecode.config import SparseConfig
from sparsedecode.experiments.bench import _op_bytes, bench_op

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
    dense, sparse = _op_bytes(cfg, 131072, 2, 14, 64, 4)
    assert dense == 2 * 2 * 131072 * 64 * 4 + 14 * 64 * 4
    blocks = (131072 - 64 - 1) // 16
    expected = 2 * blocks * 64 * 4 + 15 * 2 * 64 * 4 + 2 * 2 * 193 * 64 * 4 + 14 * 64 * 4  # centroids, tail, support, q
    assert sparse == expected
    assert sparse < dense / 25


def test_bench_op_rows_are_consistent():
    rows, bandwidth = bench_op("smollm2-135m", (512,), (97, 193), budget_s=0.0)
    assert bandwidth > 0 and [(r.support, r.kernel) for r in rows] == [
        (97, "torch"),
        (97, "c"),
        (193, "torch"),
        (193, "c"),
    ]
    for row in rows:
        assert row.speedup == row.dense_ms / row.sparse_ms
        assert row.bound_ratio == row.sparse_ms / 1e3 / (row.bytes_sparse / (row.bandwidth_gbs * 1e9))
        assert row.bytes_sparse < row.bytes_dense


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
                "0",
                "--json",
                str(op),
            ]
        )
        == 0
    )
    data = json.loads(op.read_text())
    assert set(OP_FIELDS) <= set(data["rows"][0]) and data["machine"]["torch"]
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
                "97,1000",
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
    rows = json.loads(e2e.read_text())["rows"]
    assert [(r["mode"], r["cache"], r["support"]) for r in rows] == [
        ("dense", "dynamic", None),
        ("dense", "growing", None),
        ("sparse", "growing", 97),
        ("sparse", "growing", 1000),
        ("lossless", "growing", 97),
        ("lossless", "growing", 1000),
    ]
    for row in rows:
        assert set(E2E_FIELDS) <= set(row)
    assert rows[1]["tokens_equal_to_dense"] == 6, "the in-place cache decodes exactly like DynamicCache"
    assert rows[3]["tokens_equal_to_dense"] == 6, "a support covering everything is dense"
    assert rows[4]["tokens_equal_to_dense"] == 6 and rows[4]["draft_tokens"] == 2, "lossless output is dense output"
    assert 0 <= rows[4]["acceptance_rate"] <= 1
    assert "end to end" in capsys.readouterr().out
