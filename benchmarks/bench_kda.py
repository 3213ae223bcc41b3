"""KDA speed on this CPU (float32), every ratio measured in one run, on one pinned thread and on all cores.

1. Prefill: `kda_chunked` over `kda_recurrent` (the readable NumPy loop) at B=1, T=1024, H=4, K=V=128, lower
   bound -5, in float32 (the NumPy WY/UT form) and float64 (the compiled form: `k3ref.kda.JIT_PREFILL_DTYPES`).
   Target: chunked time / recurrent time < 0.5 (the two interleaved, best of 5).
2. Decode: `kda_decode_core` at H=96, K=V=128 (K3's heads), B=1 and B=8, over the memory floor
       floor bytes = 2 * B*H*K*V * 4          # S read + new S written (float32); q, k, v, gates are ~100 KB per B
   at the bandwidth of the shared 512 MB float32 copy (conftest `floor`), copy and core interleaved.
   Target: <= 3x the floor.
Thread modes: "pinned" runs BLAS and numba on one thread; "all-cores" leaves both as a user gets them (numba on
every core, `k3ref.threads.compute_threads()`; the references pin their own BLAS calls to one thread).
Run: make bench  (or .venv/bin/python -m pytest benchmarks/bench_kda.py -q -s)
"""
from __future__ import annotations

import numpy as np
import pytest

from conformance.judge.speed import race, short_pass_miss, thread_mode
from k3ref.kda import kda_chunked, kda_decode_core, kda_gate, kda_recurrent

CHUNKED_OVER_RECURRENT_MAX = 0.5   # the chunked prefill must take under half the recurrent one's time
DECODE_FLOOR_TARGET = 3.0          # decode core time over the memory floor


THREAD_MODES = [pytest.param(True, id="pinned"), pytest.param(False, id="all-cores")]


def _mode_name(pinned: bool) -> str:
    return "pinned" if pinned else "all cores"


def _prefill_inputs(dtype=np.float32, B=1, T=1024, H=4, K=128, V=128, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, H, K))
    v = rng.standard_normal((B, T, H, V))
    g = kda_gate(rng.standard_normal((B, T, H, K)), np.log(rng.uniform(1, 16, H)), rng.uniform(-1, 1, H * K))
    beta = rng.uniform(0, 1, (B, T, H))
    return tuple(a.astype(dtype) for a in (q, k, v, g, beta))


# float32 runs the NumPy WY/UT form (k3ref.kda.JIT_PREFILL_DTYPES says why); on 2026-12-04 (load average 4-5) it
# measured 0.38-0.47 and once 0.517 pinned, where the compiled form measured 0.19-0.30 in float32
FP32_PREFILL = pytest.param(np.float32, id="fp32", marks=pytest.mark.xfail(**short_pass_miss(
    "float32 keeps the NumPy WY/UT form (the judge's fp32 baseline must err as a chunked kernel does): "
    "0.38-0.47 under load, once 0.517; the compiled form (0.19-0.30) is used in float64 only")))


@pytest.mark.parametrize("pinned", THREAD_MODES)
@pytest.mark.parametrize("dtype", [FP32_PREFILL, pytest.param(np.float64, id="fp64")])
def test_chunked_prefill_vs_recurrent(benchmark, speed, dtype, pinned):
    inputs = _prefill_inputs(dtype)
    fns = {"chunked": lambda: kda_chunked(*inputs, use_qk_l2norm=True),
    "recurrent": lambda: kda_recurrent(*inputs, use_qk_l2norm=True)}
    with thread_mode(pinned) as mode:
        best = race(fns)
        o, S = benchmark.pedantic(fns["chunked"], rounds=3, iterations=1)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(S)), "kda_chunked returned NaN/Inf"
    ratio = best["chunked"] / best["recurrent"]
    benchmark.extra_info.update(chunked_s=best["chunked"], recurrent_s=best["recurrent"], ratio=ratio)
    name = np.dtype(dtype).name
    print(f"\nKDA prefill B=1 T=1024 H=4 K=V=128 {name} ({mode}): chunked {best['chunked'] * 1e3:.1f} ms, "
          f"recurrent {best['recurrent'] * 1e3:.1f} ms, ratio {ratio:.3f}")
    times = f"{best['chunked'] * 1e3:.1f} ms / {best['recurrent'] * 1e3:.1f} ms"
    speed.check(f"kda_chunked / kda_recurrent, T1024 H4 K=V=128 {name}, {_mode_name(pinned)}", ratio,
                CHUNKED_OVER_RECURRENT_MAX, f"{times}; {mode}")


