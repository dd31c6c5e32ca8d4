"""Models whose attention has what a sparse session leaves out are refused, not decoded wrongly.

Attention sinks (gpt-oss passes ``s_aux``) and logit soft-capping (Gemma 2 passes ``softcap``) change every
softmax; the session's dense forwards (SDPA) and its sparse steps compute neither. Before this refusal a tiny
gpt-oss gave other prefill logits inside a session than outside it (max |diff| 0.25), with no error.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL, char_tokenizer, prompt, tiny_model
from test_bad_input import NoForward, one_line_exit_2
from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

import sparsedecode.session as attention
from sparsedecode import SparseConfig, compare, generate, sparse_decoding
from sparsedecode.errors import SparseDecodeError
from sparsedecode.models import catalog as models
from sparsedecode.validate import unsupported_attention


def gpt_oss():
    torch.manual_seed(0)
    config = GptOssConfig(
        **SMALL,
        num_hidden_layers=2,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=128,
        layer_types=["full_attention"] * 2,
    )
    model = GptOssForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_(std=2.0)  # sinks that matter
    return model


def gemma2():
    torch.manual_seed(0)
    return (
        Gemma2ForCausalLM(Gemma2Config(**SMALL, num_hidden_layers=2, sliding_window=4096)).eval().requires_grad_(False)
    )


MODELS = {"sinks": (gpt_oss, "attention sinks"), "softcap": (gemma2, "soft-capping")}


@pytest.mark.parametrize("kind", MODELS)
def test_entry_points_refuse_before_any_forward(kind):
    build, words = MODELS[kind]
    model = build()
    assert words.split()[-1] in unsupported_attention(model)
    ids, cfg = prompt(200), SparseConfig(support=97)
    with NoForward(model):  # refused before any forward
        with pytest.raises(SparseDecodeError, match=words):
            with sparse_decoding(model, cfg):
                pass
        with pytest.raises(SparseDecodeError, match=words):
            compare(model, None, ids, cfg, 4)
        with pytest.raises(SparseDecodeError, match=words):
            compare(model, None, [ids, prompt(180, seed=2)], cfg, 4)
        for mode in ("sparse", "lossless"):
            with pytest.raises(SparseDecodeError, match=words):
                generate(model, ids, cfg, 4, mode=mode)
    assert model.config._attn_implementation != attention.ATTENTION_NAME  # the model is left as it was
    dense = generate(model, ids, None, 3, mode="dense")  # dense decoding stays available
    assert len(dense.tokens) == 3


@pytest.mark.parametrize("kind", MODELS)
def test_the_probes_refuse_before_their_prefill(kind):
    """The mass probe and a retrieval trial prefilled (a whole context, dense) before the session refused the model."""
    from sparsedecode.experiments.probes import mass_probe
    from sparsedecode.experiments.retrieval import PasskeyPrompt, run_trial

    build, words = MODELS[kind]
    model, ids, cfg = build(), prompt(200), SparseConfig(support=97)
    passkey = PasskeyPrompt(
        ids, "12345", question_start=190, needle_start=50, needle_end=55, depth=0.3, needle_depth=0.3
    )
    with NoForward(model):
        with pytest.raises(SparseDecodeError, match=f"mass_probe: .*{words}"):
            mass_probe(model, ids, cfg, tokens=4)
        with pytest.raises(SparseDecodeError, match=f"retrieval: .*{words}"):
            run_trial(model, char_tokenizer(), passkey, [cfg], trial=0)


@pytest.mark.parametrize("kind", MODELS)
def test_the_attention_call_refuses_what_the_model_check_misses(kind, monkeypatch):
    """The forward's own ``s_aux`` / ``softcap`` arguments are refused at the first call, the prefill's."""
    build, words = MODELS[kind]
    model = build()
    monkeypatch.setattr(attention.hf, "check_sparse_attention", lambda *_: None)
    with pytest.raises(SparseDecodeError, match=words):
        with sparse_decoding(model, SparseConfig(support=97)):
            model(prompt(120))


@pytest.mark.parametrize("argument", sorted(attention.UNSUPPORTED_ARGUMENTS))
def test_every_argument_that_changes_attention_is_refused(argument):
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 150, 16)
    with sparse_decoding(model, SparseConfig(support=97)):
        with pytest.raises(SparseDecodeError, match=f"{argument} in the attention call"):
            attention.sparse_attention_forward(module, q, k, k, None, **{argument: torch.zeros(1)})
        out, _ = attention.sparse_attention_forward(module, q, k, k, None, **{argument: None})  # None: not passed
    assert out.shape == (1, 1, 4, 16)


@pytest.mark.parametrize("kind", MODELS)
def test_compiled_decoding_refuses_them_dense_too(kind, monkeypatch):
    """A compiled decoder's dense step is SDPA over the static cache: it would leave them out as the sparse step
    would. Refused before any forward, in every mode; the attention call refuses the arguments themselves (a decoder
    adopting a cache prefilled elsewhere runs no prefill that would fail first)."""
    from sparsedecode.compiled import decoder as compiled
    from sparsedecode.compiled.op import static_attention_forward

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    build, words = MODELS[kind]
    model = build()
    with NoForward(model):
        for cfg, mode in ((None, "dense"), (SparseConfig(support=97), "sparse")):
            with pytest.raises(SparseDecodeError, match=words) as caught:
                generate(model, prompt(100), cfg, 4, mode=mode, compile=True)
            assert "\n" not in str(caught.value) and (mode == "sparse" or "compiled step" in str(caught.value))
    module = tiny_model("llama").model.layers[0].self_attn
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 150, 16)
    for argument in attention.UNSUPPORTED_ARGUMENTS:
        with pytest.raises(SparseDecodeError, match=f"{argument} in the attention call"):
            static_attention_forward(module, q, k, k, None, position_ids=torch.tensor([[149]]), **{argument: 1.0})


def test_models_without_them_are_accepted():
    assert unsupported_attention(tiny_model("llama")) is None
    assert unsupported_attention(tiny_model("qwen2")) is None


def test_cli_refuses_a_soft_capping_model_in_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """What the loader hands over is checked before any work. (From a folder, ``load_model`` asks for SDPA, which
    transformers already refuses for these two architectures; the check serves models that load but carry them.)"""
    model = gemma2()
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, char_tokenizer()))
    out = tmp_path / "never.json"
    with NoForward(model):
        args = ["run", "--model", "tiny-gemma2", "--context", "150", "--tokens", "4", "--json", str(out)]
        err = one_line_exit_2(args, capsys)
        assert "soft-capping" in err and not out.exists()
        folder = tmp_path / "eval"
        args = ["eval", "--model", "tiny-gemma2", "--tasks", "vt", "--context", "600", "--samples", "1"]
        err = one_line_exit_2([*args, "--out", str(folder)], capsys)
        assert "soft-capping" in err and not folder.exists()


def falcon_alibi():
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(0)
    config = FalconConfig(
        vocab_size=96, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, alibi=True, multi_query=True,
        new_decoder_architecture=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return FalconForCausalLM(config).eval().requires_grad_(False)


def test_alibi_is_refused_from_the_config_and_from_the_mask():
    """Falcon with ALiBi puts its bias into a float attention mask: the session's short dense forward and the sparse
    step left it out (lossless tokens differed from dense; the compiled decoder failed with a traceback)."""
    model = falcon_alibi()
    ids, cfg = prompt(230), SparseConfig(support=97, window=32, block_size=8)
    with pytest.raises(SparseDecodeError, match="ALiBi"):
        generate(model, ids, cfg, 6, mode="lossless")
    with pytest.raises(SparseDecodeError, match="ALiBi"):
        generate(model, ids, None, 4, mode="dense", compile=True)
    # the attention call's own check, for a model whose config does not say: a float mask holding a bias
    from sparsedecode.session.hf import _biased

    mask = torch.zeros(1, 1, 2, 5)
    assert not _biased(mask) and not _biased(mask.masked_fill(torch.ones(1, 1, 2, 5, dtype=torch.bool), -torch.inf))
    assert _biased(mask - torch.arange(5.0))  # a finite slope over the keys: ALiBi's bias
    assert not _biased(torch.ones(1, 1, 2, 5, dtype=torch.bool))
    assert not _biased(torch.full((1, 1, 2, 5), torch.finfo(torch.float32).min))


def test_a_model_with_a_cache_of_its_own_kind_is_refused_in_one_line():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "minimax", **SMALL, num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with pytest.raises(SparseDecodeError, match="keeps a cache of its own kind"):
        generate(model, prompt(120), None, 4, mode="dense")


def test_a_module_holding_layer_idx_none_is_no_attention_layer():
    """HunYuan's MLP holds ``layer_idx=None`` and a config: it was taken for an attention layer (int(None))."""
    from conftest import tiny_family

    from sparsedecode.validate import attention_modules

    model = tiny_family("hunyuan_v1_dense")
    assert len(attention_modules(model)) == model.config.num_hidden_layers
    with sparse_decoding(model, SparseConfig(support=97)):
        pass


