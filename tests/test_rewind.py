"""Caches that ``crop`` cannot take back: sliding-window layers past their window, convolution and recurrent states.

Every paired comparison reuses the prefilled cache (dense reference, free-running, teacher-forced), and lossless
decoding drops rejected drafts; transformers' ``crop`` raises for these layers (or, for recurrent states, could not
restore them). The prefill's checkpoint and the lossless round's snapshot take them back instead. Oracles: the dense
reference equals transformers' own ``generate`` from scratch, a support covering the context reproduces dense
exactly, a batch equals its prompts alone, and lossless output equals dense output, rejections included.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import char_tokenizer, prompt, tiny_family
from transformers import DynamicCache

from sparsedecode import SparseConfig, compare, generate, sparse_decoding
from sparsedecode.cli import main
from sparsedecode.decoding.generate import compare_lossless
from sparsedecode.decoding.loop import prefill
from sparsedecode.errors import SparseDecodeError
from sparsedecode.experiments.bench import bench_e2e, bench_e2e_batch
from sparsedecode.session.kv_cache import checkpoint, crop_rewinds, rewind

HYBRIDS = {
    # a sliding-window layer (window 64, passed by the prompt) beside a full-attention layer
    "sliding": (
        "gemma3_text",
        dict(num_hidden_layers=2, sliding_window=64, layer_types=["sliding_attention", "full_attention"]),
    ),
    # short convolutions (LFM2) between full-attention layers
    "convolution": (
        "lfm2",
        dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"]),
    ),
    # gated delta-net layers with recurrent and convolution states (Qwen3-Next), then a full-attention layer
    "recurrent": ("qwen3_next", dict(num_hidden_layers=4)),
}


def hybrid(kind: str) -> torch.nn.Module:
    model_type, extra = HYBRIDS[kind]
    return tiny_family(model_type, **extra)


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def model(request):
    return hybrid(request.param)


def test_these_caches_are_not_plain(model):
    assert not crop_rewinds(DynamicCache(config=model.config))


def test_paired_comparison_reuses_the_prefill_exactly(model):
    ids = prompt(260)
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)[0, 260:].tolist()
    full = compare(model, None, ids, SparseConfig(support=385), 12)  # support >= context: dense by construction
    assert full.dense_tokens == expected
    assert full.sparse_tokens == expected and full.survives
    # the session's dense path sums in another order: 1e-3 percent points covers it (see test_families)
    assert full.teacher_forced_match == 100.0 and full.delta_ppl_percent == pytest.approx(0.0, abs=1e-3)
    sparse = compare(model, None, ids, SparseConfig(support=97), 12)
    assert sparse.dense_tokens == expected
    assert generate(model, ids, SparseConfig(support=97), 12, mode="sparse").tokens == sparse.sparse_tokens


def test_a_batch_equals_its_prompts_alone(model):
    prompts, cfg = [prompt(260, seed=3), prompt(230, seed=4)], SparseConfig(support=97)
    together = compare(model, None, prompts, cfg, 10)
    for ids, result in zip(prompts, together):
        alone = compare(model, None, ids, cfg, 10)
        assert result.dense_tokens == alone.dense_tokens and result.sparse_tokens == alone.sparse_tokens
        assert result.teacher_forced_match == pytest.approx(alone.teacher_forced_match, abs=1e-9)  # a share of tokens


def test_lossless_drops_rejected_drafts(model):
    checks = [
        compare_lossless(model, prompt(260, seed=s), SparseConfig(support=97), 16, draft_tokens=4) for s in (1, 5)
    ]
    assert all(check.equal for check in checks), [check.mismatches for check in checks]
    assert all(check.lossless.tokens == check.dense.tokens for check in checks)


def test_a_one_token_prefix_fed_again_is_dense():
    """A rejected round on these caches goes back to the round's start and feeds the accepted prefix again, densely
    as the verification did; a prefix of one token too (a one-token forward is otherwise a decode step). With a
    full-attention layer first, a sparse one would reach the cached keys of the layers after it."""
    model = tiny_family(
        "qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=48, max_window_layers=0,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip
    cfg = SparseConfig(support=97, window=32, block_size=8)
    checks = [compare_lossless(model, prompt(300, seed=s), cfg, 24, draft_tokens=3) for s in range(4)]
    assert any(a == 0 for check in checks for a in check.lossless.accepted)  # rejected at once: one token fed again
    assert all(check.equal for check in checks), [check.mismatches for check in checks]


def test_a_prefill_inside_a_session_is_dense_to_its_last_token():
    """``prefill`` is dense even inside a sparse session, a last chunk of one token too."""
    model = hybrid("sliding")
    ids = prompt(129)
    _, expected = prefill(model, ids, chunk=64)
    with sparse_decoding(model, SparseConfig(support=97, window=32, block_size=8)) as session:
        _, logits = prefill(model, ids, chunk=64)
    assert session.sparse_steps == 0  # the session's dense one-token forward is its exact short one: round-off apart
    assert torch.allclose(logits, expected, rtol=0, atol=1e-5)


def test_lossless_rejections_happen_somewhere():
    """The lossless test above would not exercise the snapshot's restore if every draft were accepted."""
    rejected = []
    for kind in HYBRIDS:
        for seed in (1, 5):
            check = compare_lossless(hybrid(kind), prompt(260, seed=seed), SparseConfig(support=97), 16, draft_tokens=4)
            rejected.append(any(a < k for a, k in zip(check.lossless.accepted, check.lossless.draft_lengths)))
    assert any(rejected)


