"""The package's layers (docs/design.md, "Layout"): every folder of src/sparsedecode imports only the folders below
it, no module imports one that imports it back (no import circles, imports inside functions and TYPE_CHECKING blocks
counted), the library never imports the CLI, experiments, reports, plotting or ``datasets`` (STYLE.md), no module is
over 400 lines, and no private name crosses a module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sparsedecode

PACKAGE = Path(sparsedecode.__file__).parent

LAYERS = (
    ("errors", "env", "layout", "files", "memory", "moved", "validate"),
    ("kernels",),
    ("selectors",),
    ("config",),
    ("step",),
    ("session",),
    ("models",),
    ("compiled",),
    ("decoding",),
    ("protocol",),
    ("integrations", "experiments"),
    ("reports",),
    ("cli", "__main__"),
)
"""Bottom to top: each unit (a folder, or a module beside the folders) may import its own layer's units and those
below, never one above. The package's ``__init__`` (the public names, imported on first use) stands over all."""

RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
LIBRARY = {unit for unit, rank in RANK.items() if rank < RANK["integrations"]}
FORBIDDEN_IN_LIBRARY = {"matplotlib", "datasets", "rich"}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (packages by their own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """The package's modules ``name`` imports (anywhere in the file), and the top-level names of everything else."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                module = ".".join(anchor + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if not target.startswith("sparsedecode"):
                outside.add(target.split(".")[0])
                continue
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                inside.add(target)
    return inside, outside


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    edges = {}
    for name, path in found.items():
        inside, _ = imports_of(name, path, known)
        # a module importing its own package's __init__ (a parent re-exporting its children) is not a circle of files
        edges[name] = {t for t in inside if not name.startswith(t + ".")}
    return edges


def unit(name: str) -> str:
    return name.split(".")[1] if "." in name else "__init__"


def test_every_folder_and_module_has_a_layer():
    units = {unit(name) for name in modules()} - {"__init__"}
    assert units == set(RANK), f"units without a layer: {units - set(RANK)}; layers naming nothing: {set(RANK) - units}"


def test_imports_go_down_the_layers():
    wrong = []
    for name, targets in graph().items():
        if unit(name) == "__init__":
            continue
        for target in targets:
            if unit(target) != "__init__" and RANK[unit(target)] > RANK[unit(name)]:
                wrong.append(f"{name} -> {target}")
            if unit(target) == "__init__" and name != "sparsedecode.moved":
                wrong.append(f"{name} -> the package's __init__ (import the module that defines the name)")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles():
    assert circles(graph()) == []
    # the check sees circles where there are some
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_library_imports_no_plotting_console_or_datasets():
    found = modules()
    for name, path in found.items():
        if unit(name) in LIBRARY:
            _, outside = imports_of(name, path, set(found))
            assert not outside & FORBIDDEN_IN_LIBRARY, f"{name} imports {outside & FORBIDDEN_IN_LIBRARY}"


@pytest.mark.parametrize("limit", [400])
def test_modules_are_read_in_one_sitting(limit):
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > limit}
    assert not long, f"modules over {limit} lines: {long}"
    c_sources = {p.name: n for p in PACKAGE.rglob("*.[ch]") if (n := len(p.read_text().splitlines())) > limit}
    assert not c_sources, f"C sources over {limit} lines: {c_sources}"


def test_functions_are_read_in_one_sitting():
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)


def test_no_private_name_is_imported_from_another_module():
    found = modules()
    crossing = []
    for name, path in found.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("sparsedecode")):
                crossing += [
                    f"{name}: {a.name}" for a in node.names if a.name.startswith("_") and not a.name.endswith("__")
                ]
    assert not crossing, "private names imported across modules:\n" + "\n".join(crossing)


def test_the_kernels_import_only_the_layout_and_the_errors():
    for name, targets in graph().items():
        if unit(name) == "kernels":
            assert {unit(t) for t in targets} <= {"kernels", "layout", "errors", "validate"}, name


def test_the_layout_is_imported_from_the_layout_module_only():
    import sparsedecode.selectors as selectors

    assert not hasattr(selectors, "BlockLayout") and not hasattr(selectors, "support_positions")


def test_models_command_lists_aliases(capsys):
    from sparsedecode.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "qwen2.5-coder-0.5b" in out


def test_models_command_prints_each_path_whole(capsys, monkeypatch):
    """Where stdout is no terminal the table is 132 columns wide: a long cache path is folded, not cut short."""
    from sparsedecode.cli import main
    from sparsedecode.models import catalog

    path = "/a/rather/long/cache/folder/of/someone/elses/sparsedecode/models/local-0123456789abcdef"
    row = {"alias": "local-0123456789abcdef", "description": "converted from x.gguf", "converted": True, "path": path}
    monkeypatch.setattr(catalog, "list_models", lambda: [row])
    assert main(["models"]) == 0
    cells = [line.split("│")[-2].strip() for line in capsys.readouterr().out.splitlines() if line.count("│") == 6]
    assert "".join(cells) == path
