"""The divergence measures of `conformance.dumps.divergence` on arrays whose answers are worked out by hand."""
from __future__ import annotations

import dataclasses
import json
import math

import ml_dtypes
import numpy as np
import pytest

from conformance.dumps.divergence import Divergence, bf16_ordered, divergence, ulp_distance
from conformance.dumps.experts import ExpertGain, ExpertPool, ExpertsCheck
from conformance.dumps.recompute import Row


def test_rel_rms_cosine_and_max_by_hand():
    ref = np.array([[3.0, 0.0], [0.0, 4.0]])          # ||r|| = 5
    eng = np.array([[3.0, 0.0], [0.0, 4.5]])          # e - r = 0.5 at [1, 1]
    d = divergence(eng, ref, bf16=False)
    assert d.rel_rms == pytest.approx(0.5 / 5.0, abs=1e-15)
    assert d.cosine == pytest.approx((9 + 18) / (5 * math.sqrt(9 + 20.25)), abs=1e-15)
    assert d.max_abs == 0.5 and d.max_index == [1, 1]
    assert d.ulp_max is None and d.ulp_median is None and d.nonfinite == 0 and d.note == ""


def test_equal_tensors_are_zero_apart():
    x = np.linspace(-2, 3, 12).reshape(3, 4)
    d = divergence(x, x, bf16=True)
    assert (d.rel_rms, d.max_abs, d.ulp_max, d.ulp_median) == (0.0, 0.0, 0, 0.0)
    assert d.cosine == pytest.approx(1.0, abs=1e-15)


def test_zero_reference_falls_back_to_absolute_rms_with_a_note():
    d = divergence(np.array([0.0, 3.0, 0.0, 4.0]), np.zeros(4), bf16=False)
    assert d.rel_rms == pytest.approx(math.sqrt(25 / 4))
    assert "absolute" in d.note


def test_ulp_distance_counts_bf16_steps_across_zero_and_signs():
    one = 1.0
    up1 = float(np.nextafter(ml_dtypes.bfloat16(1.0), ml_dtypes.bfloat16(2.0)))   # 1 + 2^-7
    assert up1 == 1.0 + 2.0 ** -7
    assert ulp_distance(np.array([up1]), np.array([one]))[0] == 1
    assert ulp_distance(np.array([1.0 + 3 * 2.0 ** -7]), np.array([one]))[0] == 3
    # +0 and -0 are one value; the smallest subnormals on both sides of zero are 2 steps apart
    tiny = float(np.finfo(ml_dtypes.bfloat16).smallest_subnormal)
    assert ulp_distance(np.array([-0.0]), np.array([0.0]))[0] == 0
    assert ulp_distance(np.array([-tiny]), np.array([tiny]))[0] == 2
    # the ordered keys sort like the values
    vals = np.array([-2.0, -1.0, -tiny, 0.0, tiny, 0.5, 1.0, 3.0])
    assert np.all(np.diff(bf16_ordered(vals)) > 0)


def test_ulp_of_a_reference_between_two_bf16_values_rounds_it_first():
    # r = 1 + 0.75 ulp rounds to 1 + 1 ulp: an engine at 1 + 1 ulp is 0 ulp away, one at 1.0 is 1 away
    r = np.array([1.0 + 0.75 * 2.0 ** -7])
    d = divergence(np.array([1.0]), r, bf16=True)
    assert d.ulp_max == 1 and d.ulp_median == 1.0
    assert divergence(np.array([1.0 + 2.0 ** -7]), r, bf16=True).ulp_max == 0


def test_nonfinite_engine_values_are_counted_and_left_out():
    ref = np.array([1.0, 2.0, 2.0, 4.0])
    eng = np.array([1.0, np.nan, np.inf, 5.0])
    d = divergence(eng, ref, bf16=True)
    assert d.nonfinite == 2
    assert d.rel_rms == pytest.approx(1.0 / math.sqrt(17.0))
    assert d.max_abs == 1.0 and d.max_index == [3]
    all_bad = divergence(np.array([np.nan]), np.array([1.0]), bf16=False)
    assert all_bad.nonfinite == 1 and math.isnan(all_bad.rel_rms) and all_bad.max_index == []


