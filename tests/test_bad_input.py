"""Bad input fails at the call, in one line (SparseDecodeError), before any expensive work, leaving nothing behind.

Library entry points are called directly; the command-line cases go through ``sparsedecode.cli.main`` and check
exit status 2, one line on stderr and no traceback. Nothing here touches the network.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import prompt, tiny_model

from sparsedecode.cli import main
from sparsedecode.config import SparseConfig
from sparsedecode.decoding.generate import generate
from sparsedecode.errors import SparseDecodeError
from sparsedecode.experiments.corpus import check_corpus, load_text
from sparsedecode.experiments.sweep import LOCK_FILE, RUNS_FILE, SPEC_FILE, SweepSpec, locked, merge_sweeps
from sparsedecode.models import catalog as models
from sparsedecode.protocol.paired import compare, dense_reference
from sparsedecode.reports.sweep import write_report
from sparsedecode.selectors import select_blocks, select_support, top_blocks
from sparsedecode.session import sparse_decoding


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def one_line_exit_2(args: list[str], capsys) -> str:
    """Run the CLI; assert exit status 2 and a single line on stderr without a traceback; return that line."""
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse errors exit instead of returning
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


class NoForward:
    """A forward pre-hook that fails the test if the model runs at all (the check must come first)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        raise AssertionError("the model ran before the arguments were checked")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


# ---- types, counts and positions at the library's entry points ----


@pytest.mark.parametrize("cfg", [None, {"support": 97}, 97, "mean-pooled"])
def test_compare_refuses_a_config_that_is_not_a_sparse_config(model, cfg):
    with NoForward(model), pytest.raises(SparseDecodeError, match="config must be a SparseConfig") as error:
        compare(model, None, prompt(150), cfg, 8)
    assert "\n" not in str(error.value)
    if isinstance(cfg, dict):
        assert "SparseConfig(**settings)" in str(error.value)


@pytest.mark.parametrize(
    "ids, message",
    [
        (prompt(150)[0], "shape \\(1, length >= 1\\)"),  # 1-D
        (torch.zeros(1, 0, dtype=torch.long), "shape \\(1, length >= 1\\)"),
        (prompt(150).float(), "int64 \\(torch.long\\) or int32"),
        (prompt(150) > 3, "int64 \\(torch.long\\) or int32"),
        (prompt(150).to(torch.uint8), "int64 \\(torch.long\\) or int32, got torch.uint8"),
        (prompt(150).to(torch.int16), "int64 \\(torch.long\\) or int32, got torch.int16"),
        (prompt(150) + 200, "must lie in \\[0, 96\\)"),  # beyond the vocabulary
        (prompt(150) - 100, "must lie in \\[0, 96\\)"),
        ([[1, 2, 3]], "torch tensor"),
    ],
)
def test_prompt_ids_are_checked_before_the_model_runs(model, ids, message):
    cfg = SparseConfig(support=97)
    for call in (
        lambda: compare(model, None, ids, cfg, 8),
        lambda: dense_reference(model, ids, tokens=8),
        lambda: generate(model, ids, cfg, 8),
    ):
        with NoForward(model), pytest.raises(SparseDecodeError, match=message):
            call()


def test_batches_are_checked_before_the_model_runs(model):
    batch = prompt(150).repeat(2, 1)
    cfg = SparseConfig(support=97)
    with NoForward(model):
        with pytest.raises(SparseDecodeError, match="must lie in"):
            dense_reference(model, [prompt(150), prompt(150) + 200], tokens=8)  # one prompt or several, each checked
        with pytest.raises(SparseDecodeError, match="lossless generation runs one sequence at a time"):
            generate(model, batch, cfg, 8)
        with pytest.raises(SparseDecodeError, match="must lie in"):
            compare(model, None, [prompt(150), prompt(150) + 200], cfg, 8)
        with pytest.raises(SparseDecodeError, match="exceeds the model's"):
            generate(model, [prompt(150), prompt(1020)], cfg, 8, mode="sparse")


