"""One kernel module of an installed serving engine (SGLang, vLLM), loaded from its wheel without the server.

The engines' wheels install with `pip install --no-deps -r requirements-engines.txt`: their kernels come along,
their server dependencies do not (importing `sglang` the usual way pulls orjson, aiohttp, zmq, IPython, torchvision
and more). So a kernel module is executed from its file under a private name (`_k3conf_<engine>.<module>`), with
the few engine imports it needs stood in by the named stubs below, installed in `sys.modules` only while the
module executes. Nothing of an engine is copied here: the module's code is the engine's, read from the installed
wheel at run time; the stubs supply the engine's plumbing (a layer object that holds a weight, a platform test),
never its math on the path that is judged.

| stub                   | stands in for                               | what the judged code uses of it            |
|------------------------|---------------------------------------------|--------------------------------------------|
| `StubRMSNorm`          | sglang.srt.layers.layernorm.RMSNorm         | `.weight`, `.variance_epsilon`; called     |
|                        |                                             | only by the eager reference (score norm)   |
|                        |                                             | and as the output norm outside the kernels |
| `StubReplicatedLinear` | sglang.srt.layers.linear.ReplicatedLinear   | `.weight` [1, H]; called by the eager      |
|                        |                                             | reference: `(x @ W^T, None)`               |
| `platform_predicates`  | sglang.srt.utils.is_cuda / is_hip / is_npu  | which path the module's dispatch takes     |

`StubRMSNorm` computes as sglang's RMSNorm.forward_native does with its defaults (fp32 variance, the product
with the weight in fp32, one cast back to the input's dtype), so the eager reference judged through it is the
engine's reference as it runs on a CPU.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any


class EngineModuleError(RuntimeError):
    """An engine's kernel module cannot be loaded: the wheel is missing, another version, or the file is gone."""


class StubRMSNorm:
    """sglang's RMSNorm as a holder of `weight` [H] and `variance_epsilon`; called, it normalises as sglang's
    forward_native does: x in fp32, x * rsqrt(mean(x^2) + eps), times the weight in fp32, cast to x's dtype."""

    def __init__(self, weight, eps: float):
        self.weight = weight
        self.variance_epsilon = float(eps)

    def __call__(self, x):
        import torch  # noqa: PLC0415 -- optional: the stubs are built only where torch is

        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
        return (x * self.weight.float()).to(dtype)


class StubReplicatedLinear:
    """sglang's ReplicatedLinear as a holder of `weight` [N, H]; called, (x @ weight^T, None) in x's dtype (the
    engine's linear returns (output, bias))."""

    def __init__(self, weight):
        self.weight = weight

    def __call__(self, x):
        return x @ self.weight.to(x.dtype).t(), None


def platform_predicates(platform: str) -> dict[str, Callable[[], bool]]:
    """sglang.srt.utils' is_cuda / is_hip / is_npu answering for `platform` ("cpu", "cuda", "hip")."""
    known = ("cpu", "cuda", "hip")
    if platform not in known:
        raise ValueError(f"platform: expected one of {known}, found {platform!r}")
    answers = {p: p == platform for p in ("cuda", "hip", "npu")}

    def predicate(answer: bool) -> Callable[[], bool]:
        return lambda: answer
    return {f"is_{p}": predicate(a) for p, a in answers.items()}


@dataclasses.dataclass(frozen=True)
class EngineModule:
    """One module of an engine wheel: the distribution (`sglang`), the file in the wheel, and the engine modules
    its imports need stood in (module name -> attribute name -> object)."""

    dist: str
    path: str                                       # inside the wheel: "sglang/srt/layers/attn_residual.py"
    stubs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def alias(self) -> str:
        """The private name it is loaded under: never the engine's own, so nothing else of the engine imports."""
        return f"_k3conf_{self.dist}." + Path(self.path).with_suffix("").as_posix().replace("/", ".")


def installed_version(dist: str) -> str | None:
    """The installed version of `dist`, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def module_file(dist: str, path: str) -> Path:
    """Where the installed wheel of `dist` holds `path`; EngineModuleError naming the install command if not."""
    if installed_version(dist) is None:
        raise EngineModuleError(f"{dist} is not installed: pip install --no-deps -r requirements-engines.txt")
    located = Path(str(importlib.metadata.distribution(dist).locate_file(path)))
    if not located.is_file():
        raise EngineModuleError(f"{dist} {installed_version(dist)}: expected {path} in the installed wheel, "
                                "found none (another version?): pip install --no-deps -r requirements-engines.txt")
    return located


@contextmanager
def stubbed(stubs: Mapping[str, Mapping[str, Any]]) -> Iterator[None]:
    """`stubs` installed as modules in sys.modules for the duration, what was there before restored after."""
    saved = {name: sys.modules.get(name) for name in stubs}
    try:
        for name, attrs in stubs.items():
            stub = ModuleType(name, f"k3conf stub of {name}")
            stub.__dict__.update(attrs)
            sys.modules[name] = stub
        yield
    finally:
        for name, before in saved.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before


def load(module: EngineModule) -> ModuleType:
    """Execute the engine's file under module.alias with its stubs in place (once per process; the loaded module
    is kept in sys.modules under the alias, so a Triton kernel's source stays findable)."""
    if module.alias in sys.modules:
        return sys.modules[module.alias]
    spec = importlib.util.spec_from_file_location(module.alias, module_file(module.dist, module.path))
    if spec is None or spec.loader is None:
        raise EngineModuleError(f"{module.path}: Python cannot load it as a module")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module.alias] = loaded
    try:
        with stubbed(module.stubs):
            spec.loader.exec_module(loaded)
    except BaseException:
        sys.modules.pop(module.alias, None)
        raise
    return loaded


@dataclasses.dataclass(frozen=True)
class EnginePackage:
    """A package of an engine wheel whose modules import each other by their absolute names (a vendored fla):
    the package itself is stood in by a bare package over the wheel's folder (its __init__ and its parents' never
    run), its modules execute under their own names, and the engine imports outside it are stood in (`stubs`)."""

    dist: str
    name: str                                       # "sglang.kernels.ops.attention.fla"
    stubs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    @property
    def path(self) -> str:
        return self.name.replace(".", "/")


def load_from_package(package: EnginePackage, module: str) -> ModuleType:
    """`package.name + "." + module` executed from the installed wheel with the package and its stubs in place,
    and every module of the package it imports (kept in sys.modules under their names: a Triton kernel's source is
    read from its module when it first runs). The stubs and the bare package are removed again afterwards."""
    name = f"{package.name}.{module}"
    if name in sys.modules:
        return sys.modules[name]
    folder = module_file(package.dist, f"{package.path}/{module}.py").parent
    bare = ModuleType(package.name, f"k3conf: {package.dist}'s {package.name}, its __init__ not run")
    bare.__path__ = [str(folder)]
    with stubbed(package.stubs):
        saved = sys.modules.get(package.name)
        sys.modules[package.name] = bare
        try:
            loaded = importlib.import_module(name)
        finally:
            if saved is None:
                sys.modules.pop(package.name, None)
            else:
                sys.modules[package.name] = saved
    return loaded