def test_a_short_forward_in_a_session_returns_what_sdpa_does():
    """The session's exact short forward returned a transposed view; JetMoe calls ``.view()`` on the output."""
    from sparsedecode.kernels.reference import dense_short_forward

    query, key, value = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    assert dense_short_forward(query, key, value, 10, None).is_contiguous()


SHARED_BLOCKS = {
    # one attention module run at two depths, told its layer by its caller, holding layer_idx -1
    "zamba2": dict(
        num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=16,
        mamba_headdim=16, n_mamba_heads=8, num_mem_blocks=1, use_shared_attention_adapter=False,
        hybrid_layer_ids=[1, 3],
    ),
    # tied blocks holding layer_idx None: the session hooked none of them and decoded densely, saying nothing
    "zamba": dict(num_hidden_layers=5, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=16, n_mamba_heads=2),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(SHARED_BLOCKS))
def test_an_attention_block_shared_across_layers_is_refused_before_any_forward(family):
    """Zamba 2's shared block kept one state for both its depths, found in the cache at layer -1 (the last): at 6
    of 14 sparse steps of a tiny one the blocks read were not the top blocks of the step's own keys."""
    from conftest import tiny_family

    model = tiny_family(family, **SHARED_BLOCKS[family])
    ids, cfg = prompt(200), SparseConfig(support=97)
    with NoForward(model):
        for call in (
            lambda: sparse_decoding(model, cfg).__enter__(),
            lambda: generate(model, ids, cfg, 4, mode="sparse"),
            lambda: compare(model, None, ids, cfg, 4),
        ):
            with pytest.raises(SparseDecodeError, match="shared across layers") as caught:
                call()
            assert "\n" not in str(caught.value)


