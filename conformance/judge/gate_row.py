"""One row of the gate table and the rule that turns a baseline's measured error into its own absolute row.

Kept apart from the table (conformance.judge.gate_table) and from the look-up and verdicts
(conformance.judge.gates), which both build on it.
"""
from __future__ import annotations

import dataclasses

PRECISIONS = ("fp64", "fp32", "bf16")
BASELINE = {"fp32": "numpy32", "bf16": "torch-bf16"}
BASELINE_FACTOR = 3.0   # a baseline's cap over its measured worst: room for another CPU's summation order


@dataclasses.dataclass(frozen=True)
class Gate:
    """One row. fp64: `cap` is the bound. fp32/bf16: bound = min(cap, k * baseline_err + floor), and the
    per-element rule: worst element error <= elem_k * the baseline's worst element error + elem_floor."""

    cap: float            # absolute bound on relative RMS error
    k: float | None       # multiple of the baseline's error (None at fp64)
    floor: float          # added to k * baseline_err, so an exact baseline does not demand exactness
    atol: float           # per-element rule for "N of M passed"
    rtol: float
    reason: str
    elem_k: float | None = None     # multiple of the baseline's worst element error (None: no per-element rule)
    elem_floor: float = 0.0         # added to it, so an exact baseline does not demand an exact element
    elem_why: str = ""              # the measurement behind elem_k and elem_floor


def baseline_row(precision: str, measured: float, where: str) -> Gate:
    """The absolute row that gates the baseline backend of `precision` itself: cap = BASELINE_FACTOR x
    `measured`, its worst relative RMS error (on `where`, the case that set it)."""
    if precision not in BASELINE:
        raise ValueError(f"precision: expected one of {sorted(BASELINE)}, found {precision!r}")
    if not measured > 0:
        raise ValueError(f"measured: expected the baseline's positive worst error, found {measured!r}")
    reason = f"{BASELINE[precision]} measured {measured:.3g} worst ({where}); cap {BASELINE_FACTOR:g}x that"
    return Gate(BASELINE_FACTOR * measured, None, 0.0, 0.0, 0.0, reason)
