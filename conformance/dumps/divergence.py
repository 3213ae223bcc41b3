"""How far an engine tensor is from its float64 recompute: one `Divergence` of several measures.

All arithmetic is float64 on the exact float64 widening of the engine's values. Non-finite engine values are
counted (`nonfinite`, an engine finding) and left out of the other measures, which are then taken over the
entries where both sides are finite; a tensor with no finite entry gets NaN measures and max_index [].
ULP distance (bf16 tensors only): both sides rounded to bf16, their bit patterns mapped to ordered integers
(sign-magnitude -> two's complement order, +0 == -0), and the distance is the integer difference: how many
representable bf16 values lie between the engine's value and the correctly rounded reference.
Gain: g - 1 where g = <e, r> / <r, r>, how much of the reference's own direction the engine's output holds
beyond 1. Rounding noise is unbiased, nearly orthogonal to r, so it moves g by about rel_rms / sqrt(n) (n
entries); a wrong scale on a part of the computation that makes a fraction p of ||r||^2 moves g by about
(scale error) x p whatever n is. A 1% error in one expert's weights can be far inside the rounding in
rel_rms and still stand well out of the rounding in gain.
"""
from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Divergence:
    """rel_rms = ||e - r|| / ||r|| (when ||r|| = 0: the absolute RMS of e - r, `note` says so)."""

    rel_rms: float
    cosine: float
    max_abs: float
    max_index: list[int]
    ulp_max: int | None
    ulp_median: float | None
    nonfinite: int
    note: str = ""
    gain: float = 0.0             # g - 1, g = <e, r> / <r, r> (0 when r = 0; older JSON without it reads 0)

    def to_json(self) -> dict:
        return {f.name: _json_float(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, d: dict) -> Divergence:
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d and n not in ("note", "gain")]
        if missing:
            raise ValueError(f"Divergence JSON: expected keys {names}, missing {missing}")
        v = {n: d.get(n, "") for n in names} | {"gain": d.get("gain", 0.0)}
        return cls(rel_rms=_from_json_float(v["rel_rms"]), cosine=_from_json_float(v["cosine"]),
                   max_abs=_from_json_float(v["max_abs"]), max_index=[int(i) for i in v["max_index"]],
                   ulp_max=None if v["ulp_max"] is None else int(v["ulp_max"]),
                   ulp_median=None if v["ulp_median"] is None else float(v["ulp_median"]),
                   nonfinite=int(v["nonfinite"]), note=str(v["note"]), gain=_from_json_float(v["gain"]))


def _json_float(x):
    """Strict JSON has no NaN / Infinity: write them as strings, read back by _from_json_float."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def _from_json_float(x) -> float:
    return float(x)


def bf16_ordered(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (nearest even) -> int32 keys whose order is the numeric order of the bf16 values."""
    bits = np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.int32)
    magnitude = bits & 0x7FFF
    return np.where(bits & 0x8000, -magnitude, magnitude)


def ulp_distance(engine: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|ordered(bf16(engine)) - ordered(bf16(ref))| elementwise (int64)."""
    return np.abs(bf16_ordered(engine).astype(np.int64) - bf16_ordered(ref).astype(np.int64))


def divergence(engine: np.ndarray, ref: np.ndarray, *, bf16: bool) -> Divergence:
    """The divergence of `engine` from `ref` (same shape); bf16: also the bf16 ULP distance."""
    e = np.asarray(engine, np.float64)
    r = np.asarray(ref, np.float64)
    if e.shape != r.shape:
        raise ValueError(f"divergence: expected the engine tensor in the reference's shape {list(r.shape)}, "
                         f"found {list(e.shape)}")
    bad = ~np.isfinite(e)
    nonfinite = int(np.count_nonzero(bad))
    ok = ~bad & np.isfinite(r)
    if not np.any(ok):
        return Divergence(math.nan, math.nan, math.nan, [], None, None, nonfinite, "no finite entries", math.nan)
    ev, rv = e[ok], r[ok]
    d = ev - rv
    err, norm = float(np.sqrt(np.dot(d, d))), float(np.sqrt(np.dot(rv, rv)))
    note, gain = "", 0.0
    if norm > 0:
        rel = err / norm
        gain = float(np.dot(d, rv)) / (norm * norm)     # <e - r, r> / <r, r> = g - 1, without cancelling 1
    else:
        rel, note = err / math.sqrt(d.size), "reference is all zeros: rel_rms is the absolute RMS"
    en = float(np.sqrt(np.dot(ev, ev)))
    cosine = float(np.dot(ev, rv) / (en * norm)) if en > 0 and norm > 0 else (1.0 if en == norm else 0.0)
    with np.errstate(invalid="ignore"):          # inf - inf where both sides overflowed: masked below
        full = np.where(ok, np.abs(e - np.where(ok, r, 0.0)), -1.0)
    flat = int(np.argmax(full))
    index = [int(i) for i in np.unravel_index(flat, e.shape)] if e.ndim else []
    ulp_max = ulp_median = None
    if bf16:
        u = ulp_distance(ev, rv)
        ulp_max, ulp_median = int(u.max()), float(np.median(u))
    return Divergence(rel, cosine, float(full.flat[flat]), index, ulp_max, ulp_median, nonfinite, note, gain)
