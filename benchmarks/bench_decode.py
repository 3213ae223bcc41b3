"""One-token decode of the `small` config on this CPU (float32): tokens/s and time over the memory floor.

Floor = bytes a decode step must touch (every active float32 weight once: all non-expert weights but the
embedding table, which costs one row; the selected experts' MXFP4 bytes; the KDA state read + written; the
MLA cache rows read) / copy bandwidth measured in the same run. Target (issue 3): at most 2x the floor.
Run: make bench  (or .venv/bin/python -m pytest benchmarks/bench_decode.py -q -s)
"""
from __future__ import annotations

import numpy as np
import pytest

from conformance.speed import copy_bandwidth, one_blas_thread
from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel, forward_prefill, forward_token
from k3ref.weights import inventory, is_routed_expert

DECODE_FLOOR_TARGET = 2.0  # issue 3: one-token decode within 2x of the memory floor


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


@pytest.mark.xfail(strict=True, reason="target not met yet: measured 3.25-3.96x the floor on 2026-12-02 "
                   "(docs/measurements.md); strict, so meeting it fails here until this marker is removed")
def test_small_decode_vs_memory_floor(benchmark, small_model):
    model, prompt = small_model, [3, 1, 4, 1, 5, 9, 2, 6]
    cache = model.new_cache()
    seq = cache.add_sequence()
    forward_prefill(model, prompt, cache, seq=seq)
    forward_token(model, 7, len(prompt), cache, seq=seq)  # warm: casts every weight once
    state = {"pos": len(prompt) + 1}

    def step():
        forward_token(model, 7, state["pos"], cache, seq=seq)
        state["pos"] += 1

    with one_blas_thread() as blas:
        benchmark.pedantic(step, rounds=8, iterations=1)
        bw = copy_bandwidth()
    t = benchmark.stats.stats.median
    floor = decode_bytes(model, state["pos"]) / bw
    ratio = t / floor
    benchmark.extra_info.update(tokens_per_s=1 / t, floor_s=floor, ratio_to_floor=ratio, copy_gb_s=bw / 1e9)
    print(f"\n{blas}; small decode: {1 / t:.2f} tok/s, {t * 1e3:.1f} ms/token, floor {floor * 1e3:.1f} ms "
          f"({decode_bytes(model, state['pos']) / 1e6:.0f} MB at {bw / 1e9:.1f} GB/s), ratio {ratio:.2f}x "
          f"(target <= {DECODE_FLOOR_TARGET}x)")
    assert ratio <= DECODE_FLOOR_TARGET, f"small decode at {ratio:.2f}x the memory floor (target {DECODE_FLOOR_TARGET}x)"