def test_positions_past_the_model_are_refused_before_decoding(model):
    limit = model.config.max_position_embeddings  # 1024
    ids = prompt(limit - 10)
    cfg = SparseConfig(support=97)
    with NoForward(model):
        with pytest.raises(SparseDecodeError, match=f"context {limit - 10} \\+ 11 tokens exceeds the model's {limit}"):
            compare(model, None, ids, cfg, 11)
        with pytest.raises(SparseDecodeError, match="exceeds the model's"):
            dense_reference(model, ids, tokens=11)
        for mode in ("dense", "sparse", "lossless"):
            with pytest.raises(SparseDecodeError, match="exceeds the model's"):
                generate(model, ids, cfg, 11, mode=mode)
    # at the limit it runs
    assert len(dense_reference(model, prompt(limit - 4), tokens=4).tokens) == 4


@pytest.mark.parametrize(
    "rope, limit",
    [
        (None, 128),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}, 512),
        ({"rope_type": "linear", "factor": 2.0}, 256),
        ({"rope_type": "dynamic", "factor": 2.0}, None),
    ],
)
def test_a_rope_scaling_that_extends_the_context_extends_the_limit(rope, limit):
    """Qwen2.5's long-context setting keeps max_position_embeddings and adds YaRN: the model then serves factor
    times the original positions (dynamic NTK: any length), and so do generate and compare."""
    from sparsedecode.validate import max_positions

    model = tiny_model("qwen2", max_position_embeddings=128, rope_scaling=rope)
    assert max_positions(model) == limit
    ids, cfg = prompt(200), SparseConfig(support=97)
    if limit is None or limit >= 206:
        assert len(generate(model, ids, cfg, 6, mode="sparse").tokens) == 6
    else:
        with NoForward(model), pytest.raises(SparseDecodeError, match=f"exceeds the model's {limit} positions"):
            generate(model, ids, cfg, 6, mode="sparse")


@pytest.mark.parametrize("tokens", [0, 1, 2.0, "8", True, None])
def test_token_counts_must_be_integers(model, tokens):
    with NoForward(model), pytest.raises(SparseDecodeError, match="tokens must be an integer"):
        compare(model, None, prompt(150), SparseConfig(support=97), tokens)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1"),
        (dict(draft_tokens=0), "draft_tokens must be an integer >= 1"),
        (dict(draft_tokens=1.5), "draft_tokens must be an integer >= 1"),
        (dict(max_draft_tokens=0, adaptive=True), "max_draft_tokens must be an integer >= 1"),
        (dict(cfg={"support": 97}), "config must be a SparseConfig"),
        (dict(cfg=None, mode="sparse"), "needs a SparseConfig"),
        (dict(mode="fast"), "unknown mode"),
    ],
)
def test_generate_checks_its_arguments(model, overrides, message):
    arguments = dict(cfg=SparseConfig(support=97), max_new_tokens=8, mode="lossless")
    arguments.update(overrides)
    cfg, tokens = arguments.pop("cfg"), arguments.pop("max_new_tokens")
    with NoForward(model), pytest.raises(SparseDecodeError, match=message):
        generate(model, prompt(150), cfg, tokens, **arguments)


@pytest.mark.parametrize("not_a_model", [None, "smollm2-135m", torch.nn.Linear(2, 2)])
def test_entry_points_refuse_what_is_not_a_model(not_a_model):
    cfg = SparseConfig(support=97)
    for call in (
        lambda: compare(not_a_model, None, prompt(150), cfg, 8),
        lambda: dense_reference(not_a_model, prompt(150), tokens=8),
        lambda: generate(not_a_model, prompt(150), cfg, 8),
    ):
        with pytest.raises(SparseDecodeError, match="model must be a transformers causal LM"):
            call()
    with pytest.raises(SparseDecodeError, match="model must be a transformers causal LM"):
        with sparse_decoding(not_a_model, cfg):
            pass


