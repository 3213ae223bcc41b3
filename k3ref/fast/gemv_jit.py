"""bf16 weight times float activations compiled with numba: y = x @ W.astype(x.dtype).T for a weight stored as
bf16 (ml_dtypes.bfloat16 or its uint16 bits, as the checkpoint reader hands it out), without a float copy of W.

The readable statement is `k3ref.ops.linear` (x @ w.astype(x.dtype).T); `linear` calls `linear_bf16` here by
default for a bf16 weight (`k3ref.fast.enabled()`; K3_FAST=numpy keeps the cast and BLAS). Each kernel compiles on
its first call per type signature and is cached on disk (`cache=True`).

A bf16 value is the top half of a float32, so each weight row is widened exactly (bits << 16) into a float32
buffer that stays in L1, then multiplied in x's dtype. Order of every sum (part of the result; no fastmath, so
LLVM neither fuses multiply-adds nor reorders sums): sixteen partial sums, a_j over the elements k = j mod 16 in
order, then a_0 + a_1 + ... + a_15 left to right (`_row_dot`); the row is padded with zeros to a multiple of 16
(adding 0 x 0 leaves a partial sum as it is). `prange` splits only independent output rows between threads, so
the bits depend on neither the vector width nor the thread count. `lane_order_reference` states the same order
in NumPy for the tests.
"""
from __future__ import annotations

import contextlib

import numba
import numpy as np

from . import forked_after_numba

LANES = 16          # partial sums per dot product (fixed: it defines the summation order)
ROW_BLOCK = 16      # output rows per parallel work item (speed only: amortises the item's scratch allocations)
THREADS_MIN_BYTES = 2 << 20   # weight bytes from which a call runs on numba's threads (speed only: a smaller one
                              # costs less than waking the threads on a busy machine)


@contextlib.contextmanager
def superword_vectorizer():
    """Compile inside this block with LLVM's SLP vectoriser on: it packs the sixteen written-out partial sums
    into vector registers (8x faster here). numba leaves it off by default after an LLVM miscompilation
    (numba issue 8705); tests/k3ref/test_fast_jit_moe.py checks these kernels bit for bit against the order
    stated in NumPy, which a miscompiled kernel would fail. numba reads the flag whenever it compiles, so
    this only affects what compiles inside the block (a function's first call per type signature)."""
    before = numba.config.SLP_VECTORIZE
    numba.config.SLP_VECTORIZE = 1
    try:
        yield
    finally:
        numba.config.SLP_VECTORIZE = before


@numba.njit(cache=True, nogil=True, inline="always")
def _row_dot(w, x):  # pragma: no cover -- compiled; tested through linear_bf16
    """w, x [K16] (K16 a multiple of 16) -> the sum of w x in the order the module docstring states."""
    z = x.dtype.type(0)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = z
    a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = z
    for k in range(0, x.shape[0], LANES):
        wk, xk = w[k:k + LANES], x[k:k + LANES]     # constant indices below: no negative-index fix-ups,
        a0 += wk[0] * xk[0]                         # so LLVM packs the sums into vector lanes
        a1 += wk[1] * xk[1]
        a2 += wk[2] * xk[2]
        a3 += wk[3] * xk[3]
        a4 += wk[4] * xk[4]
        a5 += wk[5] * xk[5]
        a6 += wk[6] * xk[6]
        a7 += wk[7] * xk[7]
        a8 += wk[8] * xk[8]
        a9 += wk[9] * xk[9]
        a10 += wk[10] * xk[10]
        a11 += wk[11] * xk[11]
        a12 += wk[12] * xk[12]
        a13 += wk[13] * xk[13]
        a14 += wk[14] * xk[14]
        a15 += wk[15] * xk[15]
    return (a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13 + a14 + a15)


@numba.njit(cache=True, nogil=True, inline="always")
def _gemv_item(item, w, x, out):  # pragma: no cover -- compiled; see linear_bf16
    """One work item: output rows item * ROW_BLOCK ... (at most ROW_BLOCK) for every row of x."""
    N, K = w.shape
    bits = np.zeros(x.shape[1], np.int32)                          # the padding stays 0 (= +0.0)
    wf = bits.view(np.float32)
    r0 = item * ROW_BLOCK
    for r in range(r0, min(r0 + ROW_BLOCK, N)):
        row = w[r]
        for k in range(K):
            bits[k] = np.int32(row[k]) << np.int32(16)
        for t in range(x.shape[0]):
            out[t, r] = _row_dot(wf, x[t])


@numba.njit(cache=True, parallel=True, nogil=True)
def _bf16_gemv_threads(w, x, out):  # pragma: no cover -- compiled; see linear_bf16
    for item in numba.prange((w.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):   # independent row blocks
        _gemv_item(item, w, x, out)


@numba.njit(cache=True, nogil=True)
def _bf16_gemv_one(w, x, out):  # pragma: no cover -- compiled; see linear_bf16
    for item in range((w.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        _gemv_item(item, w, x, out)


def padded_inputs(x: np.ndarray) -> np.ndarray:
    """x [M, K] -> [M, K16] C-contiguous, K16 = K rounded up to a multiple of LANES, zeros after K."""
    M, K = x.shape
    K16 = -(-K // LANES) * LANES
    if K16 == K and x.flags.c_contiguous:
        return x
    xp = np.zeros((M, K16), x.dtype)
    xp[:, :K] = x
    return xp


def bf16_bits(w: np.ndarray) -> np.ndarray:
    """A bf16 weight (ml_dtypes.bfloat16 or uint16) as its uint16 bits, a view (no copy) where w is C-contiguous."""
    return np.ascontiguousarray(w).view(np.uint16)


def linear_bf16(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x @ w.astype(x.dtype).T: x float32/float64 [M, K], w bf16 [N, K] (ml_dtypes.bfloat16 or its uint16
    bits), checked by the caller -> y [M, N] in x's dtype. Reads w once; no float copy of it is made."""
    M, N = x.shape[0], w.shape[0]
    out = np.empty((M, N), x.dtype)
    if M and N:
        threaded = w.nbytes >= THREADS_MIN_BYTES and not forked_after_numba()   # a forked child: serial only
        kernel = _bf16_gemv_threads if threaded else _bf16_gemv_one
        with superword_vectorizer():
            kernel(bf16_bits(w), padded_inputs(x), out)
    return out


def lane_order_reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's sums written in NumPy, for the tests: w bf16 [N, K], x [M, K] -> y [M, N], every product and
    addition in the order the module docstring states. Slow; the kernel must give the same bits."""
    W = padded_inputs(np.asarray(w).astype(np.float32).astype(x.dtype))
    xp = padded_inputs(x)
    acc = np.zeros((x.shape[0], W.shape[0], LANES), x.dtype)
    for k in range(0, xp.shape[1], LANES):
        acc += xp[:, None, k:k + LANES] * W[None, :, k:k + LANES]
    total = acc[..., 0]
    for j in range(1, LANES):
        total = total + acc[..., j]
    return total
