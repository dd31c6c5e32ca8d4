"""The library's paired protocol against an independent float64 mask-based implementation (tests/reference64.py).

The reference recomputes each decode row's support from DESIGN.md section 1 and masks dense float64 attention, so it
shares no code with the library's selection, centroid cache, gathers or kernels. The library runs in float32.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest
from conftest import prompt, tiny_model
from reference64 import paired_protocol

from sparsedecode import SparseConfig, compare

CASES = [
    # (prompt length, prompt seed, support, tokens): long prompts, a prompt that grows past S while decoding
    (300, 1, 97, 24),
    (260, 2, 129, 24),
    (400, 3, 193, 24),
    (90, 4, 97, 40),
]


def _check(model, ids, support: int, tokens: int) -> None:
    expected = paired_protocol(model, ids, support, tokens)
    result = compare(model, None, ids, SparseConfig(support=support), tokens)
    assert result.dense_tokens == expected.dense_tokens
    assert result.sparse_tokens == expected.sparse_tokens
    assert result.first_divergence == expected.first_divergence
    assert result.survives == expected.survives
    assert result.teacher_forced_match == pytest.approx(expected.teacher_forced_match, abs=1e-9)
    assert result.delta_ppl_percent == pytest.approx(expected.delta_ppl_percent, abs=0.05)


@pytest.mark.parametrize("length,seed,support,tokens", CASES)
def test_protocol_matches_float64_reference_on_tiny_models(arch, length, seed, support, tokens):
    model = tiny_model(arch, seed=seed)
    _check(model, prompt(length, seed=seed), support, tokens)


def test_reference_sees_divergence_somewhere():
    """The comparison above would be vacuous if nothing ever diverged: at least one case departs from dense."""
    outcomes = [
        paired_protocol(tiny_model(arch, seed=seed), prompt(length, seed=seed), support, tokens)
        for arch in ("llama", "qwen2")
        for length, seed, support, tokens in CASES[:2]
    ]
    assert any(not o.survives for o in outcomes)
    assert any(o.teacher_forced_match < 100 for o in outcomes)


@pytest.mark.realmodel
def test_protocol_matches_float64_reference_on_smollm2():
    from sparsedecode import load_model

    model, tokenizer = load_model("smollm2-135m")
    text = inspect.getsource(textwrap)  # a corpus no issue names: the source of a standard-library module
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, 1000:1320]
    _check(model, ids, 97, 16)
