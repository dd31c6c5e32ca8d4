"""Lossless self-speculative decoding reproduces dense greedy decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import prompt, tiny_model

from sparsedecode import SparseConfig, SparseDecodeError
from sparsedecode.decoding.generate import compare_lossless, generate
from sparsedecode.protocol.paired import dense_reference


@pytest.mark.parametrize("support", [97, 193])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_lossless_equals_dense_greedy(arch, support, k):
    model = tiny_model(arch)
    ids = prompt(400)
    check = compare_lossless(model, ids, SparseConfig(support=support), 128, draft_tokens=k)
    assert check.mismatches == [] and check.equal
    assert len(check.lossless.tokens) == 128
    assert check.dense.tokens == dense_reference(model, ids, tokens=128).tokens, "dense mode is plain greedy"
    lossless = check.lossless
    assert lossless.verifications == len(lossless.accepted) and sum(lossless.draft_lengths) >= lossless.verifications
    assert 0 <= lossless.acceptance_rate <= 1


def test_sparse_mode_is_the_plain_sparse_decode():
    model = tiny_model("llama")
    ids = prompt(300)
    sparse = generate(model, ids, SparseConfig(support=97), 40, mode="sparse")
    dense = generate(model, ids, None, 40, mode="dense")
    lossless = generate(model, ids, SparseConfig(support=97), 40, draft_tokens=4, adaptive=True)
    assert sparse.tokens != dense.tokens, "S=97 of 340 positions must depart from dense on this model"
    assert lossless.tokens == dense.tokens
    assert lossless.mean_accepted < 4, "some drafts were rejected, so verification did real work"


def test_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(SparseDecodeError):
        generate(model, prompt(10), None, 5, mode="sparse")
    with pytest.raises(SparseDecodeError):
        generate(model, prompt(10), SparseConfig(), 5, mode="fast")
    with pytest.raises(SparseDecodeError):
        generate(model, prompt(10), SparseConfig(), 5, draft_tokens=0)


def test_lossless_under_inference_mode_drafts_as_under_no_grad():
    """Found by probing: under torch.inference_mode a view keeps no ``_base``, so a session could not prove a
    GrowingCache cropped after a verification unchanged: every round dropped each layer's state, and H2O, its history
    gone, refused to draft (a SparseDecodeError telling to run the prefill inside the session)."""
    model, ids = tiny_model("llama"), prompt(150, seed=3)
    cfg = SparseConfig(support=97, selector="h2o")
    expected = generate(model, ids, cfg, 30, draft_tokens=3)
    with torch.inference_mode():
        lossless = generate(model, ids, cfg, 30, draft_tokens=3)
    assert lossless.tokens == expected.tokens == generate(model, ids, None, 30, mode="dense").tokens
    assert lossless.accepted == expected.accepted


def test_lossless_decode_stops_at_an_end_token_that_is_the_first():
    """``lossless_decode`` (what ``bench e2e`` calls) drafted past an ``eos_token_id`` that was the prefill's token and
    stopped at its next occurrence: only ``generate`` checked the first token. Found by probing lossless stops."""
    from sparsedecode.decoding.generate import lossless_decode
    from sparsedecode.decoding.loop import prefill
    from sparsedecode.session.kv_cache import GrowingCache

    model, ids = tiny_model("llama"), prompt(150)
    cache, logits = prefill(model, ids, cache=GrowingCache(config=model.config))
    first = int(logits.argmax())
    stopped = lossless_decode(model, cache, 150, first, SparseConfig(support=97), 10, eos_token_id=first)
    assert stopped.tokens == [first] and stopped.verifications == 0
