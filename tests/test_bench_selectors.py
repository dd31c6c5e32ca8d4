"""``bench op`` times every selector (issue #42, case 12): adaptive budgets (``block-top-p``, a user's ``budget()``) on
torch's operations, as decoding runs them, where the default kernels used to refuse them with an option ``bench op``
does not have."""

from __future__ import annotations

import pytest
import torch
from conftest import SELECTORS, assert_attention_close

from sparsedecode.config import SparseConfig
from sparsedecode.experiments import bench_operator
from sparsedecode.experiments.bench import bench_op
from sparsedecode.experiments.bench_operator import fresh_step
from sparsedecode.experiments.bench_operator_inputs import op_layer
from sparsedecode.experiments.op_calls import op_calls
from sparsedecode.layout import BlockLayout
from sparsedecode.session import LayerState, SparseSession

BUDGETED = '''
from dataclasses import dataclass

import torch

import sparsedecode
from sparsedecode.selectors import group_mean_queries, mean_pooled_scores


@dataclass(frozen=True)
class Halves(sparsedecode.BlockSelector):
    """Mean-pooled scores; each KV head keeps half of its b blocks (a budget of its own)."""

    statistics = ("mean",)

    def score_blocks(self, queries, stats, layout):
        return mean_pooled_scores(group_mean_queries(queries, stats["mean"].shape[0]), stats["mean"])

    def budget(self, scores, layout):
        return torch.full((scores.shape[0],), 2, dtype=torch.long)
'''


@pytest.fixture(autouse=True)
def stub_bandwidth(monkeypatch):
    monkeypatch.setattr(bench_operator, "read_bandwidth_gbs", lambda *a, **k: 12.5)  # rows' structure, not speed


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory):
    path = tmp_path_factory.mktemp("budget") / "halves.py"
    path.write_text(BUDGETED)
    return f"{path}:Halves"


@pytest.mark.parametrize("selector", [*SELECTORS, "block-top-p:p=0.5", "budgeted"])
def test_bench_op_times_every_selector(selector, budgeted):
    selector = budgeted if selector == "budgeted" else selector
    rows, _ = bench_op("smollm2-135m", (512,), (129,), selector=selector, budget_s=0.001, layers=1)
    cfg = SparseConfig(support=129, selector=selector)
    fused = cfg.kernels_serve
    assert [r.kernel for r in rows] == (["torch", "c"] if fused else ["torch"])[: len(rows)]
    assert all(r.sparse_ms > 0 and r.select_ms > 0 and r.attend_ms > 0 for r in rows)


@pytest.mark.parametrize("selector", ["block-top-p:p=0.3", "budgeted", "quest"])
def test_the_timed_attention_reads_what_the_step_reads(selector, budgeted):
    """The attention ``bench op`` times apart attends over the support the whole step chose, an adaptive budget's
    dropped blocks left out: the same output as the step, to float32 round-off."""
    selector = budgeted if selector == "budgeted" else selector
    cfg = SparseConfig(support=193, selector=selector)
    n, dims, scale = 700, (4, 2, 16), 0.25
    layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size)
    layer = op_layer(n, dims, torch.float32, "cpu", cfg.selector_name, layout, torch.Generator().manual_seed(3))
    select, attend = op_calls(cfg, layer, layout, scale, "torch")
    step = fresh_step(SparseSession(config=cfg, model=None), LayerState(0, layer.centroids), layer.query,
                       layer.keys, layer.values, n, scale)  # fmt: skip
    q, k, v = layer.query[0, :, 0], layer.keys[0], layer.values[0]
    assert_attention_close(attend(), step[0, 0], q, k, v, scale)
    if selector == budgeted:  # the budget's two blocks of b per KV head
        assert select().budget_mask.sum(dim=1).tolist() == [2, 2] and cfg.blocks == 8


def test_the_command_line_times_top_p(capsys):
    from sparsedecode.cli import main

    args = ["bench", "op", "--shape", "smollm2-135m", "--context", "512", "--support", "97", "--budget", "0.001"]
    assert main([*args, "--layers", "1", "--selector", "block-top-p"]) == 0, capsys.readouterr().err
    assert "torch" in capsys.readouterr().out
