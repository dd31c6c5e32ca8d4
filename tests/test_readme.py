"""The library examples of README.md and docs/ run as written, on a tiny random Llama in place of the real model (its
names for prompts and tensors bound to small ones), so a change of the public API that the docs do not follow
fails."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from conftest import char_tokenizer, prompt, tiny_model

import sparsedecode as sd

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", path.read_text(), flags=re.S | re.M)


def test_the_docs_have_their_library_examples():
    (library,) = python_blocks(ROOT / "README.md")
    (batches,) = python_blocks(ROOT / "docs" / "batches.md")
    (lossless,) = python_blocks(ROOT / "docs" / "lossless.md")
    assert "sd.sparse_decoding" in library and "sd.compare" in library and "sd.generate" in library
    assert "ids_a" in batches and 'mode="lossless"' in lossless


def test_the_library_examples_run(monkeypatch):
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
    (library,) = python_blocks(ROOT / "README.md")
    scope = dict(names)
    exec(compile(library, "README.md (library)", "exec"), scope)
    assert [len(positions) for positions in scope["kept"]] == [193, 193]
    assert scope["result"].first_divergence >= 1 and len(scope["out"].tokens) >= 1
    for page, check in (("batches.md", ("outs", 3)), ("lossless.md", ("out", None))):
        scope.update(names)  # the pages' examples reuse sd, cfg, model and tokenizer from the README's
        scope.pop(check[0], None)
        (block,) = python_blocks(ROOT / "docs" / page)
        exec(compile(block, f"docs/{page}", "exec"), scope)
        assert check[1] is None or len(scope[check[0]]) == check[1]
    assert len(scope["results"]) == 2 and scope["out"].acceptance_rate is not None


def test_the_family_counts_are_those_tested():
    """README.md said "Llama, Qwen2 and 14 more families" where docs/setup.md and tests/test_families.py hold 15."""
    from test_families import FAMILIES

    assert f"Llama, Qwen2 and {len(FAMILIES)} more families" in " ".join((ROOT / "README.md").read_text().split())
    setup = " ".join((ROOT / "docs" / "setup.md").read_text().split())
    assert f"tiny random models of {len(FAMILIES)} families beyond Llama and Qwen2" in setup
