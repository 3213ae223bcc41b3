"""What the suite needs from the machine, and what happens when it is missing.

A test that needs PyTorch, nvcc or g++ carries the marker `torch`, `nvcc` or `gxx` (tests/conftest.py checks
them before the test runs) or calls `require(...)`. Without the tool the test is skipped with the reason;
under K3_STRICT=1 (what CI sets) it fails with the reason instead, so CI cannot pass without compiling,
emulating and comparing what it claims to. K3_STRICT is read by the rule of `k3conf run` and the pytest plugin
(conformance.session.strict: 1/true/yes/on strict, 0/false/no/off/empty not, anything else refused).
"""
from __future__ import annotations

import importlib
import shutil

import pytest

from conformance.session import strict
from k3cuda import build

__all__ = ["import_or_skip", "missing", "require", "require_ready", "strict"]

INSTALL = {
    "torch": "PyTorch is not installed ({why}): pip install 'k3-conformance[torch]' (or `make setup`)",
    "nvcc": "nvcc is not on PATH: the CPU-side kernel gates compile the kernels (install the CUDA toolkit)",
    "gxx": "g++ is not on PATH: the CPU emulation of the kernels needs a C++17 compiler",
}


def missing(what: str) -> str | None:
    """None when `what` ("torch", "nvcc" or "gxx") is here, else why not."""
    if what == "torch":
        try:
            importlib.import_module("torch")
        except ImportError as e:
            return INSTALL["torch"].format(why=e)
        return None
    if what == "nvcc":
        return None if build.nvcc_path() else INSTALL["nvcc"]
    if what == "gxx":
        return None if shutil.which("g++") else INSTALL["gxx"]
    raise ValueError(f"requirement: expected torch, nvcc or gxx, found {what!r}")


def require(what: str) -> None:
    """Skip (fail under K3_STRICT=1) the calling test or module when `what` is missing, with the reason."""
    why = missing(what)
    if why is None:
        return
    if strict():
        pytest.fail(f"K3_STRICT=1: {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)


def import_or_skip(name: str):
    """The module `name` ("torch"), after require(name)."""
    require(name)
    return importlib.import_module(name)


def require_ready(refusal: str | None) -> None:
    """Skip (fail under K3_STRICT=1) the calling test when `refusal` (why an optional package such as an engine's
    wheel cannot run here) is not None; CI installs what the tests need."""
    if refusal is None:
        return
    if strict():
        pytest.fail(f"K3_STRICT=1: {refusal}", pytrace=False)
    pytest.skip(refusal)
