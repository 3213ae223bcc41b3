"""k3torch is an independent reading of the spec: no module of it may import k3ref, k3cuda or conformance.

Agreement between k3torch and k3ref only means two readings of docs/spec.md agree if neither borrows from the
other, so the check covers every import k3torch's source makes: at the top, inside functions, relative, and
by name through importlib. It reads the source (ast), so it runs without torch.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "k3torch"
FOREIGN = ("k3ref", "k3cuda", "conformance")
DYNAMIC = ("import_module", "__import__")      # importlib.import_module("x"), __import__("x")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The absolute module names one ast node imports (none for a node that is not an import)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if not node.level:
            return [node.module or ""]
        here = module.split(".") if is_package else module.split(".")[:-1]
        base = here[:len(here) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
        return [f"{target}.{alias.name}" if target else alias.name for alias in node.names]
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in DYNAMIC and node.args and isinstance(node.args[0], ast.Constant):
            return [str(node.args[0].value)]
    return []


def foreign_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """'module:line imports name' for every import in `source` of a package k3torch must not use."""
    hits = [(node.lineno, name) for node in ast.walk(ast.parse(source))
            for name in _imported(node, module, is_package) if name.split(".")[0] in FOREIGN]
    return [f"{module}:{line} imports {name}" for line, name in sorted(hits)]


def test_the_model_imports_nothing_of_k3ref():
    """Every module of k3torch (cores, checks, configuration, modeling, loading, trace): only torch, numpy,
    safetensors, the standard library and each other."""
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    names = {_module_name(p) for p in files}
    assert {"k3torch.cores", "k3torch.modeling_k3", "k3torch.trace"} <= names, f"found only {sorted(names)}"
    found = [hit for p in files for hit in foreign_imports(p.read_text(), _module_name(p), p.name == "__init__.py")]
    assert not found, f"k3torch imports what it must not: {found}"


def test_the_import_walk_sees_what_it_must():
    """Top-level, function-level, relative-resolved and importlib imports are all seen; own and third-party
    imports are not flagged."""
    source = ("import numpy\n"
              "import torch\n"
              "from . import cores\n"
              "from .modeling_k3 import K3ForCausalLM\n"
              "def f():\n"
              "    from k3ref.checks import require\n"
              "    import conformance.cli\n"
              "    return require, conformance\n"
              "def g():\n"
              "    import importlib\n"
              "    return importlib.import_module('k3cuda.runtime')\n"
              "from k3refine import x\n")
    assert foreign_imports(source, "k3torch.example") == [
        "k3torch.example:6 imports k3ref.checks",
        "k3torch.example:7 imports conformance.cli",
        "k3torch.example:11 imports k3cuda.runtime",
    ]
    assert foreign_imports("from .. import k3ref\n", "k3torch.example") == ["k3torch.example:1 imports k3ref"]
