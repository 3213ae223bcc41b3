"""The judge's own timing of a core: the calls it times are calls it judges.

A kernel may tell a timed call from a judged one (a stack frame, the cadence of calls, the same inputs again) and
do no work when timed. So every timed call here runs on inputs the run sent (the case's and, where the run has
them, a fresh draw's, in turn), and its outputs go back to the run, which holds them to the outputs the kernel gave
when judged on the same inputs; the run also refuses a time below the memory floor of the call's bytes. The
time comes from this process's clock, and a kernel can patch that clock: a time is a claim the run can bound
(the floor, its own wall clock), not a proof (docs/untrusted_kernels.md, "Timing").

    seconds, outputs = timed_calls(backend, "rmsnorm", [(args, kwargs), ...], repeats=5)

How a call is timed depends on where the kernel's data lives, which only the package's own backends say:
- a backend of torch tensors (conformance.backends.tensors.TorchTensorBackend): inputs uploaded once per set
  before the clock starts, the kernel called on device tensors, CUDA events on a GPU (after an L2 flush), the
  host clock on the CPU; outputs brought back after the clock stops;
- k3cuda's kernels (CudaBackend): its device launch with inputs uploaded once, CUDA events;
- anything else: the backend's NumPy core on copies of the inputs made before the clock starts, host clock.
One untimed warm-up call per input set comes first. A write into an input raises InputWritten afterwards.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from conformance.backends.builtin import CudaBackend, LazyBackend
from conformance.backends.protocol import BackendBase
from conformance.backends.tensors import TorchTensorBackend
from conformance.isolation.guard import InputWritten, Watch, param_names
from k3ref.cores import IN_OUT

Sets = list[tuple[list, dict]]
Event = Callable[[str, str], None]


def _unwrapped(backend: BackendBase) -> BackendBase:
    """The backend that decides how a call is timed: a LazyBackend's inner one."""
    while type(backend) is LazyBackend:
        inner = backend._get()
        if inner is None:
            break
        backend = inner
    return backend


def _no_event(what: str, core: str) -> None:
    return None


def timed_calls(backend: BackendBase, core: str, sets: Sets, repeats: int,
                on_event: Event = _no_event) -> tuple[list[float], list]:
    """Seconds and outputs of `repeats` calls of `core`, on the input sets in turn (call r on set r % len(sets))."""
    if not sets or repeats < 1:
        raise ValueError(f"timed_calls: expected input sets and repeats >= 1, found {len(sets)} set(s), {repeats}")
    inner = _unwrapped(backend)
    on_event("enter", core)
    if type(inner) is TorchTensorBackend:
        seconds, outs = inner.timed_calls(core, sets, repeats)
    elif type(inner) is CudaBackend:
        seconds, outs = inner.timed_calls(core, sets, repeats)
    else:
        seconds, outs = host_calls(getattr(backend.cores(), core), core, sets, repeats)
    on_event("left", core)
    return seconds, outs


def host_calls(fn: Callable, core: str, sets: Sets, repeats: int) -> tuple[list[float], list]:
    """`fn` on copies of each set (made before the clock starts), timed on the host clock."""
    names = param_names(core)
    watches: list[Watch] = []
    calls: list[tuple[tuple, dict]] = []
    for r in range(len(sets) + repeats):   # a warm-up call per set, then the timed ones
        given, named = sets[r % len(sets)]
        watch = Watch()
        calls.append((tuple(watch.own(names[i] if i < len(names) else f"argument {i}", a)
                            for i, a in enumerate(given)), {k: watch.own(k, v) for k, v in named.items()}))
        watches.append(watch)
    seconds, outs = [], []
    for r, (args, kwargs) in enumerate(calls):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        t = time.perf_counter() - t0
        if r >= len(sets):
            seconds.append(t)
            outs.append(out)
    written = sorted({name for w in watches for name in w.written(IN_OUT.get(core, ()))})
    if written:
        raise InputWritten(core, written)
    return seconds, outs


def timed_runs(run: Callable[[], object], repeats: int) -> tuple[list[float], list]:
    """Seconds and results of `repeats` calls of `run` after one untimed warm-up call (a whole-model trace)."""
    run()
    seconds, outs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs.append(run())
        seconds.append(time.perf_counter() - t0)
    return seconds, outs
