"""Each core call of an untrusted backend on its own copies of the arrays, checked afterwards for writes.

`guarded(backend, on_event)` is the backend with every core wrapped: the array arguments (and arrays inside a
list or tuple argument) are copied, so nothing the kernel writes reaches the golden or another call; the sha256
of each copy is taken before and after the call, and a changed one raises InputWritten naming the core and the
input (k3ref.cores.IN_OUT names the inputs a core may write: a state pool it updates in place, also one of its
outputs). `on_event("enter" | "left", core)` is called around the call, so a process that dies inside a core can be
told which one it was in.
"""
from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable

import numpy as np

from conformance.backends.protocol import BackendBase, WholeModelBackend, WrappedBackend
from k3ref.cores import CORE_NAMES, IN_OUT, Cores, reference_cores

Report = Callable[[str, str], None]


class InputWritten(RuntimeError):
    """A core changed an array it was given."""

    def __init__(self, core: str, inputs: list[str]):
        self.core, self.inputs = core, inputs
        what = f"input {inputs[0]}" if len(inputs) == 1 else f"inputs {', '.join(inputs)}"
        super().__init__(f"core {core} wrote into its {what} (its inputs must stay unchanged; "
                         "each call is given its own copies, compared by sha256 before and after)")


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def param_names(core: str) -> list[str]:
    """The reference core's parameter names, to name a positional input in a message."""
    try:
        return list(inspect.signature(getattr(reference_cores(), core)).parameters)
    except (TypeError, ValueError):   # a builtin without a signature: inputs are named by position
        return []


class Watch:
    """The copies given to one call, with their digests before it."""

    def __init__(self) -> None:
        self.arrays: list[tuple[str, np.ndarray, str]] = []

    def own(self, name: str, value):
        """`value` with every array in it copied and watched (arrays one level down in a list or tuple too)."""
        if isinstance(value, np.ndarray):
            copy = np.array(value, copy=True)
            self.arrays.append((name, copy, digest(copy)))
            return copy
        if isinstance(value, list | tuple) and any(isinstance(v, np.ndarray) for v in value):
            items = [self.own(f"{name}[{i}]", v) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    def written(self, allowed: tuple[str, ...] = ()) -> list[str]:
        """The watched inputs whose bytes changed, except those named in `allowed`."""
        return [name for name, copy, before in self.arrays if name not in allowed and digest(copy) != before]


def guard_core(core: str, fn: Callable, on_event: Report, check_writes: bool = True) -> Callable:
    """`fn` called on copies of its arrays, reporting enter/left, raising InputWritten after a write (unless
    check_writes is False: the start-up check leaves that verdict to the run, which reports it per case)."""
    names, allowed = param_names(core), IN_OUT.get(core, ())

    def call(*args, **kwargs):
        watch = Watch()
        args = tuple(watch.own(names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(args))
        kwargs = {k: watch.own(k, v) for k, v in kwargs.items()}
        on_event("enter", core)
        result = fn(*args, **kwargs)
        on_event("left", core)
        written = watch.written(allowed) if check_writes else []
        if written:
            raise InputWritten(core, written)
        return result

    return call


def guard_cores(cores: Cores, on_event: Report, check_writes: bool = True) -> Cores:
    return cores.replace(**{name: guard_core(name, getattr(cores, name), on_event, check_writes)
                            for name in CORE_NAMES})


class Guarded(WrappedBackend):
    """`inner` with its cores guarded; everything else is the inner backend's."""

    def __init__(self, inner: BackendBase, on_event: Report, check_writes: bool = True):
        super().__init__(inner)
        self.on_event, self.check_writes = on_event, check_writes

    def cores(self) -> Cores:
        return guard_cores(self.inner.cores(), self.on_event, self.check_writes)


def guarded(backend: BackendBase, on_event: Report, check_writes: bool = True) -> BackendBase:
    """The backend with guarded cores. A whole-model backend runs a trace by its own wiring, with no core calls
    to guard: it is returned as it is (its trace still runs in the worker, under the time limit)."""
    if isinstance(backend, WholeModelBackend):
        return backend
    return Guarded(backend, on_event, check_writes)
