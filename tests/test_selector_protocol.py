"""The selector protocol (issue #24): a user's class, in a file outside the package, through the library and every
command; the registry and the spec syntax; what a failing selector gets; the published methods built on it."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import SELECTORS, prompt, tiny_model
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sparsedecode as sd
from sparsedecode import SparseConfig, SparseDecodeError, select_support
from sparsedecode.layout import BlockLayout
from sparsedecode.selectors import parse_selector, registry, resolve_selector, split_selector_list
from sparsedecode.selectors.ops import block_centroids, group_mean_queries, mean_pooled_scores

USER_SELECTOR = '''
"""A user's selector: blocks by the largest logit any of their keys gets under the group-mean query."""
from dataclasses import dataclass

import torch

import sparsedecode
from sparsedecode.selectors import group_mean_queries


@dataclass(frozen=True)
class MaxKeyBlocks(sparsedecode.BlockSelector):
    """Blocks by their best key (a max-pooled variant of the mean-pooled selector)."""

    temperature: float = 1.0

    def __post_init__(self):
        if not self.temperature > 0:
            raise sparsedecode.SparseDecodeError(f"temperature must be > 0, got {self.temperature}")

    def score_blocks(self, queries, keys, layout):
        q = group_mean_queries(queries, keys.shape[0])
        logits = torch.einsum("hd,hnd->hn", q, keys.float())[:, 1 : layout.distant_end] / self.temperature
        pad = layout.n_blocks * layout.block_size - logits.shape[1]
        padded = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
        return padded.view(keys.shape[0], layout.n_blocks, -1).amax(dim=-1)


@dataclass(frozen=True)
class LastKeys(sparsedecode.TokenSelector):
    """Distant positions by recency (token level)."""

    def score_positions(self, queries, keys, layout):
        return torch.arange(keys.shape[1], dtype=torch.float32).expand(keys.shape[0], -1)


@dataclass(frozen=True)
class WrongShape(sparsedecode.BlockSelector):
    def score_blocks(self, queries, keys, layout):
        return torch.zeros(keys.shape[0], layout.n_blocks + 1)


@dataclass(frozen=True)
class NotFinite(sparsedecode.BlockSelector):
    def score_blocks(self, queries, keys, layout):
        return torch.full((keys.shape[0], layout.n_blocks), float("nan"))


@dataclass(frozen=True)
class Raises(sparsedecode.BlockSelector):
    def score_blocks(self, queries, keys, layout):
        raise RuntimeError("boom")
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_selectors.py"
    path.write_text(USER_SELECTOR)
    return path


def max_key_blocks_reference(queries, keys, support, window, block):
    """An independent implementation of MaxKeyBlocks' selection in numpy: positions per KV head."""
    q = queries.double().numpy()
    k = keys.double().numpy()
    kv, n, d = k.shape
    group = q.shape[0] // kv
    b = (support - 1 - window) // block
    if n <= 1 + window + b * block:
        return [list(range(n)) for _ in range(kv)]
    end = n - window
    out = []
    for h in range(kv):
        qm = q[h * group : (h + 1) * group].mean(axis=0)
        starts = list(range(1, end, block))
        scores = [max(float(k[h, p] @ qm) for p in range(s, min(s + block, end))) for s in starts]
        order = sorted(range(len(starts)), key=lambda j: (-scores[j], j))[:b]
        distant = sorted(p for j in order for p in range(starts[j], min(starts[j] + block, end)))
        out.append([0, *distant, *range(end, n)])
    return out


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(60, 400),
    kv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 4]),
    b=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_a_file_selector_selects_what_an_independent_implementation_selects(user_file, n, kv, group, b, seed):
    generator = torch.Generator().manual_seed(seed)
    d, window, block = 8, 16, 8
    queries = torch.randn(kv * group, d, generator=generator)
    keys = torch.randn(kv, n, d, generator=generator)
    support = 1 + window + b * block
    got = select_support(
        queries, keys, support=support, window=window, block_size=block, method=f"{user_file}:MaxKeyBlocks"
    )
    # float32 scores against float64 ones: a near-tie could order differently, so the draws avoid exact ties only
    assert [g.tolist() for g in got] == max_key_blocks_reference(queries, keys, support, window, block)


