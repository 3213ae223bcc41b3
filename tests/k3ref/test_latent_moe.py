"""k3ref.latent_moe: config checks, the DeepSeek-V3 sigmoid router, the expert mix, and the whole layer
against a dense, written-out float64 loop."""
from __future__ import annotations

import math
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3ref import latent_moe as lm
from k3ref import mxfp4
from k3ref.cores import reference_cores
from k3ref.mxfp4 import dequantize
from tests.support.tolerances import elem, rel_rms, tol


def _cfg(**over) -> lm.LatentMoeConfig:
    base = dict(hidden_size=19, num_experts=6, top_k=2, latent_size=64, moe_intermediate_size=32,
                n_shared_experts=2, shared_intermediate_size=5)
    return lm.LatentMoeConfig(**{**base, **over})


# ---- an independent router: per token, plain Python, sorted by (-score, index) --------------------------

def _route_reference(logits_row, bias, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
    s = [1.0 / (1.0 + math.exp(-v)) for v in logits_row]
    choice = [si + b for si, b in zip(s, bias, strict=True)]
    E = len(s)
    allowed = range(E)
    if n_group > 1:
        size = E // n_group
        gscore = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
        allowed = [e for e in range(E) if e // size in kept]
    idx = sorted(allowed, key=lambda e: (-choice[e], e))[:top_k]
    w = [s[e] for e in idx]
    if renormalize:
        total = sum(w) + 1e-20
        w = [v / total for v in w]
    return [v * scaling for v in w], idx


@pytest.mark.parametrize("over, needle", [
    pytest.param(dict(top_k=7), "top_k", id="top-k-above-experts"),
    pytest.param(dict(n_group=4), "n_group", id="experts-not-divisible"),
    pytest.param(dict(n_group=2, topk_group=3), "topk_group", id="topk-group-above-groups"),
    pytest.param(dict(n_group=3, topk_group=1, top_k=3), "top_k", id="top-k-above-kept-experts"),
    pytest.param(dict(latent_size=40), "latent_size", id="latent-not-32k"),
    pytest.param(dict(moe_intermediate_size=48), "moe_intermediate_size", id="intermediate-not-32k"),
    pytest.param(dict(hidden_size=0), "hidden_size", id="hidden-zero"),
])
def test_config_validation(over, needle):
    with pytest.raises(ValueError, match=needle):
        _cfg(**over)


def test_bias_selects_but_does_not_weigh():
    logits = np.array([[2.0, 1.0, 0.0]])
    s = [1 / (1 + math.exp(-v)) for v in (2.0, 1.0, 0.0)]
    w, idx = lm.sigmoid_topk(logits, np.zeros(3), 2)
    assert idx.tolist() == [[0, 1]] and idx.dtype == np.int64
    w, idx = lm.sigmoid_topk(logits, np.array([0.0, 0.0, 0.9]), 2)     # the bias lifts expert 2 to first
    assert idx.tolist() == [[2, 0]]
    assert np.allclose(w, [[s[2] / (s[2] + s[0]), s[0] / (s[2] + s[0])]], **elem("fp64_one_division"))
    w, _ = lm.sigmoid_topk(logits, np.array([0.0, 0.0, 0.9]), 2, renormalize=False, scaling=2.5)
    assert np.allclose(w, [[2.5 * s[2], 2.5 * s[0]]], **elem("fp64_one_division"))


def test_ties_go_to_the_lower_index():
    _, idx = lm.sigmoid_topk(np.zeros((1, 6)), np.zeros(6), 4)
    assert idx.tolist() == [[0, 1, 2, 3]]


def _logit(p):
    return math.log(p / (1 - p))


@pytest.mark.parametrize("topk_group, want", [
    pytest.param(2, [2, 3], id="keep-2-groups"),   # groups 1, 2 win (1.2, 1.1): the 0.9 expert of group 0 is out
    pytest.param(3, [0, 2], id="keep-3-groups"),   # group 0 (1.0) is kept too
    pytest.param(4, [0, 2], id="keep-all-groups"),
])
def test_groups_hand_built(topk_group, want):
    # s per expert, 4 groups of 2: [0.9, 0.1 | 0.6, 0.6 | 0.55, 0.55 | 0.2, 0.2]
    p = [0.9, 0.1, 0.6, 0.6, 0.55, 0.55, 0.2, 0.2]
    logits = np.array([[_logit(v) for v in p]])
    _, idx = lm.sigmoid_topk(logits, np.zeros(8), 2, n_group=4, topk_group=topk_group)
    assert idx.tolist() == [want]


@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([(8, 3, 1, 1), (8, 3, 4, 2), (12, 4, 3, 2), (9, 2, 3, 1)]))
def test_router_matches_reference(seed, shape):
    E, k, n_group, topk_group = shape
    r = np.random.default_rng(seed)
    logits, bias = r.standard_normal((3, E)), 0.2 * r.standard_normal(E)
    w, idx = lm.sigmoid_topk(logits, bias, k, n_group=n_group, topk_group=topk_group, scaling=1.5)
    for t in range(3):
        w_ref, idx_ref = _route_reference(logits[t], bias, k, n_group, topk_group, scaling=1.5)
        assert idx[t].tolist() == idx_ref
        assert np.allclose(w[t], w_ref, **elem("fp64_few_ops"))


def test_router_float32_stays_float32(rng):
    w, idx = lm.sigmoid_topk(rng.standard_normal((2, 8)).astype(np.float32), np.zeros(8, np.float32), 3)
    assert w.dtype == np.float32 and idx.dtype == np.int64


@pytest.mark.parametrize("call, needle", [
    pytest.param(lambda: lm.sigmoid_topk(np.zeros(8), np.zeros(8), 2), "logits", id="logits-rank"),
    pytest.param(lambda: lm.sigmoid_topk(np.zeros((2, 8)), np.zeros(7), 2), "bias", id="bias-width"),
    pytest.param(lambda: lm.sigmoid_topk(np.zeros((2, 8)), np.zeros(8), 9), "top_k", id="top-k"),
    pytest.param(lambda: lm.sigmoid_topk(np.zeros((2, 8)), np.zeros(8), 2, n_group=3), "n_group", id="groups"),
    pytest.param(lambda: lm.sigmoid_topk(np.zeros((2, 8)), np.zeros(8), 2, n_group=0), "n_group", id="groups-0"),
])
def test_router_rejects_bad_input(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


# ---- the expert mix: grouped by expert (module) vs per token and slot (here) ----------------------------

def _mix_loop(z, weights, indices, expert_fn):
    y = np.zeros_like(z)
    for t in range(z.shape[0]):
        for j in range(indices.shape[1]):
            y[t] += weights[t, j] * expert_fn(int(indices[t, j]), z[t:t + 1])[0]
    return y


def test_mix_matches_per_token_loop(rng):
    T, Dl, E, k = 7, 5, 6, 3
    M = rng.standard_normal((E, Dl, Dl))
    z = rng.standard_normal((T, Dl))
    indices = np.array([rng.choice(E - 1, size=k, replace=False) for _ in range(T)])  # expert 5 never chosen
    weights = rng.uniform(0.1, 1, size=(T, k))
    calls = []

    def expert(e, rows):
        calls.append(e)
        return np.tanh(rows @ M[e]) * (e + 1)

    got = lm.mix_routed_experts(z, weights, indices, expert)
    assert sorted(calls) == sorted(set(indices.ravel().tolist())) and 5 not in calls
    assert rel_rms(got, _mix_loop(z, weights, indices, lambda e, r: np.tanh(r @ M[e]) * (e + 1))) \
        <= tol("fp64_same_math")


# ---- the whole layer against a dense written-out loop -----------------------------------------------------

def _rmsnorm_loop(v, w, eps):
    return w * v / math.sqrt(sum(c * c for c in v) / len(v) + eps)


def _situ_glu_loop(g, u, beta, lin):
    return np.array([beta * math.tanh(a / beta) / (1 + math.exp(-a)) * lin * math.tanh(b / lin)
                     for a, b in zip(g, u, strict=True)])


def _forward_dense(weights, x, cfg):
    """Every expert dequantised up front and applied densely; routing by `_route_reference`; per token."""
    f64 = {n: np.asarray(v, np.float64) for n, v in weights.items() if "experts." not in n or "shared" in n}
    W = {(e, p): dequantize(weights[f"experts.{e}.{p}.weight_packed"], weights[f"experts.{e}.{p}.weight_scale"])
         .astype(np.float64) for e in range(cfg.num_experts) for p in ("w1", "w2", "w3")}
    y = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = [float(np.dot(f64["gate.weight"][e], row)) for e in range(cfg.num_experts)]
        w, idx = _route_reference(logits, f64["gate.e_score_correction_bias"], cfg.top_k, cfg.n_group,
                                  cfg.topk_group, cfg.renormalize, cfg.routed_scaling_factor)
        z = f64["routed_expert_down_proj.weight"] @ row
        y_lat = np.zeros(cfg.latent_size)
        for wk, e in zip(w, idx, strict=True):
            h = _situ_glu_loop(W[e, "w1"] @ z, W[e, "w3"] @ z, cfg.situ_beta, cfg.linear_beta)
            y_lat += wk * (W[e, "w2"] @ h)
        if cfg.use_norm:
            y_lat = _rmsnorm_loop(y_lat, f64["routed_expert_norm.weight"], cfg.norm_eps)
        y[t] = f64["routed_expert_up_proj.weight"] @ y_lat
        if cfg.n_shared_experts:
            h = _situ_glu_loop(f64["shared_experts.gate_proj.weight"] @ row, f64["shared_experts.up_proj.weight"] @ row,
                               cfg.situ_beta, cfg.linear_beta)
            y[t] += f64["shared_experts.down_proj.weight"] @ h
    return y


FORWARD_CASES = [
    pytest.param(dict(), 5, id="D19-E6-k2-T5"),
    pytest.param(dict(num_experts=8, top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, use_norm=False,
                      latent_size=32, moe_intermediate_size=64, n_shared_experts=1), 3, id="grouped-nonorm-T3"),
    pytest.param(dict(num_experts=4, top_k=1, n_shared_experts=0, renormalize=False), 4, id="k1-noshared-T4"),
]


@pytest.mark.parametrize("over, T", FORWARD_CASES)
def test_forward_matches_dense_loop(over, T):
    cfg = _cfg(**over)
    r = np.random.default_rng(T)
    weights = lm.random_moe_weights(cfg, r, np.float64)
    x = r.standard_normal((T, cfg.hidden_size))
    y = lm.latent_moe_forward(weights, x, cfg)
    assert y.shape == x.shape and y.dtype == np.float64
    assert rel_rms(y, _forward_dense(weights, x, cfg)) <= tol("fp64_same_math")


def test_random_weights_bias_changes_the_selection():
    cfg = _cfg(num_experts=16, top_k=4)
    r = np.random.default_rng(7)
    weights = lm.random_moe_weights(cfg, r, np.float64)
    logits = r.standard_normal((32, cfg.hidden_size)) @ weights["gate.weight"].T
    bias = weights["gate.e_score_correction_bias"]
    assert bias.dtype == np.float32 and np.abs(bias).min() > 0
    _, with_bias = lm.sigmoid_topk(logits, bias, 4)
    _, without = lm.sigmoid_topk(logits, np.zeros_like(bias), 4)
    assert (np.sort(with_bias, axis=1) != np.sort(without, axis=1)).any()


class RecordingMapping(Mapping):
    """A weight Mapping that records every key read (as a lazy checkpoint view would)."""

    def __init__(self, data):
        self.data, self.read = data, set()

    def __getitem__(self, key):
        self.read.add(key)
        return self.data[key]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def test_forward_reads_only_selected_experts():
    cfg = _cfg(num_experts=12, top_k=2)
    r = np.random.default_rng(11)
    weights = RecordingMapping(lm.random_moe_weights(cfg, r, np.float64))
    x = r.standard_normal((2, cfg.hidden_size))
    lm.latent_moe_forward(weights, x, cfg)
    logits = x @ weights.data["gate.weight"].T
    _, idx = lm.sigmoid_topk(logits, weights.data["gate.e_score_correction_bias"], cfg.top_k)
    read_experts = {int(k.split(".")[1]) for k in weights.read if k.startswith("experts.")}
    assert read_experts == set(idx.ravel().tolist())
    assert len(read_experts) <= 4 < cfg.num_experts
    assert all(f"experts.{e}.{p}.{s}" in weights.read for e in read_experts for p in ("w1", "w2", "w3")
               for s in ("weight_packed", "weight_scale"))


def test_forward_float32_tracks_float64(rng):
    cfg = _cfg()
    weights = lm.random_moe_weights(cfg, rng, np.float64)
    x = rng.standard_normal((6, cfg.hidden_size))
    y64 = lm.latent_moe_forward(weights, x, cfg)
    w32 = {n: (v.astype(np.float32) if v.dtype == np.float64 else v) for n, v in weights.items()}
    y32 = lm.latent_moe_forward(w32, x.astype(np.float32), cfg)
    assert y32.dtype == np.float32
    assert rel_rms(y32, y64) <= tol("fp32_vs_fp64")


def test_random_weights_bf16_runs_in_float32():
    cfg = _cfg()
    r = np.random.default_rng(5)
    weights = lm.random_moe_weights(cfg, r, ml_dtypes.bfloat16)
    assert weights["gate.weight"].dtype == ml_dtypes.bfloat16
    assert weights["experts.0.w2.weight_packed"].shape == (cfg.latent_size, cfg.moe_intermediate_size // 2)
    # shared_intermediate_size is the width of the one fused shared MLP (K3: 2 x 3072), not per expert
    assert weights["shared_experts.up_proj.weight"].shape == (cfg.shared_intermediate_size, cfg.hidden_size)
    y = lm.latent_moe_forward(weights, r.standard_normal((2, cfg.hidden_size)).astype(ml_dtypes.bfloat16), cfg)
    assert y.dtype == np.float32 and np.isfinite(y).all()


@pytest.mark.parametrize("mutate, needle", [
    pytest.param(lambda w, x: (w, x[:, :-1]), "x", id="x-width"),
    pytest.param(lambda w, x: ({k: v for k, v in w.items() if k != "experts.0.w1.weight_scale"}, x),
                 "experts.0.w1.weight_scale", id="missing-expert-tensor"),
    pytest.param(lambda w, x: ({**w, "gate.weight": w["gate.weight"][:-1]}, x), "gate.weight", id="gate-rows"),
    pytest.param(lambda w, x: ({**w, "routed_expert_norm.weight": w["routed_expert_norm.weight"][:-1]}, x),
                 "routed_expert_norm.weight", id="norm-width"),
])
def test_forward_rejects_bad_input(mutate, needle):
    cfg = _cfg(num_experts=2, top_k=2)
    r = np.random.default_rng(1)
    weights, x = mutate(lm.random_moe_weights(cfg, r, np.float64), r.standard_normal((2, cfg.hidden_size)))
    with pytest.raises(ValueError, match=needle):
        lm.latent_moe_forward(weights, x, cfg)


def test_mix_rejects_a_repeated_expert_in_a_row():
    """The mix adds each expert's rows with a fancy-index +=, which needs distinct experts per token."""
    z, weights = np.ones((2, 4)), np.ones((2, 2))
    with pytest.raises(ValueError, match=r"distinct experts per token, found a repeat in row 1: \[3, 3\]"):
        lm.mix_routed_experts(z, weights, np.array([[1, 3], [3, 3]]), lambda e, rows: rows)


@pytest.mark.parametrize("T", [pytest.param(1, id="T1-experts-dequantised-together"), pytest.param(4, id="T4")])
def test_checked_once_experts_equal_the_swapped_core_path(T):
    """The reference core's checked-once gemv (for one token: every expert's w1, w3, w2 dequantised together)
    gives exactly what a swapped-in gemv (called per matrix, every call checked) gives; the swapped core sees
    all 3 matrices of every selected expert."""
    cfg = _cfg(num_experts=8, top_k=3)
    r = np.random.default_rng(5)
    weights = lm.random_moe_weights(cfg, r, np.float64)
    x = r.standard_normal((T, cfg.hidden_size))
    calls = []

    def gemv(packed, scale, x):
        calls.append(packed.shape)
        return mxfp4.mxfp4_gemv(packed, scale, x)

    fast = lm.latent_moe_forward(weights, x, cfg)
    swapped = lm.latent_moe_forward(weights, x, cfg, cores=reference_cores().replace(mxfp4_gemv=gemv))
    _, idx = lm.sigmoid_topk(x @ weights["gate.weight"].T, weights["gate.e_score_correction_bias"], cfg.top_k)
    assert len(calls) == 3 * len(np.unique(idx))
    assert np.array_equal(fast, swapped)


def test_a_non_finite_expert_output_is_named():
    """A NaN scale byte (E8M0 255) in a selected expert: the layer names that expert, not a later step."""
    cfg = _cfg(num_experts=4, top_k=4)
    r = np.random.default_rng(6)
    weights = lm.random_moe_weights(cfg, r, np.float64)
    weights["experts.2.w2.weight_scale"] = weights["experts.2.w2.weight_scale"].copy()
    weights["experts.2.w2.weight_scale"][0, 0] = 255
    with pytest.raises(ValueError, match="routed expert 2 output: expected finite values"):
        lm.latent_moe_forward(weights, r.standard_normal((1, cfg.hidden_size)), cfg)