def decode_floor_bytes(state: np.ndarray) -> int:
    """The decode core's memory floor: the state S read once and the new S written once (q, k, v and the gates
    are ~100 KB per B, left out)."""
    return 2 * state.nbytes


def _decode_inputs(B, H=96, K=128, V=128, seed=1):
    rng = np.random.default_rng(seed)
    q, k, g_raw = rng.standard_normal((3, B, H, K), dtype=np.float32)
    v = rng.standard_normal((B, H, V), dtype=np.float32)
    beta_raw = rng.standard_normal((B, H), dtype=np.float32)
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    dt_bias = rng.uniform(-1, 1, H * K).astype(np.float32)
    state = rng.standard_normal((B, H, K, V), dtype=np.float32)
    return q, k, v, g_raw, beta_raw, A_log, dt_bias, state


# B1 runs on one thread in both modes (6.3 MB of state: below DECODE_BYTES_PER_THREAD), so its two rows differ by noise
DECODE_CASES = [pytest.param(1, id="B1", marks=pytest.mark.xfail(**short_pass_miss(
    "on a quiet machine of this type (load 0.6-1.3, copy 31-33 GB/s, 2026-12-04) 2.1-2.8x in 5 runs and "
    "3.46x once; under load 1.2-2.9x in 8 runs and once 3.06x: the compiled "
    "step takes ~0.48 ms, and the gates, L2 norms and argument checks before it, in NumPy, ~0.38 ms; "
    "meeting 3x with room to spare needs those fused into the compiled step"))),
                pytest.param(8, id="B8")]
# B8 (a 50 MB state; 2026-12-04, load average 4-7): pinned 2.5-3.0x while the copy floor ran at 15-19 GB/s, 3.58x
# when it ran at 27.6 GB/s; all cores 1.4-2.98x and once 3.3x (a thread descheduled on the shared 2 cores). Quiet
# (load 0.6-1.3, copy 30-32 GB/s): pinned 2.83-2.92x, all cores 1.76-2.12x in 3 runs each: met, by a thin margin
# pinned, so the declaration stays for loaded machines (CI's short pass measured 3.002x once)
B8_DECLARED = pytest.mark.xfail(**short_pass_miss(
    "a single-thread decode streams the 50 MB state at ~12 GB/s of read + read-for-ownership + write traffic "
    "(the floor's memcpy writes with non-temporal stores, so it moves 2 bytes where the step moves 3); meeting "
    "3x on a quiet machine needs non-temporal stores of the new state, which numba does not expose"))


@pytest.mark.parametrize("pinned", THREAD_MODES)
@pytest.mark.parametrize("B", DECODE_CASES)
def test_decode_core_over_memory_floor(benchmark, speed, floor, B, pinned, request):
    if B == 8:
        request.applymarker(B8_DECLARED)
    args = _decode_inputs(B)
    state = args[-1]
    floor_bytes = decode_floor_bytes(state)
    fns = {"copy": floor, "decode": lambda: kda_decode_core(*args)}
    with thread_mode(pinned) as mode:
        best = race(fns, inner={"decode": 4})
        o, new_state = benchmark.pedantic(fns["decode"], rounds=10, iterations=1)
    assert o.dtype == np.float32 and new_state.dtype == np.float32 and np.all(np.isfinite(o))
    floor_s = floor.seconds_for(floor_bytes, best["copy"])
    ratio = best["decode"] / floor_s
    benchmark.extra_info.update(decode_s=best["decode"], floor_s=floor_s, ratio=ratio,
                                copy_gb_s=floor.bandwidth(best["copy"]) / 1e9)
    speed.check(f"kda_decode_core B{B} H96 K=V=128 / floor, {_mode_name(pinned)}", ratio, DECODE_FLOOR_TARGET,
                f"{best['decode'] * 1e3:.2f} ms vs {floor_s * 1e3:.2f} ms = {floor_bytes / 1e6:.1f} MB at "
                f"{floor.bandwidth(best['copy']) / 1e9:.1f} GB/s; {mode}")

