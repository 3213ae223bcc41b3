"""The gate table: ONE table keyed by (block, tensor, precision), a reason for every number.

Accuracy (DESIGN.md section 5):
- fp64 rows are absolute bounds on the relative RMS error against the float64 golden. The `numpy64`
  backend runs the very code that wrote the goldens, so it is exact by construction on the machine that
  generated them; the bound only leaves room for another CPU's BLAS rounding (~1e-16 per operation).
- fp32 / bf16 rows are baseline-relative, flash-attention's rule, plus an absolute cap:
      err(backend vs fp64) <= k * err(baseline at the same precision vs fp64) + floor   and   err <= cap
  with err = relative RMS error. Baselines: fp32 -> "numpy32", bf16 -> "torch-bf16". When the baseline
  cannot run here, the cap alone applies and the report says so. The bf16 rows have no floor and k = 2.5, so
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

Look-up falls back from (block, tensor, precision) to rows of that block whose tensor is a glob pattern
matching the tensor (longest pattern first), to (block, "*", precision), to ("*", "*", precision).
Model-trace cases register their rows with `add_gate` (see docs/runner.md).
"""
from __future__ import annotations

import dataclasses
import fnmatch

import numpy as np

from conformance.judge.compare import Comparison

PRECISIONS = ("fp64", "fp32", "bf16")
BASELINE = {"fp32": "numpy32", "bf16": "torch-bf16"}


@dataclasses.dataclass(frozen=True)
class Gate:
    """One row. fp64: `cap` is the bound. fp32/bf16: bound = min(cap, k * baseline_err + floor)."""

    cap: float            # absolute bound on relative RMS error
    k: float | None       # multiple of the baseline's error (None at fp64)
    floor: float          # added to k * baseline_err, so an exact baseline does not demand exactness
    atol: float           # per-element rule for "N of M passed"
    rtol: float
    reason: str


_FP64 = "numpy64 = the generator's own float64 code, exact by construction; room for another CPU's BLAS rounding"
_FP32 = "fp32 inputs and math against the fp64 golden; k=4 leaves room for another summation order than numpy32's"
_BF16 = ("bf16 inputs (2^-9 relative rounding) against the fp64 golden; k=2.5 over torch-bf16 and no floor, so the "
         "bound stays under 3x the baseline's error on the same tensor")

