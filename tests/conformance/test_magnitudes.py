"""Every case of the k3 shape sets draws its inputs at K3's magnitudes (conformance.cases.magnitudes.MEASURED,
measured on the `small` trace): activations at the measured scale, with the measured outliers and row spread;
KDA gates covering (lower_bound, 0) with long runs at the bound; router scores of 896 experts whose top-16 survive
bf16 rounding with margins of the size a real router has. The inputs are drawn by the cases' own builders (a
decode's history is cut to 4 steps here: it only builds the state, the token is drawn the same way)."""
from __future__ import annotations

import decimal
from fractions import Fraction

import numpy as np
import pytest

from conformance.cases import magnitudes as mag
from conformance.cases.catalog import all_cases
from conformance.cases.core import CORE_SPECS
from conformance.cases.routes import route_stable
from k3ref.latent_moe import sigmoid_topk

K3_CASES = [c for config in ("k3", "k3-tp8") for c in all_cases(config) if c.kind == "core"]

# block -> (input name, MEASURED key) of the activations it reads
ACTIVATIONS = {
    "rmsnorm": [("x", "rmsnorm.x")],
    "situ_glu": [("gate", "situ_glu.gate"), ("up", "situ_glu.up")],
    "kda_decode": [("q", "kda.q"), ("v", "kda.v")],
    "kda_prefill": [("q", "kda.q"), ("v", "kda.v")],
    "mla_decode": [("q_abs", "mla.q_abs"), ("kv_cache", "mla.kv")],
    "mxfp4_gemv": [("x", "mxfp4_gemv.x")],
    "moe_route": [("logits", "router.logits")],
    "attnres_mix": [("sources", "attnres.sources")],
    # the engine-shaped cores read the same activations in their own layouts
    "kda_decode_pool": [("q", "kda.q"), ("v", "kda.v")],
    "kda_prefill_varlen": [("q", "kda.q"), ("v", "kda.v")],
    "mla_decode_fp8": [("q_abs", "mla.q_abs")],
    "moe_experts": [("x", "mxfp4_gemv.x")],
    "add_rmsnorm": [("x", "rmsnorm.x")],
}
# blocks whose activations the `small` trace does not record (magnitudes_measure taps the host cores' inputs)
UNMEASURED = {"kda_conv_pool": "the conv reads the projections before it, inline in the host graph",
              "mla_prefill": "the expanded form's q, k, v: the host graph attends inline"}


def _inputs(case):
    params = dict(case.params)
    params.pop("entry", None)
    if "history" in params:
        params["history"] = min(params["history"], 4)
    return CORE_SPECS[case.block].make(np.random.default_rng(case.seed), **params)


def _rows(x: np.ndarray) -> np.ndarray:
    """Rows of the last axis that hold activations (not the NaN of unused cache slots, not the traps: a row
    scaled to a tiny norm on purpose)."""
    x = np.asarray(x, np.float64).reshape(-1, np.shape(x)[-1])
    x = x[np.all(np.isfinite(x), axis=-1)]
    rms = np.sqrt(np.mean(x * x, axis=-1))
    return x[rms > 1e-2 * np.median(rms)]


@pytest.fixture(scope="module")
def drawn():
    return {c.name + "@" + c.config: _inputs(c) for c in K3_CASES}


def test_every_k3_block_has_cases_and_a_measured_scale_or_the_reason_it_has_none():
    assert {c.block for c in K3_CASES} == set(CORE_SPECS) == set(ACTIVATIONS) | set(UNMEASURED)


