"""The import graph of each package: no cycles inside k3ref or k3cuda, and nothing imported upward.

Layering: k3ref imports no other package of ours; k3cuda imports only k3ref; conformance may import both.
Imports inside functions count too: a deferred import hides a cycle from Python, not from a reader.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABOVE = {"k3ref": ("k3cuda", "conformance", "tools"), "k3cuda": ("conformance", "tools")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> set[str]:
    """Absolute names of the modules `path` imports anywhere in its body (`from . import x` counts as `pkg.x` only:
    the package itself is already being imported when one of its modules runs)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if node.module:
                names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def _graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports (a submodule import does not count its package's __init__)."""
    files = {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
    return {m: {n for n in _imported(p) if n in files and n != m} for m, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}                                   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("package", ["k3ref", "k3cuda"])
def test_no_import_cycles(package):
    graph = _graph(package)
    assert len(graph) > 3, f"{package}: found only {sorted(graph)}"
    cycle = _cycle(graph)
    assert cycle is None, f"{package}: import cycle {' -> '.join(cycle)}"


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_no_upward_imports(package):
    upward = sorted(f"{_module_name(p)} imports {n}" for p in sorted((ROOT / package).rglob("*.py"))
                    for n in _imported(p) if n.split(".")[0] in ABOVE[package])
    assert not upward, f"{package} imports a package above it: {upward}"


def test_block_modules_do_not_import_the_registry_of_cores():
    graph = _graph("k3ref")
    assert {"k3ref.kda", "k3ref.mla", "k3ref.situ"} <= graph["k3ref.cores"]
    importers = sorted(m for m in ("k3ref.attnres", "k3ref.kda", "k3ref.latent_moe", "k3ref.mla", "k3ref.mxfp4",
                                   "k3ref.ops", "k3ref.situ") if "k3ref.cores" in graph[m])
    assert not importers, f"block modules importing k3ref.cores: {importers}"


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
