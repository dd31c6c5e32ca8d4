"""Shared fixtures: tiny randomly initialised Llama and Qwen2 models (no downloads)."""

from __future__ import annotations

import copy
import functools
import math
import os

# Triton reads this when it is first imported (possibly by torch or transformers below): without a GPU, the tests
# run the optional Triton kernels through its interpreter. Export TRITON_INTERPRET=0 to test them on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

ARCHS = ("llama", "qwen2")


def _builtin_selectors() -> tuple[tuple[str, ...], tuple[str, ...]]:
    from sparsedecode.selectors import selector_class, selector_names

    names = selector_names()
    return names, tuple(name for name in names if selector_class(name).level == "block")


SELECTORS, BLOCK_SELECTORS = _builtin_selectors()
"""Every built-in selector (the tests run over this one list, as kvpress's run over its presses), and the block ones."""
TOKEN_SELECTORS = tuple(name for name in SELECTORS if name not in BLOCK_SELECTORS)

# Parallel workers (pytest-xdist, `make test`) share the machine's cores: one torch thread each, or two workers of
# two threads each would fight over two cores. A test that needs another thread count sets it and restores it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The long tests (``realmodel``, ``ray``) first, each file's in their order, then the rest as collected; under
    ``--dist loadgroup``, each test of an ``xdist_group`` named by the node id pytest-xdist groups by.

    pytest-xdist's ``loadgroup`` hands out groups of several tests first, then single tests in collection order: a
    minute-long real-model test collected late would start last and leave the other worker idle while it runs.
    Every test already runs in any order (parallel workers interleave them anyway).

    ``loadgroup`` keeps a group on one worker by node ids ending in ``@GROUP``. pytest-xdist 3.8 adds that suffix by
    setting ``item._nodeid``, which pytest 9 no longer reads (a node id comes from ``item._id``): every group was
    split over both workers, each building the group's module fixtures (a Ray instance, the lm-eval runs, the
    lossless grid's prefill). The suffix is set here where pytest reads it."""
    items.sort(key=lambda item: item.get_closest_marker("realmodel") is None and item.get_closest_marker("ray") is None)
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id

    for item in items:
        names = {m.args[0] if m.args else m.kwargs.get("name", "default") for m in item.iter_markers("xdist_group")}
        suffix = "@" + "_".join(sorted(map(str, names)))
        if names and not item.nodeid.endswith(suffix):
            item._id = coerce_node_id(item.nodeid + suffix)


VERSIONED = ("torch", "transformers", "accelerate", "gguf", "numpy", "triton", "lm-eval", "ray", "hypothesis")
"""The packages whose versions the run's header names: CI installs whatever the ranges in pyproject.toml resolve to
on the day, so a red build says what it ran with."""


def resolved_versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def named(package):
        try:
            return f"{package} {version(package)}"
        except PackageNotFoundError:
            return f"{package} (not installed)"

    return "resolved: " + ", ".join(named(package) for package in VERSIONED)


def pytest_terminal_summary(terminalreporter):
    """The versions at the end of every run (``-q`` hides pytest's header)."""
    terminalreporter.write_line(resolved_versions())


# CI runs the same hypothesis examples every time, so a red build is reproducible.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    bos_token_id=None,
    eos_token_id=None,  # generate() must not stop early: tests compare fixed-length outputs
    pad_token_id=0,
)
"""The tiny models' sizes (4 query heads sharing 2 KV heads, d = 16), for configs of other families."""


def tiny_model(arch: str = "llama", *, layers: int = 2, seed: int = 0, dtype=torch.float32, **overrides):
    """A 2-layer GQA model (4 query heads sharing 2 KV heads, d = 16) with random weights.

    Each call returns a model of its own (a deep copy of one built once per process and arguments), so a test may
    change its weights, attention implementation or config without another test seeing it."""
    key = (arch, layers, seed, dtype, tuple(sorted(overrides.items())))
    try:
        hash(key)
    except TypeError:  # an unhashable override: build it afresh
        return _build_tiny_model(arch, layers=layers, seed=seed, dtype=dtype, **overrides)
    model, rng_state = _cached_tiny_model(key)
    torch.set_rng_state(rng_state)  # the global generator as building the model leaves it, as before the cache
    return copy.deepcopy(model)


@functools.cache
def _cached_tiny_model(key) -> tuple[torch.nn.Module, torch.Tensor]:
    arch, layers, seed, dtype, overrides = key
    model = _build_tiny_model(arch, layers=layers, seed=seed, dtype=dtype, **dict(overrides))
    return model, torch.get_rng_state()


def _build_tiny_model(arch: str, *, layers: int, seed: int, dtype, **overrides):
    torch.manual_seed(seed)
    common = dict(SMALL, num_hidden_layers=layers, attn_implementation="sdpa", dtype=dtype)
    common.update(overrides)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(arch)
    sharpen_attention(model)
    return model.to(dtype).eval().requires_grad_(False)


def sharpen_attention(model: torch.nn.Module) -> None:
    """Random init gives near-uniform attention; scale the query and key projections so the selector's choice
    matters."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(4.0)


def tiny_family(model_type: str, **overrides) -> torch.nn.Module:
    """A tiny random model of any transformers family (``model_type``), sized as :data:`SMALL` with 2 layers
    unless ``overrides`` say otherwise, its attention sharpened."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**SMALL, "num_hidden_layers": 2, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    sharpen_attention(model)
    return model.float().eval().requires_grad_(False)


