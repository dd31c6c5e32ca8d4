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
        "BlockSelector": "selectors",
        "TokenSelector": "selectors",
        "register_selector": "selectors",
        "DEFAULT_MODEL": "models.catalog",
        "CompareResult": "protocol.results",
        "DenseReference": "protocol.results",
        "SparseConfig": "config",
        "SparseDecodeError": "errors",
        "SparseSession": "session",
        "compare": "protocol.paired",
        "dense_reference": "protocol.paired",
        "generate": "decoding.generate",
        "list_models": "models.catalog",
        "load_model": "models.catalog",
        "load_tokenizer": "models.catalog",
        "select_support": "selectors",
        "sparse_decoding": "session",
    }
    assert sorted(sparsedecode.__all__) == sorted(modules)
    for name, module in modules.items():
        assert getattr(sparsedecode, name) is getattr(importlib.import_module(f"sparsedecode.{module}"), name), name
        assert name in dir(sparsedecode)
    assert callable(sparsedecode.compare), "the function, not the submodule of the same name"
    from sparsedecode import compare
    from sparsedecode.models import catalog as models  # a public function, a submodule

    assert callable(compare) and models.__name__ == "sparsedecode.models.catalog"


def test_unknown_names_raise_attribute_error():
    try:
        sparsedecode.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("no AttributeError")


def test_no_submodule_shares_a_public_name_so_importing_every_module_hides_none():
    """Importing ``sparsedecode.X`` binds the submodule as the package's attribute ``X``: a module named like a public
    function would hide it. None is (the paired protocol lives in ``paired``, the kernels under ``kernels``)."""
    import importlib.util
    import pkgutil

    names = [m.name for m in pkgutil.walk_packages(sparsedecode.__path__, "sparsedecode.")]
    assert {name.split(".")[1] for name in names} & set(sparsedecode.__all__) == set()
    assert importlib.util.find_spec("sparsedecode.cpu_kernel") is None  # the old kernel names are gone
    assert importlib.util.find_spec("sparsedecode.triton_attention") is None
    skip = (".cli", "lm_eval", "__main__", "integrations.vllm.backend")  # the plug-in's backend imports vLLM
    script = "import " + ", ".join(n for n in names if not any(s in n for s in skip)) + "\nimport sparsedecode"
    done = imported_after(script + "\nprint(callable(sparsedecode.compare), callable(sparsedecode.generate))")
    assert done["printed"] == ["True True"]


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


def test_the_lowest_transformers_make_tests_is_the_range_floor():
    """``make test-lowest`` installs ``TRANSFORMERS_LOWEST``: it must be the floor pyproject.toml declares, or the
    documented check of the lowest version runs some other version."""
    import re
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[1]
    requirements = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [r for r in requirements if r.startswith("transformers")]
    floor = re.search(r">=\s*([0-9.]+)", spec).group(1)
    lowest = re.search(r"^TRANSFORMERS_LOWEST \?= (\S+)$", (root / "Makefile").read_text(), re.M).group(1)
    assert lowest == floor or lowest.startswith(floor + "."), (lowest, floor)


def test_old_module_paths_keep_importing_and_say_where_they_moved():
    """Code holding a path from before the package was folded into layers (``sparsedecode.speculative.generate``,
    ``sparsedecode.paired.compare``) still runs, warned where the module lives now; nothing here imports one."""
    script = (
        "import warnings, json, sparsedecode\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    from sparsedecode.speculative import generate\n"
        "    from sparsedecode.paired import compare\n"
        "    from sparsedecode.attention import static\n"
        "    import sparsedecode.centroids as centroids\n"
        "print(json.dumps([generate is sparsedecode.generate, compare is sparsedecode.compare, static.__name__,\n"
        "    centroids.BlockCentroids is centroids.BlockStatistics, sorted(str(w.message) for w in seen)]))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    same_generate, same_compare, static, alias, messages = json.loads(done.stdout)
    assert same_generate and same_compare and alias and static == "sparsedecode.compiled.op"
    assert "sparsedecode.speculative moved to sparsedecode.decoding.generate" in messages
    assert "sparsedecode.attention.static moved to sparsedecode.compiled.op" in messages


def test_nothing_in_the_repository_imports_an_old_module_path():
    import ast
    from pathlib import Path

    from sparsedecode.moved import MOVED

    root = Path(__file__).resolve().parents[1]
    package = root / "src"
    old = []
    for path in [*package.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "scripts").glob("*.py")]:
        if path.name == "moved.py" or path.name == Path(__file__).name:
            continue
        parts = list(path.relative_to(package).with_suffix("").parts) if path.is_relative_to(package) else []
        base = ".".join(parts if parts[-1:] == ["__init__"] and parts.pop() else parts[:-1]) if parts else ""
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                anchor = base.split(".")[: len(base.split(".")) - (node.level - 1)] if node.level else []
                module = ".".join([*anchor, *([node.module] if node.module else [])])
                names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            else:
                continue
            old += [f"{path.relative_to(root)}:{node.lineno}: {name}" for name in names if name in MOVED]
    assert not old, "\n".join(old)
