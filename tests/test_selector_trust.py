"""A user's selector cannot change anyone else's results (issue #42's silent cases): tensors it is handed are its
own copies and writing into them is refused; compiled decoders and the op's configurations are keyed by what a
selector is, not by its repr; built-in names and origins stay the built-ins'; budgets and scores are taken as given
or refused, never coerced."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
from conftest import prompt, tiny_model

import sparsedecode as sd
from sparsedecode import SparseConfig, SparseDecodeError, select_support
from sparsedecode.selectors.ops import group_mean_queries, mean_pooled_scores

WRITERS = '''
from dataclasses import dataclass

import torch

import sparsedecode
from sparsedecode.selectors import group_mean_queries


def blocks_of(queries, keys, layout):
    q = group_mean_queries(queries, keys.shape[0])
    logits = torch.einsum("hd,hnd->hn", q, keys.float())[:, 1 : layout.distant_end]
    pad = layout.n_blocks * layout.block_size - logits.shape[1]
    return torch.nn.functional.pad(logits, (0, pad)).view(keys.shape[0], layout.n_blocks, -1).sum(-1)


@dataclass(frozen=True)
class ScalesKeys(sparsedecode.BlockSelector):
    """Scores honestly, then halves the keys it was handed."""

    def score_blocks(self, queries, keys, layout):
        scores = blocks_of(queries, keys, layout)
        keys.mul_(0.5)
        return scores


@dataclass(frozen=True)
class ZeroesQueries(sparsedecode.TokenSelector):
    def score_positions(self, queries, keys, layout):
        scores = torch.einsum("hd,hnd->hn", queries.view(keys.shape[0], -1, keys.shape[-1]).mean(1), keys.float())
        queries[:] = 0
        return scores


@dataclass(frozen=True)
class ShiftsStatistics(sparsedecode.BlockSelector):
    statistics = ("mean",)

    def score_blocks(self, queries, stats, layout):
        mean = stats["mean"]
        scores = torch.einsum("hd,hnd->hn", queries.view(mean.shape[0], -1, mean.shape[-1]).mean(1), mean)
        mean.add_(3.0)
        return scores


@dataclass(frozen=True)
class WritesThroughData(sparsedecode.BlockSelector):
    """Writes where no version counter sees it: harmless only because it writes into a copy."""

    def score_blocks(self, queries, keys, layout):
        scores = blocks_of(queries, keys, layout)
        keys.data.mul_(0.0)
        keys.numpy()[:] = 7.0
        return scores
'''


@pytest.fixture(scope="module")
def writers(tmp_path_factory):
    path = tmp_path_factory.mktemp("writers") / "writers.py"
    path.write_text(WRITERS)
    return path


def _row(result) -> tuple:
    return (result.first_divergence, result.teacher_forced_match, result.sparse_ppl, result.sparse_tokens)


@pytest.mark.parametrize("writer", ["ScalesKeys", "ZeroesQueries", "ShiftsStatistics"])
def test_a_selector_writing_into_its_inputs_is_refused_and_later_rows_are_unchanged(writers, writer):
    model = tiny_model("llama")
    ids = prompt(260)
    reference = sd.dense_reference(model, ids, tokens=8)
    alone = {name: _row(sd.compare(model, None, ids, SparseConfig(support=97, selector=name), 8, reference=reference))
             for name in ("quest", "mean-pooled", "oracle-tokens")}  # fmt: skip
    with pytest.raises(SparseDecodeError) as raised:
        sd.compare(model, None, ids, SparseConfig(support=97, selector=f"{writers}:{writer}"), 8, reference=reference)
    message = str(raised.value)
    assert writer in message and "wrote into the tensors" in message and "\n" not in message
    after = {name: _row(sd.compare(model, None, ids, SparseConfig(support=97, selector=name), 8, reference=reference))
             for name in alone}  # fmt: skip
    assert after == alone


def test_writes_no_version_counter_sees_land_in_the_selectors_own_copy(writers):
    model = tiny_model("qwen2")
    ids = prompt(240)
    reference = sd.dense_reference(model, ids, tokens=8)
    before = _row(sd.compare(model, None, ids, SparseConfig(support=97, selector="quest"), 8, reference=reference))
    keys_before = [layer.keys.clone() for layer in reference.cache.layers]
    sd.compare(model, None, ids, SparseConfig(support=97, selector=f"{writers}:WritesThroughData"), 8,
               reference=reference)  # fmt: skip
    assert all(torch.equal(a, layer.keys) for a, layer in zip(keys_before, reference.cache.layers))
    after = _row(sd.compare(model, None, ids, SparseConfig(support=97, selector="quest"), 8, reference=reference))
    assert after == before


def test_select_support_leaves_the_callers_tensors_alone(writers):
    queries, keys = torch.randn(4, 16), torch.randn(2, 400, 16)
    kept_q, kept_k = queries.clone(), keys.clone()
    with pytest.raises(SparseDecodeError, match="ScalesKeys wrote into"):
        select_support(queries, keys, support=97, method=f"{writers}:ScalesKeys")
    select_support(queries, keys, support=97, method=f"{writers}:WritesThroughData")
    assert torch.equal(queries, kept_q) and torch.equal(keys, kept_k)


def test_builtins_are_handed_the_tensors_themselves_and_user_code_copies():
    from sparsedecode.selectors import calls as select
    from sparsedecode.selectors.methods.quest import Quest

    @dataclass(frozen=True)
    class Mine(Quest):
        def score_blocks(self, queries, stats, layout):
            return super().score_blocks(queries, stats, layout)

    assert select.trusted(Quest(), Quest().score_blocks)
    assert select.trusted(Quest(), Quest().budget)  # the protocol's default on a built-in
    assert not select.trusted(Mine(), Mine().score_blocks)  # a user's override of a built-in
    # a user's subclass is a user's class: its inherited methods may call what it overrides
    assert not select.trusted(Mine(), Mine().budget)


def _two_versions(tmp_path):
    """Two files, each with a class ``Sel`` of the same repr; v1 prefers the first blocks, v2 the last."""
    made = []
    for version, sign in (("v1", -1), ("v2", 1)):
        folder = tmp_path / version
        folder.mkdir()
        (folder / "sel.py").write_text(
            textwrap.dedent(
                f"""
                from dataclasses import dataclass
                import torch
                import sparsedecode

                @dataclass(frozen=True)
                class Sel(sparsedecode.BlockSelector):
                    def score_blocks(self, queries, keys, layout):
                        return {sign} * torch.arange(layout.n_blocks, dtype=torch.float32).expand(keys.shape[0], -1)
                """
            )
        )
        made.append(f"{folder / 'sel.py'}:Sel")
    return made


def test_configurations_are_told_apart_by_what_their_selector_is(tmp_path):
    from sparsedecode.compiled.op import config_key

    v1, v2 = (SparseConfig(support=97, selector=spec) for spec in _two_versions(tmp_path))
    assert repr(v1) == repr(v2) and v1.identity() != v2.identity()
    assert config_key(v1) != config_key(v2)
    assert config_key(v1) == config_key(SparseConfig(support=97, selector=v1.selector))
    assert SparseConfig(selector="quest").identity() == SparseConfig(selector="quest").identity()
    low, high = SparseConfig(selector="block-top-p:p=0.8"), SparseConfig(selector="block-top-p:p=0.9")
    assert low.identity() != high.identity()


def test_compiled_generation_keeps_two_same_named_selectors_apart(tmp_path, monkeypatch):
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = tiny_model("llama")
    ids = prompt(300)
    runs = {}
    for spec in _two_versions(tmp_path):
        cfg = SparseConfig(support=97, selector=spec)
        compiled = sd.generate(model, ids, cfg, max_new_tokens=8, mode="sparse", compile=True)
        eager = sd.generate(model, ids, cfg, max_new_tokens=8, mode="sparse")
        assert compiled.tokens == eager.tokens
        runs[spec] = compiled.tokens
    assert len(model.__dict__["_sparsedecode_decoders"]) == 2


def test_a_builtin_name_cannot_be_taken_even_before_any_lookup():
    """In a fresh interpreter, where a decorator at import time runs before anything looked a selector up."""
    script = textwrap.dedent(
        """
        from dataclasses import dataclass
        import torch, sparsedecode as sd
        from sparsedecode.selectors import registry

        @dataclass(frozen=True)
        class Impostor(sd.BlockSelector):
            def score_blocks(self, queries, keys, layout):
                return torch.zeros(keys.shape[0], layout.n_blocks)

        refused = 0
        for name in ("quest", "streaming"):
            for replace in (False, True):
                try:
                    registry.register_selector(Impostor, name=name, replace=replace)
                except sd.SparseDecodeError as error:
                    refused += "built-in" in str(error)
        names = ("quest", "streaming", "block-top-p", "sparq", "random-blocks", "sink-streaming")
        print(refused, all(registry.selector_class(n).__module__.startswith("sparsedecode.selectors.") for n in names))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["4", "True"]


