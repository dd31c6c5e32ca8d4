"""The batched sparse step: one C kernel call per layer for every sparse sequence of a left-padded batch.

The kernel call equals the single-sequence calls sequence by sequence (same blocks, same outputs); decoding a
ragged batch through it equals the per-sequence Python loop (same blocks at every step, the same bookkeeping) and
every sequence's batch-1 run; padding is never read.
"""

from __future__ import annotations

import pytest
import torch
from conftest import logits_tolerance, prompt, tiny_model

import sparsedecode.session as attention
from sparsedecode import SparseConfig, SparseDecodeError, sparse_decoding
from sparsedecode.kernels import cpu
from sparsedecode.kernels.cpu import batch as cpu_batch
from sparsedecode.layout import BlockLayout
from sparsedecode.selectors.statistics import BlockStatistics
from sparsedecode.step.plan import StepPlan

LENGTHS = (300, 150, 60, 233)  # differing by more than a block; one below the support, growing past it


@pytest.fixture(autouse=True)
def built():
    assert cpu.library() is not None, cpu.BUILD_ERROR


def ragged_batch(lengths, seed=10):
    """Left-padded prompts of ``lengths`` (pad id 0) and their attention mask."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, length in enumerate(lengths):
        ids[i, width - length :] = prompt(length, seed=seed + i)[0]
        mask[i, width - length :] = 1
    return ids, mask


def random_cache(batch, kv_heads, d, lengths, pads, seed, dtype=torch.float32):
    """Random keys and values of a batch holding sequences of ``lengths`` at ``pads``, and the generator."""
    generator = torch.Generator().manual_seed(seed)
    positions = max(p + n for p, n in zip(pads, lengths)) + 3
    keys = torch.randn(batch, kv_heads, positions, d, generator=generator).to(dtype)
    values = torch.randn(batch, kv_heads, positions, d, generator=generator).to(dtype)
    return keys, values, generator


CASES = [
    # query heads, KV heads, head dim, lengths, blocks
    (9, 3, 64, (2000, 1200, 900, 1999), 8),
    (4, 2, 16, (300, 150, 97 + 16, 233), 2),
    (6, 2, 12, (400, 333, 250), 3),  # a head dim that is not a multiple of 8
    (8, 1, 32, (200, 190, 181), 6),  # short last blocks, likely chosen
    (6, 3, 24, (500, 517), 5),  # one of 16 + 8
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:3])) + f"-{len(c[3])}rows")
def test_batch_call_equals_single_calls_sequence_by_sequence(case, threads, dtype):
    query_heads, kv_heads, d, lengths, b = case
    batch = len(lengths) + 1  # one sequence of the batch is not served by the call (a dense row)
    pads = [7 * i for i in range(len(lengths))]
    keys, values, generator = random_cache(batch, kv_heads, d, lengths, pads, seed=sum(lengths), dtype=dtype)
    q = (3 * torch.randn(batch, query_heads, d, generator=generator)).to(dtype)
    out = torch.full((batch, query_heads, d), 123.0)  # float32 whatever the inputs' dtype
    rows, expected = [], []
    for i, (pad, n) in enumerate(zip(pads, lengths)):
        layout = BlockLayout(n=n, window=64, block_size=16)
        k_i, v_i = keys[i + 1, :, pad:], values[i + 1, :, pad:]
        cache = BlockStatistics(16)
        fresh = i % 2 == 0
        blocks = cpu.select_mean_pooled(q[i + 1], k_i, cache.update(k_i, layout.n_full), layout, b)
        if fresh:
            chosen = torch.full_like(blocks, -1)
        else:  # reused blocks, in any order, one outside the distant region (read as nothing)
            blocks = torch.randint(0, layout.n_blocks, (kv_heads, b), generator=generator)
            blocks[0, 0] = layout.n_blocks + 5
            chosen = blocks.clone()
        expected.append((blocks, cpu.attend_support(q[i + 1], k_i, v_i, blocks, layout, d**-0.5)))
        rows.append((i + 1, pad, n, cache.storage(), chosen, fresh))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        cpu_batch.sparse_step_batch(q, keys, values, out, rows, 64, 16, d**-0.5)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(out[0], torch.full((query_heads, d), 123.0))  # a row not named is not written
    for i, ((*_, chosen, _), (blocks, single)) in enumerate(zip(rows, expected)):
        assert torch.equal(chosen, blocks)
        assert torch.equal(out[i + 1], single)  # the same attention code over the same support


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["full block", "tail block"])
def test_batch_call_refuses_a_non_finite_score_of_a_row_that_selects(where, bad):
    """One row selecting afresh holds a non-finite key in its distant region: the call raises as the torch path's
    score check does. The same key in a row that reuses its blocks is not scored, and the call runs."""
    kv_heads, d, lengths, pads = 2, 16, (407, 300), (0, 9)
    keys, values, generator = random_cache(2, kv_heads, d, lengths, pads, seed=5)
    q = torch.randn(2, 4, d, generator=generator)
    layout = BlockLayout(n=lengths[0], window=64, block_size=16)
    position = 1 + 4 * 16 + 2 if where == "full block" else layout.distant_end - 2
    keys[0, 1, pads[0] + position, 3] = bad

    def rows(fresh):
        out = []
        for i, (pad, n) in enumerate(zip(pads, lengths)):
            lay = BlockLayout(n=n, window=64, block_size=16)
            cache = BlockStatistics(16)
            cache.update(keys[i, :, pad:], lay.n_full)
            chosen = torch.zeros(kv_heads, 2, dtype=torch.int64)
            out.append((i, pad, n, cache.storage(), chosen, fresh or i == 1))
        return out

    with pytest.raises(SparseDecodeError, match="scores hold NaN or infinite"):
        cpu_batch.sparse_step_batch(q, keys, values, torch.empty(2, 4, d), rows(True), 64, 16, d**-0.5)
    cpu_batch.sparse_step_batch(q, keys, values, torch.empty(2, 4, d), rows(False), 64, 16, d**-0.5)


def test_batch_call_refuses_rows_it_cannot_read():
    keys = torch.randn(2, 2, 300, 16)
    q, out = torch.randn(2, 4, 16), torch.empty(2, 4, 16)
    cache = BlockStatistics(16)
    layout = BlockLayout(n=250, window=64, block_size=16)
    cache.update(keys[0], layout.n_full)
    blocks = torch.zeros(2, 2, dtype=torch.int64)

    def call(row, k=keys, query=q):
        cpu_batch.sparse_step_batch(query, k, k, out, [row], 64, 16, 0.25)

    call((0, 50, 250, cache.storage(), blocks, True))  # fits
    with pytest.raises(SparseDecodeError, match="positions"):
        call((0, 51, 250, cache.storage(), blocks, True))  # one position past the cache
    with pytest.raises(SparseDecodeError, match="positions"):
        call((2, 0, 250, cache.storage(), blocks, True))  # no such sequence
    with pytest.raises(SparseDecodeError, match="centroid"):
        call((0, 0, 250, torch.zeros(2, 16, 10), blocks, True))  # 11 full blocks, storage for 10
    with pytest.raises(SparseDecodeError, match="centroid"):
        call((0, 0, 250, torch.zeros(2, 10, 16).transpose(1, 2), blocks, True))  # the block stride is not 1
    with pytest.raises(SparseDecodeError, match="centroid"):
        call((0, 0, 250, None, blocks, True))
    with pytest.raises(SparseDecodeError, match="int64"):
        call((0, 0, 250, cache.storage(), blocks.int(), False))
    with pytest.raises(SparseDecodeError, match="blocks asked"):
        call((0, 0, 90, cache.storage(), torch.zeros(2, 3, dtype=torch.int64), True))  # 2 blocks in all
    with pytest.raises(SparseDecodeError, match="float32"):
        call((0, 0, 250, cache.storage(), blocks, True), k=keys.double(), query=q.double())
    with pytest.raises(SparseDecodeError, match="alike"):  # it would read the query's elements at the keys' size
        call((0, 0, 250, cache.storage(), blocks, True), query=q.bfloat16())
    with pytest.raises(SparseDecodeError, match="float32"):  # the output is float32 whatever the inputs' dtype
        cpu_batch.sparse_step_batch(
            q.half(), keys.half(), keys.half(), out.half(), [(0, 0, 250, None, blocks, False)], 64, 16, 0.25
        )
    with pytest.raises(SparseDecodeError, match="contiguous"):
        call((0, 0, 250, cache.storage(), blocks, True), query=q.transpose(0, 1).contiguous().transpose(0, 1))


def generate(model, ids, mask, cfg, steps, *, observers=(), track_reads=False, plan=None):
    with sparse_decoding(model, cfg) as session:
        session.track_reads, session.plan = track_reads, plan
        session.observers.extend(observers)
        result = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    logits = torch.stack(result.logits, dim=1)  # (batch, steps, vocab)
    return result.sequences[:, ids.shape[1] :], logits, session


class Calls:
    """Counts the batched kernel calls and records every sparse sequence's blocks as attention reads them, in order
    (layer by layer, sequence by sequence), whichever path runs."""

    def __init__(self, monkeypatch):
        self.batched, self.blocks = 0, []
        run_step_batch, run_attention = cpu_batch.run_step_batch, cpu.run_attention

        def batched(q, keys, values, out, rows, *args):
            self.batched += 1
            run_step_batch(q, keys, values, out, rows, *args)
            self.blocks += [chosen.clone() for *_, chosen, _ in rows]

        def single(q, keys, values, blocks, *args):
            self.blocks.append(blocks.clone())
            return run_attention(q, keys, values, blocks, *args)

        monkeypatch.setattr(cpu_batch, "run_step_batch", batched)
        monkeypatch.setattr(cpu, "run_attention", single)


PER_ROW = StepPlan("c", "c", one_call=False)
"""The per-row C calls (selection, then attention) where the one C call would serve: what runs for other kernels,
adaptive budgets and token-level selectors, passed to the session as its plan."""


def row_states(session):
    return [
        [
            (r.step, None if r.blocks is None else r.blocks.tolist(), r.centroids.count, r.centroids.computed, r.seen)
            for r in state.rows
        ]
        for _, state in sorted(session.layers.items())
    ]


@pytest.mark.parametrize("selector", ["mean-pooled", "quest:grouping=mean-query", "oracle-blocks"])
@pytest.mark.parametrize("reuse", [1, 4])
def test_one_call_per_layer_equals_the_per_sequence_loop(arch, reuse, selector, monkeypatch):
    model = tiny_model(arch)
    ids, mask = ragged_batch(LENGTHS)
    cfg = SparseConfig(support=97, reuse=reuse, selector=selector)
    results = {}
    for path in ("one call", "per row"):
        with monkeypatch.context() as patch:
            calls = Calls(patch)
            plan = PER_ROW if path == "per row" else None
            tokens, logits, session = generate(model, ids, mask, cfg, 12, track_reads=True, plan=plan)
        reads = [session.unique_distant_positions(i) for i in range(len(LENGTHS))]
        counts = (session.sparse_steps, session.dense_steps)
        results[path] = (tokens, logits, calls, row_states(session), reads, counts)
    (tokens, logits, calls, states, reads, counts), (tokens1, logits1, calls1, states1, reads1, counts1) = (
        results["one call"],
        results["per row"],
    )
    assert calls.batched == 2 * 11 and calls1.batched == 0  # 11 decode forwards (the first token is prefill's)
    assert len(calls.blocks) == len(calls1.blocks) == counts[0]
    assert all(torch.equal(a, b) for a, b in zip(calls.blocks, calls1.blocks))
    assert torch.equal(tokens, tokens1)
    assert torch.equal(logits, logits1)  # the same C code scores and attends on both paths
    assert states == states1 and counts == counts1
    assert all(torch.equal(a, b) for a, b in zip(reads, reads1))


@pytest.mark.parametrize("reuse", [1, 4])
def test_every_sequence_of_a_ragged_batch_decodes_as_alone(arch, reuse, monkeypatch):
    model = tiny_model(arch)
    ids, mask = ragged_batch(LENGTHS)
    cfg = SparseConfig(support=97, reuse=reuse)
    calls = Calls(monkeypatch)
    tokens, logits, session = generate(model, ids, mask, cfg, 40)  # the 60-token prompt grows past the support
    assert calls.batched == 2 * 39 and session.sparse_steps > 0 and session.dense_steps > 0
    for i, length in enumerate(LENGTHS):
        alone, alone_logits, _ = generate(model, prompt(length, seed=10 + i), None, cfg, 40)
        assert torch.equal(tokens[i], alone[0]), i
        # the batched C call adds in another order than batch 1: float32 round-off of reordered sums
        assert (logits[i] - alone_logits[0]).abs().max() <= logits_tolerance(alone_logits[0], model, positions=340), i


@pytest.mark.parametrize(
    "lengths, poison", [(LENGTHS, 1e4), ((300, 150, 233, 120), float("nan"))], ids=["mixed-huge", "sparse-nan"]
)
@pytest.mark.parametrize("path", ["one call", "per row"])
def test_padding_is_never_read(arch, lengths, poison, path, monkeypatch):
    """Pad keys and values poisoned after prefill change nothing: no support reaches them. (NaN only where every
    step is sparse: dense batched SDPA multiplies masked NaN logits by zero weights and propagates them.)"""
    from transformers import DynamicCache

    model = tiny_model(arch)
    ids, mask = ragged_batch(lengths)
    cfg = SparseConfig(support=97)
    pads = [ids.shape[1] - length for length in lengths]
    outputs = []
    for poisoned in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), sparse_decoding(model, cfg) as session:
            session.plan = PER_ROW if path == "per row" else None
            logits = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
            if poisoned:
                for layer in cache.layers:
                    for i, pad in enumerate(pads):
                        layer.keys[i, :, :pad] = poison
                        layer.values[i, :, :pad] = poison
            steps = []
            for _ in range(10):
                token = logits.argmax(dim=-1, keepdim=True)
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                logits = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]
                steps.append(logits)
            mask = mask[:, : ids.shape[1]]
        outputs.append(torch.stack(steps, dim=1))
    assert torch.isfinite(outputs[1]).all()
    # pads add exact zeros either way; what differs is at most float32 round-off of the sums around them
    assert (outputs[0] - outputs[1]).abs().max() <= logits_tolerance(outputs[0], model, positions=310)


def test_observers_see_each_sequence_in_its_own_positions(monkeypatch):
    """Observers get a StepView per sequence, positions its own, while the one C call serves the layer."""
    model = tiny_model("llama")
    ids, mask = ragged_batch(LENGTHS)
    calls, seen = Calls(monkeypatch), []

    def observe(view):
        seen.append((view.sequence, int(view.index.max()), view.layout.n))

    generate(model, ids, mask, SparseConfig(support=97), 4, observers=[observe])
    assert calls.batched == 2 * 3 and seen  # 3 decode forwards of 2 layers
    assert {sequence for sequence, _, _ in seen} == {0, 1, 3}  # the 60-token prompt stays dense for 4 steps
    assert all(top < n <= LENGTHS[sequence] + 4 for sequence, top, n in seen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_one_call_equals_the_per_sequence_loop(arch, dtype, monkeypatch):
    """A half-precision ragged batch: one C call per layer (reading bfloat16 or float16, writing float32, copied into
    the model's dtype) decodes as the per-sequence C calls (selection, then attention), to the bit: the same C code
    on the same inputs, rounded to the model's dtype in the same place. And as the torch path, token for token."""
    model = tiny_model(arch, dtype=dtype)
    ids, mask = ragged_batch(LENGTHS)
    results = {}
    for path in ("one call", "per row", "torch"):
        cfg = SparseConfig(support=97, reuse=2, kernel="torch" if path == "torch" else "auto")
        with monkeypatch.context() as patch:
            calls = Calls(patch)
            tokens, logits, session = generate(model, ids, mask, cfg, 12, plan=PER_ROW if path == "per row" else None)
        results[path] = (tokens, logits, calls.batched, calls.blocks, session.sparse_steps)
    (tokens, logits, batched, blocks, steps), (tokens1, logits1, batched1, blocks1, steps1) = (
        results["one call"],
        results["per row"],
    )
    assert batched == 2 * 11 and batched1 == 0 and steps == steps1 == len(blocks) == len(blocks1) > 0
    assert all(torch.equal(a, b) for a, b in zip(blocks, blocks1))
    assert torch.equal(tokens, tokens1) and torch.equal(logits, logits1)
    assert torch.equal(tokens, results["torch"][0])


def test_other_kernels_keep_the_per_sequence_path(monkeypatch):
    """kernel="torch" is served sequence by sequence, and decodes as the one C call does."""
    model = tiny_model("qwen2")
    ids, mask = ragged_batch(LENGTHS)
    calls = Calls(monkeypatch)
    tokens, logits, _ = generate(model, ids, mask, SparseConfig(support=97, kernel="torch"), 6)
    assert calls.batched == 0
    c_tokens, c_logits, _ = generate(model, ids, mask, SparseConfig(support=97), 6)
    assert calls.batched == 2 * 5
    # torch and C sum the same attention in another order: float32 round-off apart
    assert torch.equal(tokens, c_tokens)
    assert (logits - c_logits).abs().max() <= logits_tolerance(c_logits, model, positions=306)


def test_without_a_mask_a_fixed_size_cache_advances_with_the_position_ids():
    """A batch without padding may come without a mask; over a preallocated cache the key length stays the same
    from step to step, so the length must come from the position ids at every forward."""
    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 2, 300, 16, generator=generator), torch.randn(2, 2, 300, 16, generator=generator)
    lengths = []
    with sparse_decoding(model, SparseConfig(support=97)) as session:
        session.observers.append(lambda view: lengths.append(view.layout.n))
        for n in (200, 201, 202):
            query = torch.randn(2, 4, 1, 16, generator=generator)
            attention.sparse_attention_forward(module, query, key, value, None, position_ids=torch.full((2, 1), n - 1))
    assert lengths == [200, 200, 201, 201, 202, 202]  # two sequences per step
