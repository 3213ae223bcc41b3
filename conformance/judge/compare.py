"""Comparing one output tensor against its float64 golden (docs/spec.md section 5.1).

`compare(out, ref, atol, rtol)` reports, never raises on a mismatch:
- max abs error and relative RMS error ||out - ref|| / ||ref|| over the positions where both are finite;
- the worst element error: max |out - ref| over the RMS of the reference (same positions), so that it is
  scale-free like the relative RMS error and a single wrong element shows at full size instead of averaged away;
- the worst index with both values;
- NaN / +Inf / -Inf position mismatches (FlashMLA's rule: each must sit at the same positions);
- the share of elements within tolerance, |out - ref| <= atol + rtol |ref| ("N of M passed");
- a shape or dtype-kind mismatch (reported in `problem`, with the metrics left empty).
Integer tensors (router indices, ...) are compared exactly: every element must be equal.

`check_outputs(label, outs, refs, tol)` applies the same comparison with a relative-RMS tolerance to a kernel's
outputs (the GPU tests and the kernels' CPU emulation use it): this module is the one comparison engine, so a
kernel checked on a GPU and the same kernel gated by `k3conf run` follow one NaN/Inf rule. Its failure lines end
with the shape of the error (conformance.judge.diagnose) when one stands out, like the runner's.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from conformance.judge.diagnose import diagnose

TINY = np.finfo(np.float64).tiny


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The metrics of one (output, reference) pair. `problem` is set when they are not comparable."""

    shape: tuple
    dtype: str
    max_abs: float = 0.0
    rel_rms: float = 0.0
    worst_err: float = 0.0              # max abs error / RMS of the reference: the per-element rule's measure
    worst_index: tuple | None = None
    worst_out: float | None = None
    worst_ref: float | None = None
    n_within: int = 0
    n_total: int = 0
    nonfinite_mismatch: dict = dataclasses.field(default_factory=dict)   # "nan"/"+inf"/"-inf" -> count
    first_nonfinite_mismatch: tuple | None = None
    exact: bool = False                 # integer tensor: compared for equality
    problem: str = ""                   # shape / dtype mismatch, or an exact-compare failure summary
    # per row (the last axis; each element of a vector), sum(|out| - |ref|) / sum(|ref|) over its finite elements:
    # how much larger the output's magnitudes are, as a share of the reference's (< 0: pulled toward zero); NaN
    # for a row with nothing to read. A row shares its scalars (a norm, a softmax's sum), so its elements' signs
    # are not independent; rows are the units the bias rule counts (gates.lean_test).
    row_leans: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def comparable(self) -> bool:
        return not self.problem or self.exact

    @property
    def nonfinite_ok(self) -> bool:
        return not any(self.nonfinite_mismatch.values())

    @property
    def passed_line(self) -> str:
        return f"{self.n_within} of {self.n_total} passed"

    def summary(self) -> str:
        """One line: the metrics, or the problem."""
        if self.problem and not self.exact:
            return self.problem
        parts = [f"max abs {self.max_abs:.3g}", f"rel RMS {self.rel_rms:.3g}", self.passed_line]
        if self.worst_index is not None and self.max_abs > 0:
            parts.append(f"worst at {list(self.worst_index)}: out {self.worst_out:.6g} vs ref {self.worst_ref:.6g}")
        if not self.nonfinite_ok:
            bad = ", ".join(f"{k} {v}" for k, v in self.nonfinite_mismatch.items() if v)
            parts.append(f"non-finite mismatch ({bad}) first at {list(self.first_nonfinite_mismatch or ())}")
        return "; ".join(parts)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(dataclasses.replace(self, row_leans=None))
        del d["row_leans"]
        d["shape"] = list(self.shape)
        d["worst_index"] = None if self.worst_index is None else list(self.worst_index)
        d["first_nonfinite_mismatch"] = (None if self.first_nonfinite_mismatch is None
                                         else list(self.first_nonfinite_mismatch))
        return d


def compare(out, ref, atol: float = 0.0, rtol: float = 0.0) -> Comparison:
    """Compare `out` (any backend's result) with `ref` (the golden); see the module docstring.

    out, ref: arrays of one shape; floats are compared in float64. atol, rtol: the per-element rule
    |out - ref| <= atol + rtol * |ref| used only for the "N of M passed" count.
    """
    ref = np.asarray(ref)
    try:
        out = np.asarray(out)
    except Exception as e:  # noqa: BLE001 - a backend may return anything; report it
        return Comparison(ref.shape, str(ref.dtype), problem=f"output is not an array ({type(out).__name__}: {e})")
    if out.dtype == object or out.dtype.kind not in "fiub":
        return Comparison(ref.shape, str(ref.dtype), problem=f"dtype: expected a numeric array, found {out.dtype}")
    if out.shape != ref.shape:
        return Comparison(ref.shape, str(ref.dtype),
                          problem=f"shape: expected {list(ref.shape)}, found {list(out.shape)}")
    if ref.dtype.kind in "iub":
        return _compare_exact(out, ref)
    if out.dtype.kind in "iub":
        return Comparison(ref.shape, str(ref.dtype),
                          problem=f"dtype: expected floating (like {ref.dtype}), found {out.dtype}")
    return _compare_float(out.astype(np.float64), ref.astype(np.float64), atol, rtol, str(ref.dtype))


