"""The gate table: ONE table keyed by (block, tensor, precision), a reason for every number.

Accuracy (docs/spec.md section 5.2):
- fp64 rows are absolute bounds on the relative RMS error against the float64 golden. The `numpy64`
  backend runs the very code that wrote the goldens, so it is exact by construction on the machine that
  generated them; the bound only leaves room for another CPU's BLAS rounding (~1e-16 per operation).
- fp32 / bf16 rows are baseline-relative, flash-attention's rule, plus an absolute cap:
      err(backend vs fp64) <= k * err(baseline at the same precision vs fp64) + floor   and   err <= cap
  with err = relative RMS error. Baselines: fp32 -> "numpy32", bf16 -> "torch-bf16". When the baseline
  cannot run here, the cap alone applies and the report says so. In a free-running trace the logits of every
  step take the baseline's worst error over the run's steps (`TraceKind.pooled_baseline`: one step's error is one
  draw of compounded rounding noise). The bf16 rows have no floor and k = 2.5, so
  no bf16 bound exceeds 3x what torch-bf16 errs on the same tensor: a bf16 core 1% off fails.
- No baseline judges itself: the baseline backend of a precision is shown as "baseline" with its error and
  gated by an absolute row of BASELINE_GATES, about 3x the worst error it measured on that (block, tensor),
  the measurement written in the row's reason. A change that makes the baseline itself worse fails there.
- Integer tensors (router indices) must match exactly at every precision; the data of the cases keeps
  the router's k-th and (k+1)-th scores apart by more than bf16 rounding, so a flip is a bug.
- `atol` / `rtol` give the per-element rule behind "N of M passed"; it is reported, the verdict uses the
  relative RMS error (and, at fp64, requires every element within atol + rtol |ref|).

Speed: ratios measured in one run. bw_ratio = achieved bytes/s over the copy bandwidth measured in the
same run; time_ratio = time over the baseline backend's time for the same case. CPU rows are report-only
unless SPEED_TARGETS gives a target; a backend may bring its own (speed_target); the cuda kernels' bandwidth
targets are gated by tools/gpu_bench.py at sizes that fill the GPU, not on the toy-sized goldens.

Shape sets: a cap holds on the shapes it was measured on. A case of shape set X (its `config`: tiny, small, k3,
...) is gated by the rows measured on X ('<X>:<tensor>' keys) and the rows written by hand, never by another set's
measurements. On a set with no measurement of the case's family (gate_table.MEASURED: block cases or traces) no
cap applies to a backend judged against its baseline: the bound is k x the baseline's error + floor alone (as on
fresh inputs), and the rule says "no cap measured on X". The baseline itself is held there to its block's hand
cap, a sanity bound and not a measurement (the rule says so), so a baseline gone wrong still fails and then
sets nobody's bound.

Look-up (gate_row.lookup) tries '<set>:<tensor>' and the bare tensor: an exact key, then rows of that block whose
tensor is a glob pattern matching either name (the longest literal start, then the longest pattern, first), then
(block, "*", precision), then the set's default ("*", "<set>:*", precision), then ("*", "*", precision).
The rows themselves, the near-tie budgets and the speed targets are built in conformance.judge.gate_table.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from conformance.judge.compare import Comparison, compare
from conformance.judge.gate_row import BASELINE, PRECISIONS, Gate, lookup
from conformance.judge.gate_table import (
    BASELINE_GATES,
    BIAS_RULES,
    DIGEST,
    ELEMENT_RULES,
    FREE_MARGIN_BUDGETS,
    GATES,
    MARGIN_BUDGETS,
    MEASURED,
    SPEED_TARGETS,
    TABLES,
    element_rule,
    table_digest,
)

# the names other modules read here: the row type and the tables it is looked up in
__all__ = ["BASELINE", "BASELINE_GATES", "BIAS_RULES", "FREE_MARGIN_BUDGETS", "FRESH", "GATES", "MARGIN_BUDGETS",
           "MEASURED", "PRECISIONS", "SPEED_TARGETS", "BaselineError", "Gate", "SpeedResult", "Verdict",
           "baseline_gate_for", "caps_measured", "errors_against", "gate_for", "judge", "judge_speed", "larger_errors",
           "lean_test", "lookup", "margin_budgets", "near_tie_route", "no_cap_measured", "judge_state",
           "tables_changed"]

# why no cap applies on fresh inputs (judge, capped=False)
FRESH = "fresh inputs: the caps were measured on the goldens; the baseline's larger error, here or on the golden"


def near_tie_route(inter, where: str, budget: float):
    """The golden's router choice at MoE layer step `where` ('step1.layer04') for the tokens whose golden margin
    (`route.<where>.margin`) is below `budget`: (near [T] bool, choice [T, k] int64), or None where no token is
    (or the golden stores no margin there, or the budget is 0). The one rule by which every trace backend, the
    core path and the whole torch model alike, is teacher-forced."""
    margin = inter.get(f"route.{where}.margin")
    if margin is None or budget <= 0:
        return None
    near = np.asarray(margin) < budget
    if not near.any():
        return None
    return near, np.asarray(inter[f"route.{where}.choice"]).astype(np.int64)


def margin_budgets(precision: str, mode: str) -> dict[str, float]:
    """choice ('router', 'argmax') -> the near-tie budget at `precision` in a trace of `mode` ('layerwise' or
    'free': FREE_MARGIN_BUDGETS) (none: every choice must match)."""
    if mode not in ("layerwise", "free"):
        raise ValueError(f"trace mode: expected 'layerwise' or 'free', found {mode!r}")
    table = FREE_MARGIN_BUDGETS if mode == "free" else MARGIN_BUDGETS
    return {choice: budget for choice, (budget, _) in table.get(precision, {}).items()}


def caps_measured(shape_set: str, family: str) -> bool:
    """Whether the caps of `family` ('blocks': per-block and latent_moe cases, 'traces') were measured on
    `shape_set`; where not, no cap applies (no_cap_measured says why)."""
    if family not in ("blocks", "traces"):
        raise ValueError(f"family: expected 'blocks' or 'traces', found {family!r}")
    return family in MEASURED.get(shape_set, frozenset())


def no_cap_measured(shape_set: str, family: str) -> str:
    """Why a case of `shape_set` is judged with no cap: none was measured there (written into its rule)."""
    return (f"no cap measured on {shape_set} (its {family} have no measurement in conformance/judge/measured.py; "
            f"measure them with `k3conf run --config {shape_set} --no-timing`)")


def gate_for(block: str, tensor: str, precision: str,
             shape_set: str | None = None) -> tuple[tuple[str, str, str], Gate]:
    """The row that applies to (block, tensor, precision) of a case of `shape_set` and its key (most specific
    first). shape_set None: the rows written by hand alone (the kernels' own tests, which have no shape set)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, found {precision!r}")
    key, gate = lookup(GATES, block, tensor, precision, shape_set)
    if gate is None or key is None:
        raise KeyError(f"no gate row for {(block, tensor, precision)}")  # unreachable: defaults exist
    shared, own = ELEMENT_RULES.get(precision), element_rule(precision, shape_set)
    if own is not None and own != shared and (gate.elem_k, gate.elem_floor, gate.elem_why) == shared:
        # the set's own per-element rule, where the shared one does not hold there
        gate = dataclasses.replace(gate, elem_k=own[0], elem_floor=own[1], elem_why=own[2])
    return key, gate


def baseline_gate_for(block: str, tensor: str, precision: str,
                      shape_set: str) -> tuple[tuple[str, str, str], Gate]:
    """The absolute row for the baseline backend itself on a case of `shape_set`: the one measured on that set.
    Where none was (a new block, or a set not measured), the block's own hand cap applies as a sanity bound and
    the reason says that it is not a measurement."""
    key, gate = lookup(BASELINE_GATES, block, tensor, precision, shape_set)
    if gate is not None and key is not None:
        return key, gate
    key, gate = gate_for(block, tensor, precision, shape_set)
    return key, dataclasses.replace(gate, k=None, reason=f"no baseline row measured on {shape_set}: the hand cap of "
                                                         f"{key}, a sanity bound ({gate.reason})")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The decision for one compared tensor."""

    passed: bool
    bound: float          # the relative-RMS bound that applied
    why: str              # what decided it (the rule, with numbers)


@dataclasses.dataclass(frozen=True)
class BaselineError:
    """What the same-precision baseline measured on one tensor: the whole-tensor and the per-element error."""

    rel_rms: float                   # ||out - ref|| / ||ref||
    worst_err: float | None = None   # max |out - ref| / RMS(ref) (Comparison.worst_err); None: not measured
    own_cap: float | None = None   # the baseline's own BASELINE_GATES cap on this tensor (None: not known)
    row_leans: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)   # Comparison's

    @property
    def failed_own_row(self) -> bool:
        """A baseline over its own cap is broken here: it cannot set anyone's bound."""
        return self.own_cap is not None and self.rel_rms > self.own_cap


def errors_against(outs: dict, refs: dict) -> dict[str, BaselineError]:
    """tensor -> a baseline's relative RMS and worst element errors, its outputs `outs` against the golden's `refs`.
    A tensor the baseline got wrong in kind (missing, misshaped, NaN where the golden has none) has no error to
    scale a bound by: it is left out, so that row falls back to the cap alone instead of to k * 0 + floor."""
    errs = {}
    for t, ref in refs.items():
        if t in outs:
            c = compare(outs[t], ref)
            if not c.problem and not c.exact and c.nonfinite_ok:
                errs[t] = BaselineError(c.rel_rms, c.worst_err, row_leans=c.row_leans)
    return errs


def larger_errors(fresh: dict[str, BaselineError], committed: dict[str, BaselineError] | None
                  ) -> dict[str, BaselineError]:
    """Per tensor of `fresh` (a baseline's errors on fresh inputs), each error the larger of fresh's and
    committed's (its errors on the case's golden; None or a tensor missing there: fresh's alone). Why: torch, a
    correct fp32 reading, failed k x numpy32's error on 26 of 1,000 fresh seeds of the tiny cases, each where
    numpy32's error on that one draw was far below its error on the golden; with the larger, on 12
    (tools/fresh_margins.py, docs/measurements.md)."""
    out = {}
    for t, a in fresh.items():
        b = (committed or {}).get(t)
        if b is None:
            out[t] = a
            continue
        worst = [w for w in (a.worst_err, b.worst_err) if w is not None]
        out[t] = dataclasses.replace(a, rel_rms=max(a.rel_rms, b.rel_rms), worst_err=max(worst) if worst else None)
    return out


def judge(cmp: Comparison, gate: Gate, precision: str, baseline_err: float | BaselineError | None,
          as_baseline: bool = False, capped: bool = True, uncapped_why: str = FRESH) -> Verdict:
    """Apply one gate row to one comparison.

    baseline_err: what the same-precision baseline measured on this tensor (a BaselineError, or its relative
    RMS error alone), or None when the baseline is unavailable (then the cap alone applies) or at fp64. A
    baseline over its own row's cap sets no bound either: the cap alone applies and the rule says so.
    as_baseline: the backend is that baseline; `gate` is its BASELINE_GATES row (an absolute cap).
    capped=False: inputs drawn afresh, where the caps (measured on the goldens' inputs) do not hold: where the
    baseline ran on the same inputs, the bound is k x its error + floor alone (the baseline on 40 fresh draws
    went past the caps: torch-bf16 6.6e-2 on mxfp4_gemv/N1-K32 against the row's 2e-2, numpy32 2.7e-6 on
    mla_decode/B1-H2-R512-P64-L70 against its own 1.26e-6), so a kernel as good as the baseline never fails on an
    unlucky draw, while one that answers other inputs, zeros or its first answer errs O(1). The same rule judges a
    case of a shape set with no measurement (uncapped_why: no_cap_measured); there a baseline over its own row (the
    hand cap, as a sanity bound; fresh inputs set no own_cap) sets no bound, and the cap alone applies.
    Below fp64 a tensor must pass two rules: the relative RMS one and, where the baseline's worst element error
    is known, the per-element one (worst element error <= gate.elem_k x the baseline's + gate.elem_floor). A row's
    abs_floor adds abs_floor / RMS(ref) to both floors (rule_floor): where a sum cancels, its rounding is a share of the
    terms, not of its small value.
    """
    if cmp.problem and not cmp.exact:
        return Verdict(False, gate.cap, cmp.problem)
    if cmp.exact:
        ok = not cmp.problem
        return Verdict(ok, 0.0, "exact match" if ok else cmp.problem)
    if not cmp.nonfinite_ok:
        return Verdict(False, gate.cap, "NaN/Inf at positions where the golden has none (or vice versa)")
    base = BaselineError(baseline_err) if isinstance(baseline_err, float | int) else baseline_err
    if as_baseline:
        bound, rule = gate.cap, f"rel RMS <= {gate.cap:.3g} (the {precision} baseline itself: {gate.reason})"
    elif precision == "fp64" or gate.k is None:
        bound, rule = gate.cap, f"rel RMS <= {gate.cap:.3g} (fp64 bound)"
        if cmp.n_within < cmp.n_total:
            return Verdict(False, bound, f"{cmp.passed_line} within atol {gate.atol:g} + rtol {gate.rtol:g}")
    elif base is None:
        bound = gate.cap
        rule = f"rel RMS <= cap {gate.cap:.3g} (baseline {BASELINE.get(precision)} unavailable: cap only)"
    elif not capped and not base.failed_own_row:
        floor, floor_text = rule_floor(cmp, gate.floor, gate)
        bound = gate.k * base.rel_rms + floor
        rule = f"rel RMS <= {gate.k:g} x baseline {base.rel_rms:.3g} + {floor_text} = {bound:.3g} ({uncapped_why})"
        worst = _worst_element_failure(cmp, gate, base, precision)
        if worst and cmp.rel_rms <= bound:
            return Verdict(False, bound, f"{worst}; {rule}")
    elif base.failed_own_row:
        bound = gate.cap
        rule = (f"rel RMS <= cap {gate.cap:.3g} (baseline {BASELINE.get(precision)} failed its own row "
                f"(err {base.rel_rms:.3g} > cap {base.own_cap:.3g}): bound is the cap only)")
    else:
        floor, floor_text = rule_floor(cmp, gate.floor, gate)
        rel = gate.k * base.rel_rms + floor
        bound = min(gate.cap, rel)
        rule = (f"rel RMS <= min(cap {gate.cap:.3g}, {gate.k:g} x baseline {base.rel_rms:.3g} + {floor_text})"
                f" = {bound:.3g}")
        worst = _worst_element_failure(cmp, gate, base, precision)
        if worst and cmp.rel_rms <= bound:   # a tensor failing both rules keeps the whole-tensor rule's text
            return Verdict(False, bound, f"{worst}; {rule}")
    ok = cmp.rel_rms <= bound
    if ok and base is not None and not as_baseline:
        biased = _bias_failure(cmp, base, precision)
        if biased:
            return Verdict(False, bound, f"{biased}; {rule}")
    return Verdict(ok, bound, rule)


def lean_test(rows: np.ndarray | None, base_rows: np.ndarray | None) -> tuple[int, float, float] | None:
    """(rows read, the mean of the output's row leans minus the baseline's, its t statistic over the rows) for one
    tensor (Comparison.row_leans of both, on the same inputs), or None when the two cannot be paired. Pairing
    cancels what both share, the error the rounded inputs carry; what is left is how each rounds and sums."""
    if rows is None or base_rows is None or rows.shape != base_rows.shape:
        return None
    d = (rows - base_rows)[np.isfinite(rows) & np.isfinite(base_rows)]
    if d.size == 0:
        return None
    mean = float(d.mean())
    spread = float(d.std(ddof=1)) if d.size > 1 else 0.0
    t = mean / (spread / np.sqrt(d.size)) if spread > 0 else (0.0 if mean == 0 else float("inf") * np.sign(mean))
    return int(d.size), mean, float(t)


def _bias_failure(cmp: Comparison, base: BaselineError, precision: str) -> str:
    """'' unless the output's magnitudes lean (toward or away from zero) from the baseline's on the same inputs,
    row by row, by more than the precision's margin (in units of its rounding) and consistently enough over enough
    rows (BIAS_RULES); else the failure."""
    rule = BIAS_RULES.get(precision)
    test = lean_test(cmp.row_leans, base.row_leans) if rule is not None else None
    if rule is None or test is None:
        return ""
    least, margin, t_least, unit, why = rule
    rows, mean, t = test
    if rows < least or abs(mean) <= margin * unit or abs(t) <= t_least:
        return ""
    side = "toward zero" if mean < 0 else "away from zero"
    return (f"biased rounding ({side}): the output's magnitudes are {abs(mean) / unit:.2f} rounding units "
            f"({unit:.3g} each) {'smaller' if mean < 0 else 'larger'} than {BASELINE.get(precision)}'s on the same "
            f"inputs, on average over {rows} rows (t = {t:.1f}; the rule: more than {margin:g} units with |t| > "
            f"{t_least:g} over at least {least} rows: {why})")


def rule_floor(cmp: Comparison, floor: float, gate: Gate, element: bool = False) -> tuple[float, str]:
    """A rule's floor with the row's abs_floor over the reference's RMS (RMS(ref) = max_abs / worst_err) and its
    out_round (the whole-tensor rule: u; the per-element rule, `element`: u x the worst element's magnitude over
    RMS(ref)) added, and how the rule writes it; a row without either: `floor` itself."""
    total, text = floor, [f"{floor:.3g}"]
    known = cmp.worst_err > 0 and cmp.max_abs > 0
    ref_rms = float(cmp.max_abs / cmp.worst_err) if known else 0.0
    if gate.abs_floor and known:
        total += gate.abs_floor / ref_rms
        text.append(f"abs {gate.abs_floor:.3g} / RMS(ref) {ref_rms:.3g}")
    if gate.out_round and not element:
        total += gate.out_round
        text.append(f"output rounding {gate.out_round:.3g}")
    elif gate.out_round and known:
        size = max(abs(cmp.worst_out or 0.0), abs(cmp.worst_ref or 0.0))
        total += gate.out_round * size / ref_rms
        text.append(f"output rounding {gate.out_round:.3g} x |{size:.3g}| / RMS(ref) {ref_rms:.3g}")
    return total, (text[0] if len(text) == 1 else f"{' + '.join(text)} = {total:.3g}")


def _worst_element_failure(cmp: Comparison, gate: Gate, base: BaselineError, precision: str) -> str:
    """'' when the worst element is within the row's multiple of the baseline's worst element error (or the
    row has no per-element rule), else the failure with its numbers. Only a failure is written into the rule,
    so a passing tensor's rule reads as the relative RMS one alone."""
    if gate.elem_k is None or base.worst_err is None:
        return ""
    floor, floor_text = rule_floor(cmp, gate.elem_floor, gate, element=True)
    bound = gate.elem_k * base.worst_err + floor
    if cmp.worst_err <= bound:
        return ""
    where = f" at {list(cmp.worst_index)}" if cmp.worst_index is not None else ""
    return (f"worst element{where} off by {cmp.worst_err:.3g} x RMS(ref) > {gate.elem_k:g} x baseline "
            f"{BASELINE.get(precision)}'s worst {base.worst_err:.3g} + {floor_text} = {bound:.3g} "
            f"(per-element rule: {gate.elem_why})")


@dataclasses.dataclass(frozen=True)
class SpeedResult:
    """Speed ratios for one (case, backend); `passed` is None when report-only."""

    seconds: float
    bytes_moved: int
    bw_ratio: float | None          # achieved bytes/s / copy bytes/s
    time_ratio: float | None        # seconds / baseline seconds
    target_bw_ratio: float | None
    target_time_ratio: float | None
    passed: bool | None
    note: str
    baseline: str | None = None     # the backend time_ratio is relative to


def judge_speed(block: str, backend: str, seconds: float, bytes_moved: int, copy_bw: float | None,
                baseline_seconds: float | None, target_bw: float | None = None,
                baseline: str | None = None) -> SpeedResult:
    """Speed ratios and, where a target exists, the verdict.

    target_bw: a target from the backend itself (backend.speed_target(block)); SPEED_TARGETS rows win.
    """
    bw_ratio = (bytes_moved / seconds) / copy_bw if copy_bw and seconds > 0 else None
    time_ratio = seconds / baseline_seconds if baseline_seconds else None
    t_bw, t_time, reason = SPEED_TARGETS.get((block, backend), (target_bw, None, "backend target" if target_bw else ""))
    checks = []
    if t_bw is not None and bw_ratio is not None:
        checks.append(bw_ratio >= t_bw)
    if t_time is not None and time_ratio is not None:
        checks.append(time_ratio <= t_time)
    passed = all(checks) if checks else None
    note = reason if checks else "report only (no target for this block and backend)"
    return SpeedResult(seconds, bytes_moved, bw_ratio, time_ratio, t_bw, t_time, passed, note, baseline)


@dataclasses.dataclass(frozen=True)
class JudgeState:
    """What the verdicts are read from at one moment: the tables' digest, the tables and the verdict functions."""

    digest: str
    objects: tuple


def judge_state() -> JudgeState:
    here = globals()
    return JudgeState(table_digest(), tuple(here.get(name) for name in (*TABLES, *_VERDICTS)))


def tables_changed(since: JudgeState | None = None) -> str:
    """'' when the gate tables and the verdict functions are those of `since` (a run's start; default: as this
    module built them), else what changed: a row edited in place (the digest), a table or a function replaced."""
    before = since or _BUILT
    now = judge_state()
    replaced = [name for name, a, b in zip((*TABLES, *_VERDICTS), before.objects, now.objects, strict=True)
                if a is not b]
    if replaced:
        return f"replaced: {', '.join(replaced)} (conformance.judge.gates)"
    if now.digest != before.digest:
        return f"gate table rows edited in place (digest {now.digest[:12]}, was {before.digest[:12]})"
    return ""


_VERDICTS = ("judge", "_bias_failure", "lean_test", "judge_speed", "gate_for", "baseline_gate_for", "errors_against",
             "larger_errors", "lookup")
_BUILT = JudgeState(DIGEST, tuple(globals().get(name) for name in (*TABLES, *_VERDICTS)))