GATES: dict[tuple[str, str, str], Gate] = {
    # defaults per precision
    ("*", "*", "fp64"): Gate(1e-12, None, 0.0, 1e-12, 1e-9, _FP64),
    ("*", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3, _FP32 + "; cap = ~1e-7/op over <=100 ops"),
    ("*", "*", "bf16"): Gate(3e-2, 2.5, 0.0, 1e-2, 5e-2, _BF16 + "; cap = a few bf16 ulps (2^-8) of error"),
    # the CUDA kernels' blocks at fp32 (the kernels' GPU tests apply these caps too, against float64): the
    # default numbers, each with what bounds that kernel's error
    ("kda_decode", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; fp32 state and math: decay, two K-term column sums and an update "
                                      "per step, ~1e-7 per op; o and the new state both checked"),
    ("rmsnorm", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                   _FP32 + "; a sum of D <= 7168 squares (tree + serial, ~sqrt(D) ulp) and one "
                                   "exact sqrt"),
    ("situ_glu", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                    _FP32 + "; elementwise with exact exp/tanh (a few ulp each), no reduction"),
    ("attnres_mix", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                       _FP32 + "; RMS norms over D, a softmax over <= 9 sources and a weighted sum"),
    ("mxfp4_gemv", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; MXFP4 codes and scales decode exactly in fp32; fp32 accumulation "
                                      "over K <= 7168"),
    # KDA: the recurrence carries state over T steps; the chunked prefill uses a WY/UT triangular solve
    ("kda_prefill", "*", "fp64"): Gate(1e-10, None, 0.0, 1e-10, 1e-8,
                                       _FP64 + "; chunked WY solve over T<=65 steps reorders sums"),
    ("kda_prefill", "*", "fp32"): Gate(1e-4, 4.0, 1e-6, 1e-4, 1e-2,
                                       _FP32 + "; T<=65 recurrent steps plus a triangular solve per chunk"),
    ("kda_prefill", "*", "bf16"): Gate(5e-2, 2.5, 0.0, 2e-2, 1e-1,
                                       _BF16 + "; the state sums T<=65 bf16-rounded rank-1 updates"),
    # MLA: softmax over up to ~200 cached rows of width 576 in fp32
    ("mla_decode", "*", "fp32"): Gate(2e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; dot products of length 576 and a softmax over <=200 rows"),
    # MXFP4: weights are exact codes x powers of two; only x and the accumulation are rounded
    ("mxfp4_gemv", "*", "bf16"): Gate(2e-2, 2.5, 0.0, 1e-2, 5e-2,
                                      _BF16 + "; weights exact (E2M1 x 2^e), x rounded to bf16"),
    # LatentMoE composite: router + 2 MXFP4 GEMVs per expert + RMSNorm + shared MLP
    ("latent_moe", "*", "fp32"): Gate(2e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; composite of ~10 steps (router, experts, norm, shared MLP)"),
    ("latent_moe", "*", "bf16"): Gate(5e-2, 2.5, 0.0, 2e-2, 1e-1,
                                      _BF16 + "; composite of ~10 steps, each rounding its inputs"),
}

# The baselines gated against themselves would always pass, so they get absolute rows: about 3x the worst
# relative RMS error each measured on the tiny cases of that (block, tensor) with `k3conf run` (CPU, this
# repository's goldens). Filled by add_baseline_gate below and by the model traces (conformance/cases/traces.py).
BASELINE_GATES: dict[tuple[str, str, str], Gate] = {}

# Discrete choices inside the model traces (conformance/cases/traces.py): where the float64 golden's margin is below
# the budget of the backend's precision, the backend is given the golden's choice (teacher-forced, counted).
# Absent (fp64, fp32): no forcing, every choice must match. Router margins are in selection-score units
# (sigmoid + bias), argmax margins in logits. precision -> choice -> (budget, reason).
MARGIN_BUDGETS: dict[str, dict[str, tuple[float, str]]] = {
    "bf16": {
        "router": (1.5e-2, "torch-bf16 moves the selection scores by at most 4.5e-3 on the layerwise tiny trace; "
                           "3x that (the golden's smallest router margin there is 2.1e-4)"),
        "argmax": (3.5e-2, "torch-bf16 moves the logits by at most 1.2e-2 on the layerwise tiny trace; 3x that "
                           "(the golden's step-1 margin is 1.2e-3: a near-tie at bf16, far from one at fp32)"),
    },
}

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


# (block, backend) -> (target bw_ratio or None, target time_ratio or None, reason). Absent = report only.
SPEED_TARGETS: dict[tuple[str, str], tuple[float | None, float | None, str]] = {}


def add_gate(block: str, tensor: str, precision: str, gate: Gate) -> None:
    """Add (or override) a row; used by case kinds that bring their own blocks (e.g. model traces)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, found {precision!r}")
    GATES[(block, tensor, precision)] = gate


BASELINE_FACTOR = 3.0   # a baseline's cap over its measured worst: room for another CPU's summation order


def add_baseline_gate(block: str, tensor: str, precision: str, measured: float, where: str) -> None:
    """Add (or override) the absolute row that gates the baseline backend of `precision` itself:
    cap = BASELINE_FACTOR x `measured`, its worst relative RMS error (on `where`, the case that set it)."""
    if precision not in BASELINE:
        raise ValueError(f"precision: expected one of {sorted(BASELINE)}, found {precision!r}")
    if not measured > 0:
        raise ValueError(f"measured: expected the baseline's positive worst error, found {measured!r}")
    reason = (f"{BASELINE[precision]} measured {measured:.3g} worst ({where}); cap {BASELINE_FACTOR:g}x that")
    BASELINE_GATES[(block, tensor, precision)] = Gate(BASELINE_FACTOR * measured, None, 0.0, 0.0, 0.0, reason)


def _lookup(table: dict, block: str, tensor: str, precision: str):
    if (block, tensor, precision) in table:
        return (block, tensor, precision), table[(block, tensor, precision)]
    # tensor patterns (e.g. the model traces' "step*.layer*"), most specific = longest pattern first
    patterns = sorted((k for k in table if k[0] == block and k[2] == precision and k[1] != "*"
                       and any(ch in k[1] for ch in "*?[") and fnmatch.fnmatchcase(tensor, k[1])),
                      key=lambda k: -len(k[1]))
    if patterns:
        return patterns[0], table[patterns[0]]
    for key in ((block, "*", precision), ("*", "*", precision)):
        if key in table:
            return key, table[key]
    return None, None


def gate_for(block: str, tensor: str, precision: str) -> tuple[tuple[str, str, str], Gate]:
    """The row that applies to (block, tensor, precision) and its key (most specific first)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, found {precision!r}")
    key, gate = _lookup(GATES, block, tensor, precision)
    if gate is None:
        raise KeyError(f"no gate row for {(block, tensor, precision)}")  # unreachable: defaults exist
    return key, gate


def baseline_gate_for(block: str, tensor: str, precision: str) -> tuple[tuple[str, str, str], Gate]:
    """The absolute row for the baseline backend itself. Where no measurement was written down (a new
    block), the block's own cap applies and the reason says that it is not a measured one."""
    key, gate = _lookup(BASELINE_GATES, block, tensor, precision)
    if gate is not None:
        return key, gate
    key, gate = gate_for(block, tensor, precision)
    return key, dataclasses.replace(gate, k=None, reason=f"no measured baseline row: the cap of {key} "
                                                         f"({gate.reason})")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The decision for one compared tensor."""

    passed: bool
    bound: float          # the relative-RMS bound that applied
    why: str              # what decided it (the rule, with numbers)


def judge(cmp: Comparison, gate: Gate, precision: str, baseline_err: float | None,
          as_baseline: bool = False) -> Verdict:
    """Apply one gate row to one comparison.

    baseline_err: the same-precision baseline's relative RMS error on this tensor, or None when the
    baseline is unavailable (then the cap alone applies) or at fp64.
    as_baseline: the backend is that baseline; `gate` is its BASELINE_GATES row (an absolute cap).
    """
    if cmp.problem and not cmp.exact:
        return Verdict(False, gate.cap, cmp.problem)
    if cmp.exact:
        ok = not cmp.problem
        return Verdict(ok, 0.0, "exact match" if ok else cmp.problem)
    if not cmp.nonfinite_ok:
        return Verdict(False, gate.cap, "NaN/Inf at positions where the golden has none (or vice versa)")
    if as_baseline:
        bound, rule = gate.cap, f"rel RMS <= {gate.cap:.3g} (the {precision} baseline itself: {gate.reason})"
    elif precision == "fp64" or gate.k is None:
        bound, rule = gate.cap, f"rel RMS <= {gate.cap:.3g} (fp64 bound)"
        if cmp.n_within < cmp.n_total:
            return Verdict(False, bound, f"{cmp.passed_line} within atol {gate.atol:g} + rtol {gate.rtol:g}")
    elif baseline_err is None:
        bound, rule = gate.cap, f"rel RMS <= cap {gate.cap:.3g} (baseline {BASELINE.get(precision)} unavailable: cap only)"
    else:
        rel = gate.k * baseline_err + gate.floor
        bound = min(gate.cap, rel)
        rule = (f"rel RMS <= min(cap {gate.cap:.3g}, {gate.k:g} x baseline {baseline_err:.3g} + {gate.floor:.3g})"
                f" = {bound:.3g}")
    ok = cmp.rel_rms <= bound
    return Verdict(ok, bound, rule)


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


# (block, tensor) -> worst relative RMS error of numpy32 (fp32) and torch-bf16 (bf16) over the tiny cases,
# measured with `k3conf run --no-timing` (torch 2.13 CPU, NumPy/OpenBLAS) and the case that set it.
_MEASURED_BASELINE = {
    ("rmsnorm", "y"): ((6.4e-8, "rmsnorm/T3-D239-eps1e-6"), (3.3e-3, "rmsnorm/T7-D203")),
    ("situ_glu", "h"): ((9.6e-8, "situ_glu/I239"), (2.4e-3, "situ_glu/I239")),
    ("kda_decode", "o"): ((1.6e-7, "kda_decode/B1-H1-K128"), (2.3e-3, "kda_decode/B1-H1-K128")),
    ("kda_decode", "state"): ((8.2e-8, "kda_decode/B2-H2-K16-nolb"), (1.5e-3, "kda_decode/B2-H3-K16")),
    ("kda_prefill", "o"): ((4.6e-7, "kda_prefill/B1-T65-H3-K32"), (3.3e-3, "kda_prefill/B1-T65-H3-K32")),
    ("kda_prefill", "state"): ((2.9e-6, "kda_prefill/B2-T63-H2-K16"), (2.3e-3, "kda_prefill/B1-T65-H3-K32")),
    ("mla_decode", "o_lat"): ((4.2e-7, "mla_decode/B1-H2-R512-P64-L70"),
                              (6.4e-3, "mla_decode/B3-H1-R64-P16-L64-113-203")),
    ("mxfp4_gemv", "y"): ((1.9e-7, "mxfp4_gemv/N1-K32"), (2.0e-3, "mxfp4_gemv/N1-K32")),
    ("moe_route", "weights"): ((6.7e-8, "moe_route/T1-E8-k2"), (6.7e-8, "moe_route/T1-E8-k2; the router is fp32")),
    ("attnres_mix", "out"): ((1.8e-7, "attnres_mix/S3-T5-D113"), (2.8e-3, "attnres_mix/S3-T5-D113")),
    ("latent_moe", "y"): ((1.9e-7, "latent_moe/T5-D67-E8-k2-L32-I32-S1"),
                          (5.7e-3, "latent_moe/T3-D48-E8-k2-G2-g1-norenorm")),
}
for (_block, _tensor), (_fp32, _bf16) in _MEASURED_BASELINE.items():
    add_baseline_gate(_block, _tensor, "fp32", *_fp32)
    add_baseline_gate(_block, _tensor, "bf16", *_bf16)
