"""Tests of k3ref.kda: two forms of the recurrence against each other, the layer's decode against its
prefill, hand-computed values for the constants (L2 eps, gate lower bound), properties, bad input."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from k3ref import ops
from k3ref.cores import Cores
from k3ref.fast import kda as kda_fast
from k3ref.kda import (
    KDA_L2_EPS,
    KdaConfig,
    KdaState,
    kda_chunked,
    kda_decode_core,
    kda_decode_token,
    kda_gate,
    kda_prefill,
    kda_prefill_core,
    kda_recurrent,
    l2norm,
    random_kda_weights,
    short_conv,
)
from tests.support.tolerances import elem, rel_rms, tol

# Rows this file adds to the tolerance table (relative RMS), with the reason for each number.
KDA_TOL: dict[str, tuple[float, str]] = {
    "fp32_lower_bound_chunk": (1e-5, "float32 chunked over 2 chunks at cumulative log-decay -320 each vs float64 "
                                     "recurrent: ~1e-7 per op; the state only remembers the last ~10 tokens"),
}


def ktol(name: str) -> float:
    return KDA_TOL[name][0]


# ----------------------------------------------------------------------------------------------- helpers

def _unused_core(*args, **kwargs):
    raise AssertionError("a KDA layer called a core it does not need")


def _kda_cores(**swaps) -> Cores:
    """Reference cores for what a KDA layer uses (rmsnorm, kda_decode, kda_prefill); the rest must not be called."""
    cores = Cores(rmsnorm=ops.rmsnorm, situ_glu=_unused_core, kda_decode=kda_decode_core,
                  kda_prefill=kda_prefill_core, mla_decode=_unused_core, mxfp4_gemv=_unused_core,
                  moe_route=_unused_core, attnres_mix=_unused_core, attnres_hub=_unused_core)
    return cores.replace(**swaps)


@dataclasses.dataclass(frozen=True)
class RecCase:
    B: int                     # batch
    T: int                     # tokens
    H: int                     # heads
    K: int                     # key dim
    V: int                     # value dim
    init: bool = False         # start from a random state (else zeros)
    l2: bool = False           # use_qk_l2norm (else q, k are pre-normalised so the delta rule stays contractive)
    lower_bound: float | None = -5.0   # gate form: sigmoid with lower bound, or None (softplus)
    chunk: int = 64            # chunk size of kda_chunked


def _rec_inputs(case: RecCase, rng: np.random.Generator, dtype=np.float64):
    """q, k, v, g, beta, initial_state for one case (gates from kda_gate, as the cores make them)."""
    B, T, H, K, V = case.B, case.T, case.H, case.K, case.V
    q, k = rng.standard_normal((2, B, T, H, K))
    if not case.l2:
        q, k = l2norm(q), l2norm(k)
    v = rng.standard_normal((B, T, H, V))
    g = kda_gate(2.0 * rng.standard_normal((B, T, H, K)), np.log(rng.uniform(1.0, 16.0, H)),
                 rng.uniform(-1.0, 1.0, H * K), case.lower_bound)
    beta = rng.uniform(0.05, 1.0, (B, T, H))
    S0 = rng.standard_normal((B, H, K, V)) if case.init else None
    return tuple(None if a is None else a.astype(dtype) for a in (q, k, v, g, beta, S0))


# ----------------------------------------------------------------------------------------------- chunked == recurrent

@pytest.mark.parametrize("case", [
    pytest.param(RecCase(1, 1, 2, 8, 8), id="B1-T1-H2-K8-V8"),
    pytest.param(RecCase(2, 63, 3, 16, 24, init=True), id="B2-T63-H3-K16-V24-init"),
    pytest.param(RecCase(2, 64, 2, 16, 16, l2=True), id="B2-T64-H2-K16-V16-l2"),
    pytest.param(RecCase(1, 65, 2, 16, 8, init=True, l2=True, lower_bound=None),
                 id="B1-T65-H2-K16-V8-init-l2-softplus"),
    pytest.param(RecCase(2, 200, 2, 16, 16, init=True, l2=True), id="B2-T200-H2-K16-V16-init-l2"),
    pytest.param(RecCase(1, 200, 1, 32, 16, lower_bound=None), id="B1-T200-H1-K32-V16-softplus"),
    pytest.param(RecCase(1, 70, 2, 8, 8, init=True, chunk=16), id="B1-T70-H2-K8-V8-init-C16"),
    pytest.param(RecCase(1, 50, 2, 8, 8, init=True, l2=True, chunk=13), id="B1-T50-H2-K8-V8-init-l2-C13"),
    pytest.param(RecCase(1, 33, 1, 4, 4, chunk=3), id="B1-T33-H1-K4-V4-C3"),
])
def test_chunked_matches_recurrent_fp64(case, rng):
    q, k, v, g, beta, S0 = _rec_inputs(case, rng)
    o_r, S_r = kda_recurrent(q, k, v, g, beta, initial_state=S0, use_qk_l2norm=case.l2)
    o_c, S_c = kda_chunked(q, k, v, g, beta, initial_state=S0, use_qk_l2norm=case.l2, chunk_size=case.chunk)
    assert o_c.shape == (case.B, case.T, case.H, case.V) and S_c.shape == (case.B, case.H, case.K, case.V)
    assert np.all(np.isfinite(o_c)) and np.all(np.isfinite(o_r))
    assert rel_rms(o_c, o_r) <= tol("fp64_long_recurrence")
    assert rel_rms(S_c, S_r) <= tol("fp64_long_recurrence")


@pytest.mark.parametrize("gate", [
    pytest.param(0.0, id="no-decay"),
    pytest.param(-1e4, id="full-forget"),
])
def test_chunked_matches_recurrent_at_extreme_gates(gate, rng):
    case = RecCase(1, 80, 2, 8, 8, init=True)
    q, k, v, _, beta, S0 = _rec_inputs(case, rng)
    g = np.full_like(q, gate)
    o_r, S_r = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    o_c, S_c = kda_chunked(q, k, v, g, beta, initial_state=S0)
    assert rel_rms(o_c, o_r) <= tol("fp64_long_recurrence")
    assert rel_rms(S_c, S_r) <= tol("fp64_long_recurrence")


def test_full_forget_leaves_only_the_current_token(rng):
    """exp(g) = 0: the state is beta k v^T of the last token and o_t = beta_t (k_t . scale q_t) v_t."""
    case = RecCase(2, 70, 2, 8, 8, init=True)
    q, k, v, _, beta, S0 = _rec_inputs(case, rng)
    g = np.full_like(q, -1e4)
    for fn in (kda_recurrent, kda_chunked):
        o, S = fn(q, k, v, g, beta, initial_state=S0)
        expect_o = (beta * np.sum(k * q, axis=-1) * 8 ** -0.5)[..., None] * v
        expect_S = beta[:, -1, :, None, None] * k[:, -1, :, :, None] * v[:, -1, :, None, :]
        assert rel_rms(o, expect_o) <= tol("fp64_same_math"), fn.__name__
        assert rel_rms(S, expect_S) <= tol("fp64_same_math"), fn.__name__


def test_float32_chunked_at_lower_bound_for_whole_chunks(rng):
    """Every gate at -5 for 2 whole chunks: cumulative log-decay -320 per chunk, where exp(-cumsum g) is inf."""
    case = RecCase(1, 128, 2, 64, 64, init=True, l2=True)
    q, k, v, _, beta, S0 = _rec_inputs(case, rng)
    g = np.full_like(q, -5.0)
    with np.errstate(over="ignore"):
        naive = np.exp(-np.cumsum(g[:, :64].astype(np.float32), axis=1))
    assert not np.all(np.isfinite(naive)), "the case must be one where the naive chunked form overflows in float32"
    o64, S64 = kda_recurrent(q, k, v, g, beta, initial_state=S0, use_qk_l2norm=True)
    f32 = [a.astype(np.float32) for a in (q, k, v, g, beta, S0)]
    o32, S32 = kda_chunked(*f32[:5], initial_state=f32[5], use_qk_l2norm=True)
    assert o32.dtype == np.float32 and S32.dtype == np.float32
    assert np.all(np.isfinite(o32)) and np.all(np.isfinite(S32))
    assert rel_rms(o32, o64) <= ktol("fp32_lower_bound_chunk")
    assert rel_rms(S32, S64) <= ktol("fp32_lower_bound_chunk")


def test_one_recurrent_step_by_hand():
    """One step from a given state, written with scalar loops: S' = e^g S; S = S' + beta k (v - S'^T k)^T;
    o = S^T q s."""
    rng = np.random.default_rng(7)
    K, V = 2, 3
    q, k, g = rng.standard_normal((3, K))
    v, S0, beta, scale = rng.standard_normal(V), rng.standard_normal((K, V)), 0.7, 0.9
    Sd = [[math.exp(g[i]) * S0[i][j] for j in range(V)] for i in range(K)]
    u = [beta * (v[j] - sum(Sd[i][j] * k[i] for i in range(K))) for j in range(V)]
    S1 = [[Sd[i][j] + k[i] * u[j] for j in range(V)] for i in range(K)]
    o = [sum(S1[i][j] * scale * q[i] for i in range(K)) for j in range(V)]
    for fn in (kda_recurrent, kda_chunked):
        o_f, S_f = fn(q[None, None, None], k[None, None, None], v[None, None, None], g[None, None, None],
                      np.full((1, 1, 1), beta), scale=scale, initial_state=S0[None, None])
        np.testing.assert_allclose(o_f[0, 0, 0], o, **elem("fp64_hand_loops"), err_msg=fn.__name__)
        np.testing.assert_allclose(S_f[0, 0], S1, **elem("fp64_hand_loops"), err_msg=fn.__name__)


def test_zero_state_zero_values_stay_zero(rng):
    case = RecCase(2, 70, 2, 8, 8)
    q, k, v, g, beta, _ = _rec_inputs(case, rng)
    for fn in (kda_recurrent, kda_chunked):
        o, S = fn(q, k, np.zeros_like(v), g, beta)
        assert np.all(o == 0) and np.all(S == 0), fn.__name__


@pytest.mark.parametrize("lower_bound", [pytest.param(-5.0, id="lb5"), pytest.param(None, id="softplus")])
def test_prefill_core_equals_decode_core_steps(lower_bound, rng, monkeypatch):
    """The two cores over 70 tokens and 19 heads (blocks of 5 (sequence, head) rows in the decode core, the last
    one short)."""
    B, T, H, K, V = 2, 70, 19, 8, 6
    monkeypatch.setattr(kda_fast, "DECODE_BLOCK_BYTES", 5 * K * V * 8)
    assert (B * H) % 5
    q, k, g_raw = 2.0 * rng.standard_normal((3, B, T, H, K))
    v, beta_raw = rng.standard_normal((B, T, H, V)), rng.standard_normal((B, T, H))
    A_log, dt_bias = np.log(rng.uniform(1.0, 16.0, H)), rng.uniform(-1.0, 1.0, H * K)
    state0 = rng.standard_normal((B, H, K, V))
    o_p, S_p = kda_prefill_core(q, k, v, g_raw, beta_raw, A_log, dt_bias, state0, lower_bound=lower_bound)
    S, outs = state0, []
    for t in range(T):
        o_t, S = kda_decode_core(q[:, t], k[:, t], v[:, t], g_raw[:, t], beta_raw[:, t], A_log, dt_bias, S,
                                 lower_bound=lower_bound)
        outs.append(o_t)
    assert rel_rms(np.stack(outs, axis=1), o_p) <= tol("fp64_long_recurrence")
    assert rel_rms(S, S_p) <= tol("fp64_long_recurrence")


# ----------------------------------------------------------------------------------------------- constants

def test_l2_eps_is_1e6_inside_the_sqrt():
    x = np.array([3e-4, 4e-4])                                # |x|^2 = 2.5e-7, comparable to eps
    assert KDA_L2_EPS == 1e-6
    np.testing.assert_allclose(l2norm(x), x / math.sqrt(2.5e-7 + 1e-6), **elem("fp64_few_ops"))


def test_decode_core_uses_the_l2_eps_and_default_scale():
    """From a zero state one step gives o = beta (k^ . q^) v with k^ = k / sqrt(|k|^2 + 1e-6), q^ likewise * K^-1/2."""
    K, V = 2, 3
    q, k = np.array([3e-4, -4e-4]), np.array([1e-4, 2e-4])
    v = np.array([1.0, -2.0, 0.5])
    o, S = kda_decode_core(q[None, None], k[None, None], v[None, None], np.zeros((1, 1, K)), np.zeros((1, 1)),
                           np.zeros(1), np.zeros(K), np.zeros((1, 1, K, V)))
    kh = k / math.sqrt(1e-8 + 4e-8 + 1e-6)
    qh = q / math.sqrt(9e-8 + 16e-8 + 1e-6) / math.sqrt(K)
    np.testing.assert_allclose(o[0, 0], 0.5 * float(kh @ qh) * v, **elem("fp64_hand_loops"))
    np.testing.assert_allclose(S[0, 0], 0.5 * np.outer(kh, v), **elem("fp64_hand_loops"))


@pytest.mark.parametrize("dtype, want", [pytest.param(np.longdouble, np.float64, id="longdouble-to-f64"),
                                         pytest.param(np.dtype(">f8"), np.float64, id="big-endian-f64-kept-wide"),
                                         pytest.param(np.float16, np.float32, id="f16-to-f32"),
                                         pytest.param(np.float32, np.float32, id="f32-kept")])
def test_l2norm_computes_in_float32_or_wider(dtype, want):
    """Inputs are never narrowed below float64 when they are wider than float32 (as_float's promotion rule)."""
    assert l2norm(np.array([3.0, 4.0], dtype)).dtype == want


def test_gate_lower_bound_is_minus_5():
    assert KdaConfig(num_heads=2, head_dim=4).gate_lower_bound == -5.0
    g = kda_gate(np.full((1, 2, 3), 1e3), np.zeros(2), np.zeros(6))           # sigma -> 1: g = lower bound
    assert np.all(g == -5.0)
    state = np.random.default_rng(3).standard_normal((1, 2, 3, 4))
    # k = 0 writes nothing, so the core only decays the state, by exp(lower bound) at a saturated gate.
    _, new = kda_decode_core(np.ones((1, 2, 3)), np.zeros((1, 2, 3)), np.ones((1, 2, 4)), np.full((1, 2, 3), 1e3),
                             np.zeros((1, 2)), np.zeros(2), np.zeros(6), state)
    np.testing.assert_allclose(new, math.exp(-5.0) * state, **elem("fp64_few_ops"))


@pytest.mark.parametrize("lower_bound", [pytest.param(-5.0, id="lb5"), pytest.param(-2.5, id="lb2.5"),
                                         pytest.param(None, id="softplus")])
def test_gate_by_hand(lower_bound):
    """One element per form, with math's exp/log: lb * sigma(e^A (x + b)) or -e^A log(1 + e^(x + b))."""
    g_raw = np.array([[[0.3, -1.2], [2.0, 0.1]]])            # [1, H=2, K=2]
    A_log, dt_bias = np.array([0.5, 1.5]), np.array([0.1, -0.4, 0.2, 0.0])
    g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
    h, c = 1, 0
    z = float(g_raw[0, h, c] + dt_bias[h * 2 + c])
    a = math.exp(A_log[h])
    want = (-a * math.log1p(math.exp(z)) if lower_bound is None else lower_bound / (1.0 + math.exp(-a * z)))
    assert g[0, h, c] == pytest.approx(want, rel=elem("fp64_few_ops")["rtol"])


# ----------------------------------------------------------------------------------------------- properties

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@given(x=arrays(np.float64, st.integers(1, 8), elements=finite), c=st.floats(1e-3, 1e3))
def test_l2norm_is_scale_invariant_without_eps(x, c):
    if np.linalg.norm(x) < 1e-6:
        x = x + 1.0
    np.testing.assert_allclose(l2norm(c * x, eps=0.0), l2norm(x, eps=0.0), **elem("fp64_scale_invariance"))


@given(x=arrays(np.float64, st.integers(1, 8), elements=finite))
def test_l2norm_norm_is_below_one_with_eps_inside_the_sqrt(x):
    n = float(np.linalg.norm(l2norm(x)))
    s = float(np.sum(x * x))
    assert n < 1.0
    assert n == pytest.approx(math.sqrt(s) / math.sqrt(s + KDA_L2_EPS), rel=elem("fp64_norm_factor")["rtol"],
                               abs=elem("fp64_norm_factor")["atol"])


@given(g_raw=arrays(np.float64, (3, 2, 4), elements=st.floats(-1, 1)),
       A_log=arrays(np.float64, 2, elements=st.floats(0, math.log(16))),
       dt_bias=arrays(np.float64, 8, elements=st.floats(-0.5, 0.5)))
def test_decay_stays_inside_e_minus_5_and_1(g_raw, A_log, dt_bias):
    decay = np.exp(kda_gate(g_raw, A_log, dt_bias))
    assert np.all(decay > math.exp(-5.0)) and np.all(decay < 1.0)


@given(g_raw=arrays(np.float64, (3, 2, 4), elements=st.floats(-30, 30)),
       A_log=arrays(np.float64, 2, elements=st.floats(-2, 3)))
def test_softplus_gate_is_negative(g_raw, A_log):
    assert np.all(kda_gate(g_raw, A_log, np.zeros(8), lower_bound=None) < 0.0)


# ----------------------------------------------------------------------------------------------- short conv

def test_short_conv_by_hand(rng):
    """y[b,t,c] = sum_j w[c,j] x[b,t-W+1+j,c], zero history, with scalar loops."""
    B, T, C, W = 2, 6, 3, 4
    x, w = rng.standard_normal((B, T, C)), rng.standard_normal((C, 1, W))
    y, state = short_conv(x, w)
    want = np.zeros((B, T, C))
    for b in range(B):
        for t in range(T):
            for c in range(C):
                want[b, t, c] = sum(w[c, 0, j] * x[b, t - W + 1 + j, c] for j in range(W) if t - W + 1 + j >= 0)
    np.testing.assert_allclose(y, want, **elem("fp64_conv_loops"))
    np.testing.assert_array_equal(state, x[:, -(W - 1):].transpose(0, 2, 1))    # last W-1 inputs, oldest first


@pytest.mark.parametrize("W", [pytest.param(4, id="W4"), pytest.param(3, id="W3"), pytest.param(1, id="W1")])
def test_short_conv_step_by_step_equals_full_sequence(W, rng):
    B, T, C = 2, 9, 5
    x, w = rng.standard_normal((B, T, C)), rng.standard_normal((C, W))
    y_full, s_full = short_conv(x, w[:, None, :])
    state, ys = None, []
    for t in range(T):
        y_t, state = short_conv(x[:, t:t + 1], w, state)
        ys.append(y_t)
    np.testing.assert_allclose(np.concatenate(ys, axis=1), y_full, **elem("fp64_split_sequence"))
    np.testing.assert_array_equal(state, s_full)
    y_a, s_a = short_conv(x[:, :2], w)                        # split 2 + 7 (a split shorter than W - 1)
    y_b, s_b = short_conv(x[:, 2:], w, s_a)
    np.testing.assert_allclose(np.concatenate([y_a, y_b], axis=1), y_full, **elem("fp64_split_sequence"))
    np.testing.assert_array_equal(s_b, s_full)


# ----------------------------------------------------------------------------------------------- the layer

@dataclasses.dataclass(frozen=True)
class LayerCase:
    cfg: KdaConfig             # layer geometry and gate form
    D: int                     # hidden size
    B: int                     # batch
    T: int                     # tokens in total
    split: int                 # tokens prefilled; the rest are decoded one at a time


LAYER_CASES = [
    pytest.param(LayerCase(KdaConfig(2, 8), 12, 2, 9, 4), id="H2-K8-D12-B2-T9-prefill4"),
    pytest.param(LayerCase(KdaConfig(2, 8), 12, 1, 70, 66), id="H2-K8-D12-B1-T70-prefill66"),
    pytest.param(LayerCase(KdaConfig(3, 4, gate_lower_bound=None, use_full_rank_gate=False), 10, 2, 7, 0),
                 id="H3-K4-D10-B2-T7-decode-only-softplus-lowrank"),
    pytest.param(LayerCase(KdaConfig(1, 8, conv_size=3), 9, 1, 6, 1), id="H1-K8-W3-D9-B1-T6-prefill1"),
]


def _layer_setup(case: LayerCase, rng):
    w = random_kda_weights(case.cfg, case.D, rng)
    X = rng.standard_normal((case.B, case.T, case.D))
    return w, X


def _assert_states_close(a: KdaState, b: KdaState, limit: float):
    for f in dataclasses.fields(KdaState):
        assert rel_rms(getattr(a, f.name), getattr(b, f.name)) <= limit, f.name


@pytest.mark.parametrize("case", LAYER_CASES)
def test_prefill_then_decode_equals_one_pass(case, rng):
    w, X = _layer_setup(case, rng)
    cores = _kda_cores()
    state0 = KdaState.zeros(case.cfg, case.B)
    Y_full, S_full = kda_prefill(w, X, state0, case.cfg, cores)
    state, ys = state0, []
    if case.split:
        Y_a, state = kda_prefill(w, X[:, :case.split], state0, case.cfg, cores)
        ys.append(Y_a)
    for t in range(case.split, case.T):
        y_t, state = kda_decode_token(w, X[:, t], state, case.cfg, cores)
        ys.append(y_t[:, None])
    assert rel_rms(np.concatenate(ys, axis=1), Y_full) <= tol("fp64_long_recurrence")
    _assert_states_close(state, S_full, tol("fp64_long_recurrence"))


def test_layer_one_token_by_hand(rng):
    """From a zero state, one token: conv = w[:, W-1] * proj, S = beta k^ v^T, o_h = beta (k^ . q^) v,
    y = W_o concat_h[RMSNorm(o_h) * sigma(G_h)] — head by head with explicit loops."""
    cfg, D = KdaConfig(2, 4), 6
    w, x = random_kda_weights(cfg, D, rng), rng.standard_normal(D)
    H, K, W = cfg.num_heads, cfg.head_dim, cfg.conv_size

    def silu(z):
        return z / (1.0 + np.exp(-z))

    conv = {n: silu(w[f"{n}_conv1d.weight"][:, 0, W - 1] * (w[f"{n}_proj.weight"] @ x)) for n in "qkv"}
    g_raw = w["f_b_proj.weight"] @ (w["f_a_proj.weight"] @ x)
    beta = 1.0 / (1.0 + np.exp(-(w["b_proj.weight"] @ x)))
    G = w["g_proj.weight"] @ x
    heads = []
    for h in range(H):
        hs = slice(h * K, (h + 1) * K)
        qh = conv["q"][hs] / np.sqrt(np.sum(conv["q"][hs] ** 2) + 1e-6) / np.sqrt(K)
        kh = conv["k"][hs] / np.sqrt(np.sum(conv["k"][hs] ** 2) + 1e-6)
        o = beta[h] * float(kh @ qh) * conv["v"][hs]
        o = w["o_norm.weight"] * o / np.sqrt(np.mean(o ** 2) + 1e-5)
        heads.append(o / (1.0 + np.exp(-G[hs])))
    want = w["o_proj.weight"] @ np.concatenate(heads)
    assert g_raw.shape == (H * K,)                             # the gate does not matter from a zero state
    y, _ = kda_decode_token(w, x[None], KdaState.zeros(cfg, 1), cfg, _kda_cores())
    np.testing.assert_allclose(y[0], want, **elem("fp64_hand_token"))


def test_layer_routes_through_cores_and_uses_first_H_of_A_log(rng):
    cfg, D = KdaConfig(2, 8), 12
    w, X = random_kda_weights(cfg, D, rng, a_log_len=5), rng.standard_normal((1, 5, D))
    calls = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)
        return wrapped

    cores = _kda_cores(kda_prefill=spy("kda_prefill", kda_prefill_core), kda_decode=spy("kda_decode", kda_decode_core))
    state = KdaState.zeros(cfg, 1)
    Y, state = kda_prefill(w, X[:, :4], state, cfg, cores)
    y, _ = kda_decode_token(w, X[:, 4], state, cfg, cores)
    assert calls == ["kda_prefill", "kda_decode"]
    padded = dict(w, A_log=np.concatenate([w["A_log"][:2], [99.0, -99.0, 7.0]]))   # padding must be ignored
    Y2, _ = kda_prefill(padded, X[:, :4], KdaState.zeros(cfg, 1), cfg, cores)
    np.testing.assert_array_equal(Y2, Y)


def _nan_output_core(fn):
    def core(*args, **kwargs):
        o, S = fn(*args, **kwargs)
        o = o.copy()
        o[0, -1] = np.nan                                            # one unwritten (poisoned) output row
        return o, S
    return core


@pytest.mark.parametrize("swap, call, match", [
    pytest.param({"kda_decode": lambda *a, **kw: (np.zeros((1, 2, 7)), a[7])}, "decode",
                 r"kda_decode core output: expected \[1, 2, 8\]", id="decode-o-shape"),
    pytest.param({"kda_prefill": lambda *a, **kw: (np.zeros((1, 5, 2, 8)), a[7][..., :4])}, "prefill",
                 r"kda_prefill core state: expected \[1, 2, 8, 8\]", id="prefill-S-shape"),
    pytest.param({"kda_decode": _nan_output_core(kda_decode_core)}, "decode",
                 r"kda_decode core output: expected finite values, found nan at index \(0, 1, 0\)", id="decode-o-nan"),
    pytest.param({"kda_prefill": _nan_output_core(kda_prefill_core)}, "prefill",
                 r"kda_prefill core output: expected finite values, found nan at index \(0, 4, 0, 0\)",
                 id="prefill-o-nan"),
])
def test_layer_names_a_bad_core_result(swap, call, match, rng):
    """A swapped-in core that returns a misshaped or NaN result is named, not reported as a later `x`."""
    cfg, D = KdaConfig(2, 8), 12
    w, X = random_kda_weights(cfg, D, rng), rng.standard_normal((1, 5, D))
    with pytest.raises(ValueError, match=match):
        if call == "decode":
            kda_decode_token(w, X[:, 0], KdaState.zeros(cfg, 1), cfg, _kda_cores(**swap))
        else:
            kda_prefill(w, X, KdaState.zeros(cfg, 1), cfg, _kda_cores(**swap))


def test_layer_default_cores(rng):
    cfg, D = KdaConfig(2, 8), 12
    w, X = random_kda_weights(cfg, D, rng), rng.standard_normal((1, 5, D))
    Y, S = kda_prefill(w, X, KdaState.zeros(cfg, 1), cfg)
    Y_ref, S_ref = kda_prefill(w, X, KdaState.zeros(cfg, 1), cfg, _kda_cores())
    np.testing.assert_array_equal(Y, Y_ref)
    np.testing.assert_array_equal(S.recurrent, S_ref.recurrent)


def test_cores_and_layer_do_not_mutate_inputs(rng):
    cfg, D = KdaConfig(2, 8), 12
    B, T, H, K = 2, 5, 2, 8
    w = random_kda_weights(cfg, D, rng)
    core_args = [rng.standard_normal(s) for s in ((B, T, H, K),) * 4 + ((B, T, H), (H,), (H * K,), (B, H, K, K))]
    layer_X = rng.standard_normal((B, T, D))
    state = KdaState.zeros(cfg, B)
    state.recurrent[...] = rng.standard_normal(state.recurrent.shape)
    state.conv_k[...] = rng.standard_normal(state.conv_k.shape)
    before = [a.copy() for a in core_args] + [layer_X.copy()] + [state.copy()] + [{n: a.copy() for n, a in w.items()}]
    kda_prefill_core(*core_args)
    kda_decode_core(*[a[:, 0] if a.ndim in (3, 4) and a.shape[1] == T else a for a in core_args])
    kda_prefill(w, layer_X, state, cfg, _kda_cores())
    kda_decode_token(w, layer_X[:, 0], state, cfg, _kda_cores())
    for a, b in zip(core_args + [layer_X], before, strict=False):   # before also holds the state and weights
        np.testing.assert_array_equal(a, b)
    for f in dataclasses.fields(KdaState):
        np.testing.assert_array_equal(getattr(state, f.name), getattr(before[-2], f.name))
    for n, a in w.items():
        np.testing.assert_array_equal(a, before[-1][n])


def test_config_accepts_numpy_float_eps():
    """Configs built from NumPy values (e.g. read back from an array) are as valid as from Python floats."""
    assert KdaConfig(2, 4, norm_eps=np.float32(1e-5), gate_lower_bound=np.float32(-5.0)).norm_eps == np.float32(1e-5)


def test_state_zeros_and_copy():
    cfg = KdaConfig(3, 4, conv_size=4)
    s = KdaState.zeros(cfg, 2, dtype=np.float32)
    assert s.conv_q.shape == s.conv_k.shape == s.conv_v.shape == (2, 12, 3)
    assert s.recurrent.shape == (2, 3, 4, 4) and s.recurrent.dtype == np.float32
    c = s.copy()
    c.recurrent[...] = 1.0
    assert np.all(s.recurrent == 0)


# ----------------------------------------------------------------------------------------------- bad input

def _rec(**over):
    """kda_recurrent / kda_chunked arguments for B=1, T=3, H=2, K=4, V=5 with some replaced."""
    rng = np.random.default_rng(0)
    args = dict(q=rng.standard_normal((1, 3, 2, 4)), k=rng.standard_normal((1, 3, 2, 4)),
                v=rng.standard_normal((1, 3, 2, 5)), g=-np.ones((1, 3, 2, 4)), beta=np.full((1, 3, 2), 0.5))
    args.update(over)
    return args


def _nan_v():
    v = np.zeros((1, 3, 2, 5))
    v[0, 1, 1, 2] = np.nan
    return v


BAD_RECURRENCE = [
    pytest.param(_rec(q=np.zeros((1, 3, 2))), "q: expected rank 4", id="q-rank"),
    pytest.param(_rec(k=np.zeros((1, 3, 2, 5))), "k: expected", id="k-K"),
    pytest.param(_rec(v=np.zeros((1, 4, 2, 5))), "v: expected", id="v-T"),
    pytest.param(_rec(g=np.zeros((1, 3, 2, 3))), "g: expected", id="g-K"),
    pytest.param(_rec(beta=np.zeros((1, 3, 3))), "beta: expected", id="beta-H"),
    pytest.param(_rec(initial_state=np.zeros((1, 2, 5, 4))), "initial_state: expected", id="state-KV-swapped"),
    pytest.param(_rec(q=np.zeros((1, 3, 2, 4), np.complex128)), "q: expected a real floating", id="q-complex"),
    pytest.param(_rec(beta=np.full((1, 3, 2), "x")), "beta: expected a real floating", id="beta-str"),
    pytest.param(_rec(v=_nan_v()), r"v: expected finite values, found nan at index \(0, 1, 1, 2\)", id="v-nan"),
    pytest.param(_rec(scale=float("inf")), "scale", id="scale-inf"),
]


@pytest.mark.parametrize("fn", [pytest.param(kda_recurrent, id="recurrent"), pytest.param(kda_chunked, id="chunked")])
@pytest.mark.parametrize("args, match", BAD_RECURRENCE)
def test_recurrence_rejects_bad_input(fn, args, match):
    with pytest.raises(ValueError, match=match):
        fn(**args)


def _layer_call(**over):
    cfg = KdaConfig(2, 4)
    w = random_kda_weights(cfg, 6, np.random.default_rng(0))
    args = dict(weights=w, X=np.ones((1, 3, 6)), state=KdaState.zeros(cfg, 1), cfg=cfg, cores=_kda_cores())
    args.update(over)
    return lambda: kda_prefill(**args)


_CFG24 = KdaConfig(2, 4)
_W24 = random_kda_weights(_CFG24, 6, np.random.default_rng(0))

BAD_OTHER = [
    pytest.param(lambda: kda_chunked(**_rec(), chunk_size=0), "chunk_size", id="chunk-0"),
    pytest.param(lambda: kda_gate(np.zeros((3, 2, 4)), np.zeros(3), np.zeros(8)), "A_log: expected", id="gate-A_log"),
    pytest.param(lambda: kda_gate(np.zeros((3, 2, 4)), np.zeros(2), np.zeros(6)), "dt_bias: expected",
                 id="gate-dt_bias"),
    pytest.param(lambda: kda_gate(np.zeros((3, 2, 4)), np.zeros(2), np.zeros(8), 5.0), "lower_bound",
                 id="gate-lb-positive"),
    pytest.param(lambda: kda_gate(np.zeros(4), np.zeros(2), np.zeros(8)), "g_raw: expected", id="gate-rank"),
    pytest.param(lambda: short_conv(np.zeros((1, 3, 4)), np.zeros((5, 1, 4))), "weight: expected", id="conv-weight-C"),
    pytest.param(lambda: short_conv(np.zeros((1, 3, 4)), np.zeros((4, 2, 4))), "weight: expected",
                 id="conv-weight-mid"),
    pytest.param(lambda: short_conv(np.zeros((1, 3, 4)), np.zeros((4, 4)), np.zeros((1, 4, 4))), "conv_state: expected",
                 id="conv-state-W"),
    pytest.param(lambda: short_conv(np.zeros((3, 4)), np.zeros((4, 4))), "x: expected rank 3", id="conv-x-rank"),
    pytest.param(lambda: kda_decode_core(np.zeros((1, 2, 4)), np.zeros((1, 2, 4)), np.zeros((1, 2, 4)),
                                         np.zeros((1, 2, 4)), np.zeros((1, 2)), np.zeros(2), np.zeros(8),
                                         np.zeros((1, 2, 4, 5))),
                 "state: expected", id="decode-core-state"),
    pytest.param(lambda: kda_decode_core(np.zeros((1, 2, 4)), np.zeros((1, 2, 3)), np.zeros((1, 2, 4)),
                                         np.zeros((1, 2, 4)), np.zeros((1, 2)), np.zeros(2), np.zeros(8),
                                         np.zeros((1, 2, 4, 4))),
                 "k: expected", id="decode-core-k"),
    pytest.param(lambda: kda_prefill_core(np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 2, 4)),
                                          np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 2)), np.zeros(2), np.zeros(8),
                                          np.zeros((2, 2, 4, 4))), "state: expected", id="prefill-core-state-B"),
    pytest.param(lambda: kda_prefill_core(np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 2, 4)),
                                          np.zeros((1, 3, 2, 5)), np.zeros((1, 3, 2)), np.zeros(2), np.zeros(10),
                                          np.zeros((1, 2, 4, 4))), "g_raw: expected", id="prefill-core-g_raw"),
    pytest.param(lambda: kda_prefill_core(np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 2, 4)),
                                          np.zeros((1, 3, 2, 4)), np.zeros((1, 3, 3)), np.zeros(2), np.zeros(8),
                                          np.zeros((1, 2, 4, 4))), "beta_raw: expected", id="prefill-core-beta_raw"),
    pytest.param(lambda: KdaConfig(0, 4), "num_heads", id="cfg-heads"),
    pytest.param(lambda: KdaConfig(2, 4, norm_eps=-1.0), "norm_eps", id="cfg-eps"),
    pytest.param(lambda: KdaConfig(2, 4, gate_lower_bound=1.0), "gate_lower_bound", id="cfg-lb"),
    pytest.param(_layer_call(weights={n: a for n, a in _W24.items() if n != "o_proj.weight"}), "'o_proj.weight'",
                 id="layer-missing-weight"),
    pytest.param(_layer_call(weights=dict(_W24, **{"f_a_proj.weight": np.zeros((4, 7))})), "f_a_proj.weight: expected",
                 id="layer-weight-shape"),
    pytest.param(_layer_call(state=KdaState.zeros(_CFG24, 2)), "state.conv_q: expected", id="layer-state-batch"),
    pytest.param(_layer_call(X=np.ones((3, 6))), "X: expected rank 3", id="layer-X-rank"),
    pytest.param(_layer_call(X=np.full((1, 3, 6), np.inf)), "X: expected finite", id="layer-X-inf"),
    pytest.param(_layer_call(weights=dict(_W24, **{"v_proj.weight": np.full((8, 6), np.nan)})),
                 r"v_proj.weight: expected finite values, found nan at index \(0, 0\)", id="layer-weight-nan"),
    pytest.param(_layer_call(weights=dict(_W24, **{"o_proj.weight": np.where(np.eye(6, 8) > 0, np.inf,
                                                                             _W24["o_proj.weight"])})),
                 r"o_proj.weight: expected finite values, found inf at index \(0, 0\)", id="layer-o_proj-inf"),
    pytest.param(_layer_call(weights=dict(_W24, **{"o_norm.weight": np.array([1.0, np.nan, 1.0, 1.0])})),
                 r"o_norm.weight: expected finite values", id="layer-o_norm-nan"),
    pytest.param(_layer_call(weights=dict(_W24, **{"q_proj.weight": np.full((8, 6), 1e300)}),
                             X=np.full((1, 3, 6), 1e10)),
                 r"q_proj.weight: expected finite outputs.*overflow in float64", id="layer-proj-overflow",
                 marks=pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")),
    pytest.param(lambda: l2norm(np.ones(3), eps=None), "eps: expected a finite float", id="l2norm-eps-None"),
    pytest.param(lambda: kda_decode_token(_W24, np.ones((1, 1, 6)), KdaState.zeros(_CFG24, 1), _CFG24, _kda_cores()),
                 "x: expected rank 2", id="decode-x-rank"),
    pytest.param(lambda: KdaState.zeros(_CFG24, 1, dtype=np.int32), "dtype", id="state-dtype"),
]


@pytest.mark.parametrize("call, match", BAD_OTHER)
def test_rejects_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