def test_a_retired_builtin_name_cannot_be_taken(monkeypatch):
    """``top-p`` was a built-in's name: stored rows naming it are read as ``block-top-p``'s, so a user's selector
    registered under it (in code or by entry point) would have its rows read as another method's."""
    from sparsedecode.protocol.results import upgrade_selector
    from sparsedecode.selectors import registry

    @dataclass(frozen=True)
    class Mine(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            return torch.zeros(keys.shape[0], layout.n_blocks)

    assert upgrade_selector({"selector": "top-p"})["selector"] == "block-top-p"  # what its rows would become
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # nothing registered here outlives the test
    for replace in (False, True):
        with pytest.raises(SparseDecodeError, match="selector name 'top-p' was a built-in's") as raised:
            sd.register_selector(Mine, name="top-p", replace=replace)
        assert "\n" not in str(raised.value)

    class Point:  # a pip-installed package's entry point under that name is left out, as one under a built-in's
        name, value = "top-p", "pkg:Mine"

        def load(self):
            return Mine

    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [Point()])
    monkeypatch.setattr(registry, "_ENTRY_POINTS_LOADED", False)
    with pytest.raises(SparseDecodeError, match="top-p is now block-top-p"):
        registry.selector_class("top-p")


def test_a_refused_registration_leaves_the_class_its_name(monkeypatch):
    """A name refused (a built-in's, or one taken) is not given to the class: it stays named as itself, and a name it
    is then registered under is the one its rows carry (it kept the refused one, so rows of a class registered as
    ``mine`` after ``quest`` was refused named it ``quest`` and were read as the built-in's)."""
    from sparsedecode.selectors import registry

    @dataclass(frozen=True)
    class Mine(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            return torch.zeros(keys.shape[0], layout.n_blocks)

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # nothing registered here outlives the test
    for refused in ("quest", "top-p"):
        with pytest.raises(SparseDecodeError, match="built-in's"):
            sd.register_selector(Mine, name=refused)
        assert Mine().spec() == "Mine"
    sd.register_selector(Mine, name="mine-after-refusals")
    assert (
        Mine().spec() == "mine-after-refusals"
        and registry.parse_selector("mine-after-refusals").spec() == Mine().spec()
    )


def test_a_class_is_registered_under_its_own_name_alone(monkeypatch):
    """A class naming itself ``mine`` registered as ``other`` wrote ``mine`` as its spec, which did not read back
    (or read back as another class); so did a class registered twice under two names (the first became its own)."""
    from sparsedecode.selectors import registry

    @dataclass(frozen=True)
    class Mine(sd.BlockSelector):
        name = "mine-own-name"

        def score_blocks(self, queries, keys, layout):
            return torch.zeros(keys.shape[0], layout.n_blocks)

    Unnamed = type("Unnamed", (Mine,), {"name": ""})
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # nothing registered here outlives the test
    with pytest.raises(SparseDecodeError, match="names itself 'mine-own-name'"):
        sd.register_selector(Mine, name="mine-other-name")
    assert "mine-other-name" not in registry._REGISTRY
    sd.register_selector(Mine, name="mine-own-name")
    sd.register_selector(Unnamed, name="unnamed-first")
    with pytest.raises(SparseDecodeError, match="names itself 'unnamed-first'"):
        sd.register_selector(Unnamed, name="unnamed-second")
    for selector in (Mine(), Unnamed()):
        assert registry.parse_selector(selector.spec()) == selector


@pytest.mark.parametrize("own", ["mean-pooled", "top-p", "quest"])
def test_an_unregistered_class_named_as_a_builtin_is_refused(own):
    """A user's class that calls itself by a built-in's name (an attribute, or its class name) without registering
    wrote that name as its spec, so its rows read back as the built-in's (SparseConfig.from_dict rebuilt the
    built-in); passed as itself (instance or class) it is now refused in one line, as registering the name is."""

    @dataclass(frozen=True)
    class Mine(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            return torch.zeros(keys.shape[0], layout.n_blocks)

    Mine.name = own
    Bare = type(own, (Mine,), {"name": ""})  # named by its class name alone
    for selector in (Mine(), Mine, Bare):
        with pytest.raises(SparseDecodeError, match="a built-in selector's name"):
            SparseConfig(support=97, selector=selector)
        with pytest.raises(SparseDecodeError, match="a built-in selector's name"):
            select_support(torch.randn(4, 8), torch.randn(2, 300, 8), support=97, method=selector)
    Mine.name = "mine-unregistered"
    assert SparseConfig(support=97, selector=Mine()).selector.spec() == "mine-unregistered"


def test_a_name_that_is_no_string_is_refused_in_one_line():
    @dataclass(frozen=True)
    class Numbered(sd.BlockSelector):
        name = 3  # a TypeError traceback from the name's checks

        def score_blocks(self, queries, keys, layout):
            return torch.zeros(keys.shape[0], layout.n_blocks)

    for call in (lambda: sd.register_selector(Numbered), lambda: sd.register_selector(Numbered, name=("a",))):
        with pytest.raises(SparseDecodeError, match="a name is a string"):
            call()


def test_a_file_reexporting_a_builtin_leaves_the_builtins_origin(tmp_path):
    path = tmp_path / "again.py"
    path.write_text(
        "from sparsedecode.selectors.methods.quest import Quest\nfrom sparsedecode.selectors.methods.oracle import *\n"
    )
    reexported = SparseConfig(selector=f"{path}:Quest").selector
    assert reexported.source is None and reexported.spec() == "quest"
    plain = SparseConfig(selector="quest").selector
    assert plain.source is None and "selector_sha256" not in plain.record()


def test_a_subclass_does_not_inherit_its_parents_file(tmp_path):
    path = tmp_path / "parent.py"
    path.write_text(
        "from dataclasses import dataclass\nimport torch, sparsedecode\n\n@dataclass(frozen=True)\n"
        "class Parent(sparsedecode.BlockSelector):\n    def score_blocks(self, q, k, layout):\n"
        "        return torch.zeros(k.shape[0], layout.n_blocks)\n"
    )
    parent = type(SparseConfig(selector=f"{path}:Parent").selector)

    @dataclass(frozen=True)
    class Child(parent):
        pass

    assert parent.source is not None and Child.source is None and Child().spec() == "Child"


BUDGETS = {
    "negative": torch.tensor([-3, 1]),
    "nan": torch.tensor([float("nan"), 1.0]),
    "fractional": torch.tensor([1.9, 1.0]),
    "infinite": torch.tensor([float("inf"), 1.0]),
    "boolean": torch.tensor([True, False]),
}


@pytest.mark.parametrize("case", sorted(BUDGETS))
def test_a_budget_is_whole_counts_or_refused(case):
    counts = BUDGETS[case]

    @dataclass(frozen=True)
    class Budgeted(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            return mean_pooled_scores(group_mean_queries(queries, keys.shape[0]), keys[:, : layout.n_blocks].float())

        def budget(self, scores, layout):
            return counts.clone()

    with pytest.raises(SparseDecodeError, match="Budgeted: budget returned") as raised:
        select_support(torch.randn(4, 8), torch.randn(2, 400, 8), support=193, method=Budgeted())
    assert "\n" not in str(raised.value)


def test_whole_float_budgets_and_counts_past_b_are_taken():
    @dataclass(frozen=True)
    class Budgeted(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            return -torch.arange(layout.n_blocks, dtype=torch.float64).expand(keys.shape[0], -1)

        def budget(self, scores, layout):
            return torch.tensor([2.0, 100.0])

    picked = select_support(torch.randn(4, 8), torch.randn(2, 400, 8), support=193, method=Budgeted())
    assert len(picked[0]) == 1 + 2 * 16 + 64 and len(picked[1]) == 1 + 8 * 16 + 64


def test_float64_scores_are_ranked_at_their_own_precision():
    @dataclass(frozen=True)
    class Fine(sd.BlockSelector):
        scale: float = 1.0

        def score_blocks(self, queries, keys, layout):
            # the later a block, the higher, by steps float32 cannot resolve (1e-12 around 1.0 or 1e300)
            ramp = torch.arange(layout.n_blocks, dtype=torch.float64) * 1e-12
            return ((1.0 + ramp) * self.scale).expand(keys.shape[0], -1)

    keys = torch.randn(2, 400, 8)
    n_blocks = (400 - 64 - 1 + 15) // 16
    for scale in (1.0, 1e300):
        picked = select_support(torch.randn(4, 8), keys, support=97, method=Fine(scale=scale))
        # the last two blocks (the last one short), then the window
        assert picked[0].tolist() == [0, *range(1 + (n_blocks - 2) * 16, 400)], scale


@pytest.mark.parametrize("where", ["meta", "scores"])
def test_scores_on_another_device_are_one_error(where):
    @dataclass(frozen=True)
    class Meta(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            return torch.zeros(keys.shape[0], layout.n_blocks, device="meta")

    @dataclass(frozen=True)
    class MetaBudget(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            return torch.zeros(keys.shape[0], layout.n_blocks)

        def budget(self, scores, layout):
            return torch.ones(scores.shape[0], dtype=torch.long, device="meta")

    selector = Meta() if where == "meta" else MetaBudget()
    with pytest.raises(SparseDecodeError, match="on device meta") as raised:
        select_support(torch.randn(4, 8), torch.randn(2, 400, 8), support=193, method=selector)
    assert "\n" not in str(raised.value)


META = """
from dataclasses import dataclass
import torch
import sparsedecode


@dataclass(frozen=True)
class MetaStats(sparsedecode.BlockSelector):
    statistics = ("mean",)

    def score_blocks(self, queries, stats, layout):
        return torch.zeros(stats["mean"].shape[0], layout.n_blocks, device="meta")


@dataclass(frozen=True)
class MetaTokens(sparsedecode.TokenSelector):
    def score_positions(self, queries, keys, layout):
        return torch.zeros(keys.shape[0], layout.n, device="meta")
"""


@pytest.fixture(scope="module")
def meta_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("meta") / "meta.py"
    path.write_text(META)
    return path


def test_compiled_decoding_refuses_scores_on_the_meta_device_in_one_line(meta_file, monkeypatch):
    """A user's statistics selector never runs inside a traced graph, where a wrong device ended in the compiler's
    traceback: the traced form refuses it in one line, and the op's step checks its scores."""
    from sparsedecode.compiled import decoder as compiled
    from sparsedecode.step.device import serves

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    cfg = SparseConfig(support=97, selector=f"{meta_file}:MetaStats")
    assert not serves(cfg) and serves(SparseConfig(support=97, selector="quest:grouping=mean-query"))
    model = tiny_model("llama")
    with pytest.raises(SparseDecodeError, match="host-free compiled step serves") as raised:
        compiled.CompiledDecoder(model, cfg, batch=1, max_len=320, backend="aot_eager", form="traced")
    assert "\n" not in str(raised.value)
    with pytest.raises(SparseDecodeError, match="MetaStats: score_blocks returned scores on device meta") as raised:
        sd.generate(model, prompt(300), cfg, max_new_tokens=4, mode="sparse", compile=True)
    assert "\n" not in str(raised.value)


def test_run_and_bench_op_refuse_scores_on_the_meta_device_in_one_line(meta_file, tiny_model_dir, capsys, monkeypatch):
    from sparsedecode.cli import main
    from sparsedecode.experiments import bench_operator

    monkeypatch.setattr(bench_operator, "read_bandwidth_gbs", lambda *a, **k: 12.5)
    commands = [
        ["run", "--model", str(tiny_model_dir), "--context", "200", "--support", "97", "--tokens", "4"],
        ["bench", "op", "--shape", "smollm2-135m", "--context", "512", "--support", "97", "--budget", "0.001",
         "--layers", "1"],
    ]  # fmt: skip
    for command in commands:
        for name in ("MetaStats", "MetaTokens"):
            assert main([*command, "--selector", f"{meta_file}:{name}"]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{name}: score_" in err and "device meta" in err, err


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_budgets_of_any_integer_dtype_are_taken(dtype):
    """Found by probing: a budget from ``.int()`` failed with a bare RuntimeError (the cap overflowed int32)."""

    @dataclass(frozen=True)
    class Budgeted(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            return -torch.arange(layout.n_blocks, dtype=torch.float64).expand(keys.shape[0], -1)

        def budget(self, scores, layout):
            return torch.tensor([2, 100]).to(dtype)

    picked = select_support(torch.randn(4, 8), torch.randn(2, 400, 8), support=193, method=Budgeted())
    assert len(picked[0]) == 1 + 2 * 16 + 64 and len(picked[1]) == 1 + 8 * 16 + 64


def test_a_selector_editing_the_layout_it_is_handed_changes_nothing():
    """Found by probing: the layout is frozen, but ``object.__setattr__`` wrote into the library's own: a support of
    97 read 112 positions (the window read from the edited layout). A user's selector is handed a copy."""

    @dataclass(frozen=True)
    class Honest(sd.TokenSelector):
        def score_positions(self, queries, keys, layout):
            return torch.einsum("hd,hnd->hn", group_mean_queries(queries, keys.shape[0]), keys.float())

    @dataclass(frozen=True)
    class WidensWindow(Honest):
        def score_positions(self, queries, keys, layout):
            object.__setattr__(layout, "window", layout.window + 16)
            object.__setattr__(layout, "n", layout.n - 40)
            return super().score_positions(queries, keys, layout)

    model, ids = tiny_model("llama"), prompt(300)
    runs = [sd.generate(model, ids, SparseConfig(support=97, selector=s()), 8, mode="sparse") for s in (Honest,
            WidensWindow)]  # fmt: skip
    assert runs[0].tokens == runs[1].tokens
    queries, keys = torch.randn(4, 16), torch.randn(2, 400, 16)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            select_support(queries, keys, support=97, method=Honest()),
            select_support(queries, keys, support=97, method=WidensWindow()),
        )
    )


SUBCLASSES = """
from dataclasses import dataclass

import torch

import sparsedecode
from sparsedecode.selectors.methods.mean_pooled import MeanPooled


@dataclass(frozen=True)
class MaxStatistics(MeanPooled):
    statistics = ("max",)


@dataclass(frozen=True)
class Refuses(sparsedecode.BlockSelector):
    def score_blocks(self, queries, keys, layout):
        raise sparsedecode.SparseDecodeError("something is wrong")


@dataclass(frozen=True)
class Nested(sparsedecode.BlockSelector):
    def score_blocks(self, queries, keys, layout):
        return torch.nested.nested_tensor([torch.zeros(layout.n_blocks)] * keys.shape[0])


@dataclass(frozen=True)
class Base(sparsedecode.BlockSelector):
    def score_blocks(self, queries, keys, layout):
        return torch.zeros(keys.shape[0], layout.n_blocks) + SIGN


SIGN = 1.0
"""


@pytest.mark.parametrize(
    "name, message",
    [
        ("MaxStatistics", "KeyError: 'mean'"),  # the kernel's mean-dot scoring read statistics it does not keep
        ("Refuses", "something is wrong"),  # an error of its own, named
        ("Nested", "nested tensor"),
    ],
)
def test_a_users_selector_failing_is_one_line_naming_it(tmp_path, name, message):
    path = tmp_path / "subclasses.py"
    path.write_text(SUBCLASSES)
    with pytest.raises(SparseDecodeError, match=message) as raised:
        select_support(torch.randn(4, 16), torch.randn(2, 400, 16), support=97, method=f"{path}:{name}")
    assert f"selector {path}:{name}" in str(raised.value) and "\n" not in str(raised.value)


def test_twilights_base_from_a_file_is_named_parsed_and_told_apart(tmp_path):
    """Found by probing: ``twilight:base=file.py:Class`` (what its own spec() writes) was read as the file
    'twilight:base=file.py'; an edited base file kept the compiled decoders of the first (keyed by the base's name)."""
    from sparsedecode.selectors.registry import parse_selector

    path = tmp_path / "bases.py"
    path.write_text(SUBCLASSES)
    first = SparseConfig(support=97, selector=f"twilight:base={path}:Base")
    assert parse_selector(first.selector.spec()).identity() == first.selector.identity()
    record = first.selector.record()
    assert record["base_sha256"] and record["selector"] == f"twilight:base={path}:Base"
    path.write_text(SUBCLASSES.replace("SIGN = 1.0", "SIGN = -1.0"))
    second = SparseConfig(support=97, selector=f"twilight:base={path}:Base")
    assert repr(first) == repr(second) and first.identity() != second.identity()
    assert second.selector.record()["base_sha256"] != record["base_sha256"]


def test_a_selector_writing_into_the_scores_it_returned_changes_nothing():
    """Found probing selectors that keep references: one that kept the scores ``score_blocks`` returned and negated
    them in place in its ``budget`` (a reused buffer does the same) changed the scores the library ranked the chosen
    blocks by between its top-b and the budget's mask, silently (other tokens than the same selector without the
    write). The library keeps its own copy of what a user's selector returns."""

    @dataclass(frozen=True)
    class Budgeted(sd.BlockSelector):
        statistics = ("mean",)

        def score_blocks(self, queries, statistics, layout):
            centroids = statistics["mean"]
            return mean_pooled_scores(group_mean_queries(queries, centroids.shape[0]), centroids)

        def budget(self, scores, layout):
            return torch.full((scores.shape[0],), 2, dtype=torch.long)

    @dataclass(frozen=True)
    class RewritesItsScores(Budgeted):
        def score_blocks(self, queries, statistics, layout):
            self.__dict__["returned"] = scores = super().score_blocks(queries, statistics, layout)
            return scores

        def budget(self, scores, layout):
            self.__dict__["returned"].mul_(-1)
            return super().budget(scores, layout)

    model, ids = tiny_model("llama"), prompt(150)
    runs = [sd.generate(model, ids, SparseConfig(support=41, window=8, block_size=8, selector=s()), 10, mode="sparse")
            for s in (Budgeted, RewritesItsScores)]  # fmt: skip
    assert runs[0].tokens == runs[1].tokens
    queries, keys = torch.randn(4, 16), torch.randn(2, 400, 16)
    picked = [select_support(queries, keys, support=97, method=s()) for s in (Budgeted, RewritesItsScores)]
    assert all(torch.equal(a, b) for a, b in zip(*picked))


@pytest.mark.parametrize("rule, statistics", [("mean-dot", ("min", "max")), ("max-dot", ("mean",))])
def test_a_kernel_scoring_the_kernels_cannot_serve_is_refused_in_one_line(rule, statistics):
    """A class claiming the kernels' mean-dot scoring over statistics without block means (or a rule the kernels do
    not know) reached the C kernel, which failed with a message about centroid storage naming no selector."""

    @dataclass(frozen=True)
    class Claims(sd.BlockSelector):
        def score_blocks(self, queries, stats, layout):
            return stats[self.statistics[0]].sum(-1)

    Claims.statistics, Claims.kernel_scoring = statistics, rule
    with pytest.raises(SparseDecodeError, match="selector class Claims: kernel_scoring"):
        select_support(torch.randn(4, 8), torch.randn(2, 300, 8), support=97, method=Claims())
