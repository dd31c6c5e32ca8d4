"""Nothing measured changes (issue #24, item 5): today's code gives the rows recorded before the selector protocol.

tests/recorded_rows.py recorded, for every built-in selector, the paired comparison, a batch, sparse and lossless
generation and one row each of sweep, eval and compare-selectors on tiny Llama/Qwen2 models, and one paired
comparison per selector on SmolLM2. Each case is recomputed here and compared with its recorded value: tokens,
counts, flags and strings exactly; floats (perplexities, margins, percentages) to float32 round-off of sums taken in
another order on 2-layer models of width 64 (relative 1e-4 is 800 eps, far above the ~10 eps such reorderings give
and far below what one other block or token changes). Fields added since the recording are allowed; none may go.
"""

from __future__ import annotations

import json
import math

import pytest
from recorded_rows import FIXTURE, real_cases, tiny_cases

RECORDED = json.loads(FIXTURE.read_text())


def assert_same(recorded, now, where: str = "") -> None:
    if isinstance(recorded, dict):
        assert isinstance(now, dict), where
        missing = sorted(set(recorded) - set(now))
        assert not missing, f"{where}: fields gone {missing}"
        for key, value in recorded.items():
            assert_same(value, now[key], f"{where}.{key}")
    elif isinstance(recorded, list):
        assert isinstance(now, list) and len(now) == len(recorded), where
        for i, (a, b) in enumerate(zip(recorded, now)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(recorded, float) and not isinstance(now, bool) and isinstance(now, (int, float)):
        if math.isnan(recorded):
            assert math.isnan(now), where
        else:
            assert now == pytest.approx(recorded, rel=1e-4, abs=1e-6), where
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
    assert_same(RECORDED[name], dict(real_cases())[name](), name)


def test_the_recording_covers_every_selector_and_surface():
    from recorded_rows import SELECTORS

    for selector in SELECTORS:
        for surface in ("compare/llama", "compare/qwen2", "compare_batch/llama", "generate/qwen2", "real/compare"):
            assert any(name.startswith(f"{surface}/{selector}") for name in RECORDED), (surface, selector)
    assert {row["selector"] for row in RECORDED["sweep"]} == set(SELECTORS)