def _compare_exact(out: np.ndarray, ref: np.ndarray) -> Comparison:
    if out.dtype.kind == "f":
        # a float output of an integer tensor must hold the very integers: no truncation (1.5 is not 1),
        # and a NaN / Inf fails only its own position
        eq = out.astype(np.float64) == ref.astype(np.float64)
    else:
        eq = out.astype(np.int64) == ref.astype(np.int64)
    n = int(eq.size)
    ok = int(eq.sum())
    worst = worst_out = worst_ref = None
    problem = ""
    if ok < n:
        worst = tuple(int(i) for i in np.argwhere(~eq)[0])
        worst_out, worst_ref = float(out[worst]), float(ref[worst])
        problem = (f"{n - ok} of {n} elements differ (exact compare); first at {list(worst)}: "
                   f"out {worst_out:g} vs ref {worst_ref:g}")
    diff = np.abs(out.astype(np.float64) - ref.astype(np.float64))
    diff = np.where(np.isfinite(diff), diff, np.inf)
    return Comparison(ref.shape, str(ref.dtype), max_abs=float(diff.max(initial=0.0)),
                      rel_rms=0.0 if ok == n else float(n - ok) / n, worst_index=worst, worst_out=worst_out,
                      worst_ref=worst_ref, n_within=ok, n_total=n, exact=True, problem=problem)


def _compare_float(out: np.ndarray, ref: np.ndarray, atol: float, rtol: float, dtype: str) -> Comparison:
    masks = {
        "nan": (np.isnan(out), np.isnan(ref)),
        "+inf": (np.isposinf(out), np.isposinf(ref)),
        "-inf": (np.isneginf(out), np.isneginf(ref)),
    }
    mismatch = {k: int(np.sum(a != b)) for k, (a, b) in masks.items()}
    bad = np.zeros(ref.shape, bool)
    for a, b in masks.values():
        bad |= a != b
    first = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.any() else None
    both = np.isfinite(out) & np.isfinite(ref)
    same_nonfinite = ~np.isfinite(ref) & ~bad
    with np.errstate(invalid="ignore"):   # inf - inf at matching positions; masked out below
        diff = np.where(both, np.abs(out - ref), 0.0)
    within = (both & (diff <= atol + rtol * np.abs(np.where(both, ref, 0.0)))) | same_nonfinite
    ref_norm = float(np.linalg.norm(np.where(both, ref, 0.0)))
    den = max(ref_norm, TINY)
    rel = float(np.linalg.norm(diff) / den)
    ref_rms = max(ref_norm / np.sqrt(max(int(both.sum()), 1)), TINY)
    max_abs = float(diff.max(initial=0.0))
    worst = worst_out = worst_ref = None
    if ref.size:
        # the worst element: a misplaced non-finite value first, else the largest finite difference
        flat = int(np.ravel_multi_index(first, ref.shape)) if first is not None else int(np.argmax(diff))
        worst = tuple(int(i) for i in np.unravel_index(flat, ref.shape))
        worst_out, worst_ref = float(out[worst]), float(ref[worst])
    return Comparison(ref.shape, dtype, max_abs=max_abs, rel_rms=rel, worst_err=max_abs / ref_rms, worst_index=worst,
                      worst_out=worst_out, worst_ref=worst_ref, n_within=int(within.sum()), n_total=int(ref.size),
                      nonfinite_mismatch=mismatch, first_nonfinite_mismatch=first,
                      row_leans=_row_leans(out, ref, both))


def _row_leans(out: np.ndarray, ref: np.ndarray, both: np.ndarray) -> np.ndarray:
    """Comparison.row_leans: rows along the last axis (a vector's elements one by one)."""
    shape = (-1, 1) if ref.ndim <= 1 else (-1, ref.shape[-1])
    a_out, a_ref = (np.where(both, np.abs(x), 0.0).reshape(shape) for x in (out, ref))
    den = a_ref.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (a_out - a_ref).sum(axis=1) / den, np.nan)


def as_tuple(result) -> tuple[np.ndarray, ...]:
    """A core's result as a tuple of arrays (kda_decode returns two, the others one)."""
    return tuple(np.asarray(r) for r in result) if isinstance(result, tuple) else (np.asarray(result),)


def check_outputs(label: str, outs, refs, tol: float) -> list[str]:
    """Failures (empty = pass) of each output against its float64 reference, naming `label` and the output.

    An output fails when it is not comparable (shape or dtype), when a NaN/+Inf/-Inf sits elsewhere than in the
    reference, or when its relative RMS error exceeds `tol`.
    """
    outs, refs = as_tuple(outs), as_tuple(refs)
    if len(outs) != len(refs):
        return [f"{label}: kernel returned {len(outs)} outputs, the reference {len(refs)}"]
    fails = []
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        c = compare(o, r)
        if c.problem or not c.nonfinite_ok or c.rel_rms > tol:
            shape = None if c.problem else diagnose(o, r)
            fails.append(f"{label} output {i} (tolerance rel_rms {tol:g}): {c.summary()}"
                         + (f"; shape of the error: {shape}" if shape else ""))
    return fails
