"""Elementwise and small linear-algebra steps shared by the blocks.

All functions compute in the floating dtype of their input (float64 or float32).
"""
from __future__ import annotations

import numpy as np

from . import fast
from .checks import as_float, check_shape
from .fast import gemv_jit

JIT_MAX_ROWS = 64   # rows of x up to which a bf16 weight, or a float32 one times float32 x, goes through the
                    # compiled GEMV (a decode step, a short prefill); above, BLAS's blocked GEMM is faster


def sigmoid(x: np.ndarray) -> np.ndarray:
    """sigma(x) = 1 / (1 + exp(-x)), written so that neither branch overflows. Any shape."""
    x = as_float("x", x, allow_nan=True)
    e = np.abs(x, out=np.empty_like(x))                 # one buffer (an array even for a 0-d x):
    np.exp(np.negative(e, out=e), out=e)                  # e = exp(-|x|)
    top = np.where(x >= 0, 1.0, e)
    return np.divide(top, np.add(e, 1.0, out=e), out=e)   # 1 / (1 + e) for x >= 0, e / (1 + e) below


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU(x) = x * sigma(x). Any shape."""
    x = as_float("x", x, allow_nan=True)
    s = sigmoid(x)
    return np.multiply(x, s, out=s)


def softplus(x: np.ndarray) -> np.ndarray:
    """softplus(x) = log(1 + exp(x)), stable for large |x| (= max(x, 0) + log1p(exp(-|x|)))."""
    x = as_float("x", x, allow_nan=True)
    return (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))).astype(x.dtype)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Stable softmax along `axis`: exp(x - max) / sum(exp(x - max)). -inf entries get weight 0."""
    x = as_float("x", x, allow_nan=True)
    e = np.subtract(x, np.maximum.reduce(x, axis=axis, keepdims=True))   # np.max and np.sum are these reductions
    np.exp(e, out=e)                                                      # behind a Python layer (~1.5 us each)
    return np.divide(e, np.add.reduce(e, axis=axis, keepdims=True), out=e)


def mean_square(x: np.ndarray) -> np.ndarray:
    """mean(x^2) over the last axis, keepdims, for float32/float64 x: the same bits as np.mean(x * x, axis=-1,
    keepdims=True) in ~1.7 us instead of ~5 (asked ~100 times a decode token). np.mean sums in x's dtype, then
    divides in float64 by the count and rounds to x's dtype; for float32 that double rounding of a quotient gives
    the float32 quotient itself (53 >= 2 x 24 + 2 bits), so one division in x's dtype is the same bits while the
    count is exact in it (below 2^24)."""
    s = np.add.reduce(np.multiply(x, x), axis=-1, keepdims=True)
    D = x.shape[-1]
    if D >= 1 << 24:
        return np.true_divide(s, np.intp(D), out=s, casting="unsafe")   # np.mean's own division
    return np.divide(s, s.dtype.type(D), out=s)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm_eps(x; w) = w * x / sqrt(mean(x^2) + eps) over the last axis.

    x: [..., D]; w: [D] -> [..., D], in x's dtype.
    """
    x = as_float("x", x)
    D = x.shape[-1]
    w = as_float("w", w).astype(x.dtype, copy=False)
    check_shape("w", w, (D,))
    inv = 1.0 / np.sqrt(mean_square(x) + eps)
    return (x * inv) * w


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x W^T with W stored [out, in] as torch.nn.Linear and checkpoints store it.

    x: [..., in]; w: [out, in] -> [..., out], computed in x's dtype.
    A bf16 w (as `k3ref.cpu_weights.ModuleView` hands out a large checkpoint matrix), or a float32 w times float32
    x (the float32 host graph and its baseline), times a few rows of x runs the compiled GEMV by default
    (`k3ref.fast.gemv_jit.linear_jit`: w read once, no float copy of it, the same bits on any machine and thread
    count, threaded on numba's threads); K3_FAST=numpy, or more than JIT_MAX_ROWS rows (a prefill, where BLAS's
    GEMM wins), casts w and multiplies. A float64 w stays on BLAS: the float64 goldens were written by it.
    """
    x = as_float("x", x)
    w = np.asarray(w)
    check_shape("w", w, (None, x.shape[-1]))
    rows = x.size // max(x.shape[-1], 1)
    if (w.ndim == 2 and rows <= JIT_MAX_ROWS and fast.enabled()
            and (gemv_jit.is_bf16(w) or (w.dtype == np.float32 and x.dtype == np.float32))):
        y = gemv_jit.linear_jit(x.reshape(rows, x.shape[-1]), w)
        return y.reshape(x.shape[:-1] + (w.shape[0],))
    return x @ w.astype(x.dtype, copy=False).T