def test_spec_strings_parameters_and_lists(user_file):
    assert parse_selector("mean-pooled").spec() == "mean-pooled"
    assert parse_selector("block-top-p:p=0.80").spec() == "block-top-p:p=0.8"
    assert parse_selector("block-top-p:p=0.8").params() == {"p": 0.8}
    assert (
        parse_selector(f"{user_file}:MaxKeyBlocks:temperature=2").spec() == f"{user_file}:MaxKeyBlocks:temperature=2.0"
    )
    assert parse_selector(f"{user_file}:MaxKeyBlocks").source[1] == registry.read_source(str(user_file))[0]
    assert split_selector_list("mean-pooled,sparq:rank=4,block-top-p:p=0.5,quest") == [
        "mean-pooled",
        "sparq:rank=4",
        "block-top-p:p=0.5",
        "quest",
    ]
    for bad, says in [
        ("nope", "unknown selector 'nope'"),
        ("block-top-p:q=1", "has no parameter 'q'"),
        ("block-top-p:p=abc", "is not float"),
        ("block-top-p:p=2", "p must be a number in (0, 1]"),
        ("sparq:rank=1.5", "is not int"),
        ("block-top-p:p", "parameters are key=value"),
        (f"{user_file}:Nothing", "has no class 'Nothing'"),
        (f"{user_file}:MaxKeyBlocks:temperature=-1", "temperature must be > 0"),
        ("/no/such/file.py:Cls", "does not exist"),
    ]:
        with pytest.raises(SparseDecodeError, match=None) as raised:
            parse_selector(bad)
        assert says in str(raised.value), (bad, str(raised.value))


def test_register_selector_as_a_decorator_and_by_entry_point(monkeypatch):
    from dataclasses import dataclass

    @sd.register_selector
    @dataclass(frozen=True)
    class FirstBlocks(sd.BlockSelector):
        name = "test-first-blocks"

        def score_blocks(self, queries, keys, layout):
            return -torch.arange(layout.n_blocks, dtype=torch.float32).expand(keys.shape[0], -1)

    try:
        assert "test-first-blocks" in registry.selector_names()
        picked = select_support(torch.randn(4, 8), torch.randn(2, 300, 8), support=97, method="test-first-blocks")
        assert picked[0][:3].tolist() == [0, 1, 2]  # block 0 first
        with pytest.raises(SparseDecodeError, match="taken by"):

            @sd.register_selector(name="test-first-blocks")
            @dataclass(frozen=True)
            class Other(sd.BlockSelector):
                def score_blocks(self, queries, keys, layout):
                    return torch.zeros(keys.shape[0], layout.n_blocks)

        class Point:  # what importlib.metadata yields for a pip-installed package's entry point
            name, value = "test-entry-blocks", "pkg:FirstBlocks"

            def load(self):  # a class of its own: a class is registered under one name, the one its rows carry
                return EntryBlocks

        EntryBlocks = type("EntryBlocks", (FirstBlocks,), {"name": ""})

        monkeypatch.setattr(
            registry.metadata, "entry_points", lambda group: [Point()] if group == registry.ENTRY_POINTS else []
        )
        monkeypatch.setattr(registry, "_ENTRY_POINTS_LOADED", False)
        assert type(resolve_selector("test-entry-blocks")) is EntryBlocks
    finally:
        registry._REGISTRY.pop("test-first-blocks", None)
        registry._REGISTRY.pop("test-entry-blocks", None)


@pytest.mark.parametrize(
    "cls, says",
    [
        ("WrongShape", "returned shape"),
        ("NotFinite", "hold NaN or infinite values"),
        ("Raises", "failed in score_blocks: RuntimeError"),
    ],
)
def test_a_failing_selector_is_one_error_naming_it(user_file, cls, says):
    model = tiny_model("llama")
    with pytest.raises(SparseDecodeError) as raised:
        sd.compare(model, None, prompt(200), SparseConfig(support=97, selector=f"{user_file}:{cls}"), tokens=4)
    message = str(raised.value)
    assert says in message and cls in message and "\n" not in message


def test_a_selector_instance_and_a_file_selector_pickle_with_their_source(user_file):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Local(sd.BlockSelector):  # an unregistered class: SparseConfig takes the instance as it is
        def score_blocks(self, queries, keys, layout):
            return torch.zeros(keys.shape[0], layout.n_blocks)

    assert SparseConfig(selector=Local()).selector == Local()
    file_selector = parse_selector(f"{user_file}:MaxKeyBlocks:temperature=3")
    script = textwrap.dedent(
        """
        import pickle, sys
        selector = pickle.loads(sys.stdin.buffer.read())
        print(selector.spec().rsplit(":", 2)[-2:], selector.source[1][:12])
        """
    )
    # a fresh interpreter in which the file's path does not exist: the content travels with the pickle
    moved = pickle.dumps(file_selector)
    user_file_backup = user_file.read_text()
    user_file.unlink()
    try:
        out = subprocess.run([sys.executable, "-c", script], input=moved, capture_output=True, check=True).stdout
    finally:
        user_file.write_text(user_file_backup)
    assert out.decode().split() == ["['MaxKeyBlocks',", "'temperature=3.0']", file_selector.source[1][:12]]


