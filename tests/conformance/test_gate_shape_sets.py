"""Caps that hold where they claim to: each measured cap names the shape set it was measured on, a case is gated by
the caps of its own set, a set with no measurement borrows none, and every hand cap lies above what the baselines
measured on every set that has measurements."""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from conformance.backends import registry as backends
from conformance.backends.registry import NumpyBackend, get_backend
from conformance.cases.catalog import all_cases, select
from conformance.cases.protocol import CONFIGS
from conformance.golden.regen import regenerate
from conformance.judge import gate_table, gates, measured
from conformance.judge.compare import compare
from conformance.judge.gate_row import BASELINE_FACTOR, Gate, baseline_row, qualified
from conformance.judge.gates import BaselineError, judge
from conformance.runner import Runner

CASE = "rmsnorm/T3-D239-eps1e-6"


def _case_in(shape_set: str):
    """The tiny rmsnorm case as a case of `shape_set` (same data, another set's name)."""
    (case,) = select(all_cases("tiny"), [CASE])
    return dataclasses.replace(case, config=shape_set)


@pytest.fixture
def golden_of(tmp_path):
    """shape_set -> (case, root): the rmsnorm case's golden written as a case of that set."""
    def make(shape_set: str):
        case = _case_in(shape_set)
        root = tmp_path / shape_set
        regenerate([case], root)
        return case, root
    return make


def _judged(case, root, backend: str):
    runner = Runner(root, case.config, False)
    try:
        return runner.run_one(case, get_backend(backend))
    finally:
        runner.close()


# ---------------------------------------------------------------------------------------------------
# a case is gated by its own set's caps
# ---------------------------------------------------------------------------------------------------


def test_a_case_is_gated_by_the_caps_measured_on_its_own_set(monkeypatch, golden_of):
    """Two sets with their own measurement of numpy32 on rmsnorm y: a generous one on 'roomy', one far below
    numpy32's error on 'strict'. The same case passes as a 'roomy' case and fails as a 'strict' one, by that
    set's row."""
    rows = {("rmsnorm", qualified("roomy", "y"), "fp32"): baseline_row("fp32", 1e-3, "roomy's case", "roomy"),
            ("rmsnorm", qualified("strict", "y"), "fp32"): baseline_row("fp32", 1e-12, "strict's case", "strict")}
    monkeypatch.setattr(gates, "BASELINE_GATES", {**gates.BASELINE_GATES, **rows})
    monkeypatch.setattr(gates, "MEASURED", {**gates.MEASURED, "roomy": frozenset({"blocks"}),
                                            "strict": frozenset({"blocks"})})
    roomy = _judged(*golden_of("roomy"), "numpy32")
    strict = _judged(*golden_of("strict"), "numpy32")
    assert roomy.status == "pass" and strict.status == "fail"
    (t_roomy,), (t_strict,) = roomy.tensors, strict.tensors
    assert t_roomy.gate_key == ("rmsnorm", "roomy:y", "fp32") and t_roomy.verdict.bound == pytest.approx(3e-3)
    assert t_strict.gate_key == ("rmsnorm", "strict:y", "fp32") and "worst on strict" in t_strict.verdict.why
    assert t_roomy.comparison.rel_rms == t_strict.comparison.rel_rms   # the same data, judged by other caps


def test_the_look_up_finds_a_sets_own_rows_and_never_another_sets():
    for shape_set, cases in measured.BLOCK_CASES.items():
        for (block, tensor), ((fp32, _), _) in cases.items():
            key, row = gates.baseline_gate_for(block, tensor, "fp32", shape_set)
            assert key == (block, qualified(shape_set, tensor), "fp32")
            assert row.cap == pytest.approx(BASELINE_FACTOR * fp32)
    # a set with no measurement finds no measured row: the hand cap, said to be one
    key, row = gates.baseline_gate_for("attnres_mix", "out", "bf16", "never-measured")
    assert ":" not in key[1] and "no baseline row measured on never-measured" in row.reason
    assert gates.gate_for("attnres_mix", "out", "bf16", "never-measured")[0] == key


# ---------------------------------------------------------------------------------------------------
# a set with no measurement
# ---------------------------------------------------------------------------------------------------


