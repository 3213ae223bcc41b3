"""The architecture as the import graph shows it: three implementations of one spec and the judge.

Layering: k3ref (NumPy) and k3torch (PyTorch) import no other package of ours, so that their agreement means
two independent readings of the spec agree; k3cuda imports only k3ref (its emulator and argument checks);
conformance, the judge, may import all three. Inside every package there is no import cycle. Imports sit at
the top of a module: a function-level import is allowed only for an optional heavy dependency (the package must
import without it), since a deferred import of our own code only hides a cycle from Python, not from a reader.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("k3ref", "k3torch", "k3cuda", "conformance")
ABOVE = {
    "k3ref": ("k3torch", "k3cuda", "conformance", "tools", "tests"),
    "k3torch": ("k3ref", "k3cuda", "conformance", "tools", "tests"),
    "k3cuda": ("k3torch", "conformance", "tools", "tests"),
    "conformance": ("tools", "tests"),
}
# Imported inside functions on purpose: each is optional, and importing our packages must not need it
# (no GPU, no driver, no PyTorch -- so neither k3torch -- for the NumPy reference, no Triton or fla unless their
# adapter runs).
OPTIONAL_LATE = ("torch", "k3torch", "pycuda", "triton", "numba", "fla", "safetensors.torch", "threadpoolctl")
MAX_JUDGE_MODULE_LINES = 420   # "about 400": a conformance module past it usually holds two concepts
BUILD_LIKE_NAMES = ("dist", "build", "venv")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _import_nodes(tree: ast.AST):
    """(node, at_top) for every import statement; at_top: not inside a function or class body."""
    def walk(node: ast.AST, at_top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, at_top
            nested = at_top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, nested)
    yield from walk(tree, True)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> set[str]:
    """Absolute names an import statement binds (`from . import x` or `from pkg import x` inside pkg counts as
    `pkg.x` only: the package itself is already being imported when one of its modules runs)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[:len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    names = {f"{target}.{alias.name}" for alias in node.names}
    if node.module and not (module + ".").startswith(target + "."):
        names.add(target)
    return names


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported name, at top level, line) for everything `path` imports."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    return [(name, at_top, node.lineno) for node, at_top in _import_nodes(tree)
            for name in _targets(node, module, path.name == "__init__.py")]


def _graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports, wherever the import sits."""
    files = _files(package)
    return {m: {n for n, _, _ in _imports(p) if n in files and n != m} for m, p in files.items()}


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


def _is_optional(name: str) -> bool:
    return any(name == dep or name.startswith(dep + ".") for dep in OPTIONAL_LATE)


def _late_imports(source: str, name: str = "k3ref.example") -> list[str]:
    """`module:line ...` for each function-level import of something not optional, and for each late optional
    import without its reason (`# noqa: PLC0415 -- <why it is late>`)."""
    path = ROOT / (name.replace(".", "/") + ".py")
    lines = source.splitlines()
    found = []
    for node, at_top in _import_nodes(ast.parse(source)):
        if at_top:
            continue
        targets = sorted(_targets(node, name, path.name == "__init__.py"))
        required = [t for t in targets if not _is_optional(t) and not (
            isinstance(node, ast.ImportFrom) and t == node.module
            and any(_is_optional(f"{t}.{a.name}") for a in node.names))]
        found += [f"{name}:{node.lineno} imports {t}" for t in required]
        if not required and not re.search(r"noqa: [A-Z0-9, ]*PLC0415[A-Z0-9, ]* -- \S", lines[node.lineno - 1]):
            found.append(f"{name}:{node.lineno} imports {targets[0]} late without `# noqa: PLC0415 -- <reason>`")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    graph = _graph(package)
    assert len(graph) > 3, f"{package}: found only {sorted(graph)}"
    cycle = _cycle(graph)
    assert cycle is None, f"{package}: import cycle {' -> '.join(cycle)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_upward_imports(package):
    upward = sorted(f"{_module_name(p)}:{line} imports {n}" for p in _files(package).values()
                    for n, _, line in _imports(p) if n.split(".")[0] in ABOVE[package])
    assert not upward, f"{package} imports a package it must not: {upward}"


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_sit_at_the_top_except_optional_dependencies(package):
    late = [hit for m, p in _files(package).items() for hit in _late_imports(p.read_text(), m)]
    assert not late, f"{package}: function-level imports of required code: {late}"


def test_the_late_import_check_sees_what_it_must():
    source = ("import numpy\n"
              "def f():\n    import torch  # noqa: PLC0415 -- optional\n    from pycuda import driver\n"
              "    return torch, driver\n"
              "def g():\n    from k3ref import ops\n    import json\n    return ops, json\n"
              "class C:\n    def m(self):\n        from . import runner\n        return runner\n")
    assert _late_imports(source) == ["k3ref.example:4 imports pycuda late without `# noqa: PLC0415 -- <reason>`",
                                     "k3ref.example:7 imports k3ref.ops", "k3ref.example:8 imports json",
                                     "k3ref.example:12 imports k3ref.runner"]
    assert _is_optional("torch.distributed") and not _is_optional("torchvision") and not _is_optional("rich")


def test_a_function_level_import_is_an_edge_of_the_graph(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from pkg import b\n    return b\n")
    (tmp_path / "pkg" / "b.py").write_text("from . import a\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    graph = _graph("pkg")
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert _cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_judge_modules_hold_one_concept_each():
    long = sorted(f"{m}: {n} lines" for m, p in _files("conformance").items()
                  if (n := len(p.read_text().splitlines())) > MAX_JUDGE_MODULE_LINES)
    assert not long, f"conformance modules over {MAX_JUDGE_MODULE_LINES} lines: {long}"


def test_no_package_is_named_like_build_output():
    named = sorted(str(d.relative_to(ROOT)) for package in PACKAGES for d in (ROOT / package).rglob("*")
                   if d.is_dir() and d.name in BUILD_LIKE_NAMES)
    assert not named, f"folders that linters and .gitignore files treat as build output: {named}"


def test_results_do_not_travel_under_magic_keys():
    hits = sorted(f"{_module_name(p)}:{i}" for package in PACKAGES for p in _files(package).values()
                  for i, line in enumerate(p.read_text().splitlines(), 1) if "__notes__" in line or "__info__" in line)
    assert not hits, f"results under magic keys among tensors (use the Evaluation dataclass): {hits}"


def test_block_modules_do_not_import_the_registry_of_cores():
    graph = _graph("k3ref")
    assert {"k3ref.kda", "k3ref.mla", "k3ref.situ"} <= graph["k3ref.cores"]
    importers = sorted(m for m in ("k3ref.attnres", "k3ref.kda", "k3ref.latent_moe", "k3ref.mla", "k3ref.mxfp4",
                                   "k3ref.ops", "k3ref.situ") if "k3ref.cores" in graph[m])
    assert not importers, f"block modules importing k3ref.cores: {importers}"


@pytest.mark.parametrize("graph, want", [
    pytest.param({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"], id="three-cycle"),
    pytest.param({"a": {"a"}}, ["a", "a"], id="self-loop"),
    pytest.param({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None, id="diamond-no-cycle"),
    pytest.param({"a": {"b"}, "b": set()}, None, id="chain"),
])
def test_cycle_finder(graph, want):
    assert _cycle(graph) == want
