"""The sparse attention step on tiny Llama/Qwen2 models: exactness oracles and session behaviour."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import attention_tolerance, logits_tolerance, prompt, tiny_model
from transformers import DynamicCache

import sparsedecode.session as attention
from sparsedecode import SparseConfig, select_support, sparse_decoding
from sparsedecode.session.kv_cache import crop_cache


def greedy_loop(model, ids, steps, cache=None):
    """Manual greedy decoding over a DynamicCache; returns tokens and per-step logits."""
    cache = cache if cache is not None else DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1]
        tokens, all_logits = [], []
        for _ in range(steps):
            token = int(logits.argmax())
            tokens.append(token)
            logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
            all_logits.append(logits)
    return tokens, torch.stack(all_logits)


class Oracle:
    """Checks every sparse step against float64 attention over the selected positions, and the selection itself:
    at a refresh step (steps 1, 1 + R, ... of a chain of sparse steps) it equals a fresh selection from the keys
    alone; between refreshes it equals the last refresh's (blocks, or distant positions for token selectors).

    ``max_error`` is the largest absolute difference from float64; ``max_error_ratio`` the largest difference as a
    share of that step's :func:`conftest.attention_tolerance` (float32 round-off): below 1 when the step is exact."""

    def __init__(self, cfg: SparseConfig):
        self.cfg, self.steps, self.max_error, self.max_error_ratio, self.blocks = cfg, 0, 0.0, 0.0, []
        self.last: dict[int, torch.Tensor] = {}
        self.refreshes = self.changed = 0

    def __call__(self, view) -> None:
        n = view.layout.n
        keys, values = view.keys[:, :n], view.values[:, :n]
        kept = select_support(
            view.query,
            keys,
            support=self.cfg.support,
            window=self.cfg.window,
            block_size=self.cfg.block_size,
            method=self.cfg.selector,
            scale=view.scaling,
            layer=view.layer,
        )
        group = view.query.shape[0] // keys.shape[0]
        refresh = (view.step - 1) % self.cfg.reuse == 0
        chosen = view.blocks if view.blocks is not None else view.index[:, 1 : 1 + self.cfg.distant_positions]
        if refresh:
            previous = self.last.get(view.layer)
            self.changed += previous is not None and not torch.equal(previous, chosen)
            self.last[view.layer], self.refreshes = chosen.clone(), self.refreshes + 1
        else:
            assert torch.equal(chosen, self.last[view.layer]), "between refreshes the last refresh's selection"
        rows = view.index.shape[0]  # a support per KV head, or per query head (each then reads KV head h // G)
        share = view.query.shape[0] // rows
        for h in range(rows):
            got = view.index[h][view.valid[h]]
            if refresh:
                assert torch.equal(got, kept[h]), "a refresh differs from a fresh selection"
            kv = h * share // group
            q = view.query[h * share : (h + 1) * share].double()
            k, v = keys[kv, got].double(), values[kv, got].double()
            expected = torch.softmax(q @ k.T * view.scaling, dim=-1) @ v
            error = (expected - view.output[h * share : (h + 1) * share].double()).abs().max()
            self.max_error = max(self.max_error, float(error))
            tolerance = attention_tolerance(q, k, v, view.scaling)
            self.max_error_ratio = max(self.max_error_ratio, float(error) / tolerance)
        self.blocks.append((view.layer, view.step, None if view.blocks is None else view.blocks.clone()))
        self.steps += 1


def test_full_support_reproduces_dense_exactly(arch):
    model = tiny_model(arch)
    ids = prompt(150)
    dense_tokens, dense_logits = greedy_loop(model, ids, 40)
    with sparse_decoding(model, SparseConfig(support=1 + 64 + 16 * 8)) as session:
        tokens, logits = greedy_loop(model, ids, 40)
    assert session.sparse_steps == 0 and session.dense_steps > 0
    assert tokens == dense_tokens
    assert torch.equal(logits, dense_logits)
    # the same through generate()
    reference = model.generate(ids, max_new_tokens=30, do_sample=False)
    with sparse_decoding(model, SparseConfig(support=1000)):
        assert torch.equal(model.generate(ids, max_new_tokens=30, do_sample=False), reference)


@pytest.mark.parametrize("reuse", [1, 3])
def test_sparse_step_matches_masked_dense_oracle(arch, reuse):
    model = tiny_model(arch)
    cfg = SparseConfig(support=97, reuse=reuse)
    oracle = Oracle(cfg)
    with sparse_decoding(model, cfg) as session:
        session.observers.append(oracle)
        tokens, logits = greedy_loop(model, prompt(180), 70)
    assert session.sparse_steps == oracle.steps == 70 * 2
    assert oracle.max_error_ratio < 1, oracle.max_error  # float32 round-off of float64 attention
    dense_tokens, dense_logits = greedy_loop(model, prompt(180), 70)
    # far more than round-off (conftest.logits_tolerance: ~3e-6 here): the selection itself moves the logits
    assert not torch.allclose(logits, dense_logits, atol=1e-4), "S=97 of 250 positions must change the logits"
    assert oracle.refreshes == 2 * len(range(0, 70, reuse)) and oracle.changed > 0, "selections move over time"
    assert all(s.centroids.computed == s.centroids.count for s in session.layers.values()), "each block once"


