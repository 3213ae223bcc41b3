"""Backends by name: who supplies the cores a case runs on (docs/interfaces.md, "Backends").

The table (`k3conf list` shows availability and the reason):
- `numpy64`    k3ref cores, float64 inputs: exact by construction against the goldens.
- `numpy32`    k3ref cores, float inputs cast to float32: the fp32 baseline of the gate table.
- `torch`, `torch-bf16`, `torch64`  conformance.backends.pytorch.make_backend(name), built on first use;
               skipped with the reason when torch is missing. torch-bf16 is the bf16 baseline;
               torch64 / torch / torch-bf16 are the time baselines at fp64 / fp32 / bf16.
- `torch-model`, `torch-model-bf16`  k3torch: the eager PyTorch K3 model at fp32 / bf16 runs
               whole traces (a WholeModelBackend: `evaluate_trace(case, golden, config_json, prompt_len,
               router_budget=0.0)`, its router near-ties below the budget teacher-forced, used by the trace kind
               in place of the cores); n/a (skipped) for the per-block cases. torch-model-bf16 runs only when
               named (ON_REQUEST).
- `cuda`       k3cuda.cuda_cores(reference_cores()) when k3cuda.available() says so; skipped otherwise.
- `cuda-emu`   the same kernels and wrappers run by the g++ CPU emulation of k3cuda.testing (no GPU, no timing).
- `sglang`, `sglang-hip`, `sglang-ref`, `vllm`, `vllm-rocm`, `vllm-ref`  the serving engines' K3 code loaded from
               their installed wheels (conformance.backends.sglang, .vllm; docs/engines.md), bf16, run only when
               named (ON_REQUEST).
- `mutant:<name>`  numpy64 (or, for the bf16 mutants, torch-bf16) with one core replaced by a deliberately
               wrong one from conformance.backends.mutants.MUTANTS.
- `recipe:<name>`  a correct kernel written another way (conformance.backends.recipes: wider accumulation, another
               summation order, fp32 math behind bf16 outputs), the judge's false-fail rate is measured on.
- entry points of the group `k3conf.backends` (installed packages, conformance.backends.external), by name, and
  `MODULE:ATTR` / `path/to/file.py:ATTR`: a backend defined outside the package (docs/external_backends.md).
What a backend is: conformance.backends.protocol. Every backend this module hands out is a BackendBase (an object
written against the bare protocol is wrapped once, when built; one whose cores take torch tensors is put behind
conformance.backends.tensors' NumPy bridge). DEVICE_BACKENDS may be unavailable under
K3_STRICT=1 (they need an accelerator); no other backend may.
"""
from __future__ import annotations

from collections.abc import Callable

from conformance.backends import external
from conformance.backends import fla as fla_backend
from conformance.backends import sglang as sglang_backend
from conformance.backends import vllm as vllm_backend
from conformance.backends.builtin import (
    CudaBackend,
    CudaEmuBackend,
    LazyBackend,
    NumpyBackend,
    torch_loader,
    torch_model,
)
from conformance.backends.mutants import MUTANTS, Mutant, mutant_backend
from conformance.backends.protocol import (
    ALL_CORES,
    BackendBase,
    MinimalBackend,
    kernel_cores,
)
from conformance.backends.recipes import RECIPES, recipe_backend
from conformance.backends.tensors import adapt
from k3ref.cores import reference_cores

__all__ = ["ALL_CORES", "BACKENDS", "DEVICE_BACKENDS", "IN_PROCESS", "MUTANTS", "ON_REQUEST", "Mutant",
           "NumpyBackend", "backend_names", "get_backend", "is_external", "kernel_cores", "known_name",
           "reference_cores", "registered_name", "reserved_names"]

DEVICE_BACKENDS = frozenset({"cuda"})
# The built-in NumPy references run in the run's own process: they are k3ref's code, the yardstick itself. Every
# other backend runs in a worker process (conformance.isolation) and is never built in the run's process.
IN_PROCESS = frozenset({"numpy64", "numpy32"})
Factory = Callable[[], BackendBase | MinimalBackend]

