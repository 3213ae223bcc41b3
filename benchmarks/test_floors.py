"""Each speed floor against a quantity known without it: a floor that doubled (or halved) would halve (or
double) every ratio it divides unnoticed, since no unit test times anything. Cheap: no timing, no large model.
"""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from benchmarks.bench_decode import decode_bytes
from benchmarks.bench_kda import _decode_inputs, decode_floor_bytes
from benchmarks.bench_moe import K3_EXPERT, _expert_weights, expert_floor_bytes
from benchmarks.conftest import QUICK_LEFT_OUT
from conformance.judge.speed import CopyFloor
from k3ref.config import K3Config
from k3ref.weights import is_routed_expert, synthetic_weights

F32 = 4


def test_the_copy_floor_counts_read_and_write():
    floor = CopyFloor(nbytes=1 << 12)                    # 4 KB: the formula, not the 512 MB of a benchmark
    assert floor.bandwidth(2.0) == 2 * (1 << 12) / 2.0
    # moving the copy's own bytes (read + written) takes exactly the copy's time
    assert floor.seconds_for(2 * (1 << 12), 0.25) == pytest.approx(0.25)


def test_the_kda_decode_floor_is_the_state_read_and_written():
    state = _decode_inputs(1)[-1]
    assert state.shape == (1, 96, 128, 128) and state.dtype == np.float32
    assert decode_floor_bytes(state) == 2 * 96 * 128 * 128 * F32 == 12_582_912
    assert decode_floor_bytes(_decode_inputs(8, H=2)[-1]) == 8 * decode_floor_bytes(_decode_inputs(1, H=2)[-1])


def test_the_expert_floor_is_its_packed_bytes():
    # K3's expert: 3 matrices of 3072 x 3584 codes, half a byte each, plus a scale byte per 32 codes
    assert expert_floor_bytes(K3_EXPERT) == 3 * (3072 * 3584 // 2 + 3072 * 3584 // 32) == 17_547_264
    weights = _expert_weights(K3_EXPERT, np.random.default_rng(0))
    assert expert_floor_bytes(K3_EXPERT) == sum(a.nbytes for a in weights.values())


def _tiny():
    cfg = K3Config.preset("tiny")
    return cfg, types.SimpleNamespace(cfg=cfg)


def test_the_decode_floor_grows_by_one_cache_row_per_mla_layer_and_token():
    cfg, model = _tiny()
    row = cfg.mla_config().cache_width * F32
    assert decode_bytes(model, 17) - decode_bytes(model, 16) == len(cfg.mla_layers) * row


def test_the_decode_floor_is_what_the_weights_hold_for_one_token():
    """Counted from the arrays of a synthetic checkpoint instead of the inventory: every non-expert weight as
    float32 (the embedding one row), the selected experts' bytes as stored, the KDA state read and written."""
    cfg, model = _tiny()
    weights = synthetic_weights(cfg, 0)
    dense = sum(cfg.hidden_size * F32 if name.endswith("embed_tokens.weight") else a.size * F32
                for name, a in weights.items() if not is_routed_expert(name))
    expert = sum(a.nbytes for name, a in weights.items() if ".layers.1.block_sparse_moe.experts.0." in name)
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    kda = cfg.kda_config()
    state = len(cfg.kda_layers) * 2 * kda.num_heads * kda.head_dim ** 2 * F32
    assert expert > 0 and dense > 0
    assert decode_bytes(model, 0) == dense + moe_layers * cfg.num_experts_per_tok * expert + state


def test_the_short_pass_leaves_out_only_benchmark_files_that_exist():
    """A renamed benchmark file would otherwise join the short pass unnoticed (and a stale name hide nothing)."""
    here = Path(__file__).resolve().parent
    assert QUICK_LEFT_OUT and all((here / name).is_file() for name in QUICK_LEFT_OUT), sorted(QUICK_LEFT_OUT)
