"""k3ref.situ: softcap, SiTU, the situ_glu core, the dense SiTU MLP and the fused [gate | up] split."""
from __future__ import annotations

import math
import types

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3ref import situ
from tests.support.tolerances import elem, rel_rms, tol

# Test-local tolerance rows (name: (value, reason)).
LOCAL_TOL = {
    "fp64_rounding_abs": (1e-14, "absolute float64 rounding slack on O(1..100) tanh/exp products (a few ulp)"),
}

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
caps = st.floats(min_value=0.1, max_value=100.0)


@given(finite, caps)
def test_softcap_is_bounded_and_odd(z, cap):
    out = situ.softcap(np.array([z]), cap)[0]
    assert abs(out) <= cap                                  # tanh rounds to 1 far out, so <= in floats
    if abs(z) < cap:
        assert abs(out) < cap
    assert situ.softcap(np.array([-z]), cap)[0] == -out


@given(st.floats(min_value=-1.0, max_value=1.0), st.floats(min_value=1.0, max_value=50.0))
def test_softcap_is_identity_to_third_order(z, cap):
    # |tanh(u) - u| <= |u|^3 / 3, so |softcap_c(z) - z| <= |z|^3 / (3 c^2)
    out = situ.softcap(np.array([z]), cap)[0]
    assert abs(out - z) <= abs(z) ** 3 / (3 * cap * cap) + LOCAL_TOL["fp64_rounding_abs"][0]


@given(st.floats(min_value=-0.5, max_value=0.5), st.floats(min_value=2.0, max_value=50.0))
def test_situ_is_silu_near_zero(g, beta):
    # SiTU_b(g) = softcap_b(g) sigma(g) and sigma < 1, so |SiTU_b(g) - g sigma(g)| <= |g|^3 / (3 b^2)
    silu = g / (1.0 + math.exp(-g))
    out = situ.situ(np.array([g]), beta)[0]
    assert abs(out - silu) <= abs(g) ** 3 / (3 * beta * beta) + LOCAL_TOL["fp64_rounding_abs"][0]


def test_situ_differs_from_silu_far_out():
    # the cap is what distinguishes SiTU: at g = 20 SiLU is ~20, SiTU_4 is ~4
    assert abs(situ.situ(np.array([20.0]), 4.0)[0] - 4.0 * math.tanh(5.0)) < elem("situ_cap_far_out")["atol"]


def _situ_glu_scalar(g: float, u: float, beta: float, lin: float) -> float:
    return beta * math.tanh(g / beta) / (1.0 + math.exp(-g)) * lin * math.tanh(u / lin)


@pytest.mark.parametrize("beta, lin", [
    pytest.param(4.0, 25.0, id="k3-betas"), pytest.param(1.5, 3.0, id="tight-caps"),
])
def test_situ_glu_matches_scalar_formula(rng, beta, lin):
    gate = rng.standard_normal((3, 7)) * 10
    up = rng.standard_normal((3, 7)) * 40
    got = situ.situ_glu(gate, up, beta=beta, linear_beta=lin)
    want = np.vectorize(_situ_glu_scalar)(gate, up, beta, lin)
    assert got.dtype == np.float64
    assert rel_rms(got, want) <= tol("fp64_same_math")


@pytest.mark.parametrize("dtype, out_dtype", [
    pytest.param(np.float64, np.float64, id="f64"), pytest.param(np.float32, np.float32, id="f32"),
    pytest.param(np.float16, np.float32, id="f16"), pytest.param(ml_dtypes.bfloat16, np.float32, id="bf16"),
])
def test_situ_glu_computes_in_fp32_or_wider(rng, dtype, out_dtype):
    gate = rng.standard_normal(33).astype(dtype)
    up = rng.standard_normal(33).astype(dtype)
    got = situ.situ_glu(gate, up)
    assert got.dtype == out_dtype
    want = situ.situ_glu(gate.astype(np.float64), up.astype(np.float64))
    assert rel_rms(got, want) <= tol("fp32_vs_fp64")


def _mlp_loop(x, w1, w3, w2, beta, lin):
    """y[t, d] = sum_i w2[d, i] situ_glu(sum_j w1[i, j] x[t, j], sum_j w3[i, j] x[t, j]), written out."""
    xs = x.reshape(-1, x.shape[-1])
    Di, D = w1.shape
    out = np.zeros((xs.shape[0], D))
    for t, row in enumerate(xs):
        h = [_situ_glu_scalar(sum(w1[i, j] * row[j] for j in range(D)), sum(w3[i, j] * row[j] for j in range(D)),
                              beta, lin) for i in range(Di)]
        out[t] = [sum(w2[d, i] * h[i] for i in range(Di)) for d in range(D)]
    return out.reshape(x.shape)


@pytest.mark.parametrize("batch, D, Di", [
    pytest.param((1,), 7, 5, id="T1-D7-I5"),
    pytest.param((3,), 16, 33, id="T3-D16-I33"),
    pytest.param((2, 3), 9, 12, id="B2x3-D9-I12"),
])
def test_situ_glu_vec_matches_loop(rng, batch, D, Di):
    x = rng.standard_normal(batch + (D,))
    w1, w3 = rng.standard_normal((2, Di, D))
    w2 = rng.standard_normal((D, Di)) / np.sqrt(Di)
    got = situ.situ_glu_vec(x, w1, w3, w2, beta=4.0, linear_beta=25.0)
    assert got.shape == x.shape and got.dtype == np.float64
    assert rel_rms(got, _mlp_loop(x, w1, w3, w2, 4.0, 25.0)) <= tol("fp64_same_math")


def test_situ_glu_vec_calls_the_core(rng):
    seen = []

    def core(gate, up, beta=4.0, linear_beta=25.0):
        seen.append((gate.shape, beta, linear_beta))
        return np.zeros_like(gate)

    x, w1, w3 = rng.standard_normal((4, 6)), rng.standard_normal((5, 6)), rng.standard_normal((5, 6))
    y = situ.situ_glu_vec(x, w1, w3, rng.standard_normal((6, 5)), beta=2.0, linear_beta=9.0,
                          cores=types.SimpleNamespace(situ_glu=core))
    assert seen == [((4, 5), 2.0, 9.0)] and not y.any()


def test_split_fused_gate_up(rng):
    w1, w3 = rng.standard_normal((2, 6, 4))
    g, u = situ.split_fused_gate_up(np.concatenate([w1, w3]))
    assert (g == w1).all() and (u == w3).all()


@pytest.mark.parametrize("call, needle", [
    pytest.param(lambda: situ.situ_glu(np.ones((2, 3)), np.ones((2, 4))), "up", id="glu-shape"),
    pytest.param(lambda: situ.situ_glu(np.ones(3), np.array([1.0, np.nan, 0.0])), "up", id="glu-nan"),
    pytest.param(lambda: situ.softcap(np.ones(3), 0.0), "cap", id="cap-zero"),
    pytest.param(lambda: situ.situ_glu_vec(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 4)), np.ones((3, 4))),
                 "w2", id="vec-w2-shape"),
    pytest.param(lambda: situ.situ_glu_vec(np.ones((2, 4)), np.ones((3, 5)), np.ones((3, 4)), np.ones((4, 3))),
                 "w1", id="vec-w1-shape"),
    pytest.param(lambda: situ.split_fused_gate_up(np.ones((5, 4))), "w", id="split-odd"),
])
def test_bad_input_raises(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()