@pytest.mark.parametrize("kind", ["base model", "classifier", "masked LM"])
def test_models_that_cannot_generate_are_refused_at_the_call(model, kind):
    """A base model, a classifier or a masked LM used to fail late (AttributeError on .logits, IndexError) or, for a
    masked LM, to decode tokens that mean nothing."""
    from transformers import BertConfig, BertForMaskedLM, LlamaForSequenceClassification

    if kind == "base model":
        other = model.model
    elif kind == "classifier":
        other = LlamaForSequenceClassification(model.config).eval()
    else:
        bert = BertConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
        )
        other = BertForMaskedLM(bert).eval()
    cfg = SparseConfig(support=97)
    calls = (
        lambda: compare(other, None, prompt(150), cfg, 8),
        lambda: compare(other, None, [prompt(150), prompt(120)], cfg, 8),
        lambda: dense_reference(other, prompt(150), tokens=8),
        lambda: generate(other, prompt(150), cfg, 8, mode="sparse"),
        lambda: generate(other, [prompt(150), prompt(120)], cfg, 8, mode="dense"),
    )
    for call in calls:
        with NoForward(other), pytest.raises(SparseDecodeError, match=f"{type(other).__name__} cannot generate text"):
            call()
    if kind == "base model":  # a session only hooks attention layers: a base model is fine there
        with sparse_decoding(other, cfg) as session:
            other(input_ids=prompt(150))
        assert session.dense_steps == 0


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(eos_token_id="a"), "eos_token_id must be None or one token id in \\[0, 96\\)"),
        (dict(eos_token_id=-1), "eos_token_id must be None"),
        (dict(eos_token_id=1.5), "eos_token_id must be None"),
        (dict(eos_token_id=True), "eos_token_id must be None"),
        (dict(eos_token_id=96), "eos_token_id must be None"),
        (dict(eos_token_id=[3, 4]), "eos_token_id must be None"),
    ],
)
@pytest.mark.parametrize("batched", [False, True])
def test_generate_checks_eos_token_id(model, arguments, message, batched):
    ids = [prompt(150), prompt(120)] if batched else prompt(150)
    for mode in ("dense", "sparse") if batched else ("dense", "sparse", "lossless"):
        with NoForward(model), pytest.raises(SparseDecodeError, match=message):
            generate(model, ids, SparseConfig(support=97), 8, mode=mode, **arguments)


def test_generate_stops_at_eos_for_one_prompt_in_every_mode(model):
    """eos_token_id used to be ignored for one prompt (a batch honoured it)."""
    cfg = SparseConfig(support=97)
    dense = generate(model, prompt(150), None, 24, mode="dense").tokens
    # a token first output well past a draft's length, so that lossless rounds cut accepted drafts at it
    eos = next(t for i, t in enumerate(dense) if i >= 8 and t not in dense[:i])
    expected = dense[: dense.index(eos) + 1]
    assert 9 <= len(expected) < 24
    assert generate(model, prompt(150), cfg, 24, mode="dense", eos_token_id=eos).tokens == expected
    # S = 385 covers the context: every draft is accepted, so the end token comes inside a round's accepted drafts
    for support, k, adaptive in ((97, 4, False), (385, 2, False), (385, 4, False), (385, 8, False), (385, 2, True)):
        drafts = SparseConfig(support=support)
        lossless = generate(model, prompt(150), drafts, 24, eos_token_id=eos, draft_tokens=k, adaptive=adaptive)
        assert lossless.tokens == expected, (support, k, adaptive)
    sparse = generate(model, prompt(150), cfg, 24, mode="sparse").tokens
    stopped = generate(model, prompt(150), cfg, 24, mode="sparse", eos_token_id=eos).tokens
    assert stopped == sparse[: sparse.index(eos) + 1] if eos in sparse else stopped == sparse
    batch = generate(model, [prompt(150)], cfg, 24, mode="dense", eos_token_id=eos)[0].tokens
    assert batch == expected, "one prompt alone and as a batch of one agree"
    assert generate(model, prompt(150), cfg, 24, mode="dense", eos_token_id=dense[0]).tokens == dense[:1]


@pytest.mark.parametrize(
    "mask, message",
    [
        ([[1] * 150, [1] * 150], "attention_mask must be a torch tensor"),
        (torch.cat([torch.full((2, 5), 0.5), torch.ones(2, 145)], 1), "tensor of 0 and 1, got shape \\(2, 150\\) with"),
        (torch.full((2, 150), 2), "tensor of 0 and 1"),
        (torch.ones(150), "tensor of 0 and 1, got shape \\(150,\\)"),
    ],
)
def test_generate_checks_the_attention_mask_values(model, mask, message):
    """A mask of 0.5 used to pass (the check cast it to integers first) and give a third set of tokens."""
    with NoForward(model), pytest.raises(SparseDecodeError, match=message):
        generate(model, prompt(150).repeat(2, 1), SparseConfig(support=97), 8, mode="sparse", attention_mask=mask)


