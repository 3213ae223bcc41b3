"""The import graph inside the conformance package has no cycles.

Every import of one conformance module by another counts, wherever it sits: at module level, inside a function
(a lazy import is still a dependency; it only hides the cycle until run time) or under `TYPE_CHECKING`. A cycle
means two modules cannot be read, tested or changed one without the other, so the shared piece belongs in the
lower module (or is passed in).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "conformance"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from X import ...` names (relative levels resolved against the importer)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The conformance modules that `name` imports, at any depth of its syntax tree."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def add(target: str) -> None:
        # `import a.b.c` and `from a.b import c` depend on every enclosing package too; a package's own
        # __init__ is not a dependency of its submodules for this graph (Python runs it, but no name flows)
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name and target.startswith(PACKAGE):
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    colour = dict.fromkeys(graph, 0)      # 0 unseen, 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour.get(nxt, 2) == 1:
                return path[path.index(nxt):] + [nxt]
            if colour.get(nxt) == 0 and (cycle := visit(nxt)):
                return cycle
        path.pop()
        colour[node] = 2
        return None

    for start in sorted(graph):
        if colour[start] == 0 and (cycle := visit(start)):
            return cycle
    return None


def test_the_scan_sees_function_level_and_relative_imports():
    graph = import_graph()
    # commands/run.py imports the runner inside run_command only: still an edge
    assert "conformance.runner" in graph["conformance.cli.run"], "a function-level import is an edge"
    assert graph["conformance.tp.tprun"] >= {"conformance.runner"}, "`from .. import runner` is an edge"


@pytest.mark.parametrize("graph, want", [
    pytest.param({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"], id="three-cycle"),
    pytest.param({"a": {"a"}}, ["a", "a"], id="self-loop"),
    pytest.param({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None, id="diamond-no-cycle"),
])
def test_find_cycle(graph, want):
    assert find_cycle(graph) == want


def test_conformance_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle inside conformance: " + " -> ".join(cycle or [])
