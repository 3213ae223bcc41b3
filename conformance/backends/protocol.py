"""What a backend is: the protocol the runner calls, the base class that supplies its optional parts, and the
adapter that gives an object written against the bare protocol those parts once, when it is loaded.

A backend has `name`, `precision` ("fp64" | "fp32" | "bf16"), `available() -> (bool, reason)`, `cores() -> Cores`
and `time_core(core, inputs) -> float | None` (median seconds, data resident). The rest is optional; BackendBase
supplies it:
- `device`: "cpu" (a backend on an accelerator says so: K3_STRICT=1 forgives it for being unavailable); for a
  backend with `tensors = "torch"`, the torch device its tensors live on ("cpu", "cuda", "cuda:1");
- `tensors`: "numpy" (cores take and return NumPy arrays) or "torch" (cores take and return torch tensors on
  `device`: conformance.backends.tensors.adapt wraps such a backend in TorchTensorBackend, which presents it to
  the rest of the judge with NumPy cores);
- `kernel_cores() -> frozenset[str]`: the names (k3ref.cores.CORE_NAMES) of the cores the backend supplies itself;
  every other core it hands out is k3ref's. Default: all of them. The runner reads a case none of whose cores
  is a kernel core as "n/a (reference core)";
- `copy_bandwidth() -> bytes/s | None` and `speed_target(block) -> float | None`: None, no speed claim;
A whole-model backend (an eager model with no swappable cores) subclasses WholeModelBackend: it adds
`evaluate_trace(...)` and `time_trace(...)`, and the trace kind hands it the whole trace.
Every backend of this package subclasses BackendBase; `adapt` wraps any other protocol object in ForeignBackend
(ForeignWholeModel when it has `evaluate_trace`). A backend is untrusted: `checked_kernel_cores` and
`checked_availability` read what it says about itself and turn a wrong answer into a BackendError or an
unavailable row naming what was expected and what was found, never a traceback.
"""
from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol, TypeGuard, runtime_checkable

from conformance.cases.protocol import Evaluation
from k3ref.cores import CORE_NAMES, Cores

ALL_CORES = frozenset(CORE_NAMES)
REQUIRED_MEMBERS = ("name", "precision", "available", "cores", "time_core")   # what every backend must have
TENSOR_KINDS = ("numpy", "torch")   # what a backend's cores take and return


class BackendError(ValueError):
    """A backend that cannot be loaded, or whose cores do not keep the interface; the message names what."""


def checked_kernel_cores(found: object, who: str) -> frozenset[str]:
    """`found` (what kernel_cores() returned) as a frozenset of names of k3ref.cores.CORE_NAMES; BackendError
    naming `who`, what was expected and what was found otherwise. A str is refused: it would be read letter by
    letter."""
    expected = f"expected a set of core names from {sorted(ALL_CORES)}"
    if isinstance(found, (str, bytes)) or not isinstance(found, Collection):
        raise BackendError(f"{who}: kernel_cores() returned {type(found).__name__} {found!r:.200}; {expected}")
    names = list(found)
    odd = [n for n in names if not isinstance(n, str) or n not in ALL_CORES]
    if odd:
        raise BackendError(f"{who}: kernel_cores() names {odd!r:.300}, which are not core names; {expected}")
    return frozenset(names)


def checked_tensors(found: object, who: str) -> str:
    """`found` (a backend's `tensors`) when it is one of TENSOR_KINDS; BackendError naming `who` otherwise."""
    if not isinstance(found, str) or found not in TENSOR_KINDS:
        raise BackendError(f"{who}: tensors: expected one of {TENSOR_KINDS}, found {type(found).__name__} "
                           f"{found!r:.200}")
    return found


def checked_availability(probe: Callable[[], object]) -> tuple[bool, str]:
    """What `probe` (a backend's available) answers, as (bool, reason); a probe that raises or answers in another
    shape means "cannot run here", with what it did."""
    try:
        result = probe()
    except Exception as e:  # noqa: BLE001 - a probe that crashes means "cannot run here", with the reason
        return False, f"available() raised {type(e).__name__}: {e}"
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool)):
        return False, f"available() must return (bool, reason), returned {result!r:.200}"
    return result[0], str(result[1])


