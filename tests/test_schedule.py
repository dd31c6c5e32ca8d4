"""The step's schedule (sparsedecode.step.schedule) and its one declared mirror, the C kernel's ``prepared_step``:
over random schedules (batches of rows in different states, reuse 1-4, reselecting every step or not, decode steps,
rollbacks, multi-token writes, growth past a block, contexts that fall back under the support), the C call leaves
every row's statistics count, reuse counter, last length, fresh flag and the tally where the Python rules put them.
Also the rules themselves on the cases the routes rely on."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsedecode import SparseConfig
from sparsedecode.compiled.op import allocate
from sparsedecode.compiled.prepared import Prepared, centroids_of
from sparsedecode.layout import BlockLayout
from sparsedecode.step import schedule
from sparsedecode.step.plan import StepPlan

ONE_CALL = StepPlan("c", "c", one_call=True)


def test_the_rules_on_the_cases_every_route_relies_on():
    block = 16
    # a decode step where the last call ended continues the chain and keeps every statistic before it
    assert schedule.after_write(5, 3, 200, 200, 201, 200, block) == (5, 3, 201)
    # a rollback (the call starts before the last one ended) restarts the chain, drops the blocks reaching it
    assert schedule.after_write(12, 3, 200, 100, 101, 100, block) == (6, 0, 101)  # block 6 ends at 97 + 16 = 113
    # a multi-token forward never continues a chain; a new prompt (start 0) keeps nothing
    assert schedule.after_write(12, 3, 200, 200, 210, 200, block) == (12, 0, 210)
    assert schedule.after_write(12, 3, 200, 0, 300, 0, block) == (0, 0, 300)
    # keys the route cannot vouch for (keep < start) cut the statistics there and end the chain
    assert schedule.after_write(12, 3, 200, 200, 201, 50, block) == (3, 0, 201)
    # fresh at the chain's start and every `reuse` steps; every step for a selector that reselects every step
    assert [schedule.decode_step(s, True, 3, False) for s in range(5)] == [
        (True, 1), (False, 2), (False, 3), (True, 4), (False, 5)
    ]  # fmt: skip
    assert all(schedule.decode_step(s, True, 3, True)[0] for s in range(5))
    # a dense step ends the chain and selects nothing
    assert schedule.decode_step(4, False, 1, True) == (False, 0)
    # the elementwise form agrees with the scalar one
    steps = torch.tensor([0, 1, 2, 3])
    fresh, after = schedule.decode_step(steps, torch.tensor([True, True, False, True]), 2, False)
    assert fresh.tolist() == [True, False, False, False] and after.tolist() == [1, 2, 0, 4]


def test_support_reads_count_the_short_last_block_by_its_positions():
    layout = BlockLayout(n=140, window=32, block_size=16)  # distant [1, 108): 6 full blocks, a short one of 11
    assert layout.n_full == 6 and layout.n_blocks == 7
    blocks = torch.tensor([[0, 6], [2, 3]])
    reads = schedule.support_reads(blocks, layout)
    assert reads.tolist() == [1 + 32 + 16 + 11, 1 + 32 + 32]
    keep = torch.tensor([[True, False], [False, False]])
    assert schedule.support_reads(blocks, layout, keep).tolist() == [1 + 32 + 16, 1 + 32]


class Model:
    """The rules applied to a row state held in Python: what the C call must leave."""

    def __init__(self, count, step, last, tally):
        self.count, self.step, self.last, self.tally = list(count), list(step), list(last), tally.clone()

    def decode(self, n, cfg, blocks) -> list[bool]:
        layout = BlockLayout(n=n, window=cfg.window, block_size=cfg.block_size)
        fresh = []
        for r in range(len(self.count)):
            count, step, self.last[r] = schedule.after_write(
                self.count[r], self.step[r], self.last[r], n - 1, n, n - 1, cfg.block_size
            )
            f, self.step[r] = schedule.decode_step(step, True, cfg.reuse, cfg.selector.reselects_every_step)
            # a row selecting afresh has its statistics completed up to the layout's full blocks
            self.count[r] = max(count, layout.n_full) if f else count
            fresh.append(f)
        reads = int(schedule.support_reads(blocks, layout).sum())
        schedule.count_step(self.tally, len(fresh), 0, reads, blocks.shape[1])
        return fresh


def _c_call(cfg, batch, kv, heads, d, length, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, d, generator=generator)
    key = torch.randn(batch, kv, length, d, generator=generator)
    value = torch.randn(batch, kv, length, d, generator=generator)
    state = allocate(cfg, 0, batch, kv, d, length, "cpu", "prepared")
    prepared = Prepared(
        cfg, ONE_CALL, q[:, :, 0], key, value, state.stats, state.count, state.blocks, state.step, state.last,
        state.tally, d**-0.5,
    )  # fmt: skip
    return q, key, state, prepared


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    reuse=st.integers(1, 4),
    every_step=st.booleans(),
    block=st.sampled_from([4, 8]),
    starts=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), min_size=3, max_size=3),
    events=st.lists(
        st.one_of(
            st.tuples(st.just("step"), st.integers(1, 3)),
            st.tuples(st.just("back"), st.integers(1, 30)),
            st.tuples(st.just("write"), st.integers(2, 20)),
        ),
        min_size=1,
        max_size=25,
    ),
    seed=st.integers(0, 2**16),
)
def test_the_c_mirror_follows_the_rules_over_random_schedules(batch, reuse, every_step, block, starts, events, seed):
    """Every sparse decode step runs the C call; the dense steps and multi-token writes between them follow the
    rules in Python (the op's general path), on both states alike."""
    window, kv, heads, d, length = 8, 2, 4, 8, 160
    selector = "streaming" if every_step else "mean-pooled"
    cfg = SparseConfig(support=1 + window + 2 * block, window=window, block_size=block, reuse=reuse, selector=selector)
    assert cfg.selector.reselects_every_step == every_step
    q, key, state, prepared = _c_call(cfg, batch, kv, heads, d, length, seed)
    # rows in different states: a last length each (the C call decides per row whether it continues), a count
    n = 60
    kinds = cfg.selector.cached_statistics()
    for r in range(batch):
        last, count = (n - 1, starts[r][1]) if starts[r][0] % 2 else (starts[r][0] + 20, 0)
        state.last[r], state.step[r] = last, starts[r][0] % 5
        stored = centroids_of(state.stats[:, r], kinds, 0, block)
        stored.update(key[r], count)  # the statistics a row of that count holds
        state.count[r] = stored.count
    model = Model(state.count.tolist(), state.step.tolist(), state.last.tolist(), state.tally)
    for kind, amount in events:
        if kind == "step":  # decode steps: the C call where the step is sparse, the rules in Python where dense
            for _ in range(amount):
                n = min(n + 1, length)
                if n > cfg.effective_support:
                    out = torch.empty(batch, 1, heads, d)
                    prepared(q, key, state.stats, out, n)
                    fresh = model.decode(n, cfg, state.blocks)
                    assert [bool(f) for f in prepared.fields[10::11]] == fresh
                    assert list(prepared.fields[4::11]) == [n] * batch
                else:
                    for target in (state, model):
                        counts, steps, lasts = (
                            torch.as_tensor(target.count),
                            torch.as_tensor(target.step),
                            torch.as_tensor(target.last),
                        )
                        counts, steps, _ = schedule.after_write(counts, steps, lasts, n - 1, n, n - 1, block)
                        _, steps = schedule.decode_step(steps, False, reuse, every_step)
                        _assign(target, counts, steps, n)
                        schedule.count_step(target.tally, 0, batch, 0, kv)
        else:  # a rollback to an earlier length, or a multi-token write (a prefill chunk, a verification)
            start = max(n - amount, 1) if kind == "back" else n
            end = start + 1 if kind == "back" else min(n + amount, length)
            for target in (state, model):
                counts, steps, _ = schedule.after_write(
                    torch.as_tensor(target.count), torch.as_tensor(target.step), torch.as_tensor(target.last),
                    start, end, start, block,
                )  # fmt: skip
                _assign(target, counts, steps, end)
            n = end
        assert state.count.tolist() == model.count and state.step.tolist() == model.step
        assert state.last.tolist() == model.last and torch.equal(state.tally, model.tally)
    # the statistics the C call asked for are each row's own, as a row state alone computes them
    for r in range(batch):
        count = int(state.count[r])
        alone = centroids_of(torch.zeros_like(state.stats[:, r]), kinds, 0, block)
        if count:
            expected = alone.update(key[r], count)
            assert torch.equal(state.stats[0, r, :, :, :count], expected.transpose(1, 2))


def _assign(target, counts, steps, last):
    if isinstance(target, Model):
        target.count, target.step, target.last = counts.tolist(), steps.tolist(), [last] * len(target.count)
    else:
        target.count.copy_(counts)
        target.step.copy_(steps)
        target.last.fill_(last)


@pytest.mark.parametrize("reuse", [1, 3])
def test_a_row_that_did_not_end_where_the_step_starts_selects_afresh_in_c(reuse):
    """Per row, not per batch: one row continuing its chain, the other rolled back, in one C call."""
    cfg = SparseConfig(support=1 + 8 + 2 * 8, window=8, block_size=8, reuse=reuse)
    q, key, state, prepared = _c_call(cfg, 2, 2, 4, 8, 160, 3)
    state.last.copy_(torch.tensor([99, 80]))
    state.step.copy_(torch.tensor([1, 1]))
    state.count.copy_(torch.tensor([11, 11]))
    prepared(q, key, state.stats, torch.empty(2, 1, 4, 8), 100)
    assert state.step.tolist() == [2, 1]
    assert [bool(f) for f in prepared.fields[10::11]] == [reuse == 1, True]
