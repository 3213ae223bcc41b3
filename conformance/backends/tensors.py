"""Backends whose cores take and return torch tensors on a device, presented to the judge with NumPy cores.

A backend with `tensors = "torch"` keeps its data on `device` ("cpu", "cuda", "cuda:1"): its kernel cores take
torch tensors there and return torch tensors there. `TorchTensorBackend(inner)` (what `adapt` here makes of such
a backend) gives the rest of the judge (the input guard, the isolation worker, the host graph of the traces, the
checks) NumPy cores, so nothing else changes. Per call of a kernel core:

- every array argument goes to the device (upload_dtype below: floats in the torch dtype of their NumPy dtype, the bf16
  inputs of a "bf16" backend as torch.bfloat16 except the ones K3 keeps in fp32, integers as int32);
- what comes back must be torch tensors on the declared device with a floating dtype (an integer one for the
  outputs the contract gives as integers); anything else is a TensorError naming the core and the output;
- the input tensors are compared bit for bit with a copy taken before the call (except the state pools a core
  may update, k3ref.cores.IN_OUT): a write raises InputWritten;
- the outputs come back as NumPy: float64 for an fp64 backend, float32 otherwise.
Cores the inner backend does not supply (kernel_cores()) are k3ref's reference cores, called on NumPy as usual.

`time_core` uploads the inputs once, outside the timed region (and runs a core's `prepare` there when it has one,
e.g. the torch baselines' host-side input checks); on CUDA it brackets back-to-back launches with CUDA events after
an L2 flush, as tools/gpu_bench.py's time_fn does, and reports the median per launch; on the CPU the median of
host perf_counter intervals.
"""
from __future__ import annotations

import functools
import inspect
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from conformance.backends import protocol
from conformance.backends.protocol import BackendBase, BackendError, MinimalBackend, WholeModelBackend, WrappedBackend
from conformance.cases.core import CORE_SPECS
from conformance.isolation.guard import InputWritten
from k3ref.cores import CORE_NAMES, IN_OUT, Cores, reference_cores

if TYPE_CHECKING:
    import torch

__all__ = ["INTEGER_OUTPUTS", "TensorError", "TorchTensorBackend", "adapt", "upload_dtype"]

# Outputs the contracts (k3ref.cores' docstrings) give as integers; every other output of a core is floating.
INTEGER_OUTPUTS: dict[str, tuple[str, ...]] = {"moe_route": ("indices",)}
# The AttnRes hub is a factory of per-token bookkeeping, not math on arrays: it is never moved to the device.
NOT_ON_DEVICE = frozenset({"attnres_hub"})
INT32 = np.iinfo(np.int32)
CPU_REPEATS, CPU_WARMUP = 7, 2
CUDA_REPEATS, CUDA_WARMUP = 20, 3
MANY_LAUNCHES = 20   # launches per event pair when the inputs overflow twice the L2 (tools/gpu_bench.py)


class TensorError(BackendError):
    """A tensor backend's core returned something that is not a tensor of the kind the interface asks for."""


@runtime_checkable
class _Prepared(Protocol):
    """A tensor core split in two: `prepare` (checks, layout) runs outside the timed region, `compute` inside."""

    def prepare(self, *args: Any, **kwargs: Any) -> dict: ...

    def compute(self, **prepared: Any) -> Any: ...


def _torch():
    """torch, imported on first use: this module is imported by the judge on machines without torch."""
    import torch  # noqa: PLC0415 -- optional: a numpy-only install never builds a tensor backend

    return torch


def upload_dtype(a: np.ndarray, name: str, core: str, precision: str) -> torch.dtype:
    """The torch dtype array `a` (input `name` of `core`) takes on the device; TensorError for a kind with none.

    float64 / float32 as they are, except a bf16 backend's float32 inputs (bf16-rounded values, conformance.cases.
    inputs.cast) which become torch.bfloat16 unless K3 keeps them in fp32 (CoreSpec.fp32_inputs); any integer as
    int32 (block tables, slots, cu_seqlens) except uint8 (packed MXFP4, scales) kept; bool as bool."""
    torch = _torch()
    kind = a.dtype.kind
    if kind == "f":
        spec = CORE_SPECS.get(core)
        kept = spec is not None and name in spec.fp32_inputs
        if a.dtype == np.float32 and precision == "bf16" and not kept:
            return torch.bfloat16
        return {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32,
                np.dtype(np.float16): torch.float16}[a.dtype]
    if a.dtype == np.uint8:
        return torch.uint8
    if kind in "iu":
        if a.size and (int(a.min()) < INT32.min or int(a.max()) > INT32.max):
            raise TensorError(f"core {core}: input {name}: integer values {int(a.min())} .. {int(a.max())} do "
                              "not fit the int32 a tensor backend receives")
        return torch.int32
    if kind == "b":
        return torch.bool
    raise TensorError(f"core {core}: input {name}: expected a float, integer or bool array, found dtype {a.dtype}")