def test_generate_checks_the_adaptive_draft_settings(model):
    cfg = SparseConfig(support=97)
    with NoForward(model):
        with pytest.raises(SparseDecodeError, match="adaptive must be True or False"):
            generate(model, prompt(150), cfg, 8, adaptive="no")
        with pytest.raises(SparseDecodeError, match="max_draft_tokens \\(2\\) is below draft_tokens \\(4\\)"):
            generate(model, prompt(150), cfg, 8, adaptive=True, draft_tokens=4, max_draft_tokens=2)
        for adaptive in ({}, {"adaptive": False}):  # a fixed draft length: the bound was ignored without a word
            with pytest.raises(SparseDecodeError, match="max_draft_tokens bounds the adaptive draft length"):
                generate(model, prompt(150), cfg, 8, draft_tokens=3, max_draft_tokens=1, **adaptive)
        for mode in ("sparse", "dense"):  # nothing drafts there: a draft length was ignored without a word
            with pytest.raises(SparseDecodeError, match="draft_tokens, adaptive apply to mode='lossless' only"):
                generate(model, [prompt(150), prompt(140)], cfg, 8, mode=mode, draft_tokens=2, adaptive=True)


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(kernel="c", selector="streaming"),
            "kernel 'c' serves block selectors only; streaming steps run as torch",
        ),
        (dict(kernel="triton", selector="oracle-tokens"), "kernel 'triton' serves block selectors only"),
        (dict(kernel="c", selector="h2o"), "kernel 'c' serves block selectors only"),
        (dict(audit="no"), "audit must be True or False"),
        (dict(audit=None), "audit must be True or False"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(seed="x"), "seed must be an integer"),
        (dict(seed=None), "seed must be an integer"),
        (dict(seed=-1), "seed must be an integer"),
        (dict(seed=2**70), "seed must be an integer"),
        (dict(seed=True), "seed must be an integer"),
        (dict(window=0, support=1), "window must be >= 1"),
    ],
)
def test_sparse_config_checks_every_field(fields, message):
    with pytest.raises(SparseDecodeError, match=message):
        SparseConfig(**fields)


def test_random_blocks_takes_the_largest_seed():
    q, k = torch.randn(4, 8), torch.randn(2, 305, 8)  # 15 whole distant blocks: every pick reads 16 positions
    for seed in (0, 2**63 - 1):
        picks = select_support(q, k, support=97, method="random-blocks", seed=seed)
        assert all(len(p) == 97 for p in picks)


@pytest.mark.parametrize(
    "history, message",
    [
        (torch.rand(2, 10), "history must be \\(kv_heads, N\\) = \\(2, 300\\)"),
        (torch.rand(300), "history must be \\(kv_heads, N\\)"),
        ([1.0, 2.0], "history must be a floating-point torch tensor, got list"),
        (torch.ones(2, 300, dtype=torch.long), "got a tensor of torch.int64"),
        (torch.full((2, 300), float("nan")), "history hold NaN"),
    ],
)
def test_select_support_checks_the_h2o_history(history, message):
    with pytest.raises(SparseDecodeError, match=message):
        select_support(torch.randn(4, 8), torch.randn(2, 300, 8), support=97, method="h2o", history=history)


def test_compare_refuses_a_reference_of_another_kind(model):
    with NoForward(model), pytest.raises(SparseDecodeError, match="reference must be a DenseReference"):
        compare(model, None, prompt(150), SparseConfig(support=97), 8, reference={"tokens": [1, 2]})


@pytest.mark.parametrize("config", [{"support": 97}, 97, "mean-pooled"])
def test_sparse_decoding_refuses_a_dict_or_other_config_at_entry(model, config):
    with pytest.raises(SparseDecodeError, match="config must be a SparseConfig"):
        with sparse_decoding(model, config):
            pass
    assert model.config._attn_implementation == "sdpa"  # nothing was switched on


def test_sparse_decoding_names_an_unknown_override(model):
    with pytest.raises(SparseDecodeError, match="unknown SparseConfig field\\(s\\) suport"):
        with sparse_decoding(model, suport=97):
            pass
    with sparse_decoding(model, support=97) as session:  # known fields still work
        assert session.config.support == 97


# ---- non-finite queries and keys never select silently ----


