"""The decode loop's argmax (NumPy's for float32 on the CPU) picks what torch.argmax picks: the first of equal
maxima, a NaN over everything, -0.0 equal to 0.0, infinities, over rows of a batch and strided views."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsedecode.decoding.loop import argmax_rows

SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 3.0e38, -3.0e38]
VALUES = st.one_of(st.sampled_from(SPECIAL), st.floats(-4, 4, width=32), st.integers(-2, 2).map(float))


@given(st.integers(1, 3), st.integers(1, 40), st.data())
def test_argmax_rows_is_torchs_argmax(rows, vocab, data):
    values = data.draw(st.lists(VALUES, min_size=rows * vocab, max_size=rows * vocab))
    logits = torch.tensor(values, dtype=torch.float32).reshape(rows, vocab)
    assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits[0]) == int(logits[0].argmax())
    assert argmax_rows(logits.t().contiguous().t()) == logits.argmax(dim=-1).tolist()  # column-major strides
    assert argmax_rows(logits.bfloat16()) == logits.bfloat16().argmax(dim=-1).tolist()  # torch's own path


def test_a_large_vocabulary_with_ties_and_a_late_nan():
    logits = torch.randn(2, 49152)
    logits[0, [7, 40000]] = 9.0  # a tie: the first
    logits[1, 30000] = float("nan")  # a NaN after a larger number: the NaN
    logits[1, 5] = 1e30
    assert argmax_rows(logits) == [7, 30000] == logits.argmax(dim=-1).tolist()