@pytest.mark.parametrize("case", [c for c in K3_CASES if c.block in ACTIVATIONS], ids=lambda c: f"{c.config}:{c.name}")
def test_activations_at_the_measured_magnitudes(drawn, case):
    inputs, _ = drawn[case.name + "@" + case.config]
    for name, key in ACTIVATIONS[case.block]:
        m = mag.MEASURED[key]
        x = _rows(inputs[name])
        rms = np.sqrt(np.mean(x * x, axis=-1))
        scale = float(np.sqrt(np.mean(x * x)))
        assert 0.5 * m["scale"] < scale < 2.0 * m["scale"], f"{name}: scale {scale:.3g}, measured {m['scale']}"
        if key == "mla.kv":
            continue   # the cache rows are Gaussian at the measured scale (the layer's rows have no outliers)
        outlier = float(np.max(np.abs(x) / rms[:, None]))
        assert outlier > 0.8 * m["outlier"], f"{name}: largest |x| / RMS {outlier:.3g}, measured {m['outlier']}"
        if m["spread"] > 0.1 and len(rms) > 8:
            spread = float(np.log10(rms.max() / rms.min()))
            assert spread > 0.5 * m["spread"], f"{name}: row RMS spread {spread:.3g}, measured {m['spread']}"


KDA_CASES = [c for c in K3_CASES if c.block in ("kda_decode", "kda_prefill")]


@pytest.mark.parametrize("case", KDA_CASES, ids=lambda c: f"{c.config}:{c.name}")
def test_kda_gates_span_the_range_with_long_runs_at_the_bound(drawn, case):
    inputs, kwargs = drawn[case.name + "@" + case.config]
    lb = kwargs["lower_bound"]
    cov = mag.gate_coverage(mag.gate_of(inputs, lb), lb)
    assert cov["cover"] >= mag.GATE_COVER, cov
    assert cov["at_bound"] > 0.02, cov                  # not a toy range like [-0.05, -0.001]
    if case.block == "kda_prefill":                     # [B, T, H, K]: runs along the time axis
        assert cov["longest_run"] >= min(mag.GATE_RUN, case.params["T"]), cov


def test_a_toy_gate_range_is_refused_by_the_same_check():
    """The check can fail: gates pinned to [-0.05, -0.001] (the range that hid 68 broken layers) cover little."""
    g = -np.random.default_rng(0).uniform(0.001, 0.05, (1, 300, 2, 16))
    cov = mag.gate_coverage(g, -5.0)
    assert cov["cover"] < mag.GATE_COVER and cov["at_bound"] == 0 and cov["longest_run"] == 0


@pytest.mark.parametrize("case", [c for c in K3_CASES if c.block == "moe_route"], ids=lambda c: c.name)
def test_router_margins_are_real_and_survive_bf16(drawn, case):
    inputs, kw = drawn[case.name + "@" + case.config]
    logits, bias, k = inputs["logits"], inputs["bias"], kw["top_k"]
    assert logits.shape[-1] == 896 and k == 16
    score = np.sort(1.0 / (1.0 + np.exp(-logits)) + bias, axis=-1)[:, ::-1]
    margin = score[:, k - 1] - score[:, k]
    assert route_stable(logits, bias, kw)
    # realistic: as close as a real router's (measured median on small: 9.4e-3), not pushed far apart
    assert float(np.median(margin)) < 0.05, np.median(margin)
    assert not np.array_equal(sigmoid_topk(logits, bias, **kw)[1], sigmoid_topk(logits, 0 * bias, **kw)[1])
    b = mag.MEASURED["router.bias"]["scale"]
    assert 0.5 * b < float(np.std(bias)) < 2.0 * b


def test_ten_to_is_the_correctly_rounded_power_of_ten():
    """The goldens' row scales: no machine-dependent pow (NumPy's SIMD pow on an AVX-512 CPU moved one committed
    golden's inputs by an ulp). Checked against exact rational arithmetic where the answer is known exactly, and
    within an ulp of NumPy's elsewhere."""
    exact = np.array([-3.0, -1.0, 0.0, 1.0, 2.0, 22.0])
    got = mag.ten_to(exact)
    assert got.tolist() == [float(Fraction(10) ** int(e)) for e in exact]        # 10^-1 -> the nearest double
    u = np.random.default_rng(0).uniform(-1, 1, (50, 3))
    got = mag.ten_to(u)
    assert got.shape == u.shape and got.dtype == np.float64
    assert np.all(np.abs(got - 10.0 ** u) <= np.spacing(got))
    with decimal.localcontext(prec=60):                                      # the same power to 60 digits
        want = [float(decimal.Decimal(10) ** decimal.Decimal(v)) for v in u.ravel().tolist()]
    assert got.ravel().tolist() == want