# --- the published selectors -------------------------------------------------------------------------------------


def test_top_p_reads_at_most_the_support_and_p_one_is_mean_pooled():
    model = tiny_model("llama")
    ids = prompt(300, seed=4)
    whole = sd.compare(model, None, ids, SparseConfig(support=129, selector="block-top-p:p=1.0"), tokens=12)
    reference = sd.compare(model, None, ids, SparseConfig(support=129, selector="mean-pooled"), tokens=12)
    assert (
        whole.sparse_tokens == reference.sparse_tokens
        and whole.teacher_forced_tokens == reference.teacher_forced_tokens
    )
    assert whole.support_read_max <= 129
    low = sd.compare(model, None, ids, SparseConfig(support=129, selector="block-top-p:p=0.02"), tokens=12)
    assert 1 + 64 + 1 <= low.support_read_min <= low.support_read_mean <= low.support_read_max <= 129
    assert (
        low.support_read_mean < whole.support_read_mean
    )  # the budget adapts: one block where 2% of the estimated mass is reached


def test_top_p_budget_is_the_fewest_blocks_reaching_p():
    from sparsedecode.selectors.methods.top_p import blocks_for_mass

    estimated = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    assert blocks_for_mass(estimated, 0.5, estimated).tolist() == [1, 1]
    assert blocks_for_mass(estimated, 0.8, estimated).tolist() == [2, 3]
    # p = 1 keeps every block, even where the cumulative share rounds to 1 before the last (found by probing)
    sharp = torch.tensor([[1.0, 1e-9, 1e-10, 1e-12]])
    assert blocks_for_mass(sharp, 1.0, sharp).tolist() == [4]
    assert blocks_for_mass(estimated, 1.0, estimated).tolist() == [4, 4]  # the whole budget, as documented
    # counted in the selection's order, by score: a short block scoring first holds little of the mass
    scores = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    assert blocks_for_mass(torch.tensor([[0.3, 0.3, 0.3, 0.1]]), 0.9, scores).tolist() == [4]
    assert blocks_for_mass(torch.tensor([[0.3, 0.3, 0.3, 0.1]]), 0.35, scores).tolist() == [2]  # ties: lower first


@example(n=19, window=2, block=5, b=3, p=0.9, seed=254)  # the short last block scores first (probed)
@settings(max_examples=60, deadline=None)
@given(n=st.integers(20, 120), window=st.integers(1, 9), block=st.integers(2, 9), b=st.integers(1, 6),
       p=st.floats(0.05, 1.0), seed=st.integers(0, 2**16))  # fmt: skip
def test_top_p_keeps_the_fewest_top_scored_blocks_reaching_p(n, window, block, b, p, seed):
    """block-top-p's support, against the definition computed here: the distant blocks ranked by mean-pooled score
    (ties to the lower block), their estimated shares ``len_j exp(s_j)`` normalised over the distant blocks, the
    fewest leading ones whose shares reach ``p``, at most ``b``; anchor and window besides."""
    generator = torch.Generator().manual_seed(seed)
    queries, keys = torch.randn(4, 16, generator=generator) * 2, torch.randn(2, n, 16, generator=generator)
    support = 1 + window + b * block
    got = select_support(queries, keys, support=support, window=window, block_size=block, method=f"block-top-p:p={p}")
    layout = BlockLayout(n=n, window=window, block_size=block)
    if n <= support or layout.n_blocks == 0:
        return
    scores = mean_pooled_scores(group_mean_queries(queries, 2), block_centroids(keys, layout)).double()
    lengths = layout.block_lengths(torch.arange(layout.n_blocks)).double()
    for head in range(2):
        estimated = lengths * torch.exp(scores[head] - scores[head].max())
        shares = (estimated / estimated.sum()).tolist()
        ranked = sorted(range(layout.n_blocks), key=lambda j: (-float(scores[head, j]), j))
        kept, total = [], 0.0
        for j in ranked[:b]:
            if kept and total >= p:
                break
            kept.append(j)
            total += shares[j]
        distant = {int(pos) for pos in got[head].tolist() if 1 <= pos < layout.distant_end}
        expected = {pos for j in kept for pos in range(1 + j * block, min(1 + (j + 1) * block, layout.distant_end))}
        assert distant == expected, (head, kept)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(100, 300), rank=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_sparq_mean_query_scores_are_the_logits_over_the_largest_query_channels(n, rank, seed):
    """The variant this project ran before the official group rule (``grouping=mean-query``)."""
    generator = torch.Generator().manual_seed(seed)
    queries, keys = torch.randn(4, 16, generator=generator), torch.randn(2, n, 16, generator=generator)
    got = select_support(queries, keys, support=97, method=f"sparq:rank={rank},grouping=mean-query")
    q = queries.double().numpy().reshape(2, 2, 16).mean(axis=1)
    for h in range(2):
        channels = sorted(range(16), key=lambda c: (-abs(q[h, c]), c))[:rank]
        scores = keys[h].double().numpy()[:, channels] @ q[h, channels]
        distant = sorted(range(1, n - 64), key=lambda p: (-scores[p], p))[:32]
        assert got[h].tolist() == [0, *sorted(distant), *range(n - 64, n)]


