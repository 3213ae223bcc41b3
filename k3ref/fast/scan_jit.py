"""The finiteness scan of `k3ref.checks.as_float`, compiled: one pass that stops at the first NaN/Inf.

Why: the host graph checks every array it hands from step to step, ~1,500 of them in a `small` decode token, most of
a few thousand elements. There `np.isfinite(a).all()` costs ~1.6 us (a boolean temporary, then a reduction); this
loop costs ~0.6 us. The answer is the same boolean, so nothing here depends on K3_FAST.
"""
from __future__ import annotations

import numba
import numpy as np

SMALL = 1 << 16     # elements up to which the loop is used; NumPy's vectorised isfinite is as fast above


@numba.njit(cache=True, nogil=True)
def _all_finite(a):  # pragma: no cover -- compiled; see all_finite
    for v in a.flat:
        if not np.isfinite(v):
            return False
    return True


def all_finite(a: np.ndarray) -> bool:
    """True when every element of the float32/float64 array `a` is finite (neither NaN nor +-Inf)."""
    if 1 <= a.ndim <= 4 and a.size <= SMALL and a.flags.c_contiguous:
        return bool(_all_finite(a))
    return bool(np.isfinite(a).all())
