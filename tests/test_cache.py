"""GrowingCache: in-place appends give exactly what DynamicCache gives, through crops and sparse decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import prompt, tiny_model
from transformers import DynamicCache

from sparsedecode import SparseConfig, sparse_decoding
from sparsedecode.session.kv_cache import GrowingCache, GrowingLayer, crop_cache


def trace(model, cache, steps=120, crop_at=40, crop_to=330):
    logits = []
    with torch.no_grad():
        out = model(input_ids=prompt(300), cache=cache, use_cache=True).logits[0, -1]
        for step in range(steps):
            logits.append(out)
            out = model(input_ids=out.argmax().view(1, 1), cache=cache, use_cache=True).logits[0, -1]
            if step == crop_at:
                crop_cache(cache, crop_to)
    return torch.stack(logits)


@pytest.mark.parametrize("support", [None, 97])
def test_growing_cache_matches_dynamic_cache(arch, support):
    model = tiny_model(arch)
    if support is None:
        dense, growing = (
            trace(model, DynamicCache(config=model.config)),
            trace(model, GrowingCache(config=model.config)),
        )
    else:
        with sparse_decoding(model, SparseConfig(support=support)):
            dense = trace(model, DynamicCache(config=model.config))
            growing = trace(model, GrowingCache(config=model.config))
    assert torch.equal(dense, growing)


def test_growing_layer_appends_in_place():
    model = tiny_model("llama")
    cache = GrowingCache(config=model.config)
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    with torch.no_grad():
        model(input_ids=prompt(10), cache=cache, use_cache=True)
        buffer = cache.layers[0]._keys_buffer
        for token in range(50):
            model(input_ids=torch.tensor([[token + 1]]), cache=cache, use_cache=True)
    assert cache.layers[0]._keys_buffer is buffer, "no reallocation below the initial capacity"
    assert cache.get_seq_length() == 60
    assert cache.layers[0].keys.data_ptr() == buffer.data_ptr()