@pytest.mark.parametrize("method", ["mean-pooled", "quest", "oracle-blocks", "oracle-tokens", "h2o", "streaming"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["queries", "keys"])
def test_select_support_refuses_non_finite_queries_or_keys(method, bad, where):
    generator = torch.Generator().manual_seed(0)
    tensors = {"queries": torch.randn(4, 16, generator=generator), "keys": torch.randn(2, 400, 16, generator=generator)}
    if where == "queries":
        tensors["queries"][1, 3] = bad
    else:
        tensors["keys"][0, 37, 5] = bad
    with pytest.raises(SparseDecodeError, match=f"{where} hold NaN or infinite values"):
        select_support(tensors["queries"], tensors["keys"], support=97, method=method)


def test_all_nan_queries_no_longer_pick_the_first_blocks():
    keys = torch.randn(2, 400, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(SparseDecodeError, match="queries hold NaN"):
        select_support(torch.full((4, 16), float("nan")), keys, support=97)


@pytest.mark.parametrize(
    "queries, keys",
    [
        ("not a tensor", torch.randn(2, 400, 16)),
        (torch.randn(4, 16), [[0.0]]),
        (torch.ones(4, 16, dtype=torch.long), torch.randn(2, 400, 16)),
        (torch.randn(4, 16), torch.randn(2, 0, 16)),
        (torch.randn(4, 16), torch.randn(0, 400, 16)),
    ],
)
def test_select_support_refuses_wrong_kinds_of_tensors(queries, keys):
    with pytest.raises(SparseDecodeError):
        select_support(queries, keys, support=97)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_top_blocks_refuses_non_finite_scores_when_it_chooses(bad):
    scores = torch.randn(2, 20)
    scores[1, 4] = bad
    with pytest.raises(SparseDecodeError, match="scores hold NaN or infinite"):
        top_blocks(scores, 5)
    assert top_blocks(scores, 20).shape == (2, 20)  # everything is kept: nothing to choose


@pytest.mark.parametrize("kernel", ["torch", "c"])
def test_the_decode_step_refuses_a_nan_query_on_every_selection_path(kernel):
    from sparsedecode.kernels.cpu import library
    from sparsedecode.layout import BlockLayout
    from sparsedecode.selectors.statistics import BlockStatistics

    if kernel == "c" and library() is None:
        pytest.skip("no C compiler here: the C kernel path does not exist")
    cfg = SparseConfig(support=97, kernel=kernel)
    keys = torch.randn(2, 400, 16)
    queries = torch.randn(4, 16)
    queries[2, 0] = float("nan")
    layout = BlockLayout(n=400, window=cfg.window, block_size=cfg.block_size)
    with pytest.raises(SparseDecodeError, match="NaN or infinite"):
        select_blocks(cfg, BlockStatistics(cfg.block_size, ("mean",)), queries, keys, layout, scale=0.25)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["full block", "tail block"])
@pytest.mark.parametrize("kernel", ["torch", "c"])
def test_a_non_finite_key_in_a_scored_block_refuses_on_every_selection_path(kernel, where, bad):
    """A finite query and one non-finite key in the distant region: the torch path's score check and the C kernel's
    check inside its scoring both refuse, whether the key lies in a cached full block or in the short tail block."""
    from sparsedecode.kernels.cpu import library
    from sparsedecode.layout import BlockLayout
    from sparsedecode.selectors.statistics import BlockStatistics

    if kernel == "c" and library() is None:
        pytest.skip("no C compiler here: the C kernel path does not exist")
    cfg = SparseConfig(support=97, kernel=kernel)
    n = 407  # distant region [1, 343): 21 full blocks and a tail block of 6
    layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size)
    assert layout.n_blocks == layout.n_full + 1
    keys = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(3))
    position = 1 + 5 * cfg.block_size + 3 if where == "full block" else layout.distant_end - 2
    keys[1, position, 7] = bad
    queries = torch.randn(4, 16)
    fine = keys.clone()
    fine[1, position, 7] = 0.0
    select_blocks(cfg, BlockStatistics(cfg.block_size, ("mean",)), queries, fine, layout, scale=0.25)  # finite: runs
    with pytest.raises(SparseDecodeError, match="scores hold NaN or infinite"):
        select_blocks(cfg, BlockStatistics(cfg.block_size, ("mean",)), queries, keys, layout, scale=0.25)