def test_a_set_with_no_measurement_borrows_no_cap(monkeypatch, extra_backend, golden_of):
    """With the rmsnorm hand cap set below k x numpy32 + floor: on a set no one measured, a backend past that cap
    but within k x numpy32 + floor passes, its rule saying no cap was measured there, while on tiny the cap fails
    it; numpy32 itself is held to the hand cap, said to be a sanity bound, not a measurement."""
    key = ("rmsnorm", "*", "fp32")
    hand = dataclasses.replace(gates.GATES[key], cap=1.5e-7)
    monkeypatch.setattr(gates, "GATES", {**gates.GATES, key: hand})

    def scaled(base, by):
        return base.replace(rmsnorm=lambda x, w, eps: np.asarray(base.rmsnorm(x, w, eps)) * np.float32(by))

    for name, by in (("near32", 1 + 5e-7), ("far32", 1 + 5e-6)):
        extra_backend(name, lambda name=name, by=by: NumpyBackend(name, "fp32",
                                                                  lambda: scaled(backends.reference_cores(), by)))
    case, root = golden_of("never-measured")
    assert not gates.caps_measured("never-measured", "blocks")
    (near,) = _judged(case, root, "near32").tensors
    assert near.passed and near.comparison.rel_rms > hand.cap, near.verdict.why
    assert "no cap measured on never-measured" in near.verdict.why
    assert near.verdict.bound == pytest.approx(hand.k * near.baseline_err + hand.floor)   # no min(cap, ...)
    (far,) = _judged(case, root, "far32").tensors
    assert not far.passed and "no cap measured on never-measured" in far.verdict.why   # no cap is not no bound
    (b,) = _judged(case, root, "numpy32").tensors
    assert b.passed and b.verdict.bound == hand.cap and "a sanity bound" in b.verdict.why
    # the same backend on tiny: min(cap, ...) from tiny's rows, and the cap fails it
    (tiny,) = _judged(*golden_of("tiny"), "near32").tensors
    assert not tiny.passed and tiny.verdict.why.startswith("rel RMS <= min(cap 1.5e-07")


@pytest.mark.parametrize("err, base_err, own_cap, passes, says", [
    pytest.param(3e-2, 2e-2, None, True, "no cap measured on k9", id="as-good-as-the-baseline-past-the-cap"),
    pytest.param(6e-2, 2e-2, None, False, "no cap measured on k9", id="past-k-times-the-baseline"),
    pytest.param(3e-2, 2e-2, 1e-2, False, "failed its own row", id="a-broken-baseline-sets-no-bound"),
])
def test_the_rule_for_a_set_with_no_measurement(err, base_err, own_cap, passes, says):
    ref = np.random.default_rng(0).standard_normal(256)
    out = ref * (1 + err * np.where(np.arange(256) % 2, 1.0, -1.0))
    gate = Gate(1e-2, 2.5, 0.0, 0.0, 0.0, "test row")
    v = judge(compare(out, ref), gate, "bf16", BaselineError(base_err, own_cap=own_cap), capped=False,
              uncapped_why=gates.no_cap_measured("k9", "blocks"))
    assert v.passed is passes and says in v.why, v.why
    assert math.isclose(v.bound, gate.cap if own_cap else 2.5 * base_err)


def test_only_the_sets_written_down_are_measured():
    assert dict(gates.MEASURED) == {s: frozenset(f for f, t in (("blocks", measured.BLOCK_CASES),
                                                                ("traces", measured.TRACES)) if s in t)
                                    for s in {*measured.BLOCK_CASES, *measured.TRACES}}
    for shape_set in CONFIGS:
        for family in ("blocks", "traces"):
            table = measured.BLOCK_CASES if family == "blocks" else measured.TRACES
            assert gates.caps_measured(shape_set, family) == (shape_set in table)
    with pytest.raises(TypeError, match="read-only"):
        gate_table.MEASURED["k9"] = frozenset({"blocks"})   # type: ignore[index]


# ---------------------------------------------------------------------------------------------------
# every row says where it was measured; the measurements are real cases of their set
# ---------------------------------------------------------------------------------------------------


def test_every_row_names_the_shapes_it_holds_on():
    blocks_measured = sorted(s for s, f in gates.MEASURED.items() if "blocks" in f)
    for table in (gates.GATES, gates.BASELINE_GATES):
        for (block, tensor, precision), row in table.items():
            where = (block, tensor, precision)
            if ":" in tensor:   # measured on one set: its reason says which
                assert f"on {tensor.split(':', 1)[0]}" in row.reason, where
            elif precision == "fp64":
                assert "the same on every shape set" in row.reason, where
            elif block == "greedy":
                assert "exact integers" in row.reason, where
            else:   # by hand: checked against every set with block measurements
                assert f"measured worst on {', '.join(blocks_measured)}" in row.reason, where
    for key in gates.BASELINE_GATES:
        assert ":" in key[1], key   # a baseline's row is always a measurement of one set


@pytest.mark.parametrize("shape_set", sorted(measured.BLOCK_CASES))
def test_each_sets_caps_come_from_measurements_of_its_own_cases(shape_set):
    names = {c.name for c in all_cases(shape_set)}
    cases = measured.BLOCK_CASES[shape_set]
    assert {c.name.split("/")[0] for c in all_cases(shape_set) if c.kind != "trace"} <= {b for b, _ in cases}
    for (block, tensor), worsts in cases.items():
        for precision, (worst, where) in zip(("fp32", "bf16"), worsts, strict=True):
            assert where.split(";")[0] in names, (shape_set, block, where)   # a case of that set set it
            row = gates.BASELINE_GATES[(block, qualified(shape_set, tensor), precision)]
            assert row.cap == pytest.approx(BASELINE_FACTOR * worst)
            assert f"measured {worst:.3g} worst on {shape_set} ({where})" in row.reason


