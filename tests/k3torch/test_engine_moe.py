"""k3torch.engine_moe against k3ref.engine (float64), its bf16 policy, and its input checks."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.support.strict import import_or_skip

torch = import_or_skip("torch")

from k3ref import latent_moe as lm  # noqa: E402
from k3ref import ops  # noqa: E402
from k3ref.engine.moe import moe_experts, stack_experts  # noqa: E402
from k3ref.engine.norm import add_rmsnorm  # noqa: E402
from k3torch.cores import Precision, TorchCore  # noqa: E402
from k3torch.engine_moe import CORES  # noqa: E402
from tests.support.tolerances import rel_rms  # noqa: E402

# name: (relative-RMS tolerance, reason)
AGREE_TOL: dict[str, tuple[float, str]] = {
    "fp64_agreement": (1e-10, "torch float64 against k3ref float64: the same math, other summation orders (BLAS, "
                              "index_add) over <= a few hundred terms"),
    "bf16_policy": (1e-6, "the torch bf16 core against k3ref run in float64 on the values the policy rounds "
                          "(bf16 x, h and outputs): the remaining fp32 accumulation costs ~1e-7 relative"),
}


def _core(name: str, dtype=torch.float64) -> TorchCore:
    prep, compute = CORES[name]
    return TorchCore(name, prep, compute, Precision(dtype, torch.device("cpu")))


def _moe_case(T: int, E: int, k: int, Dl: int, Di: int, seed: int):
    cfg = lm.LatentMoeConfig(hidden_size=32, num_experts=E, top_k=k, latent_size=Dl, moe_intermediate_size=Di,
                             n_shared_experts=0, shared_intermediate_size=0)
    rng = np.random.default_rng(seed)
    stack = stack_experts(lm.random_moe_weights(cfg, rng), range(E), cfg)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    return dict(x=3.0 * rng.standard_normal((T, Dl)), weights=rng.uniform(0.1, 1.0, (T, k)), indices=idx,
                w13_packed=stack[0], w13_scale=stack[1], w2_packed=stack[2], w2_scale=stack[3])


MOE_SHAPES = [
    pytest.param(1, 8, 1, 64, 32, id="T1-E8-k1"),
    pytest.param(5, 16, 4, 64, 96, id="T5-E16-k4"),
    pytest.param(3, 6, 2, 224, 192, id="T3-E6-k2-Dl224-I192"),
]


@pytest.mark.parametrize("T, E, k, Dl, Di", MOE_SHAPES)
def test_moe_experts_float64_agrees_with_k3ref(T, E, k, Dl, Di):
    case = _moe_case(T, E, k, Dl, Di, seed=T + E)
    got = _core("moe_experts")(**case)
    assert got.dtype == np.float64
    assert rel_rms(got, moe_experts(**case)) <= AGREE_TOL["fp64_agreement"][0]


def _bf16(a) -> np.ndarray:
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def test_moe_experts_bf16_follows_its_policy():
    """bf16 x, exact weights, the hidden activation and the output stored in bf16, routing weights fp32: the
    same steps in float64 on those rounded values land within fp32 accumulation of the bf16 core."""
    case = _moe_case(4, 8, 3, 64, 64, seed=11)
    got = _core("moe_experts", torch.bfloat16)(**case)
    x = _bf16(case["x"])
    w = case["weights"].astype(np.float32).astype(np.float64)
    want = np.zeros_like(x)
    for e in np.unique(case["indices"]):
        tok, slot = np.nonzero(case["indices"] == e)
        w13 = lm.mxfp4.dequantize(case["w13_packed"][e], case["w13_scale"][e]).astype(np.float64)
        w2 = lm.mxfp4.dequantize(case["w2_packed"][e], case["w2_scale"][e]).astype(np.float64)
        gu = x[tok] @ w13.T
        h = _bf16(lm.situ_glu(gu[:, :64], gu[:, 64:]))
        want[tok] += w[tok, slot, None] * (h @ w2.T)
    assert got.dtype == np.float32
    assert np.array_equal(got, _bf16(got)), "the output is stored in bf16"
    assert rel_rms(got, _bf16(want)) <= AGREE_TOL["bf16_policy"][0]


@pytest.mark.parametrize("shape, eps", [
    pytest.param((1, 113), 1e-5, id="T1-D113"),
    pytest.param((7, 203), 1e-6, id="T7-D203"),
])
def test_add_rmsnorm_float64_agrees_with_k3ref(shape, eps):
    rng = np.random.default_rng(shape[-1])
    x, residual = rng.standard_normal(shape), 3.0 * rng.standard_normal(shape)
    w = 1.0 + 0.1 * rng.standard_normal(shape[-1])
    y, r = _core("add_rmsnorm")(x, residual, w, eps)
    y_ref, r_ref = add_rmsnorm(x, residual, w, eps)
    assert rel_rms(r, r_ref) <= AGREE_TOL["fp64_agreement"][0]
    assert rel_rms(y, y_ref) <= AGREE_TOL["fp64_agreement"][0]


def test_add_rmsnorm_bf16_normalises_the_stored_residual():
    rng = np.random.default_rng(5)
    x, residual = rng.standard_normal((3, 64)), 3.0 * rng.standard_normal((3, 64))
    w = 1.0 + 0.1 * rng.standard_normal(64)
    y, r = _core("add_rmsnorm", torch.bfloat16)(x, residual, w, 1e-5)
    r_want = _bf16(_bf16(x) + _bf16(residual))
    assert np.array_equal(r, r_want), "r: the fp32 sum of the bf16 inputs, rounded once to bf16"
    y_want = _bf16(_bf16(ops.rmsnorm(r_want, np.ones(64), 1e-5)) * _bf16(w))
    assert rel_rms(y, y_want) <= AGREE_TOL["bf16_policy"][0]


@pytest.mark.parametrize("change, message", [
    pytest.param(dict(indices=np.array([[0, 9]])), r"expert ids in \[0, 8\)", id="index-past-E"),
    pytest.param(dict(w2_scale=np.zeros((8, 64, 3), np.uint8)), "w2_scale: expected", id="w2-scale-shape"),
    pytest.param(dict(w13_packed=np.zeros((8, 128, 32), np.int8)), "w13_packed: expected uint8",
                 id="packed-dtype"),
    pytest.param(dict(weights=np.ones((1, 3))), "indices: expected", id="k-mismatch"),
])
def test_moe_experts_rejects_bad_input(change, message):
    case = _moe_case(1, 8, 2, 64, 64, seed=1)
    with pytest.raises(ValueError, match=message):
        _core("moe_experts")(**{**case, **change})