def test_rewind_refuses_a_length_without_a_checkpoint(model):
    cache, _ = prefill(model, prompt(200))
    model(input_ids=prompt(8, seed=9), cache=cache, use_cache=True)
    with pytest.raises(SparseDecodeError, match="cannot take this cache back to 204 positions"):
        rewind(cache, 204)
    rewind(cache, 200)  # the prefill's checkpoint
    assert cache.get_seq_length() == 200
    checkpoint(cache)
    rewind(cache, 200)  # nothing to drop


def test_bench_e2e_on_hybrid_layers(model):
    rows = bench_e2e(model, "tiny", prompt(260), supports=(97,), tokens=6, lossless=(2,), repeats=1)
    assert [row.mode for row in rows] == ["dense", "dense", "sparse", "lossless"]
    assert rows[-1].tokens_equal_to_dense == 6  # lossless
    with pytest.raises(SparseDecodeError, match="cannot be stacked into a batch"):
        bench_e2e_batch(model, "tiny", [prompt(200, seed=s) for s in (1, 2)], (2,), tokens=4)


def test_cli_run_and_sweep_on_a_sliding_window_model(tmp_path, capsys):
    folder = tmp_path / "tiny-gemma3"
    hybrid("sliding").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    common = ["--model", str(folder), "--context", "300", "--support", "97", "--tokens", "8"]
    assert main(["run", *common, "--json", str(tmp_path / "run.json")]) == 0
    (row,) = json.loads((tmp_path / "run.json").read_text())["results"]
    assert row["settings"]["support"] == 97 and row["sparse_steps"] > 0
    assert main(["sweep", *common, "--prompts", "1", "--out", str(tmp_path / "sweep")]) == 0
    assert len((tmp_path / "sweep" / "runs.jsonl").read_text().splitlines()) == 1
    capsys.readouterr()


def test_a_sliding_layer_past_its_window_is_dense_over_it():
    """Past its window, a sliding-window layer's cache and mask hold the window alone: the layer is dense over it
    (docs/setup.md), as if named in ``dense_layers``, never a sparse step over the window's slots taken for
    positions. Oracle: ``dense_layers`` = the sliding layers; before the window the layer is sparse like any other."""
    model = tiny_family(
        "qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=40, max_window_layers=1,
    )  # fmt: skip
    assert model.config.layer_types[1:] == ["sliding_attention", "sliding_attention"]
    cfg = SparseConfig(support=25, window=8, block_size=4)
    oracle = SparseConfig(support=25, window=8, block_size=4, dense_layers=(1, 2))
    past, inside = prompt(60, seed=2), prompt(30, seed=3)
    tokens = 12
    expected = generate(model, past, oracle, tokens, mode="sparse").tokens
    assert generate(model, past, cfg, tokens, mode="sparse").tokens == expected
    for cache in ({}, {"cache_implementation": "static"}):
        with sparse_decoding(model, cfg) as session:
            out = model.generate(past, max_new_tokens=tokens, do_sample=False, **cache)[0, 60:].tolist()
        assert out == expected
        assert (session.sparse_steps, session.dense_steps) == (tokens - 1, 2 * (tokens - 1))
    # inside the window the sliding layers are sparse (its first 10 steps): not the dense-layers decoding
    with sparse_decoding(model, cfg) as session:
        model.generate(inside, max_new_tokens=tokens, do_sample=False)
    assert session.sparse_steps == (tokens - 1) + 2 * 10
    # a batch with one prompt past the window and one inside it: each as alone
    together = generate(model, [past, inside], cfg, tokens, mode="sparse")
    assert together[0].tokens == expected
    assert together[1].tokens == generate(model, inside, cfg, tokens, mode="sparse").tokens


