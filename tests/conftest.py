"""Shared fixtures: tiny randomly initialised Llama and Qwen2 models (no downloads)."""

from __future__ import annotations

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
    """A 2-layer GQA model (4 query heads sharing 2 KV heads, d = 16) with random weights."""
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


def prompt(length: int, *, seed: int = 1, vocab: int = 96) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (1, length), generator=generator)  # 0 is the pad id


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
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama and its tokenizer saved as a local model directory (what `--model PATH` loads)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path
