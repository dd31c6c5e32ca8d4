"""The library never imports the CLI, experiments, reports, plotting or `datasets` (STYLE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import sparsedecode

PACKAGE = Path(sparsedecode.__file__).parent
ON_TOP = {"cli", "experiments", "report", "plots", "__main__", "eval_cli", "eval_report", "lm_eval_model"}
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
    library = [p for p in PACKAGE.glob("*.py") if p.stem not in ON_TOP]
    assert len(library) >= 8
    for path in library:
        for name in imported_names(path):
            parts = name.lstrip(".").split(".")
            assert parts[0] not in FORBIDDEN, f"{path.name} imports {name}"
            if name.startswith("."):
                assert not (set(parts) & ON_TOP), f"{path.name} imports {name}"
            assert not name.startswith("sparsedecode.") or not (set(parts[1:]) & ON_TOP), f"{path.name} imports {name}"


def test_models_command_lists_aliases(capsys):
    from sparsedecode.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "qwen2.5-coder-0.5b" in out