@pytest.mark.parametrize(
    "kernel, selector",
    [
        (k, s)
        for k in ("torch", "c", "auto")
        for s in ("mean-pooled", "quest", "quest:grouping=mean-query", "oracle-tokens")
        if (k, s) != ("c", "oracle-tokens")  # the C kernel serves block selectors
    ],
)
@pytest.mark.parametrize("poison", ["q_proj", "k_proj"])
def test_non_finite_hidden_states_raise_in_compare_instead_of_selecting(kernel, selector, poison):
    """A model whose queries (or keys) are NaN from layer 0 on: dense prefill runs, the first sparse step refuses."""
    model = tiny_model("llama")
    with torch.no_grad():
        getattr(model.model.layers[0].self_attn, poison).weight[0, 0] = float("nan")
    with pytest.raises(SparseDecodeError, match="NaN or infinite"):
        compare(model, None, prompt(150), SparseConfig(support=97, selector=selector, kernel=kernel), 4)


# ---- models: unknown paths and an unreachable hub fail at once, without the hub's retries ----


def refuse_hub(monkeypatch):
    """Record every from_pretrained; fail the test if one would ask the hub (not only the local cache)."""
    calls = []

    def load(path, dtype, **kwargs):
        calls.append((str(path), kwargs.get("local_files_only", False)))
        if not kwargs.get("local_files_only"):
            raise AssertionError(f"asked the hub for {path}")
        raise OSError(f"{path} is not in the cache")

    monkeypatch.setattr(models, "_load_pretrained", load)
    return calls


@pytest.mark.parametrize("spec", ["./nope", "../nope/model", "nope/", "a/b/c", "~/no-such-model-dir"])
def test_an_unknown_relative_path_never_asks_the_hub(tmp_path, monkeypatch, spec, capsys):
    monkeypatch.chdir(tmp_path)
    calls = refuse_hub(monkeypatch)
    monkeypatch.setattr(models, "hub_unreachable", lambda timeout=3.0: pytest.fail("probed the hub"))
    with pytest.raises(SparseDecodeError, match="unknown model .*no file or directory") as error:
        models.load_model(spec)
    assert "\n" not in str(error.value) and calls == []
    err = one_line_exit_2(["run", "--model", spec], capsys)
    assert "no file or directory" in err


def test_an_owner_name_spec_with_the_hub_unreachable_fails_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    calls = refuse_hub(monkeypatch)
    monkeypatch.setattr(models, "hub_unreachable", lambda timeout=3.0: "no connection to the hub: test")
    with pytest.raises(SparseDecodeError, match="the hub is not reachable \\(no connection to the hub: test\\)") as e:
        models.load_model("nope/model")
    assert "\n" not in str(e.value) and "no file or directory" in str(e.value)
    assert calls == [("nope/model", True)], "only the local hub cache was asked"
    err = one_line_exit_2(["run", "--model", "nope/model"], capsys)
    assert "not reachable" in err


def test_hub_unreachable_answers_offline_mode_and_refused_connections_without_the_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.hub_unreachable() == "HF_HUB_OFFLINE is set"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    import socket

    with socket.socket() as closed:  # a local port nobody listens on: the connection is refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    reason = models.hub_unreachable(timeout=2.0)
    assert reason is not None and reason.startswith("no connection to 127.0.0.1")
    with socket.socket() as server:  # and one that listens: reachable
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert models.hub_unreachable(timeout=2.0) is None


# ---- corpora: binary, non-UTF-8 and empty files are refused ----


@pytest.mark.parametrize(
    "content, message",
    [
        (b"some text\x00\x01\x02 and more", "is binary \\(a NUL byte at offset 9\\)"),
        (b"caf\xe9 au lait, " * 20, "is not UTF-8 text \\(byte 0xe9 at offset 3\\)"),
        (b"", "holds no text"),
        (b"  \n\t\n", "holds no text"),
    ],
)
def test_binary_or_empty_corpus_files_are_refused(tmp_path, content, message):
    path = tmp_path / "corpus.bin"
    path.write_bytes(content)
    with pytest.raises(SparseDecodeError, match=message):
        load_text(str(path))
    with pytest.raises(SparseDecodeError, match=message):
        check_corpus(str(path))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "good.txt").write_text("fine text " if content.strip() else "")
    (folder / "bad.txt").write_bytes(content)
    if content.strip():
        with pytest.raises(SparseDecodeError, match="bad.txt"):
            load_text(str(folder))
    else:
        with pytest.raises(SparseDecodeError, match="holds no text"):
            load_text(str(folder))