def test_shape_mismatch_is_a_named_error():
    with pytest.raises(ValueError, match=r"reference's shape \[2, 3\], found \[3, 2\]"):
        divergence(np.zeros((3, 2)), np.zeros((2, 3)), bf16=False)


def test_json_round_trip_is_strict_json_even_for_nan():
    for d in (divergence(np.array([1.0, 2.5]), np.array([1.0, 2.0]), bf16=True),
              divergence(np.array([np.nan]), np.array([1.0]), bf16=False)):
        text = json.dumps(d.to_json(), allow_nan=False)
        back = Divergence.from_json(json.loads(text))
        assert back.to_json() == d.to_json()
    with pytest.raises(ValueError, match="missing"):
        Divergence.from_json({"rel_rms": 0.0})


def test_gain_is_the_excess_along_the_reference():
    rng = np.random.default_rng(0)
    r = rng.standard_normal(64)
    assert divergence(1.01 * r, r, bf16=False).gain == pytest.approx(0.01, abs=1e-14)
    noise = rng.standard_normal(64)
    noise -= (noise @ r) / (r @ r) * r                  # orthogonal to r: moves rel_rms, not the gain
    d = divergence(r + 0.1 * noise, r, bf16=False)
    assert abs(d.gain) <= 1e-15 and d.rel_rms > 0.05
    assert divergence(np.ones(3), np.zeros(3), bf16=False).gain == 0.0     # no direction to measure along
    old = {k: v for k, v in d.to_json().items() if k != "gain"}             # JSON written before gain existed
    assert Divergence.from_json(old).gain == 0.0


def _row(rel, gain, *, experts=None):
    d = dataclasses.replace(divergence(np.ones(4), np.ones(4), bf16=False), rel_rms=rel, gain=gain)
    return Row(0, "mlp", d, budget=1e-2, gain_budget=4e-3, experts=experts)


def test_a_row_is_over_by_rel_rms_or_by_gain_and_says_which():
    assert _row(5e-3, 1e-3).over_by == [] and not _row(5e-3, 1e-3).over
    assert _row(2e-2, 1e-3).over_by == ["rel RMS 2.00e-02 > budget 1.00e-02"]
    assert _row(5e-3, -6e-3).over_by == ["gain -6.00e-03 beyond budget 4.00e-03"]
    row = _row(5e-3, 0.0, experts=ExpertsCheck(divergence(np.ones(4), np.ones(4), bf16=False),
                                               ExpertGain(3, 0.01, 9, 4.0), 1.5e-2))
    assert row.over and row.over_by == ["routed expert 3 gain +1.00e-02 over 9 slots (score 2.00e-02 > budget "
                                        "1.50e-02)"]
    back = Row.from_json(json.loads(json.dumps(row.to_json(), allow_nan=False)))
    assert back == row
    legacy = {k: v for k, v in row.to_json().items() if k not in ("gain_budget", "experts")}
    assert Row.from_json(legacy).gain_budget is None and Row.from_json(legacy).experts is None


def test_expert_pool_gain_and_effective_slots_by_hand():
    pool = ExpertPool()
    ref = np.array([[[1.0, 0.0], [0.0, 2.0]], [[3.0, 4.0], [1.0, 1.0]]])           # [T=2, k=2, Dl=2]
    eng = ref.copy()
    eng[0, 0] *= 1.02                                  # expert 5's two slots (token 0 slot 0, token 1 slot 1)
    eng[1, 1] *= 1.02
    eng[1, 0, 0] = np.nan                              # expert 7's only slot: non-finite, left out of the pool
    pool.add(np.array([[5, 6], [7, 5]]), eng, ref)
    worst = pool.worst()
    assert worst is not None and (worst.expert, worst.slots) == (5, 2)
    assert worst.gain == pytest.approx(0.02, abs=1e-14)
    assert worst.effective == pytest.approx((1 + 2) ** 2 / (1 + 4))          # |r|^2 = 1 and 2
    assert worst.score == pytest.approx(0.02 * np.sqrt(9 / 5))
    assert sorted(pool.sums) == [5, 6]
