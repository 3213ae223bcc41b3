"""KDA speed on this CPU (float32), both numbers measured in one run.

1. Prefill: `kda_chunked` (WY/UT, chunk 64) against `kda_recurrent` at B=1, T=1024, H=4, K=V=128. The chunked
   form must be at least 2x faster (asserted, on the numbers of a child process with one BLAS thread and
   glibc heap trimming off, see RACE_ENV; the same race in this process is printed next to it).
2. Decode: the one-token core `kda_decode_core` at B=1, H=96, K=V=128 (K3's heads) against the memory floor:
   the state must be read once and written once,
       floor bytes = 2 * B*H*K*V * 4          # S read + new S written (float32); q, k, v, gates are ~100 KB
   at the copy bandwidth of a large np.copyto measured in the same run. Target: <= 3x the floor (printed).
Timings are the best of several interleaved repeats, so load from other processes hits both sides alike.
Run: .venv/bin/python -m pytest benchmarks/bench_kda.py -q -s
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.speed import copy_bandwidth, one_blas_thread
from conformance.speed import timed as _timed
from k3ref.kda import kda_chunked, kda_decode_core, kda_gate, kda_recurrent

CHUNKED_SPEEDUP_MIN = 2.0   # the chunked prefill must beat the recurrent one by this factor
DECODE_FLOOR_TARGET = 3.0   # decode core time over the memory floor (target; printed, see test docstring)


def _prefill_inputs(B=1, T=1024, H=4, K=128, V=128, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, H, K), dtype=np.float32)
    v = rng.standard_normal((B, T, H, V), dtype=np.float32)
    g = kda_gate(rng.standard_normal((B, T, H, K), dtype=np.float32), np.log(rng.uniform(1, 16, H)).astype(np.float32),
                 rng.uniform(-1, 1, H * K).astype(np.float32))
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    return q, k, v, g, beta


def prefill_race(repeats: int = 7) -> dict[str, float]:
    """Best seconds of kda_chunked and kda_recurrent on the prefill inputs, runs interleaved (same load on both)."""
    q, k, v, g, beta = _prefill_inputs()
    run = {"chunked": lambda: kda_chunked(q, k, v, g, beta, use_qk_l2norm=True),
           "recurrent": lambda: kda_recurrent(q, k, v, g, beta, use_qk_l2norm=True)}
    best = {name: float("inf") for name in run}
    for _ in range(repeats):
        for name, fn in run.items():
            best[name] = min(best[name], _timed(fn))
    return best


# The child that measures the ratio: one BLAS thread, and glibc told to keep freed memory (fixed mmap threshold
# 32 MB, no heap trimming). With glibc's defaults every chunk group's ~10 MB of temporaries goes back to the OS
# and is faulted in again, ~15 ms of page faults per call that measure the allocator, not the algorithm.
RACE_ENV = {"OPENBLAS_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def _race_in_child(race: str = "prefill_race") -> dict[str, float]:
    """Run bench_kda.<race>() in a fresh interpreter with RACE_ENV; its result dict."""
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_kda; "
            f"print(json.dumps(bench_kda.{race}()))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **RACE_ENV}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"the timing child failed:\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_chunked_prefill_beats_recurrent(benchmark):
    with one_blas_thread() as blas:
        here = prefill_race()
        inputs = _prefill_inputs()              # drawn once: the benchmark times kda_chunked, not the RNG
        benchmark.pedantic(lambda: kda_chunked(*inputs, use_qk_l2norm=True), rounds=3, iterations=1)
    child = _race_in_child()
    for label, best in ((f"this process, {blas}, default malloc", here), ("child: " + " ".join(
            f"{k}={v}" for k, v in RACE_ENV.items()), child)):
        print(f"\nKDA prefill B=1 T=1024 H=4 K=V=128 fp32 ({label}): recurrent {best['recurrent'] * 1e3:.1f} ms, "
              f"chunked {best['chunked'] * 1e3:.1f} ms, {best['recurrent'] / best['chunked']:.2f}x")
    ratio = child["recurrent"] / child["chunked"]
    benchmark.extra_info.update(recurrent_s=child["recurrent"], chunked_s=child["chunked"], speedup=ratio,
                                speedup_default_malloc=here["recurrent"] / here["chunked"])
    assert ratio >= CHUNKED_SPEEDUP_MIN, f"kda_chunked is only {ratio:.2f}x faster than kda_recurrent"


def decode_race(repeats: int = 20) -> dict[str, float]:
    """Best seconds of one kda_decode_core call at B=1, H=96, K=V=128 fp32, the floor bytes, the copy bandwidth."""
    B, H, K, V = 1, 96, 128, 128
    rng = np.random.default_rng(1)
    q, k, g_raw = rng.standard_normal((3, B, H, K), dtype=np.float32)
    v = rng.standard_normal((B, H, V), dtype=np.float32)
    beta_raw = rng.standard_normal((B, H), dtype=np.float32)
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    dt_bias = rng.uniform(-1, 1, H * K).astype(np.float32)
    state = rng.standard_normal((B, H, K, V), dtype=np.float32)
    bw = copy_bandwidth()
    best = min(_timed(lambda: kda_decode_core(q, k, v, g_raw, beta_raw, A_log, dt_bias, state)) for _ in range(repeats))
    return {"time_s": best, "floor_bytes": 2 * state.nbytes, "copy_bandwidth": bw}   # S read + new S written


@pytest.mark.xfail(strict=True, reason="target not met yet: measured 4.0-4.9x the floor on 2026-12-02 "
                   "(docs/measurements.md); strict, so meeting it fails here until this marker is removed")
def test_decode_core_over_memory_floor(benchmark):
    """The target (issue 2) is asserted; it is not met yet: the NumPy core goes over S in blocks of 16 heads and
    still reads S twice from memory (S^T [k | q] and the decay) and runs ~4 NumPy passes per block in cache, where
    a fused kernel reads it once. Measured here and in the child of RACE_ENV (there the new 6 MB state is not
    faulted in afresh on every call); the child's ratio is the one asserted."""
    here = decode_race()
    child = _race_in_child("decode_race")
    for label, r in (("this process", here), ("child", child)):
        floor = r["floor_bytes"] / r["copy_bandwidth"]
        print(f"\nKDA decode core B=1 H=96 K=V=128 fp32 ({label}): {r['time_s'] * 1e6:.0f} us; floor {floor * 1e6:.0f} us "
              f"({r['floor_bytes'] / 1e6:.1f} MB at {r['copy_bandwidth'] / 1e9:.1f} GB/s copy); "
              f"{r['time_s'] / floor:.2f}x the floor (target <= {DECODE_FLOOR_TARGET}x)")
    benchmark.extra_info.update(here=here, child=child)
    rng = np.random.default_rng(2)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((1, 96, 128),) * 4 + ((1, 96), (96,), (96 * 128,),
                                                                                      (1, 96, 128, 128))]
    o, new_state = benchmark.pedantic(lambda: kda_decode_core(*args), rounds=10, iterations=1)
    assert o.dtype == np.float32 and new_state.dtype == np.float32 and np.all(np.isfinite(o))
    ratio = child["time_s"] / (child["floor_bytes"] / child["copy_bandwidth"])
    assert ratio <= DECODE_FLOOR_TARGET, f"KDA decode core at {ratio:.2f}x the memory floor (target {DECODE_FLOOR_TARGET}x)"
