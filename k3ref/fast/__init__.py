"""Tuned CPU forms of reference steps whose readable form lives in the block module (k3ref.kda, k3ref.mxfp4,
k3ref.latent_moe).

Each function here computes exactly what its readable counterpart states, reorganised for speed on a CPU
(blocked chunks, cache-sized row blocks, lookup tables, batched experts). They take arguments the block
module has already validated and never import the block module they speed up, so it may call them without a
cycle.
tests/k3ref/test_fast.py checks each one against the readable form.

The compiled forms (numba: `k3ref.fast.*_jit`) are the default; environment variable K3_FAST selects them
("jit", the default) or the NumPy forms of this package ("numpy"), read on every call so a test or a user may
switch without re-importing; inside `held()` (a host-graph forward: ~250 asks a `small` decode token) the value
read on entering holds. The readable statements (`k3ref.mxfp4.dequantize`, `k3ref.kda.kda_recurrent`, ...)
never change with it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

BACKENDS = ("jit", "numpy")
_HELD = threading.local()   # .backend: the value `held()` read on entering, per thread


def backend() -> str:
    """The fast-path backend K3_FAST names: "jit" (unset or empty: the default) or "numpy"; anything else raises
    ValueError naming the accepted values. Inside `held()`, the value read when the block was entered."""
    held_now = getattr(_HELD, "backend", None)
    if held_now is not None:
        return held_now
    raw = os.environ.get("K3_FAST", "").strip().lower()
    if not raw:
        return "jit"
    if raw not in BACKENDS:
        raise ValueError(f"K3_FAST: expected one of {', '.join(BACKENDS)} (or unset for jit), found {raw!r}")
    return raw


@contextlib.contextmanager
def held() -> Iterator[str]:
    """Read K3_FAST once and answer `backend()` with that value inside the block, on this thread (nested blocks keep
    the outer value). Why: reading the environment costs ~3 us, and one forward asks hundreds of times; a forward
    is one decision, so K3_FAST changed while it runs takes effect at the next."""
    outer = getattr(_HELD, "backend", None)
    _HELD.backend = outer if outer is not None else backend()
    try:
        yield _HELD.backend
    finally:
        _HELD.backend = outer


def enabled() -> bool:
    """True when the compiled (numba) fast paths run: K3_FAST unset, empty or "jit"; False for "numpy"."""
    return backend() == "jit"


# numba's OpenMP threading layer kills a process forked after it started, on the child's first parallel region
# (SIGTERM: "fork() called from a process already using GNU OpenMP"), and the conformance runner forks its CPU
# workers. A compiled fast path asks `forked_after_numba()` and runs serial code in such a child.
# torch shares that libgomp: once numba's OpenMP pool ran in the parent, torch's first parallel region in the
# child (a large copy_) waits forever at the team barrier. So such a child also runs torch on one thread.
_FORK = {"after_numba": False}


def _omp_pool_started() -> bool:
    """True once numba's OpenMP threading layer has started its pool in this process."""
    parallel = sys.modules.get("numba.np.ufunc.parallel")
    return bool(parallel is not None and getattr(parallel, "_is_initialized", False)
                and getattr(parallel, "_threading_layer", None) == "omp")


def _mark_fork_child() -> None:
    _FORK["after_numba"] = _FORK["after_numba"] or "numba" in sys.modules
    torch = sys.modules.get("torch")
    if torch is not None and _omp_pool_started():
        torch.set_num_threads(1)


os.register_at_fork(after_in_child=_mark_fork_child)


def forked_after_numba() -> bool:
    """True in a process forked (at any depth) from one that had numba loaded: numba's parallel regions would kill
    it, so the compiled paths must run their serial kernels."""
    return _FORK["after_numba"]
