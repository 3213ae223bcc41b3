"""Thread counts for BLAS and for the compiled fast paths: same bits on any machine, any thread count.

A threaded BLAS splits a GEMM's K dimension (or its tiles) across threads and sums the partial products in an
order that depends on the thread count, so a float32 result can change in its last bits when a user's machine
has more cores (measured here: `kda_chunked` fp32, 1 against 2 OpenBLAS threads, differs in about one element
in five). A conformance reference must give the same bits everywhere, so every reference entry point that calls
BLAS runs under `fixed_blas` (one BLAS thread per call). Parallelism belongs in the compiled fast paths, whose
work split does not change the order of any sum; `compute_threads` says how many threads those use.

The limit goes through threadpoolctl, which finds the BLAS that NumPy loaded (OpenBLAS, MKL, BLIS, ...) and
calls its own set/get functions; OpenBLAS's limit is process-wide, so a limit set here is seen by every thread.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import numpy as np  # noqa: F401 -- loads NumPy's BLAS before the controller first looks for loaded libraries
from threadpoolctl import ThreadpoolController

P = ParamSpec("P")
R = TypeVar("R")

# The BLAS limit currently in force on this thread, innermost last (from blas_threads / fixed_blas). A nested
# fixed_blas inside a one-thread scope then costs a list lookup instead of two library calls.
_STATE = threading.local()
# OpenBLAS's thread count is one per process, so one-thread pins are counted across threads: the count a pin
# replaced comes back only when the last pin of any thread ends (a thread leaving its pin must not hand BLAS
# threads back to another thread still computing under its own).
_LOCK = threading.Lock()
_PINS = [0]
_SAVED: list[int] = []


def _stack() -> list[int]:
    stack = getattr(_STATE, "blas", None)
    if stack is None:
        stack = _STATE.blas = []
    return stack


@functools.cache
def _controller() -> ThreadpoolController:
    """The loaded thread pools, found once (a scan of the loaded shared objects, ~1 ms)."""
    return ThreadpoolController()


@functools.cache
def _blas_libs() -> tuple[Any, ...]:
    """threadpoolctl's controller of each loaded BLAS library (get_num_threads / set_num_threads)."""
    return tuple(_controller().select(user_api="blas").lib_controllers)


def _set(libs: tuple[Any, ...], counts: list[int]) -> None:
    # The libraries' own get/set calls (~1 us each) instead of threadpoolctl's `limit`, which re-reads every
    # library's full info (~30 us) on each entry: fixed_blas wraps per-token reference calls.
    # threadpoolctl (>= 3.6) lets only the first Python thread that limited a pthreads OpenBLAS change it while
    # that thread lives, so a pin held by a worker thread could never be set or restored from another. The pins
    # here are already serialised by _LOCK and counted across threads, so the library's own setter is called
    # where threadpoolctl exposes it; a refusal is still checked below, never left silent.
    for lib, n in zip(libs, counts, strict=True):
        if lib.get_num_threads() != n:
            getattr(lib, "_real_set_num_threads", lib.set_num_threads)(n)
            got = lib.get_num_threads()
            if got != n:
                raise RuntimeError(f"blas_threads: expected {lib.internal_api} on {n} thread(s), found {got}: "
                                   "another Python thread holds its limit (threadpoolctl); set it from that one")


@contextlib.contextmanager
def blas_threads(n: int = 1) -> Iterator[None]:
    """Limit the loaded BLAS libraries to `n` threads inside the block; the previous limits are restored after.

    One-thread scopes of several Python threads overlap safely (the count comes back when the last ends). A
    scope of n > 1 changes the count for the whole process (OpenBLAS has one): open it only where no other
    thread computes under a one-thread pin, as the benchmarks do."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"blas_threads: expected a thread count >= 1, found {n!r}")
    libs = _blas_libs()
    stack = _stack()
    with _LOCK:
        before = [lib.get_num_threads() for lib in libs]
        _set(libs, [n] * len(libs))
        if n == 1 and _PINS[0] == 0:
            _SAVED[:] = before
        _PINS[0] += n == 1
    stack.append(n)
    try:
        yield
    finally:
        stack.pop()
        with _LOCK:
            _PINS[0] -= n == 1
            if n != 1:
                _set(libs, before)
            elif _PINS[0] == 0:
                _set(libs, _SAVED)


def fixed_blas(fn: Callable[P, R]) -> Callable[P, R]:
    """Run `fn` with one BLAS thread (its results then do not depend on the machine's core count).

    Cheap when nested: inside a scope that already holds one thread, the call goes straight to `fn`."""

    @functools.wraps(fn)
    def pinned(*args: P.args, **kwargs: P.kwargs) -> R:
        stack = _stack()
        if stack and stack[-1] == 1:
            return fn(*args, **kwargs)
        with blas_threads(1):
            return fn(*args, **kwargs)

    return pinned


def _env_threads() -> int | None:
    raw = os.environ.get("K3_THREADS", "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"K3_THREADS: expected a thread count >= 1, found {raw!r}")
    return n


def _cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one, as a container limits it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def compute_threads() -> int:
    """Threads the compiled (numba) fast paths use: K3_THREADS when set, else numba's current count when numba
    is loaded (numba.set_num_threads / NUMBA_NUM_THREADS), else every core this process may run on."""
    env = _env_threads()
    if env is not None:
        return env
    numba = sys.modules.get("numba")
    if numba is not None:
        return int(numba.get_num_threads())
    return _cores()


@contextlib.contextmanager
def numba_threads(n: int) -> Iterator[None]:
    """numba's parallel regions on `n` threads inside the block (restored after); nothing when numba is absent.

    numba's limit is per calling thread and may not exceed the pool it started with (NUMBA_NUM_THREADS)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"numba_threads: expected a thread count >= 1, found {n!r}")
    try:
        import numba  # noqa: PLC0415 -- optional heavy dependency (~0.5 s to import); only the fast paths need it
    except ImportError:
        yield
        return
    before = numba.get_num_threads()
    numba.set_num_threads(min(n, int(numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
    try:
        yield
    finally:
        numba.set_num_threads(before)


def blas_info() -> list[dict[str, Any]]:
    """threadpoolctl's record of each loaded BLAS (internal_api, version, architecture, num_threads, ...)."""
    return [dict(lib.info()) for lib in _blas_libs()]


_NAMES = {"openblas": "OpenBLAS", "mkl": "MKL", "blis": "BLIS", "flexiblas": "FlexiBLAS"}


def describe_blas() -> str:
    """One line per loaded BLAS, joined by "; ": e.g. "OpenBLAS 0.3.31 (Haswell kernel), 1 thread"."""
    libs = blas_info()
    if not libs:
        return "no BLAS library found loaded"
    parts = []
    for info in libs:
        name = _NAMES.get(str(info.get("internal_api")), str(info.get("internal_api")))
        version = info.get("version") or "version unknown"
        arch = f" ({info['architecture']} kernel)" if info.get("architecture") else ""
        n = int(info.get("num_threads") or 0)
        parts.append(f"{name} {version}{arch}, {n} thread{'s' if n != 1 else ''}")
    return "; ".join(parts)
