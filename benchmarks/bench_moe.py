"""One K3 routed expert for one token on this CPU (float32), over its packed-bytes floor, on one pinned thread and
on all cores.

The expert is K3's: w1, w3 MXFP4 [3072 x 3584], w2 MXFP4 [3584 x 3072], SiTU between (`routed_expert`).
    floor bytes = sum over w1, w3, w2 of packed (N * K/2) + scales (N * K/32)     # read once; z, h are ~30 KB
at the bandwidth of the shared 512 MB float32 copy (conftest `floor`), copy and expert interleaved.
The expert runs its default form, the compiled dequantise-and-dot (`k3ref.fast.mxfp4_jit`: a table lookup per
16 codes); 2.2 ms, 3.5x the floor, on one pinned core of the AVX-512 machine type (2026-12-04).
Target: <= 8x the floor.
Thread modes: "pinned" runs BLAS and numba on one thread; "all-cores" leaves both as a user gets them.
Run: make bench  (or .venv/bin/python -m pytest benchmarks/bench_moe.py -q -s)
"""
from __future__ import annotations

import numpy as np
import pytest

from conformance.judge.speed import race, short_pass_miss, thread_mode
from k3ref.latent_moe import LatentMoeConfig, routed_expert

EXPERT_FLOOR_TARGET = 8.0
THREAD_MODES = [
    pytest.param(True, id="pinned"),
    pytest.param(False, id="all-cores", marks=pytest.mark.xfail(**short_pass_miss(
        "met on a quiet machine of this type (1.8-2.6x, 2026-12-04), but 19.4x with two busy processes on "
        "the two cores: the threaded kernel splits rows evenly, so the call waits for the thread whose core "
        "is busy (the pinned row stayed at 2.6x); docs/measurements.md"))),
]


K3_EXPERT = LatentMoeConfig(hidden_size=7168, num_experts=1, top_k=1, latent_size=3584, moe_intermediate_size=3072,
                            n_shared_experts=0, shared_intermediate_size=0)


def _expert_weights(cfg: LatentMoeConfig, rng) -> dict[str, np.ndarray]:
    """Random MXFP4 bytes; scales 2^-9 .. 2^-1 (bytes 118..126) keep SiTU's inputs O(1) and never NaN."""
    Dl, inter = cfg.latent_size, cfg.moe_intermediate_size
    w = {}
    for proj, (rows, cols) in (("w1", (inter, Dl)), ("w3", (inter, Dl)), ("w2", (Dl, inter))):
        w[f"experts.0.{proj}.weight_packed"] = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
        w[f"experts.0.{proj}.weight_scale"] = rng.integers(118, 126, (rows, cols // 32), dtype=np.uint8)
    return w


def expert_floor_bytes(cfg: LatentMoeConfig) -> int:
    """One expert's packed-bytes floor: for each of w1, w3 [inter x latent] and w2 [latent x inter], the MXFP4
    bytes (two codes a byte) and one E8M0 scale byte per 32 codes, each read once."""
    codes = 3 * cfg.moe_intermediate_size * cfg.latent_size
    return codes // 2 + codes // 32


@pytest.mark.parametrize("pinned", THREAD_MODES)
def test_k3_expert_one_token_vs_packed_floor(benchmark, speed, floor, pinned):
    cfg = K3_EXPERT
    weights = _expert_weights(cfg, np.random.default_rng(0))
    z = np.random.default_rng(1).standard_normal((1, cfg.latent_size), dtype=np.float32)
    floor_bytes = expert_floor_bytes(cfg)
    fns = {"copy": floor, "expert": lambda: routed_expert(weights, 0, z, cfg)}
    with thread_mode(pinned) as mode:
        best = race(fns, inner={"expert": 2})
        out = benchmark.pedantic(fns["expert"], rounds=3, iterations=1)
    assert out.shape == z.shape and out.dtype == np.float32 and np.all(np.isfinite(out))
    floor_s = floor.seconds_for(floor_bytes, best["copy"])
    ratio = best["expert"] / floor_s
    benchmark.extra_info.update(expert_s=best["expert"], floor_s=floor_s, ratio=ratio)
    print(f"\nK3 routed expert, 1 token ({mode}): {best['expert'] * 1e3:.2f} ms, floor {floor_s * 1e3:.2f} ms, "
          f"ratio {ratio:.1f}x")
    speed.check(f"K3 routed expert (w1, w3, SiTU, w2), 1 token / packed floor, {'pinned' if pinned else 'all cores'}",
                ratio, EXPERT_FLOOR_TARGET,
                f"{best['expert'] * 1e3:.1f} ms vs {floor_s * 1e3:.2f} ms = {floor_bytes / 1e6:.1f} MB at "
                f"{floor.bandwidth(best['copy']) / 1e9:.1f} GB/s; {mode}")
