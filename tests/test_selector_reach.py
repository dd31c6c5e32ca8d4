"""A user's code reached through a built-in, and what a selector returns besides scores (issue #42, cases found after
it): a user's subclass of a built-in works on copies and is named as itself; compiled decoders tell apart selectors
whose parameters print alike; huge budgets are capped, not wrapped; scores of a dtype or layout nothing ranks, and a
``rows`` that contradicts ``per_query_head``, are one line naming the selector."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from conftest import prompt, tiny_model

import sparsedecode as sd
from sparsedecode import SparseConfig, SparseDecodeError, select_support
from sparsedecode.selectors.methods.twilight import Twilight
from sparsedecode.selectors.ops import group_mean_queries, mean_pooled_scores


@dataclass(frozen=True)
class HalvesThroughData(Twilight):
    """Twilight's own scoring (a built-in method), whose candidates this subclass overrides to halve the keys behind
    any version counter's back."""

    def candidates(self, queries, keys, layout):
        mask = super().candidates(queries, keys, layout)
        keys.data.mul_(0.5)
        return mask


def test_a_subclass_of_a_builtin_works_on_copies_and_is_named_as_itself():
    queries, keys = torch.randn(4, 16), torch.randn(2, 400, 16)
    kept = keys.clone()
    select_support(queries, keys, support=97, method=HalvesThroughData())
    assert torch.equal(keys, kept)
    assert HalvesThroughData().spec() == "HalvesThroughData" and Twilight().spec() == "twilight"


def test_lossless_decoding_with_such_a_subclass_is_still_dense():
    model, ids = tiny_model("llama"), prompt(300)
    dense = sd.generate(model, ids, None, max_new_tokens=10, mode="dense").tokens
    cfg = SparseConfig(support=97, selector=HalvesThroughData())
    assert sd.generate(model, ids, cfg, max_new_tokens=10, mode="lossless").tokens == dense
    assert sd.generate(model, ids, None, max_new_tokens=10, mode="dense").tokens == dense  # the model untouched


@dataclass(frozen=True)
class Biased(sd.BlockSelector):
    bias: object = None

    def score_blocks(self, queries, keys, layout):
        scores = mean_pooled_scores(group_mean_queries(queries, keys.shape[0]), keys[:, : layout.n_blocks].float())
        return scores + self.bias[: layout.n_blocks]


class Signed(sd.BlockSelector):
    """A parameter set in ``__init__``, not a dataclass field."""

    def __init__(self, sign):
        object.__setattr__(self, "sign", sign)

    def score_blocks(self, queries, keys, layout):
        return self.sign * mean_pooled_scores(group_mean_queries(queries, keys.shape[0]), keys[:, : layout.n_blocks])


def test_selectors_that_print_alike_are_told_apart():
    from sparsedecode.compiled.op import config_key

    up, down = torch.zeros(2000), torch.zeros(2000)
    up[4:12], down[4:12] = torch.linspace(1e4, 0, 8), torch.linspace(0, 1e4, 8)
    assert repr(up) == repr(down)  # what keyed them before
    for one, other in ((Biased(up), Biased(down)), (Signed(1.0), Signed(-1.0))):
        first, second = SparseConfig(selector=one), SparseConfig(selector=other)
        assert first.identity() != second.identity() and config_key(first) != config_key(second)
        assert first.identity() == SparseConfig(selector=one).identity()  # the same object: one key
    assert SparseConfig(selector=Signed(1.0)).identity() == SparseConfig(selector=Signed(1.0)).identity()
    assert SparseConfig(selector="twilight").identity() == SparseConfig(selector="twilight").identity()


def test_compiled_decoding_follows_the_selector_not_its_text(monkeypatch):
    from sparsedecode.compiled import decoder

    monkeypatch.setattr(decoder, "DEFAULT_BACKEND", "aot_eager")
    model, ids = tiny_model("llama"), prompt(300)
    runs = []
    for sign in (1.0, -1.0):
        cfg = SparseConfig(support=97, selector=Signed(sign))
        compiled = sd.generate(model, ids, cfg, max_new_tokens=8, mode="sparse", compile=True).tokens
        assert compiled == sd.generate(model, ids, cfg, max_new_tokens=8, mode="sparse").tokens
        runs.append(compiled)
    assert runs[0] != runs[1]  # the two really select differently here


@dataclass(frozen=True)
class HugeBudget(sd.BlockSelector):
    value: float = 1e20

    def score_blocks(self, queries, keys, layout):
        return torch.arange(layout.n_blocks, dtype=torch.float32).flip(0).expand(keys.shape[0], -1).contiguous()

    def budget(self, scores, layout):
        return torch.full((scores.shape[0],), self.value)


