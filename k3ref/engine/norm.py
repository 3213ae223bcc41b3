"""The residual add fused into the RMSNorm that follows it (a pre-norm decoder's `r = x + f(x)` and the next
block's input norm).

Engines fuse the two: one pass reads the block output and the residual stream, writes the new residual stream and
its normalised copy. Both outputs are judged: the residual written back is what every later layer adds to.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from k3ref.checks import as_float, check_shape, require
from k3ref.ops import rmsnorm


def add_rmsnorm(x, residual, w, eps):
    """r = x + residual; y = RMSNorm_eps(r; w). x, residual: [..., D]; w: [D] -> (y [..., D], r [..., D]).

    r is formed in the wider of the two input dtypes (float64 for float64 inputs, float32 otherwise) and y is
    normalised from that same r.
    """
    x = as_float("x", x)
    residual = as_float("residual", residual)
    require(x.ndim >= 1, "x: expected shape [..., D], found a scalar")
    check_shape("residual", residual, x.shape)
    require(float(eps) >= 0, f"eps: expected >= 0, found {eps}")
    dt = np.result_type(x.dtype, residual.dtype)
    r = x.astype(dt, copy=False) + residual.astype(dt, copy=False)
    return rmsnorm(r, w, eps), r


def rmsnorm_through_add(add_core: Callable) -> Callable:
    """An `rmsnorm(x, w, eps)` that runs `add_core` (an add_rmsnorm) on x split in halves: x/2 + x/2 = x exactly
    in binary floating point (halving is exact barring subnormals), so a model trace can run every RMSNorm of
    the host graph through a fused add + norm kernel and judge it there."""
    def rmsnorm_via_add(x, w, eps):
        half = np.asarray(x) * 0.5
        y, _ = add_core(half, half.copy(), w, eps)    # two arrays: a kernel may write its residual in place
        return y

    return rmsnorm_via_add


__all__ = ["add_rmsnorm", "rmsnorm_through_add"]