UNTOLD_WINDOWS = {  # sliding layers whose attention call gets no sliding_window: their window is in the config only
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        use_sliding_window=True, sliding_window=40, max_window_layers=2,
    ),  # layer 0 slides (layer_types), layer 1 attends fully
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=40),  # every layer (no layer_types)
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(UNTOLD_WINDOWS))
def test_a_sliding_layer_not_told_its_window_is_dense_past_it(family):
    """Qwen2-MoE and PhiMoE give a sliding layer its window's mask and cache but pass no ``sliding_window`` to the
    attention function: past the window the session took the window's slots for a whole sequence (its oldest slot
    for the anchor) and took sparse steps over them, and H2O refused the layer. Found probing families with a window
    shorter than the context. The window now comes from the config as transformers' caches read it: dense past it,
    as Mistral's is. Oracle: ``dense_layers`` = the sliding layers (as in the test above)."""
    from sparsedecode.models.catalog import layer_types

    model = tiny_family(family, **UNTOLD_WINDOWS[family])
    sliding = tuple(i for i, kind in enumerate(layer_types(model.config)) if kind == "sliding_attention")
    assert sliding
    cfg, tokens, past = SparseConfig(support=25, window=8, block_size=4), 10, prompt(60, seed=2)
    expected = generate(model, past, SparseConfig(support=25, window=8, block_size=4, dense_layers=sliding), tokens,
                        mode="sparse").tokens  # fmt: skip
    with sparse_decoding(model, cfg) as session:
        out = model.generate(past, max_new_tokens=tokens, do_sample=False)[0, 60:].tolist()
    assert out == expected and generate(model, past, cfg, tokens, mode="sparse").tokens == expected
    full = model.config.num_hidden_layers - len(sliding)
    assert (session.sparse_steps, session.dense_steps) == (full * (tokens - 1), len(sliding) * (tokens - 1))
    h2o = compare(model, None, past, SparseConfig(support=25, window=8, block_size=4, selector="h2o"), 6)
    assert h2o.sparse_steps == full * 5


def test_h2o_lossless_inside_a_sliding_window_is_refused_before_any_forward():
    """Lossless rounds restore a copy of a sliding-window layer (``crop`` cannot take it back), whose H2O history the
    session cannot prove: ``generate(mode="lossless")`` with ``h2o`` on Mistral with a window of 160 and a prompt of
    100 stopped at its second round's first draft, naming an unseen forward, beam search or a padded batch (found
    probing sliding windows longer than the support). Refused before any forward, naming the layer; past the window,
    or with a block selector, lossless still equals dense."""
    from test_bad_input import NoForward

    model = tiny_family("mistral", sliding_window=160)
    h2o = SparseConfig(support=97, selector="h2o")
    with NoForward(model), pytest.raises(SparseDecodeError, match="sliding window of 160") as caught:
        generate(model, prompt(100), h2o, 20, mode="lossless")
    assert "\n" not in str(caught.value)
    assert len(generate(model, prompt(100), h2o, 20, mode="sparse").tokens) == 20
    assert compare_lossless(model, prompt(170), h2o, 8).equal  # past the window the layers are dense
    assert compare_lossless(model, prompt(100), SparseConfig(support=97), 20).equal


def test_lossless_refuses_a_model_with_bidirectional_attention():
    """Found by probing Gemma 3's use_bidirectional_attention: the verifying forward over the drafts lets each see the
    later ones, so lossless gave other tokens than dense (from the second on); refused before any forward."""
    from test_bad_input import NoForward

    model = tiny_family("gemma3_text", use_bidirectional_attention=True)
    ids, cfg = prompt(20), SparseConfig(support=97)
    with NoForward(model), pytest.raises(SparseDecodeError, match="bidirectional attention"):
        generate(model, ids, cfg, 12, mode="lossless")
    assert generate(model, ids, cfg, 4, mode="sparse").tokens == generate(model, ids, None, 4, mode="dense").tokens
