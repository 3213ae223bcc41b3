"""k3ref.engine's moe_experts and add_rmsnorm against the host-graph forms they restate (float64, 1e-12), their
input checks, and the trace paths: a fused moe_experts swapped into the cores is what the LatentMoE layer calls,
and rmsnorm_through_add runs an RMSNorm through the fused add."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3ref import latent_moe as lm
from k3ref import ops
from k3ref.cores import reference_cores
from k3ref.engine import moe as engine_moe
from k3ref.engine.moe import moe_experts, stack_experts
from k3ref.engine.norm import add_rmsnorm, rmsnorm_through_add
from tests.support.tolerances import rel_rms, tol


def _cfg(E: int, k: int, Dl: int = 64, Di: int = 32, **over) -> lm.LatentMoeConfig:
    base = dict(hidden_size=48, num_experts=E, top_k=k, latent_size=Dl, moe_intermediate_size=Di,
                n_shared_experts=1, shared_intermediate_size=40)
    return lm.LatentMoeConfig(**{**base, **over})


def _route(rng, T: int, E: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """k distinct experts per token (token 1 shares token 0's first expert: an expert chosen by several tokens),
    weights in (0.1, 1)."""
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)])
    if T > 1 and idx[0, 0] not in idx[1]:
        idx[1, -1] = idx[0, 0]
    return rng.uniform(0.1, 1.0, (T, k)), idx


# T, E, k, Dl, Di: one token to several, top-1 to top-4, E up to 16, a K3-like Dl : Di ratio (7 : 6)
MOE_SHAPES = [
    pytest.param(1, 8, 1, 64, 32, id="T1-E8-k1"),
    pytest.param(2, 4, 4, 64, 64, id="T2-E4-k4-all"),
    pytest.param(5, 16, 4, 64, 96, id="T5-E16-k4"),
    pytest.param(7, 12, 3, 96, 32, id="T7-E12-k3"),
    pytest.param(3, 6, 2, 224, 192, id="T3-E6-k2-Dl224-I192"),
]


@pytest.mark.parametrize("T, E, k, Dl, Di", MOE_SHAPES)
def test_moe_experts_equals_routed_experts(T, E, k, Dl, Di):
    cfg = _cfg(E, k, Dl, Di)
    rng = np.random.default_rng(T * 100 + E)
    weights = lm.random_moe_weights(cfg, rng)
    z = rng.standard_normal((T, Dl))
    w, idx = _route(rng, T, E, k)
    want = lm.routed_experts(weights, z, w, idx, cfg)
    got = moe_experts(z, w, idx, *stack_experts(weights, range(E), cfg))
    assert got.dtype == np.float64 and got.shape == (T, Dl)
    assert rel_rms(got, want) <= tol("fp64_same_math")


_STACK_CFG = _cfg(6, 3)
_STACK = stack_experts(lm.random_moe_weights(_STACK_CFG, np.random.default_rng(12)), range(6), _STACK_CFG)


@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 6), st.integers(1, 3))
def test_moe_experts_is_linear_in_the_weights_and_free_of_slot_order(seed, T, k):
    """y(a) + y(b) = y(a + b) for routing weights a, b, and a token's (expert, weight) pairs in any order."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((T, 64))
    a, idx = _route(rng, T, 6, k)
    b = rng.uniform(-1.0, 1.0, a.shape)
    y_sum = moe_experts(z, a + b, idx, *_STACK)
    assert rel_rms(moe_experts(z, a, idx, *_STACK) + moe_experts(z, b, idx, *_STACK), y_sum) <= tol("fp64_same_math")
    order = np.argsort(rng.random(idx.shape), axis=-1)
    shuffled = moe_experts(z, np.take_along_axis(a + b, order, -1), np.take_along_axis(idx, order, -1), *_STACK)
    assert rel_rms(shuffled, y_sum) <= tol("fp64_same_math")


def test_moe_experts_reads_only_the_selected_experts():
    """An expert no token chose is never read: NaN scales there leave y finite and unchanged."""
    cfg = _cfg(6, 2)
    rng = np.random.default_rng(3)
    weights = lm.random_moe_weights(cfg, rng)
    z = rng.standard_normal((3, 64))
    idx = np.array([[0, 5], [5, 2], [2, 0]])
    w = rng.uniform(0.1, 1.0, idx.shape)
    stack = stack_experts(weights, range(6), cfg)
    clean = moe_experts(z, w, idx, *stack)
    for unused in (1, 3, 4):
        stack[1][unused] = 255
        stack[3][unused] = 255
    poisoned = moe_experts(z, w, idx, *stack)
    assert np.array_equal(poisoned, clean)


def test_moe_experts_float32_computes_in_float32():
    cfg = _cfg(4, 2)
    rng = np.random.default_rng(4)
    stack = stack_experts(lm.random_moe_weights(cfg, rng), range(4), cfg)
    z = rng.standard_normal((3, 64))
    w, idx = _route(rng, 3, 4, 2)
    y32 = moe_experts(z.astype(np.float32), w.astype(np.float32), idx, *stack)
    assert y32.dtype == np.float32
    assert rel_rms(y32, moe_experts(z, w, idx, *stack)) <= tol("fp32_vs_fp64")


def test_stack_experts_orders_rows_as_given_w1_before_w3():
    cfg = _cfg(5, 2)
    weights = lm.random_moe_weights(cfg, np.random.default_rng(5))
    w13_packed, w13_scale, w2_packed, w2_scale = stack_experts(weights, [4, 1], cfg)
    assert w13_packed.shape == (2, 64, 32) and w13_scale.shape == (2, 64, 2)
    assert w2_packed.shape == (2, 64, 16) and w2_scale.shape == (2, 64, 1)
    assert np.array_equal(w13_packed[0, :32], weights["experts.4.w1.weight_packed"])
    assert np.array_equal(w13_packed[0, 32:], weights["experts.4.w3.weight_packed"])
    assert np.array_equal(w13_scale[1, 32:], weights["experts.1.w3.weight_scale"])
    assert np.array_equal(w2_scale[1], weights["experts.1.w2.weight_scale"])


def _good_args():
    cfg = _cfg(4, 2)
    rng = np.random.default_rng(6)
    stack = stack_experts(lm.random_moe_weights(cfg, rng), range(4), cfg)
    return dict(x=rng.standard_normal((3, 64)), weights=np.full((3, 2), 0.5),
                indices=np.array([[0, 1], [2, 3], [3, 0]]),
                w13_packed=stack[0], w13_scale=stack[1], w2_packed=stack[2], w2_scale=stack[3])


@pytest.mark.parametrize("change, message", [
    pytest.param(dict(indices=np.array([[0, 1], [2, 4], [3, 0]])), r"expert ids in \[0, 4\).*found 4 at \[1, 1\]",
                 id="index-past-E"),
    pytest.param(dict(indices=np.array([[0, -1], [2, 3], [3, 0]])), r"found -1 at \[0, 1\]", id="index-negative"),
    pytest.param(dict(indices=np.array([[0.0, 1.0], [2.0, 3.0], [3.0, 0.0]])), "indices: expected an integer dtype",
                 id="float-indices"),
    pytest.param(dict(weights=np.full((3, 3), 0.5)), "indices: expected", id="k-mismatch"),
    pytest.param(dict(weights=np.array([[0.5, np.nan], [1, 1], [1, 1]])), "weights: expected finite",
                 id="nan-weight"),
    pytest.param(dict(x=np.zeros((3, 96))), r"w13_packed: expected .*found shape \(4, 64, 32\)", id="x-width"),
    pytest.param(dict(x=np.zeros((3, 48))), "x: expected a last dim Dl that is a multiple of 32", id="x-width-48"),
    pytest.param(dict(w13_packed=np.zeros((4, 64, 32), np.int8)), "w13_packed: expected dtype uint8",
                 id="packed-dtype"),
    pytest.param(dict(w13_scale=np.zeros((4, 64, 3), np.uint8)), "w13_scale: expected", id="scale-shape"),
    pytest.param(dict(w2_packed=np.zeros((3, 64, 16), np.uint8)), "w2_packed: expected", id="w2-experts"),
])
def test_moe_experts_rejects_bad_input(change, message):
    with pytest.raises(ValueError, match=message):
        moe_experts(**{**_good_args(), **change})


def test_stack_experts_names_a_missing_tensor():
    cfg = _cfg(3, 2)
    weights = lm.random_moe_weights(cfg, np.random.default_rng(7))
    del weights["experts.2.w3.weight_scale"]
    with pytest.raises(ValueError, match=r"missing tensor 'experts.2.w3.weight_scale' \(expected shape \[32, 2\]\)"):
        stack_experts(weights, [0, 2], cfg)


# ---- the trace path: a fused moe_experts in the cores is called once per layer and gives the reference result


class CountingMoe:
    """k3ref's moe_experts behind another function object, as a backend's fused kernel is: recorded calls."""

    def __init__(self):
        self.stack_sizes: list[int] = []

    def __call__(self, x, weights, indices, w13_packed, *rest, **kw):
        self.stack_sizes.append(len(w13_packed))
        return moe_experts(x, weights, indices, w13_packed, *rest, **kw)


@pytest.mark.parametrize("T, experts", [
    pytest.param(1, None, id="T1-all"),
    pytest.param(6, None, id="T6-all"),
    pytest.param(6, range(0, 5), id="T6-rank0-of-2"),
    pytest.param(6, range(5, 10), id="T6-rank1-of-2"),
])
def test_latent_moe_calls_a_fused_moe_experts_and_agrees(T, experts):
    cfg = _cfg(10, 3)
    rng = np.random.default_rng(8)
    weights = lm.random_moe_weights(cfg, rng)
    x = rng.standard_normal((T, cfg.hidden_size))
    fused = CountingMoe()
    want = lm.latent_moe_forward(weights, x, cfg, reference_cores(), experts=experts)
    got = lm.latent_moe_forward(weights, x, cfg, reference_cores().replace(moe_experts=fused), experts=experts)
    assert len(fused.stack_sizes) == 1, "the fused core must run once for the layer's tokens"
    _, idx = lm.sigmoid_topk(ops.linear(x, weights["gate.weight"]), weights["gate.e_score_correction_bias"],
                             cfg.top_k)
    chosen = {int(e) for e in idx.ravel() if experts is None or int(e) in experts}
    assert fused.stack_sizes == [len(chosen)], "only the chosen experts (this rank's) are stacked"
    assert rel_rms(got, want) <= tol("fp64_same_math")


def test_latent_moe_with_a_fused_core_and_no_local_expert_adds_nothing():
    cfg = _cfg(10, 2)
    rng = np.random.default_rng(9)
    weights = lm.random_moe_weights(cfg, rng)
    z = rng.standard_normal((2, cfg.latent_size))
    idx = np.array([[0, 1], [1, 2]])
    fused = CountingMoe()
    y = lm.routed_experts(weights, z, np.ones((2, 2)), idx, cfg, reference_cores().replace(moe_experts=fused),
                          experts=range(5, 10))
    assert fused.stack_sizes == [] and np.array_equal(y, np.zeros_like(z))


def test_reference_cores_keep_the_per_expert_path():
    """k3ref's own moe_experts is not routed through the stack: the reference (and its goldens) is unchanged."""
    assert reference_cores().moe_experts is engine_moe.moe_experts


# ---- add_rmsnorm


@pytest.mark.parametrize("shape, eps", [
    pytest.param((1, 113), 1e-5, id="T1-D113"),
    pytest.param((7, 203), 1e-5, id="T7-D203"),
    pytest.param((2, 3, 64), 1e-6, id="B2-T3-D64"),
])
def test_add_rmsnorm_is_the_add_then_rmsnorm(shape, eps):
    rng = np.random.default_rng(shape[-1])
    x, residual = rng.standard_normal(shape), 3.0 * rng.standard_normal(shape)
    x[..., 0, :] *= 1e-3
    residual[..., 0, :] *= 1e-3              # a row whose mean square is ~1e-6: eps matters there
    w = 1.0 + 0.1 * rng.standard_normal(shape[-1])
    y, r = add_rmsnorm(x, residual, w, eps)
    assert np.array_equal(r, x + residual)
    assert rel_rms(y, ops.rmsnorm(x + residual, w, eps)) <= tol("fp64_same_math")


def test_add_rmsnorm_adds_in_the_wider_dtype():
    x = np.array([[1.0 + 2.0 ** -40, 2.0]])
    residual = np.array([[1.0, -1.0]], np.float32)
    _, r = add_rmsnorm(x, residual, np.ones(2), 1e-5)
    assert r.dtype == np.float64 and r[0, 0] == 2.0 + 2.0 ** -40


@pytest.mark.parametrize("change, message", [
    pytest.param(dict(residual=np.zeros((2, 5))), "residual: expected", id="residual-shape"),
    pytest.param(dict(w=np.ones(5)), "w: expected", id="w-shape"),
    pytest.param(dict(x=np.array([[np.inf, 0, 0, 0]])[[0, 0]]), "x: expected finite", id="inf"),
    pytest.param(dict(eps=-1.0), "eps: expected >= 0", id="negative-eps"),
])
def test_add_rmsnorm_rejects_bad_input(change, message):
    args = dict(x=np.ones((2, 4)), residual=np.ones((2, 4)), w=np.ones(4), eps=1e-5)
    with pytest.raises(ValueError, match=message):
        add_rmsnorm(**{**args, **change})


def test_rmsnorm_through_add_is_rmsnorm():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((5, 203)) * 10.0 ** rng.uniform(-3, 3, (5, 1))
    w = 1.0 + 0.1 * rng.standard_normal(203)
    calls = []

    def add_core(a, b, w, eps):
        calls.append((a.copy(), b.copy()))
        return add_rmsnorm(a, b, w, eps)

    y = rmsnorm_through_add(add_core)(x, w, 1e-5)
    assert len(calls) == 1 and np.array_equal(calls[0][0] + calls[0][1], x)
    assert rel_rms(y, ops.rmsnorm(x, w, 1e-5)) <= tol("fp64_same_math")
