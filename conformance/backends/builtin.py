"""The backends this package ships: k3ref's cores (NumPy), the PyTorch baselines and model, k3cuda's kernels.

- NumpyBackend   k3ref's cores at one precision, timed on the CPU.
- LazyBackend    a backend built on first use (torch, cuda, cuda-emu): unavailable with the reason when that fails.
- CudaBackend    k3cuda's kernels in place of the reference cores they implement.
- CudaEmuBackend the same kernels run by k3cuda.testing's g++ emulation of the GPU (no GPU, no timing).
The table naming them is conformance.backends.registry.BACKENDS.
"""
from __future__ import annotations

import dataclasses
import importlib
import shutil
from collections.abc import Callable

import k3cuda
from conformance.backends import pytorch
from conformance.backends.protocol import ALL_CORES, BackendBase, MinimalBackend
from conformance.backends.tensors import adapt
from conformance.backends.torch_model import TorchModelBackend
from conformance.judge.speed import median_seconds, numpy_copy_bandwidth
from k3cuda import runtime as cuda_runtime
from k3cuda.testing import cpu_emulation
from k3ref.cores import CORE_NAMES, Cores, reference_cores


@dataclasses.dataclass
class NumpyBackend(BackendBase):
    """k3ref's cores at one precision; `time_core` times the core on the CPU."""

    name: str
    precision: str
    make_cores: Callable[[], Cores] = reference_cores
    repeats: int = 3

    def available(self) -> tuple[bool, str]:
        return True, "k3ref (NumPy)"

    def cores(self) -> Cores:
        return self.make_cores()

    def time_core(self, core: str, inputs: dict) -> float | None:
        """Median wall time of `core(**inputs)` over `repeats` calls after one warm-up call."""
        fn = getattr(self.cores(), core)
        return median_seconds(lambda: fn(**inputs), self.repeats)

    def copy_bandwidth(self) -> float | None:
        return numpy_copy_bandwidth()


@dataclasses.dataclass
class LazyBackend(BackendBase):
    """A backend built on first use by `load()`; unavailable (with the reason) when that fails."""

    name: str
    precision: str
    load: Callable[[], BackendBase | MinimalBackend]
    _inner: BackendBase | None = None
    _why: str = ""

    def _get(self) -> BackendBase | None:
        if self._inner is None and not self._why:
            try:
                self._inner = adapt(self.load())
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
        return ALL_CORES if inner is None else inner.kernel_cores()

    def time_core(self, core: str, inputs: dict) -> float | None:
        inner = self._get()
        return None if inner is None else inner.time_core(core, inputs)

    def copy_bandwidth(self) -> float | None:
        inner = self._get()
        return None if inner is None else inner.copy_bandwidth()

    def speed_target(self, block: str) -> float | None:
        inner = self._get()
        return None if inner is None else inner.speed_target(block)

    def timed_cores(self) -> frozenset[str]:
        inner = self._get()
        return frozenset() if inner is None else inner.timed_cores()


def torch_loader(name: str) -> Callable[[], BackendBase | MinimalBackend]:
    """The load() of the torch baseline `name`: ImportError with the install hint when torch is missing."""
    def load() -> BackendBase | MinimalBackend:
        try:
            torch = importlib.import_module("torch")
        except ImportError as e:
            raise ImportError(f"PyTorch is not installed ({e}); pip install 'k3-conformance[torch]' "
                              "(or `make setup`, which installs the CPU build)") from None
        # One intra-op thread: the runner times one core at a time, and on a small shared machine torch's
        # OpenMP threads spin-wait for busy cores (`k3conf run` took 6.6x its quiet time under load).
        torch.set_num_threads(1)
        return pytorch.make_backend(name)
    return load


def torch_model(name: str) -> BackendBase:
    """The eager PyTorch K3 model (k3torch): whole traces only; torch imported on first use."""
    return adapt(TorchModelBackend(name))


def cuda_env_problem() -> str:
    """'' when every K3_CUDA_* environment name and value is one k3cuda reads, else why not (the known names)."""
    try:
        k3cuda.check_env()
    except ValueError as e:
        return str(e)
    return ""


class CudaBackend(BackendBase):
    """k3cuda's kernels in place of the reference cores they implement (the rest stay k3ref's). An unknown
    K3_CUDA_* name (a misspelt escape) makes it unavailable with the list of known names, and its cores refuse."""

    name = "cuda"
    precision = "fp32"

    def available(self) -> tuple[bool, str]:
        problem = cuda_env_problem()
        return (False, problem) if problem else k3cuda.available()

    def cores(self) -> Cores:
        return k3cuda.cuda_cores(reference_cores())

    def kernel_cores(self) -> frozenset[str]:
        """The cores with an enabled kernel (K3_CUDA_<BLOCK>=0 keeps the reference core)."""
        return frozenset(b for b in k3cuda.KERNEL_MODULES if k3cuda.enabled(b))

    def time_core(self, core: str, inputs: dict) -> float | None:
        """Median CUDA-event seconds of the kernel with its inputs uploaded once (k3cuda.<core>.device_launch);
        None for a core without an enabled kernel."""
        if core not in self.kernel_cores():
            return None
        return cuda_runtime.time_fn(k3cuda.kernel_module(core).device_launch(inputs))

    def copy_bandwidth(self) -> float | None:
        return cuda_runtime.copy_bandwidth()

    def timed_calls(self, core: str, sets: list[tuple[list, dict]], repeats: int) -> tuple[list[float], list]:
        """Seconds of `repeats` device launches of `core`'s kernel (inputs uploaded once per set before the
        clock starts, CUDA events), and the outputs of the core on each timed call's inputs: this package's own
        kernels, whose launches are the calls the judge makes (conformance.isolation.timing)."""
        if core not in self.kernel_cores():
            raise ValueError(f"timed_calls: {core} has no enabled kernel")
        launches = [k3cuda.kernel_module(core).device_launch(kwargs) for _, kwargs in sets]
        for launch in launches:
            launch()   # warm-up
        fn = getattr(self.cores(), core)
        seconds, outs = [], []
        for r in range(repeats):
            seconds.append(cuda_runtime.time_fn(launches[r % len(sets)], warmup=0, iters=1))
            args, kwargs = sets[r % len(sets)]
            outs.append(fn(*args, **kwargs))
        return seconds, outs

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
        problem = cuda_env_problem()
        if problem:
            return False, problem
        if shutil.which("g++") is None:
            return False, "g++ not found on PATH (the CPU emulation of the kernels compiles them as C++)"
        return True, "k3cuda kernels run on the CPU by the g++ emulation (no GPU rounding, races or timing)"

    def cores(self) -> Cores:
        base = reference_cores()
        kernels = k3cuda.cuda_cores(base)

        def emulated(fn):
            def call(*args, **kwargs):
                with cpu_emulation():
                    return fn(*args, **kwargs)
            return call

        return kernels.replace(**{n: emulated(getattr(kernels, n)) for n in CORE_NAMES
                                  if getattr(kernels, n) is not getattr(base, n)})

    def time_core(self, core: str, inputs: dict) -> float | None:
        return None  # emulated time says nothing about the GPU

    def timed_cores(self) -> frozenset[str]:
        return frozenset()  # emulated time says nothing about the GPU

    def copy_bandwidth(self) -> float | None:
        return None
