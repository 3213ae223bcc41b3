"""Backends: who supplies the cores a case runs on (docs/interfaces.md, "Backends").

Registry (`k3conf list` shows availability and the reason):
- `numpy64`    k3ref cores, float64 inputs: exact by construction against the goldens.
- `numpy32`    k3ref cores, float inputs cast to float32: the fp32 baseline of the gate table.
- `torch`, `torch-bf16`, `torch64`  conformance.backends.pytorch.make_backend(name), imported lazily;
               skipped with the reason when torch or that module is missing. torch-bf16 is the bf16 baseline;
               torch64 / torch / torch-bf16 are the time baselines at fp64 / fp32 / bf16.
- `torch-model`, `torch-model-bf16`  k3torch: the eager PyTorch K3 model at fp32 / bf16 runs
               whole traces (`evaluate_trace(case, golden, config_json, prompt_len, router_budget=0.0)`,
               its router near-ties below the budget teacher-forced, used by the trace kind
               in place of the cores); n/a (skipped) for the per-block cases. torch-model-bf16 runs only when
               named (ON_REQUEST).
- `cuda`       k3cuda.cuda_cores(reference_cores()) when k3cuda.available() says so; skipped otherwise.
- `cuda-emu`   the same kernels and wrappers run by the g++ CPU emulation of k3cuda.testing (no GPU, no timing).
- `mutant:<name>`  numpy64 (or, for the bf16 mutants, torch-bf16) with one core replaced by a deliberately
               wrong one from MUTANTS; the mutation tests prove that the runner catches each mistake and
               names its block first.
- entry points of the group `k3conf.backends` (installed packages, conformance.backends.external), by name, and
  `MODULE:ATTR` / `path/to/file.py:ATTR`: a backend defined outside the package (docs/external_backends.md).
Add a backend with `register_backend(name, factory)` and a mutant with `register_mutant(...)`.

A backend object has `name`, `precision` ("fp64" | "fp32" | "bf16"), `available() -> (bool, reason)`,
`cores() -> Cores` and `time_core(core, inputs) -> float | None` (median seconds, data resident);
optionally `copy_bandwidth() -> bytes/s`, `speed_target(block) -> float | None` and
`kernel_cores() -> frozenset[str]`: the names (k3ref.cores.CORE_NAMES) of the cores the backend supplies
itself; every other core it hands out is k3ref's reference core. The runner reads a case none of whose cores
is a kernel core as "n/a (reference core)"; a backend without the method supplies all its cores itself.
DEVICE_BACKENDS may be unavailable under K3_STRICT=1 (they need an accelerator); no other backend may.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

import numpy as np

from k3ref.cores import CORE_NAMES, Cores, reference_cores

ALL_CORES = frozenset(CORE_NAMES)
DEVICE_BACKENDS = frozenset({"cuda"})


def kernel_cores(backend) -> frozenset[str]:
    """The cores `backend` supplies itself (all of them when it does not say)."""
    fn = getattr(backend, "kernel_cores", None)
    return ALL_CORES if fn is None else frozenset(fn())


@dataclasses.dataclass
class NumpyBackend:
    """k3ref's cores at one precision; `time_core` times the core on the CPU."""

    name: str
    precision: str
    make_cores: Callable[[], Cores] = reference_cores
    repeats: int = 3

    def available(self) -> tuple[bool, str]:
        return True, "k3ref (NumPy)"

    def cores(self) -> Cores:
        return self.make_cores()

    def kernel_cores(self) -> frozenset[str]:
        return ALL_CORES

    def time_core(self, core: str, inputs: dict) -> float | None:
        """Median wall time of `core(**inputs)` over `repeats` calls after one warm-up call."""
        from conformance.judge.speed import median_seconds

        fn = getattr(self.cores(), core)
        return median_seconds(lambda: fn(**inputs), self.repeats)

    def copy_bandwidth(self) -> float:
        from conformance.judge.speed import numpy_copy_bandwidth

        return numpy_copy_bandwidth()