@pytest.mark.parametrize(
    "selector", ["oracle-blocks", "oracle-tokens", "block-top-p:p=0.5", "twilight", "random-blocks"]
)
def test_select_support_reproduces_a_session_whose_model_scales_otherwise(selector):
    """A model whose attention scales by other than 1/sqrt(d) (Gemma 3's query_pre_attn_scalar, Granite's
    multiplier): `select_support` with the module's `scaling` (and the layer, which random-blocks salts its draws
    with) chooses what the session chose at every refresh."""
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.6  # 1/sqrt(16) = 0.25: a flatter or sharper softmax reorders block masses
    cfg = SparseConfig(support=97, selector=selector)
    oracle = Oracle(cfg)
    with sparse_decoding(model, cfg) as session:
        session.observers.append(oracle)
        greedy_loop(model, prompt(300), 12)
    assert oracle.steps == session.sparse_steps == 12 * 2 and oracle.max_error_ratio < 1


def test_centroid_cache_survives_new_prompts_and_crops(arch):
    model = tiny_model(arch)
    cfg = SparseConfig(support=97)
    oracle = Oracle(cfg)
    with sparse_decoding(model, cfg) as session:
        session.observers.append(oracle)
        cache = DynamicCache(config=model.config)
        greedy_loop(model, prompt(200, seed=1), 20, cache=cache)
        crop_cache(cache, 170)  # roll back past several completed blocks, then continue differently
        with torch.no_grad():
            for token in range(30):
                model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        greedy_loop(model, prompt(260, seed=2), 20)  # a new generation in the same session
    assert oracle.steps == (20 + 30 + 20) * 2
    assert oracle.max_error_ratio < 1, oracle.max_error  # float32 round-off of float64 attention
    assert any(s.centroids.computed > s.centroids.count for s in session.layers.values()), "blocks were recomputed"


def test_memory_overhead_is_about_one_block_fraction():
    model = tiny_model("llama")
    with sparse_decoding(model, SparseConfig(support=97)) as session:
        cache = DynamicCache(config=model.config)
        greedy_loop(model, prompt(600), 4, cache=cache)
    key_bytes = sum(layer.keys.nelement() * layer.keys.element_size() for layer in cache.layers)
    # centroids (d floats) per block, capacity rounded up to a power-of-two growth
    assert 0 < session.centroid_bytes() <= 2 * key_bytes * (16 + 1) / (16 * 16)


def test_model_is_restored_even_after_an_error():
    model = tiny_model("qwen2")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), sparse_decoding(model, SparseConfig(support=97)):
        assert model.config._attn_implementation == attention.ATTENTION_NAME
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_sessions_are_per_model_and_per_thread():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=5)
    ids = prompt(200)
    dense_a, _ = greedy_loop(a, ids, 8)
    dense_b, dense_b_logits = greedy_loop(b, ids, 8)
    seen = {}
    with (
        sparse_decoding(a, SparseConfig(support=97)) as session,
        sparse_decoding(b, SparseConfig(support=1000)),
    ):
        thread = threading.Thread(target=lambda: seen.update(a=greedy_loop(a, ids, 8)[0]))
        thread.start()
        thread.join()
        _, logits_b = greedy_loop(b, ids, 8)
        greedy_loop(a, ids, 8)
    assert seen["a"] == dense_a, "another thread sees no session: dense"
    assert torch.equal(logits_b, dense_b_logits), "b's session has full support: dense"
    assert session.sparse_steps == 8 * 2, "only this thread's steps of model a ran sparse"


def test_sparse_path_never_computes_dense_attention(monkeypatch):
    model = tiny_model("llama")
    calls = []
    original = attention.hf.sdpa_attention_forward

    def counting(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(attention.hf, "sdpa_attention_forward", counting)  # every module that calls it
    monkeypatch.setattr(attention.forward, "sdpa_attention_forward", counting)
    with sparse_decoding(model, SparseConfig(support=97)) as session:
        greedy_loop(model, prompt(200), 10)
    assert session.sparse_steps == 20
    assert calls and all(q_len > 1 for q_len in calls), "only the prefill went through dense SDPA"


def test_short_multi_token_forward_in_a_session_is_exact_dense(arch):
    """Verification-sized forwards inside a session skip repeat_kv but compute the same causal attention."""
    model = tiny_model(arch)
    ids = prompt(200)
    chunk = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        expected = model(input_ids=chunk, cache=cache, use_cache=True).logits
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        with sparse_decoding(model, SparseConfig(support=97)):
            got = model(input_ids=chunk, cache=cache, use_cache=True).logits
    # the same attention without repeat_kv: its sums may run in another order, so float32 round-off apart
    assert torch.allclose(got, expected, atol=logits_tolerance(expected, model, positions=205), rtol=0)
