"""k3cuda: CUDA C kernels of the K3 decoder, loaded with PyCUDA, behind the same cores as k3ref.

Importing k3cuda (or any wrapper module) never touches a GPU: PyCUDA is imported and the context created on
the first launch. `available()` says whether the CUDA backend can run here and, if not, why;
`cuda_cores(base)` swaps in the kernels that exist. See docs/k3cuda.md.
"""
from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

from . import build, runtime
from .forcing import forced_entries, forced_entry, forcing
from .spec import ARCHS, BenchCase, CheckCase, EntrySpec, KernelSpec, Traffic

# One wrapper module k3cuda/<block>.py per kernel; the block name is also the core's name.
KERNEL_MODULES = ("kda_decode", "rmsnorm", "situ_glu", "mla_decode", "mxfp4_gemv", "attnres_mix")

# K3_CUDA_<BLOCK>=0 keeps the base core for that block (the escape when a kernel is suspect); the two mixer
# kernels also answer to their short names, K3_CUDA_KDA and K3_CUDA_MLA. Any other K3_CUDA_* name is refused
# (check_env): a misspelt escape would otherwise leave the kernel it meant to turn off running, unnoticed.
ENV_PREFIX = "K3_CUDA_"
_ENV_ALIASES = {"kda_decode": ("K3_CUDA_KDA",), "mla_decode": ("K3_CUDA_MLA",)}
ENV_OFF = ("0", "false", "no", "off")
ENV_ON = ("", "1", "true", "yes", "on")

__all__ = ["ARCHS", "BenchCase", "CheckCase", "ENV_PREFIX", "EntrySpec", "KERNEL_MODULES", "KernelSpec", "Traffic",
           "available", "check_env", "cuda_cores", "enabled", "env_names", "force_entry", "forced_entries",
           "forced_entry", "kernel_module", "kernel_specs"]


def kernel_module(block: str):
    """Import and return the wrapper module k3cuda.<block> (no GPU needed)."""
    if block not in KERNEL_MODULES:
        raise ValueError(f"block: expected one of {list(KERNEL_MODULES)}, found {block!r}")
    return importlib.import_module(f"{__name__}.{block}")


def kernel_specs() -> tuple[KernelSpec, ...]:
    """The KernelSpec (`KERNEL`) of every wrapper module in KERNEL_MODULES, in that order."""
    return tuple(kernel_module(block).KERNEL for block in KERNEL_MODULES)


def available() -> tuple[bool, str]:
    """(True, device description) when kernels can be compiled and launched here, else (False, why not)."""
    try:
        import pycuda  # noqa: F401, PLC0415 -- optional: importing k3cuda never needs a GPU or pycuda
    except ImportError as e:
        return False, (f"pycuda is not installed ({e}); pip install '.[cuda]', or on a machine without network "
                       "install the wheel that tools/build_pycuda_wheel.sh builds into .whl/")
    try:
        import pycuda.driver as cuda  # noqa: PLC0415 -- optional: importing k3cuda never needs a GPU or pycuda
    except ImportError as e:
        return False, f"pycuda cannot load the CUDA driver library (libcuda.so.1): {e}"
    if not build.nvcc_path():
        return False, "nvcc is not on PATH (the kernels are compiled on first use; install the CUDA toolkit)"
    try:
        index = runtime.device_index()
    except ValueError as e:
        return False, str(e)
    try:
        cuda.init()
        n = cuda.Device.count()
        if n == 0:
            return False, "the CUDA driver found no device"
        dev = cuda.Device(index)
        major, minor = dev.compute_capability()
        return True, f"{dev.name()} (sm_{major}{minor}), {n} device(s)"
    except cuda.Error as e:
        return False, f"no usable CUDA device: {type(e).__name__}: {e}"


def _block_env(block: str) -> tuple[str, ...]:
    return (f"{ENV_PREFIX}{block.upper()}", *_ENV_ALIASES.get(block, ()))


def env_names() -> tuple[str, ...]:
    """Every K3_CUDA_* environment name k3cuda reads: K3_CUDA_<BLOCK> per kernel, then the short aliases."""
    return tuple(f"{ENV_PREFIX}{b.upper()}" for b in KERNEL_MODULES) + tuple(
        a for b in KERNEL_MODULES for a in _ENV_ALIASES.get(b, ()))


def check_env(environ=None) -> None:
    """ValueError when the environment (default os.environ) holds a K3_CUDA_* name k3cuda does not read, or one
    of its names with a value that is neither on nor off; the message lists what is known."""
    env = os.environ if environ is None else environ
    known = env_names()
    unknown = sorted(n for n in env if n.startswith(ENV_PREFIX) and n not in known)
    if unknown:
        raise ValueError(f"unknown K3_CUDA_* environment name(s) {unknown}: expected some of {list(known)} "
                         f"(K3_CUDA_<KERNEL>=0 keeps the reference core for that kernel)")
    odd = {n: env[n] for n in known if n in env and env[n].strip().lower() not in ENV_OFF + ENV_ON}
    if odd:
        raise ValueError(f"K3_CUDA_* value(s) {odd}: expected one of {list(ENV_OFF)} (keep the reference core) "
                         f"or {[v for v in ENV_ON if v]} / empty (run the kernel)")


def enabled(block: str) -> bool:
    """False when K3_CUDA_<BLOCK>=0 (or an alias: K3_CUDA_KDA=0, K3_CUDA_MLA=0) asks to keep the base core.
    ValueError (check_env) when a K3_CUDA_* name is unknown or a value neither on nor off."""
    check_env()
    return not any(os.environ.get(n, "").strip().lower() in ENV_OFF for n in _block_env(block))


def cuda_cores(base):
    """`base` (a k3ref.cores.Cores) with every core that has a kernel replaced by its CUDA host function.

    A block whose K3_CUDA_<BLOCK> (or its alias) is 0 keeps base's core; cores without a kernel always keep
    base's. ValueError (check_env), before any core is swapped, for an unknown K3_CUDA_* name or value.
    """
    check_env()
    swaps = {}
    for block in KERNEL_MODULES:
        if enabled(block):
            swaps[block] = getattr(kernel_module(block), block)
    return base.replace(**swaps)


@contextlib.contextmanager
def force_entry(block: str, entry: str) -> Iterator[None]:
    """Inside the `with`, the wrapper of `block` launches `entry` instead of the one it would pick.

    For a kernel with several entries chosen by shape or dtype (kda_decode: full width or a 4-way V split by
    B*H; mla_decode: fp32 or bf16 cache), so that a small golden case exercises each of them. Only the
    choosing entries can be forced (not mla_decode's combine, which always runs). ValueError names the choices.
    """
    choices = kernel_module(block).CHOOSABLE_ENTRIES   # empty for single-entry kernels: they choose nothing
    if entry not in choices:
        raise ValueError(f"force_entry: {block} has no choosable entry {entry!r}; expected one of {list(choices)}")
    with forcing(block, entry):
        yield