def test_a_device_file_is_not_a_corpus():
    with pytest.raises(SparseDecodeError, match="not a regular file"):
        load_text("/dev/null")


def test_utf8_text_still_loads(tmp_path):
    path = tmp_path / "ok.txt"
    path.write_text("café au lait, naïve résumé\n" * 3, encoding="utf-8")
    assert load_text(str(path)).startswith("café")


def test_cli_refuses_a_binary_corpus_and_writes_nothing(tiny_model_dir, tmp_path, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 16)
    out = tmp_path / "never.json"
    args = ["--model", str(tiny_model_dir), "--corpus", str(binary), "--context", "150", "--tokens", "4"]
    err = one_line_exit_2(["run", *args, "--json", str(out)], capsys)
    assert "is binary" in err and not out.exists()
    sweep_out = tmp_path / "sweep"
    err = one_line_exit_2(["sweep", *args, "--support", "97", "--prompts", "1", "--out", str(sweep_out)], capsys)
    assert "is binary" in err and not sweep_out.exists()


# ---- merge and sweep refusals leave no lock file or folder behind ----


def sweep_folder(path: Path, **overrides) -> Path:
    settings = dict(model="tiny", contexts=(150,), supports=(97,), prompts=1, tokens=10)
    settings.update(overrides)
    path.mkdir(parents=True)
    (path / SPEC_FILE).write_text(json.dumps({"spec": SweepSpec(**settings).to_dict(), "sessions": []}))
    (path / RUNS_FILE).write_text("")
    return path


def test_a_refused_merge_leaves_nothing_behind(tmp_path, capsys):
    a, b = sweep_folder(tmp_path / "a"), sweep_folder(tmp_path / "b", tokens=8)
    out = tmp_path / "deep" / "merged"
    with pytest.raises(SparseDecodeError, match="settings differ"):
        merge_sweeps([a, b], out)
    assert not (tmp_path / "deep").exists()
    err = one_line_exit_2(["merge", str(a), str(b), "--out", str(out)], capsys)
    assert "settings differ" in err and not (tmp_path / "deep").exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    one_line_exit_2(["merge", str(a), str(b), "--out", str(existing)], capsys)
    assert existing.is_dir() and list(existing.iterdir()) == []  # kept (it was there), and no .lock inside
    assert sorted(p.name for p in a.iterdir()) == [RUNS_FILE, SPEC_FILE]


