"""The library's paired protocol against an independent float64 mask-based implementation (tests/reference64.py).

The reference recomputes each decode row's support from docs/definitions.md, section 1 and masks dense float64
attention, so it shares no code with the library's selection, centroid cache, gathers or kernels. The library runs
in float32.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest
from conftest import prompt, tiny_model
from reference64 import paired_protocol, paired_protocols

from sparsedecode import SparseConfig, compare, dense_reference

CASES = [
    # (prompt length, prompt seed, support, tokens): long prompts, a prompt that grows past S while decoding
    (300, 1, 97, 24),
    (260, 2, 129, 24),
    (400, 3, 193, 24),
    (90, 4, 97, 40),
]

REUSE_CASES = [
    # (prompt length, prompt seed, support, tokens, reuse interval)
    (300, 1, 97, 24, 3),
    (260, 2, 129, 24, 2),
    (400, 3, 193, 24, 4),
    (90, 4, 97, 40, 4),
]


def _check(model, ids, support: int, tokens: int, reuse: int = 1, ppl_tolerance: float = 0.05, *, expected=None, **kw):
    """The library's paired comparison against the reference's ``expected`` outcome (computed here if not given);
    ``kw`` goes to ``compare`` (a shared dense ``reference``)."""
    expected = expected or paired_protocol(model, ids, support, tokens, reuse)
    result = compare(model, None, ids, SparseConfig(support=support, reuse=reuse), tokens, **kw)
    assert result.dense_tokens == expected.dense_tokens
    assert result.sparse_tokens == expected.sparse_tokens
    assert result.first_divergence == expected.first_divergence
    assert result.survives == expected.survives
    assert result.teacher_forced_match == pytest.approx(expected.teacher_forced_match, abs=1e-9)  # share of tokens
    # float32 against float64 logits: each NLL moves by twice the logits' round-off, the percent change by 400 times
    # it when every error points the same way (callers pass a tolerance above their model's typical error)
    assert result.delta_ppl_percent == pytest.approx(expected.delta_ppl_percent, abs=ppl_tolerance)
    return expected


@pytest.mark.parametrize("length,seed,support,tokens", CASES)
def test_protocol_matches_float64_reference_on_tiny_models(arch, length, seed, support, tokens):
    model = tiny_model(arch, seed=seed)
    _check(model, prompt(length, seed=seed), support, tokens, ppl_tolerance=1e-3)  # 400 * 2.6e-6, logits_tolerance


@pytest.mark.parametrize("length,seed,support,tokens,reuse", REUSE_CASES)
def test_reuse_interval_matches_float64_reference_on_tiny_models(arch, length, seed, support, tokens, reuse):
    """R > 1: fresh selections at steps 1, 1 + R, ... of each chain of sparse steps, block indices reused between
    them while the window slides (README, "Reuse"). Every case reuses a block that was short when chosen and so
    reads more positions now; reading only what it held when chosen gives other tokens in some of these cases."""
    model = tiny_model(arch, seed=seed)
    expected = _check(model, prompt(length, seed=seed), support, tokens, reuse, ppl_tolerance=1e-3)
    assert expected.grown_reuses > 0


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
def test_protocol_matches_float64_reference_on_smollm2(smollm2):
    """Reuse 1 and 4, sharing the reference's float64 copy, prefill and dense pass, and the library's dense run."""
    model, tokenizer = smollm2
    text = inspect.getsource(textwrap)  # a corpus no issue names: the source of a standard-library module
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][:, 1000:1320]
    reuses = (1, 4)
    reference = dense_reference(model, ids, tokens=16)
    for reuse, expected in zip(reuses, paired_protocols(model, ids, 97, 16, reuses)):
        # default 0.05: SmolLM2's float32 logits sit ~1e-4 from float64 (roundoff_tolerance bounds them at 3.6e-3);
        # 16 NLL errors of random sign move the percent change by 400 * 1e-4 / sqrt(16) = 0.01
        _check(model, ids, 97, 16, reuse, expected=expected, reference=reference)