def test_attention_dropout_in_training_mode_is_refused_not_left_out():
    """A model in training mode with ``attention_dropout > 0`` passes that dropout to its attention call: SDPA applies
    it, but a session's sparse steps and short forwards did not, silently (two decode steps of the same cache gave
    equal logits in a session and a short prefill was deterministic in it while random outside). Refused in one line
    at the first forward of the session; in eval mode, and outside the session, nothing changes."""
    model = tiny_model("llama", attention_dropout=0.5)
    ids = prompt(60)
    model.train()
    with sparse_decoding(model, SparseConfig(support=33, window=8, block_size=8)):
        with pytest.raises(SparseDecodeError, match=r"attention dropout.*model\.eval\(\)") as refused:
            model(ids)
    assert "\n" not in str(refused.value)
    model(ids)  # outside the session: transformers' own dropout
    model.eval()
    with sparse_decoding(model, SparseConfig(support=33, window=8, block_size=8)):
        inside = model(ids).logits
    torch.testing.assert_close(inside, model(ids).logits)


def test_a_copy_made_inside_a_session_is_named_as_such_when_compiled():
    """A deep copy of a model made while a session is open keeps the session's attention switch (the copy is not the
    session's model, so nothing switches it back): compiling it is refused naming that cause and the way out, not as
    "inside a sparse_decoding session"; once its attention is put back it compiles."""
    import copy

    from sparsedecode.compiled import decoder as compiled

    model = tiny_model("llama")
    with sparse_decoding(model, SparseConfig(support=97)):
        twin = copy.deepcopy(model)
    assert twin.config._attn_implementation == "sparsedecode" and model.config._attn_implementation == "sdpa"
    with pytest.raises(SparseDecodeError, match=r"no session holds it \(a copy made inside a session") as caught:
        compiled.check_compilable(twin, SparseConfig(support=97), "generate")
    assert "\n" not in str(caught.value)
    twin.set_attn_implementation("sdpa")
    compiled.check_compilable(twin, SparseConfig(support=97), "generate")
