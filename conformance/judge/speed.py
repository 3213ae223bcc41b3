"""Speed measurement helpers shared by the runner's speed gates and the benchmarks (host side).

Ratios are what this product reports (time over a memory floor, time over a baseline), each measured in
one run: these machines are shared and noisy.
"""
from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from k3ref.threads import blas_threads, compute_threads, describe_blas, numba_threads

FLOOR_COPY_BYTES = 512 << 20    # the memory floor's copy: 512 MB of float32, far beyond any cache here
FLOOR_REPEATS = 5               # best of 5 (these machines are shared: the best run is the least disturbed)
QUICK_ENV = "K3_BENCH_QUICK"    # "1": the short pass CI runs (`make bench-quick`): fewer timed rounds per target
QUICK_REPEATS = 2               # rounds per target in the short pass (after the untimed warm-up round)


class SpeedTargetMissed(Exception):
    """A measured speed ratio missed its target. Benchmarks raise this (and only this) for a miss, so a
    declared miss can be marked `xfail(raises=SpeedTargetMissed)` while a NaN or a crash still fails."""

    def __init__(self, what: str, ratio: float, target: float, detail: str = ""):
        self.what, self.ratio, self.target, self.detail = what, float(ratio), float(target), detail
        super().__init__(f"{what}: measured {self.ratio:.3g}, target <= {self.target:.3g}"
                         + (f" ({detail})" if detail else ""))


def check_target(what: str, ratio: float, target: float, detail: str = "") -> float:
    """ratio if ratio <= target; else raise SpeedTargetMissed (a NaN ratio raises ValueError: nothing measured)."""
    if not np.isfinite(ratio):
        raise ValueError(f"{what}: expected a finite measured ratio, found {ratio}")
    if ratio > target:
        raise SpeedTargetMissed(what, ratio, target, detail)
    return ratio


class CopyFloor:
    """The memory floor every CPU speed target divides by: a `FLOOR_COPY_BYTES` float32 np.copyto, bytes
    read + bytes written counted. Run it inside `race` with the work, so both see the same load."""

    def __init__(self, nbytes: int = FLOOR_COPY_BYTES):
        self.src = np.ones(nbytes // 4, np.float32)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)                                # fault every page in before timing

    def __call__(self) -> None:
        np.copyto(self.dst, self.src)

    def bandwidth(self, seconds: float) -> float:
        """Bytes/s of one copy that took `seconds` (read + write)."""
        return 2 * self.src.nbytes / seconds

    def seconds_for(self, nbytes: float, copy_seconds: float) -> float:
        """The floor: seconds to move `nbytes` at the bandwidth of a copy that took `copy_seconds`."""
        return nbytes / self.bandwidth(copy_seconds)


def quick() -> bool:
    """True in the short benchmark pass (K3_BENCH_QUICK=1); a value other than 1, 0 or empty raises."""
    raw = os.environ.get(QUICK_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{QUICK_ENV}: expected 1 (the short pass) or 0 / unset (the full one), found {raw!r}")
    return raw == "1"


def short_pass_miss(reason: str) -> dict[str, object]:
    """`pytest.mark.xfail(**short_pass_miss(reason))`: the declaration of a target that meets on a quiet machine by
    less than a shared one's noise. In the short pass (CI's `make bench-quick`, 2 rounds beside other work) its miss
    is declared -- xfailed and listed as a declared miss; in the full pass (`make bench`) it is not, so there every
    target holds and a miss fails the run. A miss that is not a target at all (a mode the benchmark only reports)
    keeps a plain xfail. (Arguments, not the mark: the judge does not need pytest.)"""
    return {"condition": quick(), "raises": SpeedTargetMissed, "strict": False,
            "reason": f"declared in the short pass only: {reason}"}


def bench_repeats(full: int = FLOOR_REPEATS) -> int:
    """Timed rounds for a benchmark: `full` in `make bench`, at most QUICK_REPEATS in the short pass."""
    return min(full, QUICK_REPEATS) if quick() else full


def race(fns: Mapping[str, Callable[[], object]], repeats: int | None = None,
         inner: Mapping[str, int] | None = None) -> dict[str, float]:
    """Best seconds of each fn over `repeats` rounds (default `bench_repeats()`: 5, or 2 in the short pass), the fns
    interleaved within a round (a burst of load from other processes hits all of them, not one), after one
    untimed warm-up round. inner[name] > 1 times that fn so many times per round (for work much shorter than
    the floor's copy)."""
    if repeats is None:
        repeats = bench_repeats()
    inner = inner or {}
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            for _ in range(inner.get(name, 1)):
                best[name] = min(best[name], timed(fn))
    return best


def timed(fn) -> float:
    """Seconds of one call of fn()."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of fn() over `repeats` calls after one warm-up call (a core timed on the host)."""
    fn()
    return statistics.median(timed(fn) for _ in range(repeats))


def copy_bandwidth(nbytes: int = 1 << 27, repeats: int = 5) -> float:
    """Bytes/s of a large np.copyto (bytes read + written counted), best of `repeats` after a warm-up.
    The runner's speed gates use this; benchmarks use `CopyFloor` inside `race`."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return 2 * src.nbytes / min(timed(lambda: np.copyto(dst, src)) for _ in range(repeats))


@contextlib.contextmanager
def one_blas_thread() -> Iterator[str]:
    """Run the loaded BLAS on one thread inside the block (restored after); yields a line saying what it did.

    On a small shared machine a threaded GEMV spin-waits for a busy core: measured here, a [4864, 1024]
    float32 GEMV ran at 3 GB/s on two threads under load and at 20 GB/s on one. The references pin one thread
    themselves (k3ref.threads.fixed_blas); this pins the code around them too (baselines, floors).
    """
    before = describe_blas()
    with blas_threads(1):
        yield f"{describe_blas()} (was: {before})"


@contextlib.contextmanager
def thread_mode(pinned: bool) -> Iterator[str]:
    """One BLAS and one numba thread (pinned), or the defaults a user gets; yields a line naming the mode and the
    load average (the benchmarks' two threadings)."""
    load = "load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    if not pinned:
        yield f"all cores (numba on {compute_threads()} threads), {load}"
        return
    with one_blas_thread(), numba_threads(1):
        yield f"pinned to 1 thread, {load}"


@functools.cache
def numpy_copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes/s of a large np.copyto (read + write counted), measured once per process, best of `repeats`."""
    return copy_bandwidth(nbytes, repeats)