@dataclasses.dataclass
class LazyBackend:
    """A backend built on first use by `load()`; unavailable (with the reason) when that fails."""

    name: str
    precision: str
    load: Callable[[], object]
    _inner: object = None
    _why: str = ""

    def _get(self):
        if self._inner is None and not self._why:
            try:
                self._inner = self.load()
            except Exception as e:  # noqa: BLE001 - any failure to build means "not here", with the reason
                self._why = f"{type(e).__name__}: {e}"
        return self._inner

    def available(self) -> tuple[bool, str]:
        inner = self._get()
        if inner is None:
            return False, self._why
        return inner.available()

    def cores(self) -> Cores:
        inner = self._get()
        if inner is None:
            raise RuntimeError(f"backend {self.name} is unavailable: {self._why}")
        return inner.cores()

    def kernel_cores(self) -> frozenset[str]:
        inner = self._get()
        return ALL_CORES if inner is None else kernel_cores(inner)

    def time_core(self, core: str, inputs: dict) -> float | None:
        inner = self._get()
        return None if inner is None else inner.time_core(core, inputs)

    def copy_bandwidth(self) -> float | None:
        fn = getattr(self._get(), "copy_bandwidth", None)
        return fn() if fn else None

    def speed_target(self, block: str) -> float | None:
        fn = getattr(self._get(), "speed_target", None)
        return fn(block) if fn else None


def _torch(name: str) -> Callable[[], object]:
    def load():
        try:
            torch = importlib.import_module("torch")
        except ImportError as e:
            raise ImportError(f"PyTorch is not installed ({e}); pip install 'k3-conformance[torch]' "
                              "(or `make setup`, which installs the CPU build)") from None
        # One intra-op thread: the runner times one core at a time, and on a small shared machine torch's
        # OpenMP threads spin-wait for busy cores (`k3conf run` took 6.6x its quiet time under load).
        torch.set_num_threads(1)
        mod = importlib.import_module("conformance.backends.pytorch")
        return mod.make_backend(name)
    return load


def _torch_model(name: str):
    """The eager PyTorch K3 model (k3torch): whole traces only; torch imported on first use."""
    return importlib.import_module("k3torch.trace").TorchModelBackend(name)


class CudaBackend:
    """k3cuda's kernels in place of the reference cores they implement (the rest stay k3ref's)."""

    name = "cuda"
    precision = "fp32"

    def __init__(self):
        import k3cuda
        self._k3cuda = k3cuda

    def available(self) -> tuple[bool, str]:
        fn = getattr(self._k3cuda, "available", None)
        if fn is None:   # e.g. an editable install made before k3cuda/__init__.py existed: a namespace package
            where = getattr(self._k3cuda, "__file__", None) or list(getattr(self._k3cuda, "__path__", []))
            return False, f"k3cuda.available() is missing (k3cuda imported from {where}; reinstall: pip install -e .)"
        return fn()

    def cores(self) -> Cores:
        return self._k3cuda.cuda_cores(reference_cores())

    def kernel_cores(self) -> frozenset[str]:
        """The cores with an enabled kernel (K3_CUDA_<BLOCK>=0 keeps the reference core)."""
        return frozenset(b for b in self._k3cuda.KERNEL_MODULES if self._k3cuda.enabled(b))

    def _module(self, block: str):
        """k3cuda.<block> when that kernel exists and is enabled, else None."""
        if block not in self._k3cuda.KERNEL_MODULES or not self._k3cuda.enabled(block):
            return None
        return self._k3cuda.kernel_module(block)

    def time_core(self, core: str, inputs: dict) -> float | None:
        """Median CUDA-event seconds of the kernel with its inputs uploaded once (k3cuda.<core>.device_launch)."""
        mod = self._module(core)
        if mod is None or not hasattr(mod, "device_launch"):
            return None
        from k3cuda import runtime

        return runtime.time_fn(mod.device_launch(inputs))

    def copy_bandwidth(self) -> float | None:
        from k3cuda import runtime

        return runtime.copy_bandwidth()

    def speed_target(self, block: str) -> float | None:
        """None: report only. The golden cases are toy-sized, so a kernel on them is launch-bound and no
        bandwidth target means anything there; the targets (BenchCase.target_bw_ratio) are gated by
        tools/gpu_bench.py at the sizes of k3cuda.<block>.bench_cases(), which fill the GPU."""
        return None


