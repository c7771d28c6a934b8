"""The package's architecture, checked on its source: layers, no cycles, one attempt loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import koila_retry as koila

PACKAGE = Path(koila.__file__).parent
# Each subpackage may import from its own layer and those before it, never after.
LAYERS = ["_common", "_core", "_estimation", "_diagnostics", "_frontends", "compat", "_cli", "integrations"]


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(encoding="utf-8"))
    return found


def imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """Every ``from koila_retry... import names`` in a module, at any depth, with the names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("koila_retry"):
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def resolved(module: str, names: list[str], known: dict[str, ast.Module]) -> list[str]:
    """The modules an import reaches: ``from pkg import mod`` names a module, else the module itself."""
    return [f"{module}.{name}" if f"{module}.{name}" in known else module for name in names]


def test_no_module_imports_an_underscore_name_from_another() -> None:
    known = modules()
    offending = [
        f"{name}: from {module} import {imported}"
        for name, tree in known.items()
        for module, names in imports(tree)
        for imported in names
        if imported.startswith("_") and imported not in ("__version__", "__main__")
    ]
    assert offending == []


def test_there_is_no_import_cycle() -> None:
    known = modules()
    graph = {name: set() for name in known}
    for name, tree in known.items():
        for module, names in imports(tree):
            graph[name].update(target for target in resolved(module, names, known) if target in known)
    # A package's __init__ importing its own modules is how the namespace is made, not a cycle.
    for name in graph:
        graph[name] -= {other for other in graph[name] if other.startswith(f"{name}.")}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(target) :], target]))
            if target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_import_only_from_layers_below_them() -> None:
    known = modules()
    offending = []
    for name, tree in known.items():
        own = layer(name)
        if own is None:
            continue
        for module, names in imports(tree):
            for target in resolved(module, names, known):
                theirs = layer(target)
                if theirs is not None and theirs > own:
                    offending.append(f"{name} imports {target}")
    assert offending == []


def test_only_the_engine_drives_attempts() -> None:
    """No front end writes an attempt loop: ``with attempt:`` and ``.retry()`` live in the engine."""
    offending = []
    for name, tree in modules().items():
        if name in ("koila_retry._core.engine", "koila_retry._core.attempt"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.With) and any(
                isinstance(item.context_expr, ast.Name) and "attempt" in item.context_expr.id for item in node.items
            ):
                offending.append(f"{name}:{node.lineno}: with {ast.unparse(node.items[0].context_expr)}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "retry":
                offending.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert offending == []


def test_the_public_namespace_is_sorted_and_complete() -> None:
    assert koila.__all__ == sorted(koila.__all__)
    assert all(hasattr(koila, name) for name in koila.__all__)


def test_no_module_is_over_900_lines() -> None:
    sizes = {
        path.relative_to(PACKAGE.parent).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert {name: lines for name, lines in sizes.items() if lines > 900} == {}


@pytest.mark.parametrize(("module", "name"), [("_core.attempt", "Mechanics"), ("_core.engine", "Controller")])
def test_the_engines_driver_and_controller_stay_small_and_free_of_feature_branches(module: str, name: str) -> None:
    """At most 150 lines each, and no branch on an option: features are strategies (``_core.strategies``)."""
    tree = modules()[f"koila_retry.{module}"]
    (found,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    assert found.end_lineno is not None
    assert found.end_lineno - found.lineno + 1 <= 150
    features = ("grow", "grow_gain", "refine", "snapshot", "on_oom")
    branches = [
        ast.unparse(node.test)
        for node in ast.walk(found)
        if isinstance(node, (ast.If, ast.IfExp))
        and any(isinstance(part, ast.Attribute) and part.attr in features for part in ast.walk(node.test))
    ]
    assert branches == []