@runtime_checkable
class MinimalBackend(Protocol):
    """The members every backend must have (REQUIRED_MEMBERS); an object with these is a backend."""

    name: str
    precision: str

    def available(self) -> tuple[bool, str]: ...

    def cores(self) -> Cores: ...

    def time_core(self, core: str, inputs: dict) -> float | None: ...


class BackendProtocol(MinimalBackend, Protocol):
    """Everything the runner calls on a backend: the required members and the optional ones."""

    @property
    def device(self) -> str: ...

    tensors: str

    def kernel_cores(self) -> frozenset[str]: ...

    def copy_bandwidth(self) -> float | None: ...

    def speed_target(self, block: str) -> float | None: ...


@runtime_checkable
class WholeModelProtocol(Protocol):
    """What a whole-model backend adds: it runs a model trace by its own wiring instead of on cores."""

    def evaluate_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int,
                       router_budget: float = 0.0) -> Evaluation: ...

    def time_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int) -> tuple[float, int] | None: ...


class BackendBase(abc.ABC):
    """A backend with the optional members' defaults (see the module docstring); subclasses supply the rest."""

    name: str
    precision: str
    # False: the backend's cores may give other bits on the same inputs (atomics, split-K order); the runner then
    # reports and gates the spread between two calls instead of requiring bit-identical outputs
    deterministic: bool = True
    # "torch": the cores take and return torch tensors on `device` (tensors.adapt puts them behind a NumPy bridge)
    tensors: str = "numpy"

    @property
    def device(self) -> str:
        """Where the cores run; "cpu" unless the backend says otherwise."""
        return "cpu"

    @abc.abstractmethod
    def available(self) -> tuple[bool, str]:
        """(True, what runs) or (False, why it cannot run here)."""

    @abc.abstractmethod
    def cores(self) -> Cores:
        """The cores a case runs on."""

    def time_core(self, core: str, inputs: dict) -> float | None:
        """Median seconds of one call of `core` on `inputs`; None: not timed."""
        return None

    def kernel_cores(self) -> frozenset[str]:
        """The cores this backend supplies itself."""
        return ALL_CORES

    def copy_bandwidth(self) -> float | None:
        """Bytes/s of a large copy on this backend's device; None: no bandwidth ratio is claimed."""
        return None

    def speed_target(self, block: str) -> float | None:
        """The bandwidth ratio `block` must reach; None: reported, not gated."""
        return None

    def timed_cores(self) -> frozenset[str]:
        """The cores the judge times (conformance.isolation.timing): the kernel cores, unless the backend's time
        says nothing (an emulation of a GPU)."""
        return self.kernel_cores()

    def run_notes(self) -> list[str]:
        """Lines for the report about the core calls since the last ask (which implementation ran, the limits of
        the verdict); none by default."""
        return []


class WrappedBackend(BackendBase):
    """A backend that stands for `inner` and changes how its cores are called (guarded, on device tensors):
    everything it does not override is the inner backend's."""

    def __init__(self, inner: BackendBase):
        self.inner = inner
        self.name, self.precision, self.deterministic = inner.name, inner.precision, inner.deterministic

    @property
    def device(self) -> str:
        return self.inner.device

    def available(self) -> tuple[bool, str]:
        return self.inner.available()

    def cores(self) -> Cores:
        return self.inner.cores()

    def time_core(self, core: str, inputs: dict) -> float | None:
        return self.inner.time_core(core, inputs)

    def kernel_cores(self) -> frozenset[str]:
        return self.inner.kernel_cores()

    def copy_bandwidth(self) -> float | None:
        return self.inner.copy_bandwidth()

    def speed_target(self, block: str) -> float | None:
        return self.inner.speed_target(block)

    def timed_cores(self) -> frozenset[str]:
        return self.inner.timed_cores()

    def run_notes(self) -> list[str]:
        return self.inner.run_notes()


