"""The compiled sparse step's C++ kernel (``csrc/torch_ops.cpp``): it makes a layer state's prepared calls itself,
with the same tokens, outputs and state as the Python implementation (a fresh process without a C++ compiler), and
an error raised in the Python parts it calls back is raised as itself, in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import prompt, tiny_model

from sparsedecode import SparseConfig, SparseDecodeError
from sparsedecode.kernels import cpu
from sparsedecode.kernels.cpu import native

SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from conftest import prompt, tiny_model
import sparsedecode as sd
from sparsedecode.compiled import decoder
from sparsedecode.kernels.cpu import native
decoder.DEFAULT_BACKEND = "eager"  # no functionalization: the op gets the state itself
torch.manual_seed(0)
out = {{}}
for family, reuse in (("llama", 1), ("qwen2", 3)):
    model = tiny_model(family)
    cfg = sd.SparseConfig(support=97, reuse=reuse)
    run = sd.generate(model, prompt(300), cfg, max_new_tokens=40, mode="sparse", compile=True)
    out[family] = {{"tokens": run.tokens, "steps": native.step_calls()}}
print(json.dumps(out))
"""


def _generations(tmp_path, cxx: str | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cxx is not None:
        env["CXX"] = cxx
    script = SCRIPT.format(tests=os.path.dirname(__file__))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(cpu.library() is None, reason="the C library does not build here")
def test_the_cpp_kernel_makes_the_prepared_calls_with_the_python_implementations_tokens(tmp_path):
    assert native.load(cpu.library()), native.BUILD_ERROR  # a C++ compiler is part of the development set-up
    with_cpp = _generations(tmp_path, None)
    without = _generations(tmp_path, str(tmp_path / "c++-that-is-not-here"))
    for family in ("llama", "qwen2"):
        assert with_cpp[family]["tokens"] == without[family]["tokens"]
    # 2 layers, about 40 steps past the support: most calls made in C++ (none without a compiler)
    assert with_cpp["llama"]["steps"] >= 2 * 30 and without["qwen2"]["steps"] == 0


@pytest.fixture
def warm_decoder(monkeypatch):
    from sparsedecode.compiled import decoder

    monkeypatch.setattr(decoder, "DEFAULT_BACKEND", "eager")  # the op gets the state itself
    assert native.load(cpu.library()), native.BUILD_ERROR
    model = tiny_model("llama")
    made = decoder.decoder_for(model, SparseConfig(support=97), 1, 512)
    with made.installed():
        token = made.prefill(prompt(300)).argmax(-1)
        made.warm_up(token)
        before = native.step_calls()
        for _ in range(4):
            token = made.step(token).argmax(-1)
        assert native.step_calls() > before  # the C++ kernel serves these steps
        yield made, token


def test_an_error_of_the_python_part_is_raised_as_itself(warm_decoder):
    """Non-finite block statistics: the C call's status goes back to Python, whose error the step raises."""
    from sparsedecode.compiled.op import STATE
    from sparsedecode.validate import attention_modules

    made, token = warm_decoder
    getattr(attention_modules(made.model)[0], STATE).stats.fill_(float("nan"))
    with pytest.raises(SparseDecodeError, match="block selection scores hold NaN or infinite values") as raised:
        made.step(token)
    assert "\n" not in str(raised.value)


def test_an_eager_call_of_the_op_raises_the_python_error_too(warm_decoder):
    from sparsedecode.compiled.op import KEPT_ERROR, STATE, _step_op
    from sparsedecode.validate import attention_modules

    made, _ = warm_decoder
    state = getattr(attention_modules(made.model)[0], STATE)
    layer = made.cache.layers[0]
    heads = made.model.config.num_attention_heads
    past = torch.tensor([[layer.keys.shape[2] + 5]])
    arguments = (
        torch.randn(1, heads, 1, layer.keys.shape[3]), layer.keys, layer.values, past, state.stats, state.count,
        state.blocks, state.budget_mask, state.positions, state.step, state.last, state.tally, state.config,
        state.layer, 0.25, state.form,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=KEPT_ERROR):  # the kernel's own failure, as torch raises it
        torch.ops.sparsedecode.sparse_step(*arguments)
    with pytest.raises(SparseDecodeError, match="lies past the cache") as raised:
        _step_op(*arguments)
    assert "\n" not in str(raised.value)
