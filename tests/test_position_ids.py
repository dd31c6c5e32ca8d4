"""Position ids that are not the cache index (restarted, shifted: a packed or multimodal prompt, a user's own): on a
cache that grows, the context N a step lays out is the number of cached positions, so the window ends at the current
token and a support of at least N decodes exactly as dense."""

from __future__ import annotations

import torch
from conftest import prompt, tiny_model
from transformers import DynamicCache

from sparsedecode import SparseConfig, sparse_decoding
from sparsedecode.session.kv_cache import GrowingCache

P, STEPS = 150, 12


def test_restarted_position_ids_lay_out_the_cached_context():
    model = tiny_model("llama")
    ids = prompt(P, seed=3)
    positions = torch.cat([torch.arange(0, 60), torch.arange(0, P - 60)])[None]  # they restart after 60 tokens
    for cache in (DynamicCache(config=model.config), GrowingCache(config=model.config)):
        seen = []

        def observe(view, seen=seen):
            seen.append((view.layout.n, view.keys.shape[1], view.index))

        with sparse_decoding(model, SparseConfig(support=97)) as session:
            session.observers.append(observe)
            out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1)
            for k in range(STEPS):
                position = torch.tensor([[P - 60 + k]])
                out = model(input_ids=token[:, None], position_ids=position, cache=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1)
        assert session.sparse_steps == STEPS * model.config.num_hidden_layers and session.dense_steps == 0
        for n, cached, index in seen:  # the current token (position n - 1 of the cache) is in its own support
            assert n == cached and bool((index == n - 1).any())


def test_a_covering_support_with_shifted_position_ids_is_dense():
    model = tiny_model("qwen2")
    ids, positions = prompt(P, seed=3), torch.arange(10, 10 + P)[None]
    settings = dict(position_ids=positions, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    dense = model.generate(ids, **settings)
    with sparse_decoding(model, SparseConfig(support=1 + 64 + 16 * 6)) as session:  # 161 >= every N here
        sparse = model.generate(ids, **settings)
    assert torch.equal(sparse, dense) and session.sparse_steps == 0