@pytest.mark.parametrize("value", [1e9, 2.0**63, 1e20])
def test_budgets_past_what_an_int64_holds_are_capped_at_b(value):
    picked = select_support(torch.randn(4, 16), torch.randn(2, 400, 16), support=97, method=HugeBudget(value))
    assert [len(p) for p in picked] == [97, 97]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda s: s.to(torch.float8_e4m3fn), "float8_e4m3fn scores; return one of"),
        (lambda s: s.to_sparse(), "sparse_coo tensor; return a dense one"),
        (lambda s: s.to(torch.uint8), "uint8 scores; return one of"),
    ],
)
def test_scores_nothing_ranks_are_one_line(make, message):
    @dataclass(frozen=True)
    class Odd(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            return make(torch.ones(keys.shape[0], layout.n_blocks))

    with pytest.raises(SparseDecodeError, match=f"selector Odd: score_blocks returned .*{message}") as raised:
        select_support(torch.randn(4, 16), torch.randn(2, 400, 16), support=97, method=Odd())
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("compile", [False, True])
def test_rows_contradicting_per_query_head_are_one_line(compile, monkeypatch):
    from sparsedecode.compiled import decoder

    monkeypatch.setattr(decoder, "DEFAULT_BACKEND", "aot_eager")

    @dataclass(frozen=True)
    class OneRow(sd.TokenSelector):
        def rows(self, query_heads, kv_heads):
            return 1

        def score_positions(self, queries, keys, layout):
            return keys.float().sum(-1)[:1]

    model, ids = tiny_model("llama"), prompt(300)
    cfg = SparseConfig(support=97, selector=OneRow())
    with pytest.raises(SparseDecodeError, match=r"selector OneRow: rows\(4, 2\) returned 1, expected 2") as raised:
        sd.generate(model, ids, cfg, max_new_tokens=4, mode="sparse", compile=compile)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("kind", [RuntimeError, SparseDecodeError])
def test_a_selectors_error_of_several_lines_is_one_line(kind):
    @dataclass(frozen=True)
    class Talkative(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            raise kind("first line\nsecond line\n  third")

    with pytest.raises(SparseDecodeError, match="first line second line third") as raised:
        select_support(torch.randn(4, 16), torch.randn(2, 400, 16), support=97, method=Talkative())
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("base", ["mean-pooled", "quest:grouping=mean-query", "random-blocks"])
def test_twilights_candidates_come_from_any_block_selector(base):
    """Twilight's candidates are its base's support, for any block selector with a fixed budget (issue #39's
    "any block selector by parameter")."""
    from sparsedecode.layout import BlockLayout
    from sparsedecode.selectors.registry import parse_selector

    torch.manual_seed(0)
    queries, keys = torch.randn(6, 16), torch.randn(2, 600, 16)
    twilight = parse_selector(f"twilight:base={base}")
    assert twilight.spec() == f"twilight:base={base}"
    layout = BlockLayout(n=600, window=64, block_size=16, distant=193 - 1 - 64)
    mask = twilight.candidates(queries, keys, layout)
    expected = select_support(queries, keys, support=193, method=base)
    group = 6 // len(expected)
    for head in range(6):
        assert mask[head].nonzero().flatten().tolist() == expected[head // group].tolist()


def test_twilight_over_an_adaptive_base_decodes_and_refuses_token_bases():
    cfg = SparseConfig(support=97, selector="twilight:base=block-top-p")
    model, ids = tiny_model("llama"), prompt(300)
    assert len(sd.generate(model, ids, cfg, max_new_tokens=4, mode="sparse").tokens) == 4
    with pytest.raises(SparseDecodeError, match="base must be a block selector .* 'sparq', which selects tokens"):
        SparseConfig(selector="twilight:base=sparq")
    with pytest.raises(SparseDecodeError, match="twilight: base 'nothing': unknown selector"):
        SparseConfig(selector="twilight:base=nothing")


@pytest.mark.parametrize("scale", [1.0, 1e300])
def test_twilights_base_scores_are_ranked_at_their_own_precision(scale):
    """A base's float64 scores rank Twilight's candidates as they rank the base alone: steps float32 cannot resolve
    (1e-12 around 1.0) are not ties, and finite scores past float32's range (1e300) are not refused as infinite."""
    from sparsedecode.layout import BlockLayout

    @dataclass(frozen=True)
    class Fine(sd.BlockSelector):
        scale: float = 1.0

        def score_blocks(self, queries, keys, layout):
            ramp = torch.arange(layout.n_blocks, dtype=torch.float64) * 1e-12  # the later a block, the higher
            return ((1.0 + ramp) * self.scale).expand(keys.shape[0], -1)

    sd.register_selector(Fine, name="fine-float64-base", replace=True)
    queries, keys = torch.randn(4, 8), torch.randn(2, 400, 8)
    twilight = Twilight(base=f"fine-float64-base:scale={scale!r}")
    mask = twilight.candidates(queries, keys, BlockLayout(n=400, window=64, block_size=16, distant=97 - 1 - 64))
    for head, alone in enumerate(select_support(queries, keys, support=97, method=Fine(scale=scale))):
        assert mask[2 * head : 2 * head + 2].nonzero()[:, 1].unique().tolist() == alone.tolist()  # the last blocks
    assert len(select_support(queries, keys, support=97, method=twilight)) == 4  # decodes: nothing refused


def test_a_users_base_is_handed_copies():
    @dataclass(frozen=True)
    class ZeroesKeys(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            scores = mean_pooled_scores(group_mean_queries(queries, keys.shape[0]), keys[:, : layout.n_blocks].float())
            keys.data.zero_()
            return scores

    sd.register_selector(ZeroesKeys, name="zeroes-keys-base", replace=True)
    queries, keys = torch.randn(6, 16), torch.randn(2, 600, 16)
    kept = keys.clone()
    select_support(queries, keys, support=193, method="twilight:base=zeroes-keys-base")
    assert torch.equal(keys, kept)


def test_a_fresh_process_makes_twilight_with_a_builtin_base_before_the_registry():
    script = (
        "import sys\n"
        "from sparsedecode.selectors.methods.twilight import Twilight\n"
        "assert 'sparsedecode.selectors.registry' not in sys.modules\n"
        "print(Twilight(base='mean-pooled').base_selector.spec())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "mean-pooled", done.stderr[-800:]


def test_a_mean_pooled_subclass_with_a_support_per_query_head_is_one_line():
    """A subclass of mean-pooled that declares ``per_query_head`` but keeps its parent's scores (one row per KV head):
    ``select_support`` scored it in the kernels, which choose per KV head, and failed with an IndexError reading a
    support per query head from them; it is scored in torch as a decode step scores it, and its scores' shape is one
    line naming it."""
    from sparsedecode.selectors.methods.mean_pooled import MeanPooled

    @dataclass(frozen=True)
    class PerHeadMean(MeanPooled):
        @property
        def per_query_head(self):
            return True

    message = r"selector PerHeadMean: score_blocks returned shape \(2, 21\), expected \(4, 21\)"
    with pytest.raises(SparseDecodeError, match=message) as raised:
        select_support(torch.randn(4, 16), torch.randn(2, 400, 16), support=97, method=PerHeadMean())
    assert "\n" not in str(raised.value)
    model, ids = tiny_model("llama"), prompt(300)
    with pytest.raises(SparseDecodeError, match=r"selector PerHeadMean: score_blocks returned shape \(2, 15\)"):
        sd.generate(model, ids, SparseConfig(support=97, selector=PerHeadMean()), max_new_tokens=2, mode="sparse")


@dataclass(frozen=True)
class HeavyHitterOne(sd.TokenSelector):
    """H2O's ranking (the attention each position received) with an adaptive budget: one distant position a row."""

    uses_history = True

    def score_positions(self, queries, history, layout):
        return history

    def budget(self, scores, layout):
        return torch.ones(scores.shape[0], dtype=torch.long, device=scores.device)


def test_a_history_selector_with_an_adaptive_budget_attends_only_what_its_budget_keeps():
    """A token selector ranking by history (``uses_history``) with an adaptive budget attended every candidate its
    fixed budget held, the ones its budget dropped included, and reported them all as read."""
    from test_attention import greedy_loop

    model = tiny_model("llama")
    views = []
    with sd.sparse_decoding(model, SparseConfig(support=1 + 64 + 8, selector=HeavyHitterOne())) as session:
        session.observers.append(views.append)
        greedy_loop(model, prompt(200), 3)
    assert len(views) == 3 * 2
    for view in views:
        distant = view.valid & (view.index >= 1) & (view.index < view.layout.distant_end)
        assert distant.sum(dim=1).tolist() == [1, 1]
        group = view.query.shape[0] // view.keys.shape[0]
        for h in range(view.query.shape[0]):
            kept = view.index[h // group][view.valid[h // group]]
            keys, values = view.keys[h // group, kept].double(), view.values[h // group, kept].double()
            weights = torch.softmax(keys @ view.query[h].double() * view.scaling, dim=0)
            assert torch.allclose(view.output[h].double(), weights @ values, atol=1e-5)