def test_sink_streaming_keeps_the_sinks_and_the_latest():
    got = select_support(torch.randn(4, 8), torch.randn(2, 300, 8), support=97, method="sink-streaming")
    assert got[0].tolist() == [0, 1, 2, 3, *range(300 - 93, 300)]
    one = select_support(torch.randn(4, 8), torch.randn(2, 300, 8), support=97, method="sink-streaming:sinks=1")
    assert one[0].tolist() == [0, *range(300 - 96, 300)]


@pytest.mark.parametrize("selector", SELECTORS)
def test_a_support_covering_the_context_is_dense_for_every_selector(selector):
    model = tiny_model("qwen2")
    ids = prompt(150, seed=9)
    dense = sd.generate(model, ids, None, 12, mode="dense").tokens
    covered = sd.generate(model, ids, SparseConfig(support=1 + 64 + 16 * 7, selector=selector), 12, mode="sparse")
    assert covered.tokens == dense
    assert sd.generate(model, ids, SparseConfig(support=97, selector=selector), 12).tokens == dense  # lossless


def test_capabilities_not_names_decide_what_the_library_does():
    for name in SELECTORS:
        selector = resolve_selector(name)
        assert selector.token_level == (selector.level == "token")
        assert selector.practical == (not selector.reads_every_key)
    assert resolve_selector("oracle-blocks").reads_every_key and not resolve_selector("quest").reads_every_key
    assert resolve_selector("mean-pooled").kernel_scoring == "mean-dot"
    assert resolve_selector("block-top-p").kernel_scoring is None and resolve_selector("block-top-p").adaptive
    with pytest.raises(SparseDecodeError, match="adaptive budget"):
        SparseConfig(selector="block-top-p", kernel="c")
    source = " ".join(
        path.read_text()
        for path in __import__("pathlib").Path(sd.__file__).parent.rglob("*.py")
        if "selectors" not in path.parts
    )
    for name in SELECTORS:
        assert f'== "{name}"' not in source and f"== '{name}'" not in source and f'!= "{name}"' not in source, name


