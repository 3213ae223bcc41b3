"""What a person reads after a run: each table cell says how near its bound it came and names the tensor the
first-failure line names; token flips are counted in tokens; what a backend cannot run is one line per backend,
not one per case; `k3conf regen --check` lists only the goldens that need action.

The results are built from real comparisons judged by real gate rows (conformance.judge), so a cell's numbers
are the judge's own."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from conformance import report_md
from conformance import report_text as rep
from conformance.cli.regen import DRIFT_LINES, report_lines
from conformance.golden.drift import TensorDrift
from conformance.golden.regen import RegenOutcome
from conformance.judge.compare import compare
from conformance.judge.gates import BaselineError, Gate, judge
from conformance.results import CaseResult, RunReport, TensorResult

# fp32 row: bound = min(cap, k x baseline + floor); atol/rtol 0, so "N of M passed" counts exact elements only
FP32_ROW = Gate(1e-3, 2.0, 0.0, 0.0, 0.0, "test row: 2x the fp32 baseline")
FP64_ROW = Gate(1e-12, None, 0.0, 1e-14, 1e-12, "test row: float64 against float64")
BASE_ERR = 5e-6   # the fp32 baseline's error on every tensor here: the bound is 1e-5


def _tensor(name: str, rel: float, row: Gate = FP32_ROW, precision: str = "fp32", n: int = 64) -> TensorResult:
    """A float tensor whose output is off the golden by relative RMS error `rel`, judged by `row`."""
    ref = np.random.default_rng(len(name)).standard_normal(n)
    out = ref * (1.0 + rel)
    cmp = compare(out, ref, row.atol, row.rtol)
    base = None if precision == "fp64" else BaselineError(BASE_ERR)
    return TensorResult(name, "rmsnorm", cmp, ("rmsnorm", name, precision), row, judge(cmp, row, precision, base))


def _ints(name: str, ref: np.ndarray, out: np.ndarray) -> TensorResult:
    cmp = compare(out, ref)
    return TensorResult(name, "greedy", cmp, ("greedy", name, "fp32"), FP32_ROW, judge(cmp, FP32_ROW, "fp32", None))


def _result(case: str, tensors: list[TensorResult], backend: str = "cand32", status: str = "", **kw) -> CaseResult:
    status = status or ("pass" if all(t.passed for t in tensors) else "fail")
    return CaseResult(case, case.split("/")[0], backend, "fp32", status, tensors, **kw)


def _report(results: list[CaseResult]) -> RunReport:
    names = dict.fromkeys(r.backend for r in results)
    return RunReport("tiny", [{"name": b, "available": True, "reason": ""} for b in names], results, 1.0, {})


def _terminal(report: RunReport) -> list[str]:
    text = io.StringIO()
    rep.print_terminal(report, Console(file=text, width=250, color_system=None))
    return text.getvalue().splitlines()


# ---------------------------------------------------------------------------------------------------
# a cell: the error, its share of the bound, the tensor the first-failure line names
# ---------------------------------------------------------------------------------------------------


def test_a_passing_cell_says_what_share_of_its_bound_the_error_is():
    r = _result("rmsnorm/T1-D8", [_tensor("y", 1.2e-6)])
    assert r.worst is not None and r.worst.verdict.bound == pytest.approx(2 * BASE_ERR)
    assert rep.cell(r) == "ok 1e-06 (12%)"


@pytest.mark.parametrize("fraction, shown", [
    pytest.param(0.999, "99%", id="never-rounded-up-to-a-full-bound"),
    pytest.param(0.004, "<1%", id="below-one-percent"),
    pytest.param(1.0, "100%", id="at-the-bound"),
])
def test_a_share_is_never_rounded_up(fraction, shown):
    assert rep._percent(fraction) == shown


def test_the_report_names_the_tensor_nearest_its_bound():
    r = _result("kda_decode/B1", [_tensor("o", 1e-6), _tensor("state", 8e-6)])
    assert rep.cell(r) == "ok 8e-06 (80%)"                       # the terminal: short
    md = report_md.markdown(_report([r]))
    assert "| kda_decode/B1 | ok 8e-06 (80%) state |" in md          # report.md: which tensor that is


def test_a_failing_cell_names_the_tensor_of_the_first_failure_line():
    # o fails first (3x its bound); state fails by more (100x): the line and the cell must agree on one
    r = _result("kda_decode/B1", [_tensor("o", 3e-5), _tensor("state", 1e-3 * 0.999)])
    report = _report([r])
    cell = rep.cell(r)
    assert cell == "FAIL 3e-05>1e-05 o", cell
    assert report.first_failure_line().startswith("FIRST FAILURE: kda_decode/B1 on cand32: outputs.o ")


def test_a_failure_of_the_per_element_rule_does_not_read_as_an_error_under_its_bound():
    row = Gate(1e-1, 2.0, 0.0, 0.0, 0.0, "test row", elem_k=1.0, elem_floor=0.0, elem_why="test")
    ref = np.random.default_rng(3).standard_normal(512)
    out = ref.copy()
    out[-1] += 0.05
    cmp = compare(out, ref)
    v = judge(cmp, row, "fp32", BaselineError(5e-3, worst_err=0.01))
    assert not v.passed and cmp.rel_rms <= v.bound
    t = TensorResult("y", "rmsnorm", cmp, ("rmsnorm", "y", "fp32"), row, v)
    assert rep.cell(_result("rmsnorm/T1-D512", [t])) == "FAIL worst element"


def test_greedy_token_flips_are_counted_in_tokens():
    tokens = [_ints(f"step{i}.token", np.array([7]), np.array([7 if i == 0 else 9])) for i in range(5)]
    r = _result("trace/free-P7-D5", [_tensor("step1.logits", 1e-6), *tokens])
    assert rep.cell(r) == "FAIL 4 of 5 tokens"
    assert "outputs.step1.token" in _report([r]).first_failure_line()


def test_an_integer_tensor_counts_its_differing_values():
    idx = _ints("idx", np.arange(20), np.r_[np.arange(17), [0, 0, 0]])
    assert rep.cell(_result("moe_route/T5", [idx])) == "FAIL 3 of 20 idx values"


def test_the_flips_of_one_result_are_one_line():
    flips = [{"step": s, "expected": 7, "found": 9, "margin": 0.5} for s in (1, 2, 3, 4)]
    r = _result("trace/free-P7-D5", [_tensor("step1.logits", 1e-6)], status="fail", flips=flips)
    (line,) = rep.flip_lines(_report([r]))
    assert line.startswith("trace/free-P7-D5 on cand32: 4 greedy token flips: step 1: expected 7, found 9")


# ---------------------------------------------------------------------------------------------------
# what a backend cannot run: one line per backend and reason
# ---------------------------------------------------------------------------------------------------

BLOCKS = ("rmsnorm", "moe_route", "kda_prefill", "mla_prefill")


def _swap_one_core_run() -> RunReport:
    """A backend with one kernel core (kda_decode): 28 per-block cases n/a, the same two notes on 32 traces;
    a whole-trace backend skips every per-block case for one reason."""
    results, na = [], "reference core: cand32 supplies no kernel for {}, so only k3ref's core would run"
    for i in range(28):
        block = BLOCKS[i % len(BLOCKS)]
        case = f"{block}/T{i}"
        results.append(_result(case, [_tensor("y", 1e-6)], backend="numpy32", role="baseline"))
        results.append(_result(case, [], status="n/a", error=na.format(block)))
        results.append(_result(case, [], backend="model32", status="skip",
                               error="model32 runs whole model traces only: n/a for the per-block cases"))
    notes = [f"{core}: k3ref's reference core ran (not a kernel core of cand32)" for core in ("kda_prefill",
                                                                                                "moe_route")]
    for i in range(32):
        case = f"trace/free-T{i}"
        results.append(_result(case, [_tensor("step1.logits", 1e-6)], backend="numpy32", role="baseline"))
        results.append(_result(case, [_tensor("step1.logits", 2e-6)], notes=notes))
        results.append(_result(case, [_tensor("step1.logits", 2e-6)], backend="model32"))
    return _report(results)


def test_cases_a_backend_cannot_run_are_one_line_per_backend():
    lines = _terminal(_swap_one_core_run())
    na = [line for line in lines if line.startswith("cand32") and "n/a" in line]
    assert na == ["cand32: 28 cases n/a (reference core only: cand32 supplies no kernel for the cores they "
                  "exercise): every case but trace/*"], na
    skips = [line for line in lines if "model32" in line and "per-block" in line]
    assert skips == ["model32: 28 cases skipped (model32 runs whole model traces only: n/a for the per-block "
                     "cases): every case but trace/*"], skips
    notes = [line for line in lines if "reference core ran" in line]
    assert notes == ["cand32: kda_prefill, moe_route: k3ref's reference core ran (not a kernel core of cand32) — on 32 "
                     "cases: trace/*"], notes
    rows = [line for line in lines if line.startswith("│ rmsnorm/T0 ")]
    assert len(rows) == 1 and "skip" not in rows[0] and "n/a" not in rows[0] and rows[0].count(" - ") == 2, rows
    assert len(lines) < 28 + 32 + 12, len(lines)    # the table's rows and a handful of lines


def test_a_case_no_backend_runs_has_no_row():
    runs = _result("kda_decode/B1-K128", [_tensor("o", 1e-6)])
    na = _result("rmsnorm/T1", [], status="n/a", error="reference core: cand32 supplies no kernel for rmsnorm, so ...")
    lines = _terminal(_report([runs, na]))
    assert not any(line.startswith("│ rmsnorm/T1 ") for line in lines), lines
    assert any(line.startswith("│ kda_decode/B1-K128 ") for line in lines), lines
    assert "cand32: 1 case n/a (reference core only: cand32 supplies no kernel for the cores they exercise): " \
           "rmsnorm/T1" in lines, lines


def test_a_backend_that_runs_few_cases_names_those_it_runs():
    na = "reference core: cand32 supplies no kernel for {}"
    results = [_result(f"{block}/T{i}", [], status="n/a", error=na.format(block)) for block in BLOCKS for i in range(3)]
    results += [_result(f"kda_decode/T{i}", [_tensor("o", 1e-6)]) for i in range(2)]
    (line,) = rep.not_run_lines(_report(results))
    assert line.endswith("cores they exercise): every case but kda_decode/*"), line


def test_a_skip_among_the_cases_a_backend_runs_stays_in_the_table():
    runs = _result("kda_decode/B1-K128", [_tensor("o", 1e-6)])
    skipped = _result("kda_decode/B2-K16", [], status="skip", error="kernel built for K = 128, found K=16")
    lines = _terminal(_report([runs, skipped]))
    assert any(line.startswith("│ kda_decode/B2-K16 ") and "skip" in line for line in lines), lines
    assert "cand32: skipped kda_decode/B2-K16: kernel built for K = 128, found K=16" in lines


def test_a_long_result_lists_its_failures_and_the_tensors_nearest_their_bounds():
    reported = [_tensor(f"step1.layer{i:02d}.x", 1e-7 * (i + 1)) for i in range(30)]
    for t in reported:
        t.gated = False
    gated = _tensor("step1.logits", 1e-7)                      # gated, but nearer its bound than no other
    r = _result("trace/free-P7-D5", [*reported, gated])
    rows = report_md._md_rows(r)
    shown = [row.split(" | ")[3] for row in rows[:-1]]
    assert shown == [*(f"step1.layer{i:02d}.x" for i in range(25, 30)), "step1.logits"], shown
    assert "| 25 more tensors, each within its bound" in rows[-1]


# ---------------------------------------------------------------------------------------------------
# per-element counts only where a rule counts elements
# ---------------------------------------------------------------------------------------------------


def test_the_element_count_shows_only_where_a_rule_decides_by_it():
    baseline = _result("rmsnorm/T1", [_tensor("y", 1e-7)], backend="numpy32", role="baseline")
    fp64 = _tensor("y", 1e-15, FP64_ROW, "fp64")
    exact = CaseResult("rmsnorm/T1", "rmsnorm", "numpy64", "fp64", "pass", [fp64])
    assert baseline.tensors[0].comparison.passed_line == "0 of 64 passed"   # what used to read as a failure
    assert not rep.counts_elements(baseline, baseline.tensors[0])
    assert rep.counts_elements(exact, fp64)
    md = report_md.markdown(_report([baseline, exact]))
    assert "0 of 64 passed" not in md and "64 of 64 passed" in md
    failing = _result("rmsnorm/T2", [_tensor("y", 1e-3)])      # fp32: the bound decides, not the count
    assert "rel RMS 0.001" in rep._why(failing) and "passed" not in rep._why(failing), rep._why(failing)


# ---------------------------------------------------------------------------------------------------
# regen --check: a summary, and only the goldens that need action
# ---------------------------------------------------------------------------------------------------


def test_regen_check_lists_only_the_goldens_that_need_action():
    root = Path("/g")
    rounding = [TensorDrift(f"outputs.t{i}", "changed", 1e-15, 1e-15 * (i + 1)) for i in range(40)]
    outcomes = ([RegenOutcome(f"rmsnorm/T{i}", root / f"r{i}", "unchanged") for i in range(60)]
                + [RegenOutcome(f"trace/t{i}", root / f"t{i}", "rounding", rounding) for i in range(5)]
                + [RegenOutcome("mla_decode/B1", root / "m", "drift",
                                [TensorDrift("outputs.o", "changed", 1e-3, 1e-3),
                                 TensorDrift("metadata.seed", "changed", detail="'99' -> '5'")])])
    lines = report_lines(outcomes, {o.case for o in outcomes}, root)
    assert lines == ["mla_decode/B1: DRIFT  [/g/m]",
                     "    outputs.o: changed, max abs 0.001, rel RMS 0.001",
                     "    metadata.seed: changed '99' -> '5'",
                     "66 case(s) in /g: 60 unchanged, 5 rounding-only drift (kept), 1 DRIFT",
                     "rounding-level drift (<= 1e-12 relative RMS; the files are kept): largest 4e-14 on trace/t0 "
                     "outputs.t39"], lines


def test_a_changed_trace_shows_its_largest_drift_first_and_counts_the_rest():
    drift = [TensorDrift(f"outputs.t{i:03d}", "changed", 1.0, float(i)) for i in range(100)]
    lines = report_lines([RegenOutcome("trace/t", Path("/g/t"), "changed", drift)], {"trace/t"}, Path("/g"))
    shown = [line for line in lines if line.startswith("    outputs.")]
    assert len(shown) == DRIFT_LINES and shown[-1].startswith("    outputs.t099: changed")
    assert f"    ... and {100 - DRIFT_LINES} more tensor(s) changed less" in lines
