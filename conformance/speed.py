"""Speed measurement helpers shared by the runner's speed gates and the benchmarks (host side).

Ratios are what this product reports (time over a memory floor, time over a baseline), each measured in
one run: these machines are shared and noisy.
"""
from __future__ import annotations

import contextlib
import ctypes
import re
import time

import numpy as np


def timed(fn) -> float:
    """Seconds of one call of fn()."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def copy_bandwidth(nbytes: int = 1 << 27, repeats: int = 5) -> float:
    """Bytes/s of a large np.copyto (bytes read + written counted), best of `repeats` after a warm-up."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return 2 * src.nbytes / min(timed(lambda: np.copyto(dst, src)) for _ in range(repeats))


def _openblas_thread_fns():
    try:
        maps = open("/proc/self/maps").read()  # Linux: the loaded shared objects
    except OSError:
        return None
    for path in sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", maps))):
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_openblas_", "64_"), ("scipy_openblas_", ""), ("openblas_", "")):
            if hasattr(lib, f"{prefix}set_num_threads{suffix}"):
                return getattr(lib, f"{prefix}set_num_threads{suffix}"), getattr(lib, f"{prefix}get_num_threads{suffix}")
    return None


@contextlib.contextmanager
def one_blas_thread():
    """Run OpenBLAS on one thread inside the block (restored after).

    On a small shared machine a threaded GEMV spin-waits for a busy core: measured here, a [4864, 1024]
    float32 GEMV ran at 3 GB/s on two threads under load and at 20 GB/s on one. Yields a line saying what it did.
    """
    fns = _openblas_thread_fns()
    if fns is None:
        yield "BLAS threads unchanged (no OpenBLAS found)"
        return
    before = fns[1]()
    fns[0](1)
    try:
        yield f"OpenBLAS on 1 thread (was {before})"
    finally:
        fns[0](before)
