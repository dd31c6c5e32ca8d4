"""Sparse decoding on tiny random models of many transformers families, beyond the Llama and Qwen2 of conftest.

Per family: the paired comparison's dense reference equals transformers' own ``generate`` from scratch, a support
covering the context reproduces it exactly (tokens and perplexity), a small support really takes sparse steps (whose
omitted-mass identity the audit checks), and lossless decoding equals dense. The families differ in what the
attention call sees: biases, partial rotary embeddings, QK norms, MoE blocks, multi-head latent attention (key and
value head dims differ), GPT-2's fused projections. Sliding-window and recurrent layers have their own tests
(test_rewind.py); families whose attention the session cannot compute are refused (test_unsupported_attention.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import prompt, tiny_family

from sparsedecode import SparseConfig, compare
from sparsedecode.decoding.generate import compare_lossless
from sparsedecode.errors import SparseDecodeError

FAMILIES = {
    "mistral": {},
    "qwen3": {},  # QK norms
    "phi3": {},  # fused QKV projection
    "olmo2": {},
    "cohere": {},  # parallel attention and MLP
    "granite": {},  # attention multiplier as its scaling
    "gpt_neox": {},  # partial rotary embeddings
    "starcoder2": {},  # biases
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "opt": {},  # learned positions
    # a Mamba layer, then attention; counts each forward's positions from 0 unless given them (as generate does)
    "bamba": {"attn_layer_indices": [1], "mamba_d_state": 16, "mamba_n_heads": 4, "mamba_d_head": 32},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 1024},
    "gptj": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 1024, "rotary_dim": 16},
    "gemma3n_text": {  # its last 2 layers read the cache of earlier ones: DummyLayer cache entries, with no length
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "sliding_window": 512,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "laurel_rank": 8,
        "altup_num_inputs": 2,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 96,
        "activation_sparsity_pattern": [0.0] * 4,
        "intermediate_size": [128] * 4,
    },
    "deepseek_v3": {  # multi-head latent attention: keys of 24 dims, values of 16
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "head_dim": 8,  # the rotary part (its config sets it so)
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 32,
    },
}


def family_model(name: str) -> torch.nn.Module:
    return tiny_family(name, **FAMILIES[name])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_sparse_decoding_on_the_family(name):
    model = family_model(name)
    ids = prompt(260)
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)[0, 260:].tolist()
    full = compare(model, None, ids, SparseConfig(support=385), 12)  # support >= context: dense by construction
    assert full.dense_tokens == expected and full.sparse_tokens == expected
    # dense attention through the session sums in another order: NLLs move by twice the logits' round-off (~3e-7
    # seen, 2.6e-6 by conftest.logits_tolerance) and the percent change by 400 times it: 1e-3 covers the bound
    assert full.teacher_forced_match == 100.0 and full.delta_ppl_percent == pytest.approx(0.0, abs=1e-3)
    sparse = compare(model, None, ids, SparseConfig(support=97, audit=True), 12)
    assert sparse.sparse_steps > 0 and sparse.dense_tokens == expected
    assert 0.0 <= sparse.teacher_forced_match <= 100.0 and math.isfinite(sparse.delta_ppl_percent)
    # the identity o_sparse - o_dense = eps (o_kept - o_omitted) and its bound hold at every audited step
    assert sparse.audit["audited_steps"] > 0
    # (float32 round-off of the output relative to its size, as in test_diagnostics)
    assert sparse.audit["identity_residual_max"] <= 1e-5 and sparse.audit["bound_violations"] == 0
    check = compare_lossless(model, ids, SparseConfig(support=97), 12, draft_tokens=4)
    assert check.equal and check.lossless.tokens == expected


def test_h2o_says_why_latent_attention_keeps_no_history():
    model = family_model("deepseek_v3")
    with pytest.raises(SparseDecodeError, match="rebuilt from its cache at every step"):
        compare(model, None, prompt(260), SparseConfig(support=97, selector="h2o"), 6)
    assert compare(model, None, prompt(260), SparseConfig(support=97, selector="quest"), 6).sparse_steps > 0


def test_h2o_says_why_a_kv_shared_layer_keeps_no_history():
    """Gemma 3n's last layers read earlier layers' caches (a placeholder with no length in their own place): H2O's
    history of their own cached positions cannot be adopted, refused in one line (it was an AttributeError from
    inside transformers); a block selector decodes them."""
    model = family_model("gemma3n_text")
    with pytest.raises(SparseDecodeError, match="reads another layer's cache") as caught:
        compare(model, None, prompt(260), SparseConfig(support=97, selector="h2o"), 6)
    assert "\n" not in str(caught.value)
    assert compare(model, None, prompt(260), SparseConfig(support=97, selector="quest"), 6).sparse_steps > 0


def test_layers_with_different_kv_heads_are_compared():
    """Gemma 4 with ``attention_k_eq_v`` gives its full-attention layers one KV head of 32 dims where its sliding
    layers have two of 16: ``compare`` failed with a traceback from ``torch.stack`` counting the distinct positions
    each KV head read (found probing families whose head dims differ). They are counted over every layer's heads."""
    model = tiny_family(
        "gemma4_text", sliding_window=512, layer_types=["sliding_attention", "full_attention"], global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=96,
    )  # fmt: skip
    heads = [layer.self_attn.k_proj.out_features // layer.self_attn.head_dim for layer in model.model.layers]
    assert heads == [2, 1]
    ids = prompt(260)
    expected = model.generate(ids, max_new_tokens=8, do_sample=False)[0, 260:].tolist()
    full = compare(model, None, ids, SparseConfig(support=385), 8)
    assert full.sparse_tokens == expected and full.teacher_forced_match == 100.0
    # dense steps read every distant position of the last step's context, on every KV head of both layers
    assert full.mean_unique_distant_positions_per_kv == 260 + 8 - 1 - 64 - 1
    sparse = compare(model, None, ids, SparseConfig(support=97, audit=True), 8)
    assert sparse.sparse_steps > 0 and sparse.audit["identity_residual_max"] <= 1e-5
    assert 2 * 16 <= sparse.mean_unique_distant_positions_per_kv <= 260 + 8 - 64 - 1
