"""Nothing measured changes (issue #24, item 5): today's code gives the rows recorded before the selector protocol.

tests/recorded_rows.py recorded, for every built-in selector, the paired comparison, a batch, sparse and lossless
generation and one row each of sweep, eval and compare-selectors on tiny Llama/Qwen2 models, and one paired
comparison per selector on SmolLM2. Each case is recomputed here and compared with its recorded value: tokens,
counts, flags and strings exactly; floats (perplexities, margins, masses, percentages) to float32 round-off of
sums taken in another order (another machine's BLAS, another kernel): relative 1e-4 (800 eps, far above the ~10 eps
such reorderings give), and besides it an absolute term from the logits' round-off (conftest.roundoff_tolerance),
since a field that is a difference of two nearly equal quantities (a logit error, a margin, a perplexity change in
percent) keeps the absolute error of its terms, not a relative one. Fields added since the recording are allowed;
none may go.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import roundoff_tolerance
from recorded_rows import FIXTURE, real_cases, tiny_cases

from sparsedecode.protocol.results import upgrade_selector  # noqa: E402


def _renamed(value):
    """The recording with every selector named as today (a stored row is read so)."""
    if isinstance(value, dict):
        value = upgrade_selector(value) if "selector" in value else value
        return {key: _renamed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_renamed(item) for item in value]
    return value


RECORDED = _renamed(json.loads(FIXTURE.read_text()))
# Absolute float32 round-off of one logit: the tiny models have 2 layers, sums of at most 600 terms (the eval case's
# context) and logits below 1; SmolLM2 30 layers, its MLP's 1536 terms, logits up to ~40 (conftest's docstring).
TINY_LOGIT = roundoff_tolerance(torch.ones(1), depth=2, width=600)
REAL_LOGIT = roundoff_tolerance(torch.full((1,), 40.0), depth=30, width=1536)


def tolerance(field: str, logit: float) -> float:
    """The absolute term for ``field``: a margin, a logit error or an NLL moves by twice a logit's round-off; a
    perplexity ratio by four times it relatively, which is 400 times it in percent points (``*_percent``)."""
    return (400 if field.endswith("_percent") else 2) * logit


def assert_same(recorded, now, where: str = "", logit: float = TINY_LOGIT) -> None:
    if isinstance(recorded, dict):
        assert isinstance(now, dict), where
        missing = sorted(set(recorded) - set(now))
        assert not missing, f"{where}: fields gone {missing}"
        for key, value in recorded.items():
            assert_same(value, now[key], f"{where}.{key}", logit)
    elif isinstance(recorded, list):
        assert isinstance(now, list) and len(now) == len(recorded), where
        for i, (a, b) in enumerate(zip(recorded, now)):
            assert_same(a, b, f"{where}[{i}]", logit)
    elif isinstance(recorded, float) and not isinstance(now, bool) and isinstance(now, (int, float)):
        if math.isnan(recorded):
            assert math.isnan(now), where
        else:
            field = where.rsplit(".", 1)[-1].split("[", 1)[0]
            assert now == pytest.approx(recorded, rel=1e-4, abs=tolerance(field, logit)), where
    else:
        assert now == recorded, where


TINY = dict(tiny_cases())


@pytest.mark.parametrize("name", sorted(name for name in RECORDED if not name.startswith("real/")))
def test_tiny_rows_are_unchanged(name):
    assert_same(RECORDED[name], TINY[name](), name)


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(name for name in RECORDED if name.startswith("real/")))
def test_real_model_rows_are_unchanged(name):
    assert_same(RECORDED[name], dict(real_cases())[name](), name, REAL_LOGIT)


def test_the_recording_covers_every_selector_and_surface():
    from recorded_rows import SELECTORS, now

    for selector in SELECTORS:
        for surface in ("compare/llama", "compare/qwen2", "compare_batch/llama", "generate/qwen2", "real/compare"):
            assert any(name.startswith(f"{surface}/{selector}") for name in RECORDED), (surface, selector)
    assert {row["selector"] for row in RECORDED["sweep"]} == set(map(now, SELECTORS))
