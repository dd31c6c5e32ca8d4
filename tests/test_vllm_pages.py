"""The vLLM backend's step over pages (sparsedecode.integrations.vllm.pages/step/batch), without vLLM: pages laid
out as vLLM's CPU kernels lay them out for the vec instruction sets (and as its CUDA backends do, keys and values
apart), filled by hand, against the library's own selection (select_support) and attention over the same keys held
contiguously."""

import pytest
import torch

from sparsedecode import SparseConfig, select_support
from sparsedecode.errors import SparseDecodeError
from sparsedecode.integrations.vllm.pages import PagedCache, PageStatistics
from sparsedecode.integrations.vllm.spec import config_from_spec, configured
from sparsedecode.integrations.vllm.step import mean_dot_blocks, row_layout, row_support, sparse_rows, statistics_for
from sparsedecode.kernels.reference import attend_positions
from sparsedecode.layout import support_positions

KV, G, D, PAGE = 2, 3, 16, 32


class Pages:
    """A layer's paged cache: ``pages`` physical pages, sequences written through their block tables."""

    def __init__(self, pages: int, page: int = PAGE, dtype=torch.float32, kernel: bool | str = True):
        if kernel == "split":  # vLLM's CUDA layout: keys and values apart, (pages, P, kv, d) each; torch reads it
            self.data = torch.full((2, pages, page, KV, D), float("nan"), dtype=dtype)
            self.cache = PagedCache.of_split(self.data[0], self.data[1])
        else:
            self.data = torch.full((pages, KV, page, 2 * D), float("nan"), dtype=dtype)  # unwritten = NaN
            self.cache = PagedCache.of(self.data, kernel)  # kernel: the C kernel reads the pages, else torch
        self.page = page

    def write(self, table, keys, values, start=0, stats=None):
        """Write positions ``[start, start + len)`` of a sequence; refresh ``stats`` with their slots."""
        n = keys.shape[1]
        positions = torch.arange(start, start + n)
        page, offset = table[positions // self.page].long(), positions % self.page
        for h in range(KV):
            self.cache.keys[page, h, :, offset] = keys[h].to(self.data.dtype)
            self.cache.values[page, h, offset] = values[h].to(self.data.dtype)
        if stats is not None:
            stats.refresh(page * self.page + offset)


def sequence(n, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(KV, n, D, generator=g)
    keys[:, 1:] += 2 * torch.randn(KV, 1, D, generator=g) * (torch.arange(1, n) % 97 < 20).float().view(1, -1, 1)
    return keys, torch.randn(KV, n, D, generator=g), torch.randn(KV * G, D, generator=g)


def reference(cfg, q, keys, values, scale):
    """The library's selection and attention over contiguous keys."""
    chosen = select_support(
        q, keys, support=cfg.support, window=cfg.window, block_size=cfg.block_size, method=cfg.selector
    )
    width = max(len(c) for c in chosen)
    index = torch.stack([torch.nn.functional.pad(c, (0, width - len(c))) for c in chosen])
    valid = torch.stack([torch.arange(width) < len(c) for c in chosen])
    return chosen, attend_positions(q, keys, values, index, scale, valid=valid)


SELECTORS = ["mean-pooled", "quest", "quest:grouping=mean-query", "sparq", "oracle-tokens", "oracle-blocks",
             "streaming", "block-top-p:p=0.7", "twilight", "random-blocks"]  # fmt: skip


@pytest.mark.parametrize("selector", SELECTORS)
@pytest.mark.parametrize("lengths", [(300, 613, 130), (1000,)])
@pytest.mark.parametrize("kernel", [True, False, "split"], ids=["c", "torch", "torch-cuda-layout"])
def test_pages_select_and_attend_as_the_library(selector, lengths, kernel):
    cfg = config_from_spec({"support": 97, "selector": selector})
    pages = Pages(80, kernel=kernel)
    stats = statistics_for(cfg, pages.cache)
    free = torch.randperm(80).int()
    tables, qs, refs, used = [], [], [], 0
    for i, n in enumerate(lengths):
        keys, values, q = sequence(n, i)
        table = torch.zeros(40, dtype=torch.int32)
        count = -(-n // PAGE)
        table[:count] = free[used : used + count]
        used += count
        pages.write(table, keys[:, : n - 7], values[:, : n - 7], 0, stats)  # a prefill, then decode steps
        for p in range(n - 7, n):
            pages.write(table, keys[:, p : p + 1], values[:, p : p + 1], p, stats)
        tables.append(table)
        qs.append(q)
        refs.append(reference(cfg, q, keys, values, D**-0.5))
    out = sparse_rows(
        cfg, pages.cache, stats, torch.stack(qs), torch.stack(tables), list(lengths), layer=0, scale=D**-0.5
    )
    for r, (chosen, expected) in enumerate(refs):
        index, valid = row_support(cfg, pages.cache, stats, qs[r], tables[r], row_layout(cfg, lengths[r], 0, D**-0.5))
        assert [i[v].sort().values.tolist() for i, v in zip(index, valid)] == [c.tolist() for c in chosen]
        torch.testing.assert_close(out[r], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("support", [97, 193, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_mean_dot_equals_row_by_row(support, dtype):
    """Every row's selection at once (the C kernel's, through the pages) is the row-by-row one (torch's)."""
    cfg = SparseConfig(support=support)
    pages = Pages(120, page=64, dtype=dtype)
    stats = statistics_for(cfg, pages.cache)
    lengths = [support + 1, 700, 701, 1000, 1234, 2000]
    tables, qs = [], []
    order = torch.randperm(120).int()
    used = 0
    for i, n in enumerate(lengths):
        keys, values, q = sequence(n, 10 + i)
        count = -(-n // 64)
        table = torch.zeros(40, dtype=torch.int32)
        table[:count] = order[used : used + count]
        used += count
        pages.write(table, keys, values, 0, stats)
        tables.append(table)
        qs.append(q.to(dtype))
    queries, tables = torch.stack(qs), torch.stack(tables)
    assert pages.cache.kernel_serves(queries)
    blocks = mean_dot_blocks(cfg, stats, queries, tables, lengths)
    for r, n in enumerate(lengths):
        layout = row_layout(cfg, n, 0, D**-0.5)
        index, valid = support_positions(blocks[r], layout)
        one, ok = row_support(cfg, pages.cache, stats, qs[r], tables[r], layout)
        assert torch.equal(index[valid], one[ok]) and torch.equal(valid, ok)


def test_a_reused_page_never_lends_its_old_statistics():
    """Sequence A fills pages; vLLM frees them and hands them to sequence B, which writes over them a position at a
    time: B selects as it would on fresh pages, at every step."""
    cfg = SparseConfig(support=97, selector="quest")  # min/max statistics: a stale value would show
    pages, fresh = Pages(12), Pages(12)
    stats, fresh_stats = statistics_for(cfg, pages.cache), statistics_for(cfg, fresh.cache)
    a_keys, a_values, _ = sequence(380, 1)
    a_keys *= 50  # A's keys dominate any statistic they leak into
    table = torch.arange(12, dtype=torch.int32).flip(0)
    pages.write(table, a_keys, a_values, 0, stats)
    b_keys, b_values, q = sequence(360, 2)
    b_table = torch.arange(12, dtype=torch.int32)  # the same pages, in another order
    pages.write(b_table, b_keys[:, :200], b_values[:, :200], 0, stats)
    fresh.write(b_table, b_keys[:, :200], b_values[:, :200], 0, fresh_stats)
    for n in range(201, 361):
        pages.write(b_table, b_keys[:, n - 1 : n], b_values[:, n - 1 : n], n - 1, stats)
        fresh.write(b_table, b_keys[:, n - 1 : n], b_values[:, n - 1 : n], n - 1, fresh_stats)
        layout = row_layout(cfg, n, 0, D**-0.5)
        got = row_support(cfg, pages.cache, stats, q, b_table, layout)
        want = row_support(cfg, fresh.cache, fresh_stats, q, b_table, layout)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), n


def test_shared_prefix_pages_serve_each_sequence_its_own_blocks():
    """Two sequences share their first pages (vLLM's prefix cache) and differ after: the block that straddles the
    last shared page and the first own page takes its last key from each sequence's own page."""
    cfg = SparseConfig(support=97)
    pages = Pages(20)
    stats = statistics_for(cfg, pages.cache)
    k1, v1, q = sequence(300, 3)
    k2, v2, _ = sequence(300, 4)
    k2[:, :128], v2[:, :128] = k1[:, :128], v1[:, :128]  # 4 shared pages of 32
    t1 = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], dtype=torch.int32)
    t2 = torch.tensor([0, 1, 2, 3, 10, 11, 12, 13, 14, 15], dtype=torch.int32)
    pages.write(t1, k1, v1, 0, stats)
    pages.write(t2, k2[:, 128:], v2[:, 128:], 128, stats)
    for keys, values, table in ((k1, v1, t1), (k2, v2, t2)):
        layout = row_layout(cfg, 300, 0, D**-0.5)
        index, valid = row_support(cfg, pages.cache, stats, q, table, layout)
        chosen, _ = reference(cfg, q, keys, values, D**-0.5)
        assert [i[v].tolist() for i, v in zip(index, valid)] == [c.tolist() for c in chosen]
        means = stats.blocks(table, layout)["mean"]
        torch.testing.assert_close(means[:, 7], keys[:, 113:129].mean(dim=1), rtol=1e-6, atol=1e-6)


def test_pages_must_hold_whole_blocks():
    with pytest.raises(SparseDecodeError, match="multiple of the block size"):
        PageStatistics(Pages(2, page=32).cache, 24, ("mean",))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ('{"support": 97', "not valid JSON"),
        ("[97]", "JSON object"),
        ('{"support": 50}', "smaller than anchor"),
        ('{"support": 97, "selector": "h2o"}', "history"),
        ('{"support": 97, "reuse": 4}', "reuse 4"),
        ('{"support": 97, "selector": "nope"}', "nope"),
        ('{"support": 97, "audit": true}', "audit"),
        ('{"support": 97, "colour": 1}', "colour"),
        ('{"budget": "/nonexistent/budget.json"}', "no such file"),
        ('{"budget": 5}', "a budget file's path"),  # found by probing: a bare TypeError
        ('{"budget": null}', "a budget file's path, got None"),  # found by probing: decoded without the budget
        ('{"budget": ""}', "a budget file's path, got ''"),  # found by probing: 'budget file : Is a directory'
        ('{"budget": false}', "a budget file's path, got False"),
        ('{"support": 97, "kernel": "c"}', "kernel"),
    ],
)
def test_a_bad_spec_is_one_line(spec, message):
    with pytest.raises(SparseDecodeError, match=message) as error:
        configured({}, {"SPARSEDECODE_VLLM": spec})
    assert "\n" not in str(error.value)


def test_a_null_spec_and_the_defaults_of_refused_fields():
    """Found by probing: a null spec in vLLM's config decoded dense without a word; ``audit: false`` and
    ``kernel: "auto"`` (the defaults, nothing asked) were refused."""
    with pytest.raises(SparseDecodeError, match="is null"):
        configured({"sparsedecode": None}, {})
    assert configured({}, {"SPARSEDECODE_VLLM": '{"support": 97, "audit": false, "kernel": "auto"}'}).support == 97


@pytest.mark.parametrize("selector", ["quest", "mean-pooled", "twilight"])
def test_blocks_of_one_key_are_served(selector):
    """Found by probing: with ``block_size`` 1 a block's piece holds no key, and min/max over none crashed the first
    refresh of the page statistics."""
    cfg = config_from_spec({"support": 40, "window": 7, "block_size": 1, "selector": selector})
    pages = Pages(20)
    stats = statistics_for(cfg, pages.cache)
    keys, values, q = sequence(300, 3)
    table = torch.randperm(20).int()
    pages.write(table, keys[:, :290], values[:, :290], 0, stats)
    for p in range(290, 300):
        pages.write(table, keys[:, p : p + 1], values[:, p : p + 1], p, stats)
    chosen, expected = reference(cfg, q, keys, values, D**-0.5)
    index, valid = row_support(cfg, pages.cache, stats, q, table, row_layout(cfg, 300, 0, D**-0.5))
    assert [i[v].sort().values.tolist() for i, v in zip(index, valid)] == [c.tolist() for c in chosen]
    out = sparse_rows(cfg, pages.cache, stats, q[None], table[None], [300], layer=0, scale=D**-0.5)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


def test_the_spec_comes_from_vllms_config_first():
    assert configured({}, {}) is None
    assert configured({"sparsedecode": {"support": 193}}, {"SPARSEDECODE_VLLM": '{"support": 97}'}).support == 193
    assert configured({}, {"SPARSEDECODE_VLLM": '{"support": 97, "dense_layers": [0]}'}).dense_layers == (0,)


def test_bench_vllm_refuses_before_any_engine_starts(tmp_path, capsys):
    from sparsedecode.cli import main

    missing = ["bench", "vllm", "--vllm-python", str(tmp_path / "none"), "--context", "512"]
    assert main(missing) == 2
    assert "make vllm" in capsys.readouterr().err
    python = tmp_path / "python"
    python.write_text("")
    assert main(["bench", "vllm", "--vllm-python", str(python), "--selector", "h2o"]) == 2
    assert "history" in capsys.readouterr().err
    assert main(["bench", "vllm", "--vllm-python", str(python), "--batch", "0"]) == 2
    assert "--batch" in capsys.readouterr().err


def test_a_failed_engine_is_named_by_its_cause():
    from sparsedecode.experiments.bench_vllm import cause

    log = "INFO starting\nTraceback (most recent call last):\n  File x\nValueError: no pages left\nINFO shutdown\n"
    assert cause(log) == "ValueError: no pages left"
    assert cause("only this\n") == "only this"


@pytest.mark.parametrize("spec", [{"support": 65}, {"support": 80}, {"support": 97, "layer_supports": {"0": 65}}])
def test_a_support_of_no_distant_block_is_served_by_the_c_kernel(spec):
    """Found by probing: a support of ``1 + window`` (``b = 0``: the anchor and the window only) crashed the process
    in the C kernel (a segmentation fault: the empty tensor of chosen blocks has a NULL pointer, which the kernel
    took for "positions given by index", and read a NULL index)."""
    cfg = config_from_spec(spec).for_layer(0)
    assert cfg.blocks == 0
    pages = Pages(20)
    stats = statistics_for(cfg, pages.cache)
    keys, values, q = sequence(300, 3)
    table = torch.randperm(20).int()
    pages.write(table, keys, values, 0, stats)
    assert pages.cache.kernel_serves(q[None])
    _, expected = reference(cfg, q, keys, values, D**-0.5)
    out = sparse_rows(cfg, pages.cache, stats, q[None], table[None], [300], layer=0, scale=D**-0.5)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


def test_a_budget_file_made_for_another_layer_count_is_refused(tmp_path):
    """Found by probing: the command line refuses a budget file made for a model of another number of attention
    layers (its ``layers``), but the plug-in took it, so a 24-layer calibration on a 30-layer model left layers 24 to
    29 at the spec's support without a word."""
    budget = tmp_path / "budget.json"
    budget.write_text('{"layer_supports": {"0": 97, "1": 193}, "layers": 2}')
    spec = {"sparsedecode": {"budget": str(budget)}}
    with pytest.raises(SparseDecodeError, match="made for a model of 2 attention layers; this model has 30") as error:
        configured(spec, {}, layers=30)
    assert "\n" not in str(error.value)
    assert configured(spec, {}, layers=2).layer_supports == ((0, 97), (1, 193))
    assert configured(spec, {}).layer_supports == ((0, 97), (1, 193))  # the model not known yet (the plug-in's hook)


def test_bench_vllm_refuses_a_budget_file_made_for_another_model(tmp_path, capsys, tiny_model_dir):
    """Found by probing: every command refuses a budget file made for a model of another number of attention layers,
    but ``bench vllm`` started its engines with it (their sparse runs would have left the model's other layers at
    ``--support``)."""
    from sparsedecode.cli import main

    budget = tmp_path / "budget.json"
    budget.write_text('{"layer_supports": {"0": 97}, "layers": 30}')
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    args = ["bench", "vllm", "--model", str(tiny_model_dir), "--budget", str(budget), "--vllm-python", str(python),
            "--context", "100", "--tokens", "4", "--batch", "1", "--support", "97"]  # fmt: skip
    assert main(args) == 2
    assert "made for a model of 30 attention layers; " in capsys.readouterr().err


@pytest.mark.parametrize("layers", [["--dense-layers", "0,40"], ["--layer-supports", "41:193"]])
def test_bench_vllm_refuses_a_layer_past_the_models_before_any_engine(tmp_path, capsys, tiny_model_dir, layers):
    """Found by probing: a --dense-layers or --layer-supports layer past the model's was refused by vLLM only after
    the dense engine's whole round; now in one line before any engine starts (the stand-in python would fail one)."""
    from sparsedecode.cli import main

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    args = ["bench", "vllm", "--model", str(tiny_model_dir), "--vllm-python", str(python), "--context", "100",
            "--tokens", "4", "--batch", "1", "--support", "97", *layers]  # fmt: skip
    assert main(args) == 2
    assert "the model has 2 attention layers" in capsys.readouterr().err


def test_bench_vllm_refuses_a_support_of_partial_blocks(tmp_path, capsys):
    """Found by probing: every other command refuses a support that block selectors floor to whole blocks, so that the
    support asked for is the one in every table; ``bench vllm --support 100`` ran 97 under the label ``S=100``."""
    from sparsedecode.cli import main

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    assert main(["bench", "vllm", "--vllm-python", str(python), "--support", "100", "--context", "100"]) == 2
    assert "--support 100 is not 1 + W + b*B" in capsys.readouterr().err