FLOAT32_EPS = 2.0**-23
"""float32's unit round-off doubled: the relative error of one rounded operation is at most half of it."""


def roundoff_tolerance(reference: torch.Tensor, *, depth: int, width: int) -> float:
    """How far float32 logits of the same model may move when only the order of its sums changes.

    Batched and batch-1 matrix products (or two BLAS builds) add the same terms in another order. One dot product
    over ``width`` terms then differs by about ``sqrt(width) * eps`` of the magnitude of what it sums (round-off
    errors of a long sum grow like a random walk); each of ``depth`` layers adds such an error to the residual
    stream, and the final projection carries it to the logits in proportion to their own magnitude. So the bound is
    ``depth * sqrt(width) * eps * max|reference|``: on SmolLM2 (30 layers, width 576, logits up to ~40) 3.6e-3, about
    50 times the 6e-5 seen on an AMD EPYC and the 1.0e-4 on an Intel Xeon, and far below what a differently chosen
    block moves (0.1 and more). Tokens are compared exactly beside it.
    """
    return depth * math.sqrt(width) * FLOAT32_EPS * float(reference.abs().max())


def logits_tolerance(reference: torch.Tensor, model: torch.nn.Module, *, positions: int) -> float:
    """:func:`roundoff_tolerance` for ``model``'s logits over contexts of up to ``positions`` tokens: the width is
    the longest sum a layer makes (hidden size, MLP width, or the attention over every position), the depth its
    layer count. On the tiny models (2 layers, sums of at most 340 terms, logits below ~0.6) about 2.6e-6, some 9
    times the 3e-7 batched and batch-1 logits differ by here."""
    config = model.config
    width = max(config.hidden_size, getattr(config, "intermediate_size", 0) or 0, positions)
    return roundoff_tolerance(reference, depth=config.num_hidden_layers, width=width)


def attention_tolerance(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> float:
    """How far float32 attention of ``query`` over ``keys``/``values`` (heads x positions x d) may sit from the same
    attention computed in float64.

    A score sums d products, so it is off by about ``sqrt(d) * eps * |q| |k| * scaling`` (Cauchy-Schwarz bounds what
    it sums); exp turns that absolute error into the same relative error of a weight. The softmax's normaliser and
    the weighted sum of n value rows then add ``sqrt(n) * eps`` relative to the largest value. So
    ``(sqrt(n) + sqrt(d) * max|q| max|k| scaling) * eps * max|v|``: about 1e-6 on the tiny models, against 6e-8 seen.
    """
    n, d = keys.shape[-2], keys.shape[-1]
    scores = float(query.double().norm(dim=-1).max() * keys.double().norm(dim=-1).max()) * scaling
    return (math.sqrt(n) + math.sqrt(d) * scores) * FLOAT32_EPS * float(values.abs().max())


def assert_attention_close(out, reference, query, keys, values, scaling: float) -> None:
    """``out`` is attention of ``query`` over (a support of) ``keys``/``values`` within float32 round-off of
    ``reference``: :func:`attention_tolerance` from a float64 reference, twice it from another float32 computation
    (each is that far from the exact value). All of ``keys`` count as attended: an upper bound for a support."""
    tolerance = attention_tolerance(query, keys, values, scaling)
    tolerance *= 1 if reference.dtype == torch.float64 else 2
    error = float((out.double() - reference.double()).abs().max())
    assert out.shape == reference.shape and error <= tolerance, f"{error:.3g} > {tolerance:.3g}"


def prompt(length: int, *, seed: int = 1, vocab: int = 96) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (1, length), generator=generator)  # 0 is the pad id


@pytest.fixture(autouse=True)
def quick_operator_times(monkeypatch):
    """``compare-selectors`` times each selector's decode-attention call (``bench_op``: a read-bandwidth measurement
    of a second, which it does not use, and 0.2 s per timing), 25 of the 28 s of a comparison of every selector on a
    tiny model. The tests check where times appear (``op_ms`` positive where the support is sparse, none where it is
    not), not their size: here the same ``bench_op`` runs with a fixed bandwidth and 1 ms budgets (each timing still
    the median of at least ten real calls). ``test_bench.py`` measures the bandwidth itself once."""
    from sparsedecode.experiments import bench_operator, selector_comparison

    real = selector_comparison.bench_op

    def quick(*args, **kwargs):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(bench_operator, "read_bandwidth_gbs", lambda *a, **k: 12.5)
            return real(*args, **{**kwargs, "budget_s": 0.001})

    monkeypatch.setattr(selector_comparison, "bench_op", quick)


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


def char_tokenizer():
    """A character-level fast tokenizer over printable ASCII: 96 ids, matching the tiny models' vocab."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(i): i - 31 for i in range(32, 127)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M and its tokenizer from the real cache, loaded once per test process (about 5 s a load). Tests
    use it inside sparse_decoding sessions, which restore the model on exit; none may change its weights."""
    from sparsedecode import load_model

    model, tokenizer = load_model("smollm2-135m")
    sums = {name: float(p.double().sum()) for name, p in model.named_parameters()}
    yield model, tokenizer
    changed = [name for name, p in model.named_parameters() if float(p.double().sum()) != sums[name]]
    assert not changed, f"a test changed the shared SmolLM2's weights: {changed[:3]}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama and its tokenizer saved as a local model directory (what `--model PATH` loads)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path
