"""The library never imports the CLI, experiments, reports, plotting or `datasets` (STYLE.md); the kernels sit below
the selectors and the attention step and never import them."""

from __future__ import annotations

import ast
from pathlib import Path

import sparsedecode

PACKAGE = Path(sparsedecode.__file__).parent
ON_TOP = {"cli", "experiments", "report", "plots", "__main__", "eval_report", "lm_eval_model"}
FORBIDDEN = {"matplotlib", "datasets", "rich"}


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
            names.update(f"{base}.{alias.name}" if node.module else f"{base}{alias.name}" for alias in node.names)
    return names


def test_library_modules_do_not_import_what_sits_on_top():
    library = [p for p in [*PACKAGE.glob("*.py"), *PACKAGE.glob("kernels/*.py")] if p.stem not in ON_TOP]
    assert len(library) >= 8
    for path in library:
        for name in imported_names(path):
            parts = name.lstrip(".").split(".")
            assert parts[0] not in FORBIDDEN, f"{path.name} imports {name}"
            if name.startswith("."):
                assert not (set(parts) & ON_TOP), f"{path.name} imports {name}"
            assert not name.startswith("sparsedecode.") or not (set(parts[1:]) & ON_TOP), f"{path.name} imports {name}"


KERNELS_MAY_IMPORT = {"layout", "errors", "kernels"}
"""What ``sparsedecode.kernels`` may import from the package: the block layout, the errors, and itself."""


def package_imports(path: Path) -> set[str]:
    """The ``sparsedecode`` modules ``path`` imports (relative or absolute), as names under the package."""
    depth = len(path.parent.relative_to(PACKAGE).parts)  # 0 for sparsedecode/*.py, 1 for sparsedecode/kernels/*.py
    here = path.parent.relative_to(PACKAGE).parts
    modules = set()
    for name in imported_names(path):
        if name.startswith("sparsedecode."):
            modules.add(name.split(".")[1])
        elif name.startswith("."):
            level = len(name) - len(name.lstrip("."))
            inside = (*here[: depth - (level - 1)], *name.lstrip(".").split("."))
            if inside and inside[0]:
                modules.add(inside[0])
    return modules


def test_kernels_depend_on_the_layout_never_on_the_selectors():
    kernel_files = sorted(PACKAGE.glob("kernels/*.py"))
    assert {p.stem for p in kernel_files} >= {"__init__", "dispatch", "cpu", "triton_attention", "_triton_kernels"}
    assert (PACKAGE / "kernels" / "csrc" / "sparse_step.c").is_file()
    for path in [*kernel_files, PACKAGE / "layout.py"]:
        imported = package_imports(path)
        assert imported <= KERNELS_MAY_IMPORT, f"{path.relative_to(PACKAGE)} imports sparsedecode.{imported}"
    assert package_imports(PACKAGE / "layout.py") == set()  # the layout: torch only
    # the check itself sees the imports it should: selectors and attention do use the kernels and the layout
    assert {"kernels", "layout"} <= package_imports(PACKAGE / "selectors" / "select.py")
    assert {"kernels", "layout", "selectors"} <= package_imports(PACKAGE / "attention" / "step.py")
    assert "errors" in package_imports(PACKAGE / "kernels" / "cpu.py")


def test_the_layout_is_imported_from_the_layout_module_only():
    import sparsedecode.selectors as selectors

    assert not hasattr(selectors, "BlockLayout") and not hasattr(selectors, "support_positions")


def test_models_command_lists_aliases(capsys):
    from sparsedecode.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "qwen2.5-coder-0.5b" in out


NOT_LIBRARY = ("cli", "experiments", "report.py", "eval_report.py", "plots.py", "lm_eval_model.py")
"""What sits on top of the library: the command line, the experiments, reports, plots and the lm-eval adapter."""


def test_library_modules_and_functions_stay_small():
    """No library module over 400 lines, no library function over 80 (issue #24): one idea per module."""
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in NOT_LIBRARY:
            continue
        text = path.read_text()
        assert len(text.splitlines()) <= 400, f"{relative}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 80, f"{relative}: {node.name} is {length} lines"
