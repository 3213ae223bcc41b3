"""Judging another call of a kernel on the same inputs: its second call (candidate, its worker's freed memory filled
with NaN, candidate), and each call the judge timed.

A deterministic backend (BackendBase.deterministic, the default) must give the same bits again; one that declares
`deterministic = False` may not, but the spread between its answers is reported and must stay within the
tensor's own gate bound (its relative RMS taken against the first answer). Each failure is one more
TensorResult of the cell, so the first-failure line names the tensor and the rule.
"""
from __future__ import annotations

import numpy as np

from conformance.judge.compare import compare
from conformance.judge.gates import Verdict
from conformance.results import TensorResult


def identical(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bits (NaN where the other has NaN)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))


SECOND_CALL = "a second call of {cores} on the same inputs (after its freed memory was filled with NaN)"
TIMED_CALL = "a timed call of {cores} on the inputs it was judged on"
NOTES = {SECOND_CALL: "second call on the same inputs", TIMED_CALL: "timed call on the same inputs"}


def repeat_results(judged: list[TensorResult], first: dict, again: dict, deterministic: bool,
                   cores: str, call: str = SECOND_CALL) -> tuple[list[TensorResult], list[str]]:
    """(failing TensorResults, notes) of another call's outputs `again` against the first's `first`, for the
    tensors already judged on the first call. `cores`: the kernel cores the case ran; `call`: what the other call
    was (SECOND_CALL, TIMED_CALL), for the messages."""
    short = NOTES.get(call, "another call on the same inputs")
    call = call.format(cores=cores)
    failed, notes = [], []
    for t in judged:
        if t.tensor not in first:
            continue   # the first call already failed on a missing tensor
        a, b = first[t.tensor], again.get(t.tensor)
        if b is not None and identical(a, b):
            continue
        cmp = compare(b, a) if b is not None else None
        if cmp is None:
            why = f"{call} returned no {t.tensor} (found {sorted(again)[:20]})"
            failed.append(_failed(t, why, t.comparison, note=short))
        elif deterministic:
            why = (f"not deterministic: {call} gave other bits ({cmp.summary()}); a backend whose results may vary "
                   "run to run declares deterministic = False")
            failed.append(_failed(t, why, cmp, note=short))
        else:
            spread = f"{t.tensor}: spread between the judged call and {call}: {cmp.summary()}"
            notes.append(spread + " (the backend declares deterministic = False)")
            if cmp.problem or not cmp.nonfinite_ok or cmp.rel_rms > t.verdict.bound:
                failed.append(_failed(t, f"{spread}, over the tensor's bound rel RMS {t.verdict.bound:.3g}", cmp,
                                      t.verdict.bound, short))
    return failed, notes


def _failed(t: TensorResult, why: str, cmp, bound: float = 0.0, note: str = "") -> TensorResult:
    return TensorResult(t.tensor, t.block, cmp, t.gate_key, t.gate, Verdict(False, bound, why), t.baseline,
                        t.baseline_err, t.layer, True, note)
