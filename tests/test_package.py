"""The package's public names load on first use, and ``sparsedecode.generate`` is the API first asked for."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import torch
from conftest import prompt, tiny_model

import sparsedecode

HEAVY = ("torch", "transformers")


def imported_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; which heavy top-level modules it imported, and what it printed."""
    heavy = f"sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})"
    script = f"{code}\nimport sys, json\nprint(json.dumps({heavy}))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    *printed, heavy = proc.stdout.strip().splitlines()
    return {"heavy": json.loads(heavy), "printed": printed}


def imported_after_each(steps: list[str]) -> list[list[str]]:
    """Run ``steps`` one after another in one fresh interpreter; the heavy top-level modules imported by then, after
    each step. The modules only accumulate, so a step that imports none imports none alone either."""
    heavy = f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})))"
    script = "\n".join(["import sys, json", *(f"{step}\n{heavy}" for step in steps)])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return [json.loads(line) for line in proc.stdout.strip().splitlines()]


def test_import_is_cheap_and_names_stay_listed():
    steps = [
        "import sparsedecode\nassert set(sparsedecode.__all__) <= set(dir(sparsedecode))",
        "sparsedecode.SparseConfig",  # config needs no torch
        "sparsedecode.compare",
    ]
    after_import, after_config, after_compare = imported_after_each(steps)
    assert after_import == [] and after_config == []
    assert "torch" in after_compare


def test_every_public_name_is_its_module_attribute():
    modules = {
        "DEFAULT_MODEL": "models",
        "CompareResult": "compare",
        "DenseReference": "compare",
        "SparseConfig": "config",
        "SparseDecodeError": "errors",
        "SparseSession": "attention",
        "compare": "compare",
        "dense_reference": "compare",
        "generate": "speculative",
        "list_models": "models",
        "load_model": "models",
        "load_tokenizer": "models",
        "select_support": "selectors",
        "sparse_decoding": "attention",
    }
    assert sorted(sparsedecode.__all__) == sorted(modules)
    for name, module in modules.items():
        assert getattr(sparsedecode, name) is getattr(importlib.import_module(f"sparsedecode.{module}"), name), name
        assert name in dir(sparsedecode)
    assert callable(sparsedecode.compare), "the function, not the submodule of the same name"
    from sparsedecode import compare, cpu_kernel, models  # submodules still import by name

    assert callable(compare) and models.__name__ == "sparsedecode.models" and hasattr(cpu_kernel, "library")


def test_unknown_names_raise_attribute_error():
    try:
        sparsedecode.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("no AttributeError")


def test_compare_stays_the_function_when_the_submodule_is_imported_first():
    done = imported_after("import sparsedecode.compare\nimport sparsedecode\nprint(callable(sparsedecode.compare))")
    assert done["printed"] == ["True"]


def test_top_level_generate_reproduces_dense_greedy_decoding():
    model = tiny_model("llama")
    ids = prompt(300)
    cfg = sparsedecode.SparseConfig(support=97)
    lossless = sparsedecode.generate(model, ids, cfg, 24, mode="lossless", draft_tokens=3)
    dense = sparsedecode.generate(model, ids, None, 24, mode="dense")
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
    assert lossless.tokens == dense.tokens == greedy
    assert lossless.verifications > 0 and max(lossless.draft_lengths) == 3
