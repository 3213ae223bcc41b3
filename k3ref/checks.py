"""Input validation shared by every reference: shapes, ranks, dtypes, finiteness.

Every check raises ValueError naming the argument, what was expected and what was found.
"""
from __future__ import annotations

import math

import numpy as np

from .fast import scan_jit

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def as_float(name: str, x, *, allow_nan: bool = False) -> np.ndarray:
    """Return x as a floating ndarray (float32/float64 kept; ints, float16 and bf16 promoted to float32;
    long double narrowed to float64, never below it).

    Bool, complex and other dtypes raise; so do NaN/Inf unless allow_nan (the message gives the first index).
    """
    a = np.asarray(x)
    if a.dtype not in _FLOATS:                    # (every host-graph step asks: the common case is tested first)
        if a.dtype.kind not in "fiu" and a.dtype.name != "bfloat16":
            raise ValueError(f"{name}: expected a real floating array, found dtype {a.dtype}")
        a = a.astype(np.float64 if a.dtype.kind == "f" and a.dtype.itemsize >= 8 else np.float32)
    if not allow_nan and not scan_jit.all_finite(a):
        bad = np.argwhere(~np.isfinite(a))[0]
        raise ValueError(f"{name}: expected finite values, found {a[tuple(bad)]} at index {tuple(int(i) for i in bad)}")
    return a


def check_shape(name: str, a: np.ndarray, expected: tuple) -> tuple[int, ...]:
    """Check a's shape against `expected`, a tuple of ints (exact) or None (any) or str (named dim).

    Named dims must agree with each other within one call; returns a.shape.
    """
    a = np.asarray(a)
    if a.shape == expected:                       # every dim given and equal (asked ~1,000 times per decode step)
        return a.shape
    if a.ndim != len(expected):
        raise ValueError(f"{name}: expected rank {len(expected)} {_fmt(expected)}, found shape {a.shape}")
    bound: dict[str, int] = {}
    for axis, (want, got) in enumerate(zip(expected, a.shape, strict=True)):  # ranks equal (checked above)
        if want is None or want == got:           # (a named dim, a str, never equals a size)
            continue
        if isinstance(want, str):
            if bound.setdefault(want, got) != got:
                raise ValueError(f"{name}: dim {want} is {bound[want]} and {got} in shape {a.shape} ({_fmt(expected)})")
        elif want != got:
            raise ValueError(f"{name}: expected {_fmt(expected)}, found shape {a.shape} (axis {axis}: {want} != {got})")
    return a.shape


def is_finite_real(x) -> bool:
    """True for a finite real number given as a Python or NumPy scalar. bool is not one: `True` would
    otherwise pass as 1, and a flag passed where a number belongs is a caller's mistake."""
    return (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
            and math.isfinite(x))


def is_int_value(x) -> bool:
    """True for a Python or NumPy integer that is not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def require(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond."""
    if not cond:
        raise ValueError(msg)


def _fmt(expected: tuple) -> str:
    return "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
