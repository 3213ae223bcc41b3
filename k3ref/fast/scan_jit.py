"""The finiteness scan of `k3ref.checks.as_float`, compiled: one pass that stops at the first NaN/Inf.

Why: the host graph checks every array it hands from step to step, ~1,500 of them in a `small` decode token, most of
a few thousand elements. There `np.isfinite(a).all()` costs ~1.6 us (a boolean temporary, then a reduction); this
loop costs ~0.6 us. The answer is the same boolean, so nothing here depends on K3_FAST. numba is imported, and the
loop compiled (or loaded from numba's cache), on the first scan, so `k3ref.checks` imports without it.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

SMALL = 1 << 16     # elements up to which the loop is used; NumPy's vectorised isfinite is as fast above
_COMPILED: dict[str, Callable[[np.ndarray], bool]] = {}


def _all_finite(a):  # pragma: no cover -- compiled by _kernel
    for v in a.flat:
        if not np.isfinite(v):
            return False
    return True


def _kernel() -> Callable[[np.ndarray], bool]:
    kernel = _COMPILED.get("all_finite")
    if kernel is None:
        import numba  # noqa: PLC0415 -- heavy (~0.5 s to import): loaded on the first scan, not with k3ref.checks
        kernel = _COMPILED["all_finite"] = numba.njit(cache=True, nogil=True)(_all_finite)
    return kernel


def all_finite(a: np.ndarray) -> bool:
    """True when every element of the float32/float64 array `a` is finite (neither NaN nor +-Inf)."""
    if 1 <= a.ndim <= 4 and a.size <= SMALL and a.flags.c_contiguous:
        return bool(_kernel()(a))
    return bool(np.isfinite(a).all())
