"""One-token decode of the `small` config on this CPU (float32) after a 16-token prefill: tokens/s and time over the
memory floor, on one pinned thread and on all cores.

Floor = bytes a decode step must touch (every active float32 weight once: all non-expert weights but the
embedding table, which costs one row; the selected experts' MXFP4 bytes; the KDA state read + written; the
MLA cache rows read) at the bandwidth of the shared 512 MB float32 copy (conftest `floor`), copy and decode
steps interleaved. Target: at most 2x the floor.
The host graph runs its default forms: the float32 projections and lm_head's float32 blocks through the compiled
GEMV (`k3ref.fast.gemv_jit`, no copy of a weight), the compiled routed experts
(`k3ref.fast.latent_moe.routed_pairs_jit`) and the compiled KDA step (MLA decode stays on BLAS by default).
Thread modes: "pinned" runs BLAS and numba on one thread; "all-cores" leaves both as a user gets them.
Run: make bench  (or .venv/bin/python -m pytest benchmarks/bench_decode.py -q -s)
"""
from __future__ import annotations

import numpy as np
import pytest

from conformance.judge.speed import race, short_pass_miss, thread_mode
from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel, forward_prefill, forward_token
from k3ref.weights import inventory, is_routed_expert

DECODE_FLOOR_TARGET = 2.0  # one-token decode within 2x of the memory floor
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]   # 16 tokens
_MISS = ("measured {} on 2026-12-04 on the 2-core machine type (AVX-512; the VM's speed moved by up to 40% within "
         "the hour): per pinned token the float32 GEMVs take ~23-25 ms (645 MB at 26-29 GB/s, lm_head included) and "
         "~20 ms go to the host graph's Python and NumPy steps (norms, gates, AttnRes, the router, checks: ~28,000 "
         "Python calls a token) and the experts' calls; docs/measurements.md")
THREAD_MODES = [
    pytest.param(True, id="pinned", marks=pytest.mark.xfail(**short_pass_miss(
        _MISS.format("1.80-1.96x quiet (was 1.99-2.53x before the host graph's steps took fewer calls); CI's short "
                     "pass measured 2.155x once")))),
    pytest.param(False, id="all-cores", marks=pytest.mark.xfail(**short_pass_miss(
        _MISS.format("1.40-1.72x quiet (the GEMVs on both cores, the host graph's steps on one), 3.77x beside one "
                     "busy process: each threaded GEMV waits for its half on the busy core")))),
]


def decode_bytes(model: K3CpuModel, context: int) -> int:
    """Bytes one decode step must touch (see the module docstring), term by term."""
    cfg, f32 = model.cfg, 4
    specs = inventory(cfg)
    total = 0
    for spec in specs:
        if is_routed_expert(spec.name):
            continue  # counted below: only the selected experts
        if spec.name.endswith("embed_tokens.weight"):
            total += cfg.hidden_size * f32  # one embedding row
        else:
            total += spec.numel * f32  # every other weight, cast to float32 once
    per_expert = sum(s.nbytes for s in specs
                     if ".layers.1.block_sparse_moe.experts.0." in s.name)  # U8 packed + scales
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    total += moe_layers * cfg.num_experts_per_tok * per_expert
    kda, mla = cfg.kda_config(), cfg.mla_config()
    total += len(cfg.kda_layers) * 2 * kda.num_heads * kda.head_dim * kda.head_dim * f32  # KDA state read + written
    total += len(cfg.mla_layers) * context * mla.cache_width * f32  # latent cache rows read
    return total


@pytest.fixture(scope="module")
def small_model():
    return K3CpuModel.synthetic(K3Config.preset("small"), seed=0, dtype=np.float32)


@pytest.mark.parametrize("pinned", THREAD_MODES)
def test_small_decode_vs_memory_floor(benchmark, speed, floor, small_model, pinned):
    model = small_model
    cache = model.new_cache()
    seq = cache.add_sequence()
    forward_prefill(model, PROMPT, cache, seq=seq)
    state = {"pos": len(PROMPT)}

    def step():
        logits = forward_token(model, 7, state["pos"], cache, seq=seq)
        state["pos"] += 1
        return logits

    with thread_mode(pinned) as blas:
        best = race({"copy": floor, "decode": step}, inner={"decode": 2})   # warm-up round casts every weight once
        logits = benchmark.pedantic(step, rounds=3, iterations=1)
    assert np.all(np.isfinite(logits)), "decode returned NaN/Inf logits"
    nbytes = decode_bytes(model, state["pos"])
    floor_s = floor.seconds_for(nbytes, best["copy"])
    ratio = best["decode"] / floor_s
    bw = floor.bandwidth(best["copy"])
    benchmark.extra_info.update(tokens_per_s=1 / best["decode"], floor_s=floor_s, ratio_to_floor=ratio,
                                copy_gb_s=bw / 1e9)
    print(f"\n{blas}; small decode: {1 / best['decode']:.2f} tok/s, {best['decode'] * 1e3:.1f} ms/token, floor "
          f"{floor_s * 1e3:.1f} ms ({nbytes / 1e6:.0f} MB at {bw / 1e9:.1f} GB/s), ratio {ratio:.2f}x")
    speed.check(f"small (0.40B) decode, 1 token after 16 / floor, {'pinned' if pinned else 'all cores'}", ratio,
                DECODE_FLOOR_TARGET, f"{best['decode'] * 1e3:.1f} ms vs {floor_s * 1e3:.1f} ms = {nbytes / 1e6:.0f} "
                f"MB at {bw / 1e9:.1f} GB/s; {blas}")