class WholeModelBackend(BackendBase):
    """A backend that runs the model traces by its own wiring (an eager model): the trace kind hands it the
    whole trace instead of running the trace on its cores."""

    @abc.abstractmethod
    def evaluate_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int,
                       router_budget: float = 0.0) -> Evaluation:
        """The trace tensors of `golden`, its router near-ties below `router_budget` teacher-forced."""

    def time_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int) -> tuple[float, int] | None:
        """(seconds, bytes) of one whole trace; None: not timed."""
        return None

    def timed_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int, router_budget: float,
                    repeats: int) -> tuple[list[float], list[dict]] | None:
        """The judge's timing of the trace: seconds and outputs of each of `repeats` runs; None: not timed. Only
        a whole model in a worker is timed so (conformance.isolation.remote.RemoteWholeModel); its own
        time_trace is not asked."""
        return None


# One protocol per optional member, so that the adapter below asks the foreign object what it has by type.
@runtime_checkable
class _HasDevice(Protocol):
    @property
    def device(self) -> str: ...


@runtime_checkable
class _HasDeterministic(Protocol):
    deterministic: bool


@runtime_checkable
class _HasTensors(Protocol):
    tensors: str


@runtime_checkable
class _HasKernelCores(Protocol):
    def kernel_cores(self) -> Collection[str]: ...


@runtime_checkable
class _HasCopyBandwidth(Protocol):
    def copy_bandwidth(self) -> float | None: ...


@runtime_checkable
class _HasSpeedTarget(Protocol):
    def speed_target(self, block: str) -> float | None: ...


@runtime_checkable
class _HasRunNotes(Protocol):
    def run_notes(self) -> list[str]: ...


@runtime_checkable
class _HasEvaluateTrace(Protocol):
    def evaluate_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int,
                       router_budget: float = 0.0) -> Evaluation: ...


@runtime_checkable
class _HasTimeTrace(Protocol):
    def time_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int) -> tuple[float, int] | None: ...


class ForeignBackend(BackendBase):
    """An object with the backend protocol that does not subclass BackendBase: the members it has are used, the
    defaults stand in for the others. What it has is read once, here."""

    def __init__(self, obj: MinimalBackend):
        self.obj = obj
        self.name = _attribute(obj, "name", str, "a non-empty backend name")
        if not self.name:
            raise BackendError(f"{obj!r:.200}: name: expected a non-empty backend name, found ''")
        self.precision = _attribute(obj, "precision", str, "'fp64', 'fp32' or 'bf16'")
        if isinstance(obj, _HasDeterministic):   # optional: BackendBase's default (True) stands in when absent
            self.deterministic = _attribute(obj, "deterministic", bool, "True or False")
        if isinstance(obj, _HasTensors):        # optional: "numpy" when absent
            self.tensors = checked_tensors(_attribute(obj, "tensors", object, ""), f"backend {self.name}")
        self._kernel_cores = obj if isinstance(obj, _HasKernelCores) else None
        self._kernel_names: frozenset[str] | None = None   # read and checked once, on first use
        self._copy_bandwidth = obj if isinstance(obj, _HasCopyBandwidth) else None
        self._speed_target = obj if isinstance(obj, _HasSpeedTarget) else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.obj!r})"

    @property
    def device(self) -> str:
        # read when asked, not at wrapping: a device property may import a library or fail on a bad setting
        return self.obj.device if isinstance(self.obj, _HasDevice) else "cpu"

    def available(self) -> tuple[bool, str]:
        return checked_availability(self.obj.available)

    def cores(self) -> Cores:
        try:
            cores = self.obj.cores()
        except Exception as e:
            raise BackendError(f"backend {self.name}: cores() raised {type(e).__name__}: {e}") from e
        if not isinstance(cores, Cores):
            raise BackendError(f"backend {self.name}: cores() returned {type(cores).__name__}, expected "
                               "k3ref.cores.Cores")
        return cores

    def time_core(self, core: str, inputs: dict) -> float | None:
        return self.obj.time_core(core, inputs)

    def kernel_cores(self) -> frozenset[str]:
        if self._kernel_cores is None:
            return super().kernel_cores()
        if self._kernel_names is None:
            try:
                found = self._kernel_cores.kernel_cores()
            except Exception as e:
                raise BackendError(f"backend {self.name}: kernel_cores() raised {type(e).__name__}: {e}") from e
            self._kernel_names = checked_kernel_cores(found, f"backend {self.name}")
        return self._kernel_names

    def copy_bandwidth(self) -> float | None:
        return super().copy_bandwidth() if self._copy_bandwidth is None else self._copy_bandwidth.copy_bandwidth()

    def speed_target(self, block: str) -> float | None:
        return super().speed_target(block) if self._speed_target is None else self._speed_target.speed_target(block)

    def run_notes(self) -> list[str]:
        if not isinstance(self.obj, _HasRunNotes):
            return []
        notes = self.obj.run_notes()
        if not (isinstance(notes, list) and all(isinstance(n, str) for n in notes)):
            raise BackendError(f"backend {self.name}: run_notes() returned {notes!r:.200}, expected a list of str")
        return notes


