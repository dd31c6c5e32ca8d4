"""The decode loop's argmax (NumPy's for float32 on the CPU) picks what torch.argmax picks: the first of equal
maxima, a NaN over everything, -0.0 equal to 0.0, infinities, over rows of a batch and strided views; and the loop
without NLLs gives the same tokens."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from sparsedecode.decoding.loop import argmax_rows, decode_tokens

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


def test_the_loop_without_nlls_gives_the_same_tokens():
    """Teacher-forced then greedy, a stop token for one row: the same tokens with ``nll=False``, and no NLLs."""
    table = torch.randn(50, 50, generator=torch.Generator().manual_seed(3))

    def step(tokens: torch.Tensor) -> torch.Tensor:
        return table[tokens]

    model = torch.nn.Linear(1, 1)
    kwargs = dict(teacher=[[4, 9, 11], [7]], stop=int(table[7].argmax()), step_fn=step)
    tokens, nll = decode_tokens(model, None, [4, 7], 12, **kwargs)
    bare, none = decode_tokens(model, None, [4, 7], 12, nll=False, **kwargs)
    assert bare == tokens and none == [[], []]
    assert [len(x) for x in nll] == [len(x) for x in tokens] and len(tokens[1]) < len(tokens[0])
    expected = -torch.log_softmax(table[4], -1)[9]
    assert abs(nll[0][0] - float(expected)) < 1e-5