BACKENDS: dict[str, Factory] = {
    "numpy64": lambda: NumpyBackend("numpy64", "fp64"),
    "numpy32": lambda: NumpyBackend("numpy32", "fp32"),
    "torch": lambda: LazyBackend("torch", "fp32", torch_loader("torch")),
    "torch-bf16": lambda: LazyBackend("torch-bf16", "bf16", torch_loader("torch-bf16")),
    "torch64": lambda: LazyBackend("torch64", "fp64", torch_loader("torch64")),
    "cuda": lambda: LazyBackend("cuda", "fp32", CudaBackend),
    "torch-model": lambda: torch_model("torch-model"),
    "cuda-emu": lambda: LazyBackend("cuda-emu", "fp32", CudaEmuBackend),
}
# Run only when named: torch-model-bf16 passes three of the four traces with its router near-ties teacher-forced,
# but on tiny's free-running one a step-1 route of layer 4 whose golden margin (1.7e-2) sits just above the bf16
# router budget (1.5e-2, measured on the layerwise trace) flips under the accumulated free-run error, and the
# step-1 logits then err 0.26 > 0.205 (`k3conf run --backend torch-model-bf16 --cases 'trace/*'`; see
# docs/torch_model.md, "Router near-ties at bf16").
ON_REQUEST: dict[str, Factory] = {
    "torch-model-bf16": lambda: torch_model("torch-model-bf16"),
    # fla's real KDA kernels (under Triton's interpreter without a GPU): tiny's free-running trace fails on them
    # as on torch-model-bf16 (conformance.backends.fla.EXPECTED_FINDINGS); `make fla` runs them and checks that
    "fla": fla_backend.make_backend,
    # the serving engines' K3 code as their wheels ship it (docs/engines.md): SGLang's two Triton AttnRes paths and
    # its eager reference, and vLLM's Triton AttnRes kernels; `make engines` runs them and checks their documented
    # findings (conformance.backends.engines)
    **{name: sglang_backend.factory(name) for name in sglang_backend.NAMES},
    **{name: vllm_backend.factory(name) for name in vllm_backend.NAMES},
}
_CACHE: dict[str, BackendBase] = {}   # name -> backend, built once per process


def reserved_names() -> frozenset[str]:
    """The names an external backend may not take: the built-in and on-request ones (and, by prefix, mutants)."""
    return frozenset(BACKENDS) | frozenset(ON_REQUEST)


def is_external(name: str) -> bool:
    """True for a backend name that resolves outside this package: MODULE:ATTR or an installed entry point."""
    return external.is_spec(name) or (name in external.entry_points() and name not in reserved_names())


def backend_names() -> list[str]:
    """Registered names (mutants excluded), in registry order, then the installed packages' entry points."""
    return list(BACKENDS) + [n for n in external.entry_points() if n not in reserved_names()]


def known_name(name: str) -> None:
    """KeyError naming the choices when `name` is no backend this registry can build, found without building it
    (and so without importing an external backend's module)."""
    if name.startswith("mutant:"):
        if name[len("mutant:"):] not in MUTANTS:
            raise KeyError(f"unknown mutant {name!r}; known: {['mutant:' + m for m in MUTANTS]}")
        return
    if name.startswith("recipe:"):
        if name[len("recipe:"):] not in RECIPES:
            raise KeyError(f"unknown recipe {name!r}; known: {['recipe:' + r for r in RECIPES]}")
        return
    if name in BACKENDS or name in ON_REQUEST or external.is_spec(name) or name in external.entry_points():
        return
    raise KeyError(f"unknown backend {name!r}; known: {backend_names()}, mutant:<{'|'.join(MUTANTS)}> "
                   "or MODULE:ATTR (an external backend)")


def get_backend(name: str) -> BackendBase:
    """The backend called `name` (built once per process); KeyError naming the choices when unknown,
    conformance.backends.external.BackendError (a ValueError) naming what is wrong when a MODULE:ATTR cannot load."""
    if name not in _CACHE:
        _CACHE[name] = _build(name)
    return _CACHE[name]


def registered_name(backend: BackendBase) -> str:
    """The name get_backend built `backend` under: for an external backend its MODULE:ATTR spec (backend.name is
    the author's), which is what another process passes to get_backend to build the same backend; KeyError when
    get_backend did not build it."""
    for name, built in _CACHE.items():
        if built is backend:
            return name
    raise KeyError(f"backend {backend.name!r} was not built by conformance.backends.registry.get_backend")


def _build(name: str) -> BackendBase:
    if name.startswith("mutant:"):
        mutant = MUTANTS.get(name[len("mutant:"):])
        if mutant is None:
            raise KeyError(f"unknown mutant {name!r}; known: {['mutant:' + m for m in MUTANTS]}")
        return mutant_backend(name, mutant, get_backend(mutant.base))
    if name.startswith("recipe:"):
        known_name(name)
        return recipe_backend(name)
    if name in BACKENDS or name in ON_REQUEST:
        return adapt({**ON_REQUEST, **BACKENDS}[name]())
    if external.is_spec(name):              # MODULE:ATTR: a backend defined outside the package
        return external.load(name, reserved=reserved_names())
    if name in external.entry_points():     # an installed package's backend
        return external.from_entry_point(name, reserved=reserved_names())
    raise KeyError(f"unknown backend {name!r}; known: {backend_names()}, mutant:<{'|'.join(MUTANTS)}> "
                   "or MODULE:ATTR (an external backend)")