class CudaEmuBackend(CudaBackend):
    """k3cuda's kernels run by the g++ emulation in k3cuda.testing: no GPU needed.

    The real .cu sources, the wrappers and their argument packing run, block by block and thread by thread on
    the CPU, so a wrong index, reduction or combine shows here; GPU rounding of fused multiply-adds, races
    and speed do not (no timing). A core given shapes its kernel is not built for is a skipped case.
    """

    name = "cuda-emu"
    precision = "fp32"

    def available(self) -> tuple[bool, str]:
        import shutil

        if shutil.which("g++") is None:
            return False, "g++ not found on PATH (the CPU emulation of the kernels compiles them as C++)"
        if getattr(self._k3cuda, "cuda_cores", None) is None:
            return False, "k3cuda.cuda_cores() is missing (reinstall: pip install -e .)"
        return True, "k3cuda kernels run on the CPU by the g++ emulation (no GPU rounding, races or timing)"

    def cores(self) -> Cores:
        from k3cuda.testing import cpu_emulation

        base = reference_cores()
        kernels = self._k3cuda.cuda_cores(base)

        def emulated(fn):
            def call(*args, **kwargs):
                with cpu_emulation():
                    return fn(*args, **kwargs)
            return call

        return kernels.replace(**{n: emulated(getattr(kernels, n)) for n in CORE_NAMES
                                  if getattr(kernels, n) is not getattr(base, n)})

    def time_core(self, core: str, inputs: dict) -> float | None:
        return None  # emulated time says nothing about the GPU

    def copy_bandwidth(self) -> float | None:
        return None

    def speed_target(self, block: str) -> float | None:
        return None


# --------------------------------------------------------------------------------------------------
# mutants: numpy64 with one deliberately wrong core


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A known mistake: `make(base) -> Cores` swaps one core of `base`; `block` is where it must show first.

    base: the backend whose cores are mutated and whose precision the mutant runs at ("numpy64": a gross
    mistake seen at every precision; "torch-bf16": a small one that the bf16 gates must still catch)."""

    block: str
    description: str
    make: Callable[[Cores], Cores]
    base: str = "numpy64"


@dataclasses.dataclass
class MutantBackend:
    """`base`'s cores with one mutated; unavailable (with the base's reason) where the base cannot run."""

    name: str
    base: object
    make: Callable[[Cores], Cores]

    @property
    def precision(self) -> str:
        return self.base.precision

    def available(self) -> tuple[bool, str]:
        ok, why = self.base.available()
        return ok, (f"mutated {why}" if ok else why)

    def cores(self) -> Cores:
        return self.make(self.base.cores())

    def kernel_cores(self) -> frozenset[str]:
        return ALL_CORES

    def time_core(self, core: str, inputs: dict) -> float | None:
        return None   # a mutant is about being caught, not about speed


def _kda_l2_eps_1e12(base: Cores) -> Cores:
    """KDA with L2(x) = x / sqrt(sum(x^2) + 1e-12): exact otherwise (k3ref's gate and recurrence)."""
    from k3ref import kda, ops

    def l2(x):
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-12)

    def prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
        g = kda.kda_gate(g_raw, A_log, dt_bias, lower_bound)
        return kda.kda_recurrent(l2(np.asarray(q)), l2(np.asarray(k)), v, g, ops.sigmoid(beta_raw), scale=scale,
                                 initial_state=state, use_qk_l2norm=False)

    def decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, **kw):
        o, S = prefill(*(np.asarray(a)[:, None] for a in (q, k, v, g_raw, beta_raw)), A_log, dt_bias, state, **kw)
        return o[:, 0], S

    return base.replace(kda_decode=decode, kda_prefill=prefill)


