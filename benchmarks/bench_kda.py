"""KDA speed on this CPU (float32, one BLAS thread), every ratio measured in one run.

1. Prefill: `kda_chunked` (WY/UT, chunk 64) over `kda_recurrent` at B=1, T=1024, H=4, K=V=128, lower bound -5.
   Target: chunked time / recurrent time < 0.5 (the two interleaved, best of 5).
2. Decode: `kda_decode_core` at H=96, K=V=128 (K3's heads), B=1 and B=8, over the memory floor
       floor bytes = 2 * B*H*K*V * 4          # S read + new S written (float32); q, k, v, gates are ~100 KB per B
   at the bandwidth of the shared 512 MB float32 copy (conftest `floor`), copy and core interleaved.
   Target: <= 3x the floor.
Run: make bench  (or .venv/bin/python -m pytest benchmarks/bench_kda.py -q -s)
"""
from __future__ import annotations

import numpy as np
import pytest

from conformance.judge.speed import SpeedTargetMissed, one_blas_thread, race
from k3ref.kda import kda_chunked, kda_decode_core, kda_gate, kda_recurrent

CHUNKED_OVER_RECURRENT_MAX = 0.5   # the chunked prefill must take under half the recurrent one's time
DECODE_FLOOR_TARGET = 3.0          # decode core time over the memory floor


def _prefill_inputs(B=1, T=1024, H=4, K=128, V=128, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, B, T, H, K), dtype=np.float32)
    v = rng.standard_normal((B, T, H, V), dtype=np.float32)
    g = kda_gate(rng.standard_normal((B, T, H, K), dtype=np.float32), np.log(rng.uniform(1, 16, H)).astype(np.float32),
                 rng.uniform(-1, 1, H * K).astype(np.float32))
    beta = rng.uniform(0, 1, (B, T, H)).astype(np.float32)
    return q, k, v, g, beta


def test_chunked_prefill_vs_recurrent(benchmark, speed):
    inputs = _prefill_inputs()
    fns = {"chunked": lambda: kda_chunked(*inputs, use_qk_l2norm=True),
           "recurrent": lambda: kda_recurrent(*inputs, use_qk_l2norm=True)}
    with one_blas_thread() as blas:
        best = race(fns)
        o, S = benchmark.pedantic(fns["chunked"], rounds=3, iterations=1)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(S)), "kda_chunked returned NaN/Inf"
    ratio = best["chunked"] / best["recurrent"]
    benchmark.extra_info.update(chunked_s=best["chunked"], recurrent_s=best["recurrent"], ratio=ratio)
    print(f"\nKDA prefill B=1 T=1024 H=4 K=V=128 fp32 ({blas}): chunked {best['chunked'] * 1e3:.1f} ms, "
          f"recurrent {best['recurrent'] * 1e3:.1f} ms, ratio {ratio:.3f}")
    speed.check("kda_chunked / kda_recurrent, T1024 H4 K=V=128", ratio, CHUNKED_OVER_RECURRENT_MAX,
                f"{best['chunked'] * 1e3:.1f} ms / {best['recurrent'] * 1e3:.1f} ms")


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


DECODE_CASES = [
    pytest.param(1, id="B1", marks=pytest.mark.xfail(
        raises=SpeedTargetMissed, strict=False,
        reason="met under load (1.9-2.3x on 2026-12-02, copy at 10-12 GB/s), missed on a quieter machine (5.8x, "
               "copy at 23 GB/s): the gates, L2 norms and ~6 NumPy passes over the 6 MB state (it fits in L3) cost "
               "~3 ms whatever the DRAM bandwidth; meeting 3x needs a fused one-pass update (compiled code)")),
    pytest.param(8, id="B8", marks=pytest.mark.xfail(
        raises=SpeedTargetMissed, strict=False,
        reason="measured 4.6-5.5x the floor on 2026-12-02: per cache-sized block NumPy makes ~6 "
               "passes (S^T [k | q], the decay, the k u^T temporary, the add) and the fresh 50 MB output is "
               "zeroed by the kernel first; meeting 3x needs a fused one-pass update (compiled code)")),
]


@pytest.mark.parametrize("B", DECODE_CASES)
def test_decode_core_over_memory_floor(benchmark, speed, floor, B):
    args = _decode_inputs(B)
    state = args[-1]
    floor_bytes = decode_floor_bytes(state)
    fns = {"copy": floor, "decode": lambda: kda_decode_core(*args)}
    with one_blas_thread():
        best = race(fns, inner={"decode": 4})
        o, new_state = benchmark.pedantic(fns["decode"], rounds=10, iterations=1)
    assert o.dtype == np.float32 and new_state.dtype == np.float32 and np.all(np.isfinite(o))
    floor_s = floor.seconds_for(floor_bytes, best["copy"])
    ratio = best["decode"] / floor_s
    benchmark.extra_info.update(decode_s=best["decode"], floor_s=floor_s, ratio=ratio,
                                copy_gb_s=floor.bandwidth(best["copy"]) / 1e9)
    speed.check(f"kda_decode_core B{B} H96 K=V=128 / floor", ratio, DECODE_FLOOR_TARGET,
                f"{best['decode'] * 1e3:.2f} ms vs {floor_s * 1e3:.2f} ms = {floor_bytes / 1e6:.1f} MB at "
                f"{floor.bandwidth(best['copy']) / 1e9:.1f} GB/s")