# --- every command takes a file selector ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def commands():
    """``python -m sparsedecode`` commands, each in a fresh process (forked from a helper that imported torch and
    transformers once: tests/forked_commands.py)."""
    from forked_commands import ForkedCommands

    forked = ForkedCommands({**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    yield forked
    forked.close()


def test_a_file_selector_runs_through_every_command(commands, user_file, tiny_model_dir, tmp_path):
    cli = commands.run
    spec = f"{user_file}:MaxKeyBlocks:temperature=2"
    common = ["--model", str(tiny_model_dir)]
    done = cli(
        "run",
        *common,
        "--context",
        "200",
        "--support",
        "97",
        "--tokens",
        "4",
        "--selector",
        spec,
        "--json",
        str(tmp_path / "run.json"),
    )
    assert done.returncode == 0, done.stderr
    run = json.loads((tmp_path / "run.json").read_text())
    settings_ = run["results"][0]["settings"]
    assert settings_["selector"] == f"{user_file}:MaxKeyBlocks:temperature=2.0" and settings_["selector_sha256"]

    sweep = tmp_path / "sweep"
    args = [
        "sweep",
        *common,
        "--out",
        str(sweep),
        "--context",
        "200",
        "--support",
        "97",
        "--prompts",
        "1",
        "--tokens",
        "4",
    ]
    done = cli(*args, "--selectors", f"mean-pooled,{spec}")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (sweep / "runs.jsonl").read_text().splitlines()]
    mine = [r for r in rows if "MaxKeyBlocks" in r["selector"]]
    assert len(mine) == 1 and mine[0]["selector_params"] == {"temperature": 2.0} and mine[0]["selector_sha256"]
    meta = json.loads((sweep / "sweep.json").read_text())
    assert list(meta["selector_files"].values()) == [mine[0]["selector_sha256"]]

    text = user_file.read_text()
    user_file.write_text(text + "\n# changed\n")
    try:
        done = cli(*args, "--selectors", f"mean-pooled,{spec}", "--prompts", "2")
        assert done.returncode == 2 and "sha256" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    finally:
        user_file.write_text(text)

    done = cli(
        "compare-selectors",
        *common,
        "--context",
        "200",
        "--support",
        "97",
        "--prompts",
        "1",
        "--tokens",
        "4",
        "--selectors",
        f"streaming,{spec}",
        "--out",
        str(tmp_path / "cmp"),
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "cmp" / "selectors.json").read_text())["summary"]
    assert [r["selector"] for r in summary] == ["streaming", f"{user_file}:MaxKeyBlocks:temperature=2.0"]

    done = cli(
        "eval",
        *common,
        "--out",
        str(tmp_path / "ev"),
        "--tasks",
        "niah_single_noise",
        "--context",
        "600",
        "--samples",
        "1",
        "--support",
        "97",
        "--answer-tokens",
        "3",
        "--selectors",
        spec,
    )
    assert done.returncode == 0, done.stderr
    erows = [json.loads(line) for line in (tmp_path / "ev" / "runs.jsonl").read_text().splitlines()]
    assert {r["selector"] for r in erows} == {"dense", f"{user_file}:MaxKeyBlocks:temperature=2.0"}

    done = cli(
        "bench",
        "op",
        "--shape",
        "smollm2-135m",
        "--context",
        "512",
        "--support",
        "97",
        "--layers",
        "1",
        "--budget",
        "0.02",
        "--selector",
        spec,
        "--json",
        str(tmp_path / "op.json"),
    )
    assert done.returncode == 0, done.stderr

    done = cli(
        "run", *common, "--context", "200", "--support", "97", "--tokens", "4", "--selector", f"{user_file}:WrongShape"
    )
    assert done.returncode == 2 and "WrongShape" in done.stderr and "Traceback" not in done.stderr


def test_the_lm_eval_model_takes_every_form_of_selector(user_file):
    pytest.importorskip("lm_eval")
    from lm_eval.utils import simple_parse_args_string

    from sparsedecode.integrations.lm_eval import sparse_settings

    for argument, spec in [
        ("selector=quest", "quest"),
        ("selector=block-top-p:p=0.8", "block-top-p:p=0.8"),
        (f"selector={user_file}:MaxKeyBlocks:temperature=2", f"{user_file}:MaxKeyBlocks:temperature=2.0"),
    ]:
        cfg, _ = sparse_settings(**simple_parse_args_string(f"pretrained=x,support=97,{argument}"))
        assert cfg.selector_name == spec
    with pytest.raises(SparseDecodeError, match="has no parameter 'q'"):
        sparse_settings(**simple_parse_args_string("pretrained=x,support=97,selector=block-top-p:q=1"))


@pytest.mark.parametrize("name", [" leading", "trailing ", "two words", "new\nline", "tab\tname"])
def test_a_selector_name_with_white_space_is_refused_when_registered(name):
    """Found probing register_selector: a name with white space was registered without a word, but a spec is read
    stripped (" leading" was looked up as "leading": unknown selector), so the name could never be used and the spec
    every row stores of it could not be read back; a newline split the one-line errors naming it."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Named(sd.BlockSelector):
        def score_blocks(self, queries, keys, layout):
            return torch.zeros(keys.shape[0], layout.n_blocks)

    try:
        with pytest.raises(SparseDecodeError, match="white space") as refused:
            sd.register_selector(Named, name=name)
        assert "\n" not in str(refused.value).replace(repr(name), "")
        assert name not in registry._REGISTRY
    finally:
        registry._REGISTRY.pop(name, None)
