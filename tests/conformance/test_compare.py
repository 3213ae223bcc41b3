"""compare(): metrics, non-finite positions, mismatches reported not raised; gates: the table and the rules."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.judge import gates
from conformance.judge.compare import compare
from conformance.judge.gates import Gate, gate_for, judge, judge_speed
from tests.support.tolerances import elem

NAN, INF = float("nan"), float("inf")


def test_metrics_of_a_known_error():
    ref = np.ones(4)
    out = np.array([1.0, 1.0, 1.5, 1.0])
    c = compare(out, ref, atol=0.1)
    assert c.max_abs == 0.5
    assert math.isclose(c.rel_rms, 0.5 / 2.0)                  # ||out - ref|| / ||ref|| = 0.5 / 2
    assert c.worst_index == (2,) and (c.worst_out, c.worst_ref) == (1.5, 1.0)
    assert (c.n_within, c.n_total) == (3, 4) and c.passed_line == "3 of 4 passed"
    assert "worst at [2]: out 1.5 vs ref 1" in c.summary()


def test_rtol_counts_relative_to_ref():
    ref = np.array([100.0, 1.0])
    out = np.array([100.5, 1.5])
    assert compare(out, ref, atol=0.0, rtol=0.01).n_within == 1   # 0.5 <= 1.0 but 0.5 > 0.01


def test_identical_is_zero(rng):
    x = rng.standard_normal((3, 7))
    c = compare(x.copy(), x)
    assert (c.max_abs, c.rel_rms, c.n_within) == (0.0, 0.0, 21) and c.nonfinite_ok


@pytest.mark.parametrize("out, ref, mismatch, first", [
    pytest.param([1.0, NAN, 3.0], [1.0, 2.0, 3.0], {"nan": 1}, (1,), id="nan-in-out"),
    pytest.param([1.0, 2.0, 3.0], [NAN, 2.0, 3.0], {"nan": 1}, (0,), id="nan-in-ref"),
    pytest.param([INF, 2.0], [-INF, 2.0], {"+inf": 1, "-inf": 1}, (0,), id="inf-sign-flip"),
    pytest.param([1.0, 2.0, INF], [1.0, 2.0, 9.0], {"+inf": 1}, (2,), id="inf-in-out"),
])
def test_nonfinite_positions_must_match(out, ref, mismatch, first):
    c = compare(np.array(out), np.array(ref), atol=1e-3)
    assert {k: v for k, v in c.nonfinite_mismatch.items() if v} == mismatch
    assert c.first_nonfinite_mismatch == first and c.worst_index == first
    assert not c.nonfinite_ok
    v = judge(c, gate_for("rmsnorm", "y", "fp64")[1], "fp64", None)
    assert not v.passed and "NaN/Inf" in v.why


def test_nonfinite_at_the_same_positions_pass():
    ref = np.array([1.0, NAN, -INF, 4.0])
    out = np.array([1.0, NAN, -INF, 4.0 + 1e-14])
    c = compare(out, ref, atol=1e-12)
    assert c.nonfinite_ok and (c.n_within, c.n_total) == (4, 4)
    assert math.isfinite(c.rel_rms) and c.rel_rms < 1e-14
    assert judge(c, gate_for("rmsnorm", "y", "fp64")[1], "fp64", None).passed


@pytest.mark.parametrize("out, problem", [
    pytest.param(np.zeros((3, 2)), "shape: expected [2, 3], found [3, 2]", id="transposed"),
    pytest.param(np.zeros(6), "shape: expected [2, 3], found [6]", id="flat"),
    pytest.param(np.array([["a"] * 3] * 2), "dtype: expected a numeric array", id="strings"),
    pytest.param(np.zeros((2, 3), dtype=np.int64), "dtype: expected floating", id="int-for-float"),
])
def test_mismatch_is_reported_not_raised(out, problem):
    c = compare(out, np.zeros((2, 3)))
    assert problem in c.problem and not c.comparable
    v = judge(c, gate_for("rmsnorm", "y", "fp32")[1], "fp32", 1e-7)
    assert not v.passed and problem in v.why


def test_integer_tensors_compare_exactly():
    ref = np.array([[3, 1], [0, 2]], dtype=np.int64)
    same = compare(ref.copy(), ref)
    assert same.exact and same.comparable and not same.problem
    assert judge(same, gate_for("moe_route", "indices", "bf16")[1], "bf16", None).passed
    c = compare(np.array([[3, 1], [0, 5]], dtype=np.int64), ref)
    assert c.exact and "1 of 4 elements differ" in c.problem and c.worst_index == (1, 1)
    assert (c.n_within, c.n_total) == (3, 4)
    assert not judge(c, gate_for("moe_route", "indices", "fp64")[1], "fp64", None).passed


@pytest.mark.parametrize("out, n_within, first", [
    pytest.param([3.0, 1.5], 1, (1,), id="fraction-is-not-truncated"),
    pytest.param([3.0, NAN], 1, (1,), id="nan-fails-only-its-position"),
    pytest.param([3.0, 1.0], 2, None, id="float-holding-the-integers"),
])
def test_float_output_of_an_integer_tensor(out, n_within, first):
    c = compare(np.array(out), np.array([3, 1], dtype=np.int64))
    assert c.exact and (c.n_within, c.n_total) == (n_within, 2)
    assert c.worst_index == first and bool(c.problem) == (first is not None)


@given(x=st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=30).filter(lambda v: any(abs(t) > 1e-3 for t in v)),
       eps=st.floats(1e-6, 0.5), sign=st.sampled_from([-1.0, 1.0]))
def test_rel_rms_of_a_uniform_scaling_is_the_scale(x, eps, sign):
    eps *= sign
    ref = np.array(x)
    c = compare(ref * (1 + eps), ref)
    assert math.isclose(c.rel_rms, abs(eps), rel_tol=elem("scaling_recovered")["rtol"])
    assert math.isclose(c.max_abs, float(np.max(np.abs(ref * eps))), rel_tol=elem("scaling_recovered")["rtol"])


# ---- gates


def test_every_row_has_a_reason_and_a_known_precision():
    for (block, tensor, prec), g in gates.GATES.items():
        assert prec in gates.PRECISIONS and g.reason.strip(), (block, tensor, prec)
        assert (g.k is None) == (prec == "fp64") and g.cap > 0
        if prec == "fp64":
            assert "exact by construction" in g.reason


@pytest.mark.parametrize("block, tensor, precision, key", [
    pytest.param("kda_prefill", "o", "fp64", ("kda_prefill", "*", "fp64"), id="block-row"),
    pytest.param("moe_route", "weights", "fp32", ("*", "*", "fp32"), id="default-row"),
    pytest.param("mla_decode", "o_lat", "fp32", ("mla_decode", "*", "fp32"), id="mla-fp32"),
])
def test_gate_lookup_falls_back(block, tensor, precision, key):
    assert gate_for(block, tensor, precision)[0] == key


def test_gate_lookup_rejects_unknown_precision():
    with pytest.raises(ValueError, match="precision: expected one of"):
        gate_for("rmsnorm", "y", "fp8")


ROW = Gate(cap=1e-4, k=4.0, floor=1e-6, atol=0.0, rtol=0.0, reason="test row")


def _cmp_with_rel(rel: float):
    ref = np.ones(100)
    return compare(ref * (1 + rel), ref)


@pytest.mark.parametrize("err, baseline, passed", [
    pytest.param(1.3e-6, 1e-7, True, id="under-k-times-baseline"),      # bound 4e-7 + 1e-6 = 1.4e-6
    pytest.param(1.5e-6, 1e-7, False, id="over-k-times-baseline"),
    pytest.param(9e-5, 1e-3, True, id="cap-binds-under"),                # 4e-3 + 1e-6 > cap 1e-4
    pytest.param(2e-4, 1e-3, False, id="cap-binds-over"),
    pytest.param(9e-5, None, True, id="no-baseline-cap-only"),
])
def test_baseline_relative_rule(err, baseline, passed):
    v = judge(_cmp_with_rel(err), ROW, "fp32", baseline)
    assert v.passed is passed
    if baseline is None:
        assert v.bound == ROW.cap and "unavailable" in v.why
    else:
        assert math.isclose(v.bound, min(ROW.cap, ROW.k * baseline + ROW.floor))


def test_fp64_requires_every_element_within():
    row = gates.GATES[("*", "*", "fp64")]
    ref = np.ones(10**4)
    ref[7] = 1e-6
    out = ref.copy()
    out[7] += 1e-11          # rel RMS 1e-13 is under the cap, but element 7 is off by 1e-5 of itself
    c = compare(out, ref, row.atol, row.rtol)
    assert c.rel_rms < row.cap
    v = judge(c, row, "fp64", None)
    assert not v.passed and "9999 of 10000 passed" in v.why


def test_speed_ratios_and_targets(monkeypatch):
    s = judge_speed("rmsnorm", "numpy32", seconds=1e-3, bytes_moved=10**6, copy_bw=1e10, baseline_seconds=2e-3)
    assert math.isclose(s.bw_ratio, (1e6 / 1e-3) / 1e10) and math.isclose(s.time_ratio, 0.5)
    assert s.passed is None and "report only" in s.note
    assert judge_speed("rmsnorm", "cuda", 1e-3, 10**6, 1e10, None, target_bw=0.05).passed is True
    assert judge_speed("rmsnorm", "cuda", 1e-3, 10**6, 1e10, None, target_bw=0.5).passed is False
    monkeypatch.setattr(gates, "SPEED_TARGETS", {**gates.SPEED_TARGETS,      # the table is read-only: a test copy
                                                 ("rmsnorm", "numpy32"): (None, 0.4, "test: at most 0.4x numpy32")})
    assert judge_speed("rmsnorm", "numpy32", 1e-3, 10**6, 1e10, 2e-3).passed is False
