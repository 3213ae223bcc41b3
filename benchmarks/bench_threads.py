"""KDA prefill under the threading users get, on a loaded machine.

`kda_chunked` over `kda_recurrent` at B=1, T=1024, H=4, K=V=128, float32 (bench_kda's inputs), the two
interleaved, while one busy process (a Python spin loop, `busy_cores(1)`) holds a core: on the 2-core CI machine
the work then has one free core and one shared with the spinner. Run under both `threads` modes; "all" is what a
user's process gets (numba on every core, the BLAS's default thread count), the mode where a threaded BLAS used to
wait for the busy core (chunked then ran 7.8x slower than recurrent, where it was 0.37x on one thread).
Target: chunked / recurrent < 0.5 in both modes; the pinned row is a declared miss (PINNED_DECLARED says why).
Run: make bench  (or .venv/bin/python -m pytest benchmarks/bench_threads.py -q -s)
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from benchmarks.bench_kda import CHUNKED_OVER_RECURRENT_MAX, _prefill_inputs
from benchmarks.bench_run import busy_cores
from conformance.judge.speed import SpeedTargetMissed, race
from k3ref.kda import kda_chunked, kda_recurrent

BUSY_PROCESSES = 1
# float32 runs the NumPy WY/UT form (k3ref.kda.JIT_PREFILL_DTYPES says why), declared a miss in bench_kda for the
# same reason; on one thread beside the spinner it measured 0.21-0.41 in most runs (2026-12-04, quiet and loaded)
# and 0.569 once (47.4 ms / 83.3 ms) in CI's short pass on a fresh clone. The "all" row, the threads users get
# and the target the row guards, stays undeclared: 0.24-0.38 in the same runs.
PINNED_DECLARED = pytest.mark.xfail(
    raises=SpeedTargetMissed, strict=False,
    reason="float32 keeps the NumPy WY/UT form; pinned beside a busy process 0.21-0.41, once 0.569 in CI's short "
           "pass (2026-12-04); the users' threading row is the guarded one")


def test_chunked_prefill_vs_recurrent_loaded(benchmark, speed, threads, request):
    if threads.mode == "pinned":
        request.applymarker(PINNED_DECLARED)
    inputs = _prefill_inputs()
    fns = {"chunked": lambda: kda_chunked(*inputs, use_qk_l2norm=True),
           "recurrent": lambda: kda_recurrent(*inputs, use_qk_l2norm=True)}
    fns["chunked"]()                                       # compiled code loaded before the load starts
    with busy_cores(BUSY_PROCESSES):
        best = race(fns)
        load = os.getloadavg()[0]
        o, S = benchmark.pedantic(fns["chunked"], rounds=1, iterations=1)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(S)), "kda_chunked returned NaN/Inf"
    ratio = best["chunked"] / best["recurrent"]
    benchmark.extra_info.update(chunked_s=best["chunked"], recurrent_s=best["recurrent"], ratio=ratio,
                                busy_processes=BUSY_PROCESSES, load_average=load, threads=threads.describe())
    print(f"\nKDA prefill T=1024 H=4 fp32, {BUSY_PROCESSES} busy process(es), load average {load:.1f} "
          f"({threads.describe()}): chunked {best['chunked'] * 1e3:.1f} ms, "
          f"recurrent {best['recurrent'] * 1e3:.1f} ms, ratio {ratio:.3f}")
    speed.check(f"kda_chunked / kda_recurrent, T1024 H4, {BUSY_PROCESSES} busy", ratio, CHUNKED_OVER_RECURRENT_MAX,
                f"{best['chunked'] * 1e3:.1f} ms / {best['recurrent'] * 1e3:.1f} ms, load {load:.1f}")