def test_small_has_its_own_measurements_not_tinys():
    tiny, small = measured.BLOCK_CASES["tiny"], measured.BLOCK_CASES["small"]
    small_blocks = {c.block for c in all_cases("small") if c.kind != "trace"}
    assert {b for b, _ in small} == small_blocks <= {b for b, _ in tiny}   # each block it has, small measures anew
    assert any(small[k] != tiny[k] for k in small)
    # the one that broke small out of the box: tiny's attnres_mix caps are below small's measured error
    (tiny32, _), (tiny16, _) = tiny[("attnres_mix", "out")]
    (small32, _), (small16, _) = small[("attnres_mix", "out")]
    assert small32 > BASELINE_FACTOR * tiny32 and small16 > BASELINE_FACTOR * tiny16


# ---------------------------------------------------------------------------------------------------
# hand rows hold on every set they gate
# ---------------------------------------------------------------------------------------------------


def test_every_hand_cap_lies_above_every_sets_measured_worst():
    assert gate_table.hand_caps_below_measurements(gate_table._BY_HAND, measured.BLOCK_CASES) == []


def test_a_hand_cap_below_a_measurement_is_found():
    fake = {"k9": {("attnres_mix", "out"): ((1e-7, "attnres_mix/S9-T16-D7168"), (0.5, "attnres_mix/S9-T16-D7168"))}}
    (bad,) = gate_table.hand_caps_below_measurements(gate_table._BY_HAND, fake)
    assert bad.startswith("('*', '*', 'bf16') cap 0.03 < 0.5 measured on k9 (attnres_mix/S9-T16-D7168)")
    # a set's own variant of the row (of the block, or the set's default) fixes it, and wins for that set only
    for key in (("attnres_mix", "k9:*", "bf16"), ("*", "k9:*", "bf16")):
        variant = {**gate_table._BY_HAND, key: Gate(1.0, 2.5, 0.0, 0.0, 0.0, "k9's own")}
        assert gate_table.hand_caps_below_measurements(variant, fake) == []
        assert gates.lookup(variant, "attnres_mix", "out", "bf16", "k9")[0] == key
        assert gates.lookup(variant, "attnres_mix", "out", "bf16", "tiny")[0] == ("*", "*", "bf16")


def test_the_element_rule_sits_above_every_sets_measured_ratio():
    assert gate_table.element_rules_below_measurements() == []
    for shape_set, (ratio, where) in measured.ELEMENT_RATIO_BY_SET.items():
        rule = gate_table.element_rule("fp32", shape_set)
        assert rule is not None and ratio < rule[0], (shape_set, ratio)
        assert f"{ratio:g}x on {shape_set} ({where})" in rule[2]


def test_a_sets_own_element_rule_applies_on_that_set_only():
    """k3's outlier channels measured a worst element ratio past the shared 8x: k3 has its own multiple, and the
    other sets keep the shared one, whose reason lists only the sets it holds on."""
    (ratio, _), shared = measured.ELEMENT_RATIO_BY_SET["k3"], gate_table.ELEMENT_RULES["fp32"]
    assert ratio > shared[0] and f"{ratio:g}x on k3" not in shared[2] and "own rules on k3" in shared[2]
    for block, tensor in (("kda_decode", "o"), ("rmsnorm", "y")):
        own = gates.gate_for(block, tensor, "fp32", "k3")[1]
        assert (own.elem_k, own.elem_why) == gate_table.ELEMENT_RULES_BY_SET["k3"]["fp32"][::2]
        for other in ("tiny", "small", "never-measured", None):
            assert gates.gate_for(block, tensor, "fp32", other)[1].elem_k == shared[0], other
    with pytest.raises(TypeError, match="read-only"):
        gate_table.ELEMENT_RULES_BY_SET["k3"]["fp32"] = (1e9, 0.0, "anything")   # type: ignore[index]


def _sizes(shape_set: str, block: str, name: str) -> list[int]:
    return [int(c.params[name]) for c in all_cases(shape_set) if c.block == block and name in c.params]


@pytest.mark.parametrize("shape_set", CONFIGS)
def test_the_sizes_hand_reasons_state_hold_on_every_set(shape_set):
    """A hand row's reason that bounds a size must be true of every case it gates, on every set."""
    for block, name, row in (("rmsnorm", "D", ("rmsnorm", "*", "fp32")),
                             ("mxfp4_gemv", "K", ("mxfp4_gemv", "*", "fp32")),
                             ("mla_decode", "R", ("mla_decode", "*", "fp32"))):
        stated = [int(n) for n in re.findall(r"<= (\d+)", gates.GATES[row].reason)]
        assert stated, row
        limit = stated[0] - (64 if block == "mla_decode" else 0)   # MLA rows: kv_lora R + rope 64
        assert all(size <= limit for size in _sizes(shape_set, block, name)), (shape_set, row, stated)
    for row, g in gates.GATES.items():   # no hand reason bounds T or a row count any more
        if ":" not in row[1]:
            assert not re.search(r"T ?<= ?\d|<= ?\d+ rows", g.reason), row