def test_a_merge_that_succeeds_leaves_no_lock_file(tmp_path):
    a = sweep_folder(tmp_path / "a")
    merge_sweeps([a], tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [RUNS_FILE, SPEC_FILE]


def test_locked_removes_its_lock_and_the_folders_it_made_on_failure(tmp_path):
    target = tmp_path / "x" / "y"
    with pytest.raises(RuntimeError), locked(target):
        assert (target / LOCK_FILE).exists()
        raise RuntimeError("refused")
    assert not (tmp_path / "x").exists()
    with pytest.raises(RuntimeError), locked(target):
        (target / "kept.txt").write_text("work done before the failure")
        raise RuntimeError("refused later")
    assert sorted(p.name for p in target.iterdir()) == ["kept.txt"]  # not empty: kept, minus the lock file
    with locked(target):
        with pytest.raises(SparseDecodeError, match="another process"), locked(target):
            pass
        assert (target / LOCK_FILE).exists(), "a refused second writer must not remove the holder's lock"
    assert not (target / LOCK_FILE).exists()


# ---- report: malformed input files give one line naming the file, and no partial output ----

RETRIEVAL_SPEC = {
    "model": "tiny",
    "dtype": "float32",
    "haystack": "filler",
    "contexts": [256],
    "depths": [0.5],
    "trials": 1,
    "digits": 5,
    "seed": 0,
    "answer_tokens": 8,
    "supports": [97],
    "window": 64,
    "block_size": 16,
    "reuse": 1,
    "selector": "mean-pooled",
}
TRIAL = {
    "mode": "dense",
    "support": None,
    "context": 256,
    "depth": 0.5,
    "trial": 0,
    "correct": True,
    "captured_mass_ratio_mean": None,
    "needle_read_mean": None,
}


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not valid JSON"),
        (b"\xff\xfe{}", "is not valid JSON"),
        ("[1, 2, 3]", "is not a retrieval result"),
        ('{"spec": {}}', "is not a retrieval result"),
        ('{"spec": [], "trials": []}', "is not a retrieval result"),
        (json.dumps({"spec": RETRIEVAL_SPEC, "trials": [1, 2]}), "a trial that is not a JSON object"),
        (json.dumps({"spec": RETRIEVAL_SPEC, "trials": [{"mode": "dense"}]}), "a field 'support' is missing"),
        (json.dumps({"spec": {"model": "tiny"}, "trials": []}), "a field 'dtype' is missing"),
        (
            json.dumps({"spec": RETRIEVAL_SPEC, "trials": [dict(TRIAL, correct="yes")]}),
            "does not hold what a report needs",
        ),
    ],
)
def test_a_malformed_retrieval_json_is_one_line_naming_it(tmp_path, capsys, content, message):
    path = tmp_path / "retrieval.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SparseDecodeError, match=message) as error:
        write_report(tmp_path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    err = one_line_exit_2(["report", str(tmp_path)], capsys)
    assert str(path) in err
    assert "rerun" not in err or "rerun `sparsedecode probe retrieval`" in err, "a command that exists"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["retrieval.json"], "nothing half-written"


@pytest.mark.parametrize(
    "spec_text, runs_text, message",
    [
        ("{broken", "", "sweep.json is not a valid sweep description"),
        ("[]", "", "sweep.json is not a valid sweep description \\(not a JSON object\\)"),
        ('{"sessions": []}', "", "sweep.json is not a valid sweep description \\(missing 'spec'\\)"),
        ('{"spec": {"model": "m", "supports": [50]}}', "", "sweep.json is not a valid sweep description \\(support 50"),
        ('{"spec": {"bogus": 1}}', "", "sweep.json is not a valid sweep description"),
        (None, "{not json\n", "runs.jsonl line 1 is not valid JSON"),
        (None, "[1, 2]\n", "runs.jsonl line 1 is not a JSON object"),
        (None, '{"context": 150}\n', "runs.jsonl run 1: a row of the old first_divergence convention lacks its token"),
        (None, '{"context": 150, "first_divergence_convention": 2}\n', "runs.jsonl does not hold what a report needs"),
    ],
)
def test_a_malformed_sweep_folder_is_one_line_naming_the_file(tmp_path, capsys, spec_text, runs_text, message):
    folder = sweep_folder(tmp_path / "s")
    if spec_text is not None:
        (folder / SPEC_FILE).write_text(spec_text)
    (folder / RUNS_FILE).write_text(runs_text)
    with pytest.raises(SparseDecodeError, match=message) as error:
        write_report(folder)
    assert "\n" not in str(error.value)
    one_line_exit_2(["report", str(folder)], capsys)
    assert sorted(p.name for p in folder.iterdir()) == [RUNS_FILE, SPEC_FILE], "nothing half-written"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"scale": 0.0}, "scale must be a positive finite number"),
        ({"scale": float("nan")}, "scale must be a positive finite number"),
        ({"scale": "0.25"}, "scale must be a positive finite number"),
        ({"layer": -1}, "layer must be an integer >= 0"),
        ({"layer": 1.0}, "layer must be an integer >= 0"),
    ],
)
def test_select_support_refuses_a_bad_scale_or_layer(kwargs, message):
    with pytest.raises(SparseDecodeError, match=message):
        select_support(torch.randn(4, 8), torch.randn(2, 300, 8), support=97, **kwargs)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(dense_layers=(5,)), "dense_layers names layer 5; the model has 2 attention layers"),
        (dict(layer_supports=((7, 129),)), "layer_supports names layer 7; the model has 2 attention layers"),
    ],
)
def test_a_layer_the_model_lacks_is_refused_before_the_prefill(model, fields, message):
    """Found by probing: generate refused a dense_layers or layer_supports entry naming a layer the model lacks only
    as its session opened, after the dense prefill, and compare after the whole dense reference."""
    cfg = SparseConfig(support=97, **fields)
    calls = (
        lambda: generate(model, prompt(150), cfg, 8, mode="sparse"),
        lambda: generate(model, prompt(150), cfg, 8),
        lambda: generate(model, [prompt(150), prompt(120)], cfg, 8, mode="sparse"),
        lambda: compare(model, None, prompt(150), cfg, 8),
    )
    for call in calls:
        with NoForward(model), pytest.raises(SparseDecodeError, match=message):
            call()