def _attribute(obj: object, member: str, kind: type, expected: str):
    """obj.<member>, which must be a `kind`; BackendError naming what was expected and found otherwise."""
    try:
        value = getattr(obj, member)
    except Exception as e:
        raise BackendError(f"{obj!r:.200}: reading {member} raised {type(e).__name__}: {e}") from e
    if not isinstance(value, kind):
        raise BackendError(f"{obj!r:.200}: {member}: expected {expected}, found {type(value).__name__} {value!r:.200}")
    return value


class ForeignWholeModel(ForeignBackend, WholeModelBackend):
    """A foreign object that also has `evaluate_trace` (WholeModelProtocol): a whole-model backend."""

    def __init__(self, obj: MinimalBackend):
        super().__init__(obj)
        self.model = obj if isinstance(obj, _HasEvaluateTrace) else None
        self._time_trace = obj if isinstance(obj, _HasTimeTrace) else None

    def evaluate_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int,
                       router_budget: float = 0.0) -> Evaluation:
        if self.model is None:
            raise TypeError(f"{self.obj!r} has no evaluate_trace(); ForeignWholeModel wraps whole-model backends only")
        return self.model.evaluate_trace(case, golden, config_json, prompt_len, router_budget=router_budget)

    def time_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int) -> tuple[float, int] | None:
        if self._time_trace is None:
            return None
        return self._time_trace.time_trace(case, golden, config_json, prompt_len)


def is_backend(obj: object) -> TypeGuard[BackendBase | MinimalBackend]:
    """A BackendBase, or an instance (not a class) with the members of MinimalBackend."""
    return isinstance(obj, BackendBase) or (not isinstance(obj, type) and isinstance(obj, MinimalBackend))


def adapt(obj: BackendBase | MinimalBackend) -> BackendBase:
    """`obj` itself when it subclasses BackendBase, else `obj` wrapped in ForeignBackend (ForeignWholeModel when
    it has `evaluate_trace`); its `tensors` checked. A backend whose cores take torch tensors comes back as it is:
    conformance.backends.tensors.adapt (what the registry and the external loader call) also puts it behind the
    NumPy bridge."""
    backend = obj if isinstance(obj, BackendBase) else (
        ForeignWholeModel(obj) if isinstance(obj, _HasEvaluateTrace) else ForeignBackend(obj))
    checked_tensors(backend.tensors, f"backend {backend.name}")
    return backend


def kernel_cores(backend: BackendBase | MinimalBackend) -> frozenset[str]:
    """The cores `backend` supplies itself (all of them when it does not say)."""
    return adapt(backend).kernel_cores()
