"""The README's library examples run as written, on a tiny random Llama in place of the real model (its names for
prompts and tensors bound to small ones), so a change of the public API that the README does not follow fails."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from conftest import char_tokenizer, prompt, tiny_model

import sparsedecode as sd

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_its_two_library_examples():
    blocks = python_blocks()
    assert len(blocks) == 2 and "sd.sparse_decoding" in blocks[0] and "ids_a" in blocks[1]


def test_the_readme_library_examples_run(monkeypatch):
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    monkeypatch.setattr(sd, "load_model", lambda spec, *args, **kwargs: (model, tokenizer))
    generator = torch.Generator().manual_seed(5)
    names = {
        "input_ids": prompt(300, seed=2),
        "prompt_ids": prompt(280, seed=3),
        "queries": torch.randn(4, 16, generator=generator),
        "keys": torch.randn(2, 400, 16, generator=generator),
        "ids_a": prompt(260, seed=4),
        "ids_b": prompt(230, seed=5),
        "ids_c": prompt(300, seed=6),
        "eos": 2,
    }
    first, second = python_blocks()
    scope = dict(names)
    exec(compile(first, "README.md (library)", "exec"), scope)
    assert [len(positions) for positions in scope["kept"]] == [193, 193]
    assert scope["result"].first_divergence >= 1 and len(scope["out"].tokens) >= 1
    scope.update(names)  # the batch example reuses cfg and model from the first
    exec(compile(second, "README.md (batches)", "exec"), scope)
    assert len(scope["outs"]) == 3 and len(scope["results"]) == 2