class _Upload:
    """The device tensors of one call, with a copy of each to check afterwards that the core left them alone."""

    def __init__(self, core: str, precision: str, device: torch.device):
        self.core, self.precision, self.device = core, precision, device
        self.watched: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def put(self, name: str, value: Any) -> Any:
        """`value` with every array in it (one level down in a list or tuple too) as a tensor on the device."""
        if isinstance(value, np.ndarray):
            torch = _torch()
            dtype = upload_dtype(value, name, self.core, self.precision)
            # a copy: on the CPU a tensor from_numpy shares the caller's memory
            t = torch.from_numpy(np.array(value, copy=True)).to(device=self.device, dtype=dtype)
            self.watched.append((name, t, t.clone()))
            return t
        if isinstance(value, list | tuple) and any(isinstance(v, np.ndarray) for v in value):
            items = [self.put(f"{name}[{i}]", v) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    def written(self) -> list[str]:
        """The inputs whose bits changed, except the ones the core may update in place (IN_OUT)."""
        allowed = IN_OUT.get(self.core, ())
        return [name for name, t, before in self.watched
                if name not in allowed and not _same_bits(t, before)]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: a NaN poison left in place is unchanged (torch.equal would call NaN != NaN)."""
    torch = _torch()
    if a.is_floating_point():
        as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.equal(a, b)


def _param_names(core: str) -> list[str]:
    """The reference core's parameter names, to name a positional input in a message."""
    try:
        return list(inspect.signature(getattr(reference_cores(), core)).parameters)
    except (TypeError, ValueError):   # a builtin without a signature: inputs are named by position
        return []


def _same_device(found: torch.device, declared: torch.device) -> bool:
    """"cuda" declared means the current CUDA device: a tensor on "cuda:0" is on it."""
    return found.type == declared.type and (declared.index is None or found.index == declared.index)


class TorchTensorBackend(WrappedBackend):
    """`inner` (a backend whose kernel cores take and return torch tensors on `inner.device`) with NumPy cores;
    see the module docstring for what each call does and checks."""

    tensors = "numpy"   # what this wrapper presents to the judge

    def __init__(self, inner: BackendBase):
        if isinstance(inner, WholeModelBackend):
            raise BackendError(f"backend {inner.name}: tensors='torch' applies to cores; a whole-model backend runs "
                               "its traces by its own wiring (leave tensors at 'numpy')")
        super().__init__(inner)
        self._cores: Cores | None = None

    def __repr__(self) -> str:
        return f"TorchTensorBackend({self.inner!r})"

    @property
    def torch_device(self) -> torch.device:
        """The declared device as a torch.device; BackendError naming what was found when it is not one."""
        torch = _torch()
        found = self.inner.device
        try:
            return torch.device(found)
        except (RuntimeError, TypeError) as e:
            raise BackendError(f"backend {self.name}: device: expected a torch device string (cpu, cuda, cuda:1), "
                               f"found {found!r:.200} ({str(e).splitlines()[0]})") from e

    def available(self) -> tuple[bool, str]:
        ok, why = self.inner.available()
        if not ok:
            return ok, why
        try:
            torch = _torch()
        except ImportError as e:
            return False, f"its cores take torch tensors, and PyTorch is not installed ({e})"
        try:
            device = self.torch_device
        except BackendError as e:
            return False, str(e)
        if device.type == "cuda" and not torch.cuda.is_available():
            return False, f"its tensors live on {device}, and torch {torch.__version__} sees no CUDA GPU"
        return True, why

    def _on_device(self) -> frozenset[str]:
        return self.kernel_cores() - NOT_ON_DEVICE

    def cores(self) -> Cores:
        """The inner backend's kernel cores behind the NumPy bridge; k3ref's reference cores for the rest."""
        if self._cores is None:
            inner, base = self.inner.cores(), reference_cores()
            device = self.torch_device
            on_device, supplied = self._on_device(), self.kernel_cores()
            self._cores = base.replace(**{
                name: self._bridged(name, getattr(inner, name), device) if name in on_device
                else getattr(inner if name in supplied else base, name) for name in CORE_NAMES})
        return self._cores

    def _bridged(self, core: str, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
        names = _param_names(core)

        def call(*args, **kwargs):
            upload = _Upload(core, self.precision, device)
            args = tuple(upload.put(names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(args))
            kwargs = {k: upload.put(k, v) for k, v in kwargs.items()}
            result = fn(*args, **kwargs)
            written = upload.written()
            if written:
                raise InputWritten(core, written)
            return self._to_numpy(core, result, device)

        call.__name__ = call.__qualname__ = core
        call.__doc__ = getattr(fn, "__doc__", None)
        return call

    def _to_numpy(self, core: str, result: Any, device: torch.device) -> Any:
        """The checked outputs of `core` as NumPy (a tuple stays a tuple)."""
        spec = CORE_SPECS.get(core)
        names = spec.outputs if spec is not None else ()
        several = isinstance(result, tuple | list)
        items = list(result) if several else [result]
        arrays = [self._output(core, names[i] if i < len(names) else f"output {i}", t, device)
                  for i, t in enumerate(items)]
        return tuple(arrays) if several else arrays[0]

    def _output(self, core: str, name: str, t: Any, device: torch.device) -> np.ndarray:
        torch = _torch()
        where = f"backend {self.name}: core {core}: output {name}"
        if not isinstance(t, torch.Tensor):
            raise TensorError(f"{where}: expected a torch.Tensor on {device} (the backend declares "
                              f"tensors='torch'), found {type(t).__module__}.{type(t).__name__}")
        if not _same_device(t.device, device):
            raise TensorError(f"{where}: expected a tensor on the backend's device {device}, found one on {t.device}")
        integer = name in INTEGER_OUTPUTS.get(core, ())
        if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise TensorError(f"{where}: expected an integer dtype (the contract gives integers), found {t.dtype}")
        if not integer and not t.is_floating_point():
            raise TensorError(f"{where}: expected a floating dtype (float64, float32 or bfloat16), found {t.dtype}")
        host = t.detach().to("cpu")
        if integer:
            return host.numpy()
        return host.to(torch.float64 if self.precision == "fp64" else torch.float32).numpy()

    def time_core(self, core: str, inputs: dict) -> float | None:
        """Median seconds of one call of `core` on inputs uploaded once (module docstring); None for a core the
        backend does not supply."""
        if core not in self._on_device():
            return None
        repeats = CUDA_REPEATS if self.torch_device.type == "cuda" else CPU_REPEATS
        return statistics.median(self.timed_calls(core, [([], inputs)], repeats)[0])

    def timed_cores(self) -> frozenset[str]:
        return self._on_device()

    def timed_calls(self, core: str, sets: list[tuple[list, dict]], repeats: int) -> tuple[list[float], list]:
        """Seconds and NumPy outputs of `repeats` calls of the inner core on device tensors, the input sets in
        turn, each set uploaded once before the clock starts (module docstring); warm-up calls first. On CUDA
        each call is bracketed by events after an L2 flush; InputWritten when a call wrote into an input."""
        fn = getattr(self.inner.cores(), core)
        device = self.torch_device
        names = _param_names(core)
        uploads: list[_Upload] = []
        launches: list[Callable[[], Any]] = []
        for args, kwargs in sets:
            upload = _Upload(core, self.precision, device)
            targs = [upload.put(names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(args)]
            tkw = {k: upload.put(k, v) for k, v in kwargs.items()}
            uploads.append(upload)
            if isinstance(fn, _Prepared):
                launches.append(functools.partial(fn.compute, **fn.prepare(*targs, **tkw)))
            else:
                launches.append(functools.partial(fn, *targs, **tkw))
        timer = _CudaTimer(device) if device.type == "cuda" else _host_timer
        warmup = CUDA_WARMUP if device.type == "cuda" else CPU_WARMUP
        for r in range(warmup * len(sets)):
            launches[r % len(sets)]()
        seconds, results = [], []
        for r in range(repeats):
            t, out = timer(launches[r % len(sets)])
            seconds.append(t)
            results.append(out)
        written = sorted({name for u in uploads for name in u.written()})
        if written:
            raise InputWritten(core, written)
        return seconds, [self._to_numpy(core, out, device) for out in results]


def adapt(obj: BackendBase | MinimalBackend) -> BackendBase:
    """conformance.backends.protocol.adapt(obj), wrapped in TorchTensorBackend when its cores take torch tensors:
    every backend the judge loads comes through here."""
    backend = protocol.adapt(obj)
    return TorchTensorBackend(backend) if backend.tensors == "torch" else backend


def _host_timer(launch: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = launch()
    return time.perf_counter() - t0, out


class _CudaTimer:
    """One launch between CUDA events after a memset of twice the L2 (tools/gpu_bench.py's time_fn on torch), so
    the inputs come from DRAM as cases are gated against DRAM bandwidth."""

    def __init__(self, device: torch.device):
        torch = _torch()
        self.device = device
        l2 = int(torch.cuda.get_device_properties(device).L2_cache_size)
        self.flush_buffer = torch.empty(2 * l2, dtype=torch.uint8, device=device)

    def __call__(self, launch: Callable[[], Any]) -> tuple[float, Any]:
        torch = _torch()
        with torch.cuda.device(self.device):
            self.flush_buffer.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = launch()
            end.record()
            end.synchronize()
        return start.elapsed_time(end) * 1e-3, out