def _kda_no_lower_bound(base: Cores) -> Cores:
    def decode(*args, **kw):
        return base.kda_decode(*args, **{**kw, "lower_bound": None})

    def prefill(*args, **kw):
        return base.kda_prefill(*args, **{**kw, "lower_bound": None})

    return base.replace(kda_decode=decode, kda_prefill=prefill)


def _mla_scale_128(base: Cores) -> Cores:
    def decode(*args, **kw):
        return base.mla_decode(*args, **{**kw, "scale": 128 ** -0.5})

    return base.replace(mla_decode=decode)


def _router_bias_in_weights(base: Cores) -> Cores:
    def route(logits, bias, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
        _, idx = base.moe_route(logits, bias, top_k, n_group=n_group, topk_group=topk_group,
                                renormalize=renormalize, scaling=scaling)
        logits = np.asarray(logits)
        choice = 1.0 / (1.0 + np.exp(-logits)) + np.asarray(bias, logits.dtype)
        w = np.take_along_axis(choice, idx, axis=-1)
        if renormalize:
            w = w / (np.sum(w, axis=-1, keepdims=True) + 1e-20)
        return (w * scaling).astype(logits.dtype), idx

    return base.replace(moe_route=route)


def _mxfp4_nibbles_swapped(base: Cores) -> Cores:
    def gemv(packed, scale, x):
        p = np.asarray(packed)
        return base.mxfp4_gemv(((p >> 4) | (p << 4)).astype(np.uint8), scale, x)

    return base.replace(mxfp4_gemv=gemv)


MUTANTS: dict[str, Mutant] = {
    "kda-l2-eps-1e-12": Mutant("kda_decode", "KDA L2 norm with eps 1e-12 instead of 1e-6", _kda_l2_eps_1e12),
    "kda-no-lower-bound": Mutant("kda_decode", "KDA gate without the lower bound (Kimi Linear softplus form)",
                                 _kda_no_lower_bound),
    "mla-scale-128": Mutant("mla_decode", "MLA softmax scale 1/sqrt(128) instead of 1/sqrt(192)", _mla_scale_128),
    "router-bias-in-weights": Mutant("moe_route", "router bias also used for the routing weights",
                                     _router_bias_in_weights),
    "mxfp4-nibbles-swapped": Mutant("mxfp4_gemv", "MXFP4 element 2i read from the high nibble",
                                    _mxfp4_nibbles_swapped),
}


def _scaled_by_one_percent(core: str) -> Callable[[Cores], Cores]:
    """`core`'s floating outputs times (1 +- 1%), the sign drawn per element: 1% relative RMS error, about 3x
    what bf16 rounding costs a core (torch-bf16 measures 2e-3 .. 6e-3 on the tiny cases)."""
    def off(a):
        a = np.asarray(a)
        if a.dtype.kind != "f":
            return a
        sign = np.where(np.random.default_rng(a.size).random(a.shape) < 0.5, -1.0, 1.0)
        return (a * (1.0 + 0.01 * sign)).astype(a.dtype)

    def make(base: Cores) -> Cores:
        fn = getattr(base, core)

        def perturbed(*args, **kwargs):
            out = fn(*args, **kwargs)
            return tuple(off(o) for o in out) if isinstance(out, tuple) else off(out)

        return base.replace(**{core: perturbed})
    return make


# A bf16 kernel one percent off must fail its block's cases and be named by the layer-by-layer trace.
BF16_MUTANT_CORES = ("rmsnorm", "situ_glu", "kda_decode", "mla_decode", "mxfp4_gemv", "attnres_mix")
for _core in BF16_MUTANT_CORES:
    MUTANTS[f"bf16-{_core.replace('_', '-')}-1pct"] = Mutant(
        _core, f"torch-bf16 with the {_core} output off by 1% relative (sign random per element)",
        _scaled_by_one_percent(_core), base="torch-bf16")


def register_mutant(name: str, block: str, description: str, make: Callable[[Cores], Cores],
                    base: str = "numpy64") -> None:
    """Add a mutant; `k3conf run --backend mutant:<name>` then runs `base` with it."""
    MUTANTS[name] = Mutant(block, description, make, base)


# --------------------------------------------------------------------------------------------------
# registry

BACKENDS: dict[str, Callable[[], object]] = {
    "numpy64": lambda: NumpyBackend("numpy64", "fp64"),
    "numpy32": lambda: NumpyBackend("numpy32", "fp32"),
    "torch": lambda: LazyBackend("torch", "fp32", _torch("torch")),
    "torch-bf16": lambda: LazyBackend("torch-bf16", "bf16", _torch("torch-bf16")),
    "torch64": lambda: LazyBackend("torch64", "fp64", _torch("torch64")),
    "cuda": lambda: LazyBackend("cuda", "fp32", CudaBackend),
    "torch-model": lambda: _torch_model("torch-model"),
    "cuda-emu": lambda: LazyBackend("cuda-emu", "fp32", CudaEmuBackend),
}
# Run only when named: torch-model-bf16 passes three of the four traces with its router near-ties teacher-forced,
# but on tiny's free-running one a step-1 route of layer 4 whose golden margin (1.7e-2) sits just above the bf16
# router budget (1.5e-2, measured on the layerwise trace) flips under the accumulated free-run error, and the
# step-1 logits then err 0.26 > 0.205 (`k3conf run --backend torch-model-bf16 --cases 'trace/*'`; see
# docs/torch_model.md, "Router near-ties at bf16").
ON_REQUEST: dict[str, Callable[[], object]] = {
    "torch-model-bf16": lambda: _torch_model("torch-model-bf16"),
}
_CACHE: dict[str, object] = {}


def register_backend(name: str, factory: Callable[[], object]) -> None:
    """Add (or replace) a backend; factory() builds it on first use."""
    BACKENDS[name] = factory
    _CACHE.pop(name, None)


def is_external(name: str) -> bool:
    """True for a backend name that resolves outside this package: MODULE:ATTR or an installed entry point."""
    from conformance.backends.external import entry_points, is_spec

    return is_spec(name) or (name in entry_points() and name not in BACKENDS)


def backend_names() -> list[str]:
    """Registered names (mutants excluded), in registry order, then the installed packages' entry points."""
    from conformance.backends.external import entry_points

    return list(BACKENDS) + [n for n in entry_points() if n not in BACKENDS]


def get_backend(name: str):
    """The backend called `name` (built once per process); KeyError naming the choices when unknown,
    conformance.backends.external.BackendError (a ValueError) naming what is wrong when a MODULE:ATTR cannot load."""
    from conformance.backends import external

    if name in _CACHE:
        return _CACHE[name]
    if name.startswith("mutant:"):
        mutant = MUTANTS.get(name[len("mutant:"):])
        if mutant is None:
            raise KeyError(f"unknown mutant {name!r}; known: {['mutant:' + m for m in MUTANTS]}")
        if mutant.base == "numpy64":
            backend = NumpyBackend(name, "fp64", lambda: mutant.make(reference_cores()))
        else:
            backend = MutantBackend(name, get_backend(mutant.base), mutant.make)
    elif name in BACKENDS or name in ON_REQUEST:
        backend = {**ON_REQUEST, **BACKENDS}[name]()
    elif external.is_spec(name):              # MODULE:ATTR: a backend defined outside the package
        backend = external.load(name, reserved=BACKENDS)
    elif name in external.entry_points():     # an installed package's backend
        backend = external.from_entry_point(name, reserved=BACKENDS)
    else:
        raise KeyError(f"unknown backend {name!r}; known: {backend_names()}, mutant:<{'|'.join(MUTANTS)}> "
                       "or MODULE:ATTR (an external backend)")
    _CACHE[name] = backend
    return backend


def availability() -> list[tuple[str, str, bool, str]]:
    """(name, precision, available, reason) for every registered backend."""
    rows = []
    for name in backend_names():
        b = get_backend(name)
        ok, why = b.available()
        rows.append((name, b.precision, ok, why))
    return rows
