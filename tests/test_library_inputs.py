"""Unusual inputs to the library's entry points (found by probing): one line naming the problem, never a bare error
from deep inside, never read as something else."""

from __future__ import annotations

import pytest
import torch

import sparsedecode as sd


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: sd.SparseConfig(dense_layers="²"), "comma-separated list"),  # "²".isdigit() is true
        (lambda: sd.SparseConfig(layer_supports={"²": 385}), "a layer is an integer"),
        (lambda: sd.SparseConfig(dense_layers=b"0"), "give layer indices"),  # iterated: layer 48
        (lambda: sd.SparseConfig(layer_supports=["12"]), r"pairs, got \('12',\)"),  # read as layer 1, support '2'
        (lambda: sd.select_support(torch.randn(4, 16, device="meta"), torch.randn(2, 300, 16), support=97), "meta"),
        (lambda: sd.select_support(torch.randn(4, 0), torch.randn(2, 300, 0), support=97), "none of them 0"),
        (
            lambda: sd.select_support(torch.randn(0, 16), torch.randn(2, 300, 16), support=97, method="streaming"),
            "none of them 0",
        ),  # fmt: skip
        (lambda: sd.select_support(torch.randn(4, 16).to_sparse(), torch.randn(2, 300, 16), support=97), "dense one"),
    ],
)
def test_unusual_library_inputs_are_one_line(call, message):
    """Found by probing: each of these raised a bare ValueError, RuntimeError or ZeroDivisionError, or was read as
    something else (b"0" as layer 48, no query heads as supports for two KV heads)."""
    with pytest.raises(sd.SparseDecodeError, match=message):
        call()


def test_a_hook_that_is_not_callable_is_refused_before_the_prefill():
    from conftest import prompt, tiny_model

    model, ids = tiny_model("llama"), prompt(120)
    with pytest.raises(sd.SparseDecodeError, match="progress must be callable"):
        sd.generate(model, ids, sd.SparseConfig(support=97), 4, progress=5)
    with pytest.raises(sd.SparseDecodeError, match="session_hook must be callable"):
        sd.compare(model, None, ids, sd.SparseConfig(support=97), 3, session_hook=5)


def test_a_reference_is_used_only_for_what_computed_it():
    """Found by probing: one prompt's part of a batch's reference crashed ``compare`` with a bare RuntimeError and
    cut the batch's cache to that prompt's length (later batch results wrong, no error); a reference of another
    model was scored against silently."""
    from conftest import prompt, tiny_model

    model, cfg = tiny_model("llama"), sd.SparseConfig(support=97)
    long, short = prompt(160, seed=1), prompt(130, seed=2)
    batch = sd.dense_reference(model, [long, short], tokens=6)
    before = sd.compare(model, None, [long, short], cfg, 6, reference=batch)
    with pytest.raises(sd.SparseDecodeError, match="part of a BatchReference"):
        sd.compare(model, None, short, cfg, 6, reference=batch.references[1])
    after = sd.compare(model, None, [long, short], cfg, 6, reference=batch)  # the batch's cache left whole
    assert [r.sparse_tokens for r in after] == [r.sparse_tokens for r in before]
    alone = sd.dense_reference(model, short, tokens=6)
    other = tiny_model("llama", seed=7)
    with pytest.raises(sd.SparseDecodeError, match="computed by another model"):
        sd.compare(other, None, short, cfg, 6, reference=alone)
    with pytest.raises(sd.SparseDecodeError, match="computed by another model"):
        sd.compare(other, None, [long, short], cfg, 6, reference=batch)
    model.to(torch.bfloat16)
    with pytest.raises(sd.SparseDecodeError, match="in another dtype"):
        sd.compare(model, None, short, cfg, 6, reference=alone)


@pytest.mark.parametrize("block_size", [2**31 + 1, 2**62, 10**30])
def test_a_block_size_past_any_cache_is_refused_in_one_line(block_size):
    """Found probing huge values: ``SparseConfig(support=33, window=8, block_size=10**30)`` was accepted (``b = 0``),
    then every sparse step on the torch path failed deep inside with a multi-line TypeError ("Overflow when unpacking
    long long") or RuntimeError ("Stride calculation overflowed" at 2**62), and the C kernel was handed the size
    truncated to 64 bits; ``select_support`` raised a bare OverflowError."""
    with pytest.raises(sd.SparseDecodeError, match="block_size must be at most") as refused:
        sd.SparseConfig(support=33, window=8, block_size=block_size)
    assert "\n" not in str(refused.value)
    with pytest.raises(sd.SparseDecodeError, match="block_size must be at most"):
        sd.select_support(torch.randn(4, 16), torch.randn(2, 300, 16), support=33, window=8, block_size=block_size)
    assert sd.SparseConfig(support=33, window=8, block_size=2**31).blocks == 0


@pytest.mark.parametrize(
    "cfg",
    [
        sd.SparseConfig(),
        sd.SparseConfig(support=193, selector="quest", reuse=2, dense_layers=(0,), layer_supports={1: 385}),
        sd.SparseConfig(support=97, selector="twilight:p=0.5;base=mean-pooled", audit=True, kernel="torch"),
        sd.SparseConfig(support=120, window=9, block_size=5, selector="sparq:rank=4", seed=3),
    ],
)
def test_a_configs_record_reads_back_as_the_configuration(cfg):
    """``SparseConfig.from_dict`` of ``to_dict()`` (a result's ``settings``, through JSON) is the configuration it
    recorded: ``SparseConfig(**to_dict())`` fails on the entries that follow from the fields (a bare TypeError)."""
    import json

    assert sd.SparseConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(sd.SparseDecodeError, match="unknown SparseConfig field.*bogus"):
        sd.SparseConfig.from_dict({**cfg.to_dict(), "bogus": 1})
