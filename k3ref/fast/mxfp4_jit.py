"""MXFP4 dequantise-and-dot compiled with numba: y = dequantize(W) x reading each packed byte once, never forming
the float matrix, for one matrix or for a batch of routed experts each with its own rows of x.

The readable statement is `k3ref.mxfp4.dequantize` followed by a matmul; `k3ref.mxfp4.mxfp4_gemv` and
`k3ref.latent_moe.routed_experts` call this module by default (`k3ref.fast.enabled()`; K3_FAST=numpy selects the
NumPy forms of `k3ref.fast.mxfp4` and `k3ref.fast.latent_moe`). numba is a base dependency; each kernel compiles
on its first call per type signature and is cached on disk (`cache=True`).

Each weight is decoded exactly as `dequantize` defines it, in float32: the E2M1 code's magnitude bits are placed
in a float32's exponent and mantissa fields (code e m -> bits e << 23 | m << 22, which is E2M1 x 2^-126, exact),
and the product with the group's scale 2^(s - 127) is one float32 multiply by 2^(s - 1) when that factor is
finite (s <= 128: the result is exact and never overflows), else two (x 2^126, then x the scale: float32 rounds
to inf exactly where `dequantize` does, and s = 255 gives NaN). The weight is then widened to x's dtype and
multiplied in it, as `dequantize(W).astype(x.dtype)` would be.

Order of every sum (part of the result; no fastmath, so LLVM neither fuses multiply-adds nor reorders sums): a
dot product keeps sixteen partial sums, a_j over the low-nibble products of bytes i = j mod 8 and b_j over the
high-nibble ones, bytes in order, then adds a_0 + ... + a_7 + b_0 + ... + b_7 left to right (`_row_dot`). The
partial sums sit side by side in vector registers without any reassociation, so the bits do not depend on the
vector width; `prange` splits only independent output rows between threads, so they do not depend on the thread
count either. `lane_order_reference` states the same order in NumPy for the tests.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from . import forked_after_numba
from .gemv_jit import superword_vectorizer

ROW_BLOCK = 16      # output rows per parallel work item (speed only: amortises the item's scratch allocations)
THREADS_MIN_BYTES = 2 << 20   # packed bytes from which a call runs on numba's threads (speed only: a smaller one,
                              # `small`'s 256 KB of experts, costs less than waking the threads on a busy machine)
_TWO_126 = np.float32(2.0 ** 126)
# scale byte s -> the float32 factor the decoded bits are multiplied by: 2^(s - 1) for s <= 128 (the whole scale,
# exact); 1 above, where `_decode_row` has already applied the scale in two steps.
_FACTOR = np.array([math.ldexp(1.0, s - 1) if s <= 128 else 1.0 for s in range(256)], np.float32)


@numba.njit(cache=True, nogil=True, inline="always")
def _decode_row(row, srow, lob, hib, lof, hif):  # pragma: no cover -- compiled; tested through its callers
    """Bits of the low / high nibbles' E2M1 x 2^-126 into lob, hib int32 [K/2] (lof, hif: their float32 views);
    in the rare groups with a scale byte above 128 the full weight (E2M1 x 2^126 x scale, inf / NaN as
    `dequantize`) replaces them, so that x `_FACTOR` (1 there) gives the weight in every group."""
    for i in range(row.shape[0]):
        b = np.int32(row[i])
        lob[i] = ((b & np.int32(7)) << np.int32(22)) | ((b & np.int32(8)) << np.int32(28))
        hib[i] = ((b & np.int32(0x70)) << np.int32(18)) | ((b & np.int32(0x80)) << np.int32(24))
    for g in range(srow.shape[0]):
        s = srow[g]
        if s > 128:
            sv = np.float32(np.nan) if s == 255 else np.float32(math.ldexp(1.0, np.int64(s) - 127))
            for i in range(16 * g, 16 * g + 16):
                lof[i] = (lof[i] * _TWO_126) * sv
                hif[i] = (hif[i] * _TWO_126) * sv


@numba.njit(cache=True, nogil=True, inline="always")
def _row_dot(lof, hif, srow, factor, xe, xo):  # pragma: no cover -- compiled; tested through its callers
    """One output: the weights of a decoded row (lof, hif, scale bytes srow) against one input row split into
    its even and odd elements xe, xo [K/2]. Sixteen partial sums, written out so that LLVM keeps them in
    vector registers: a_j adds the low-nibble products of bytes i = j mod 8, b_j the high-nibble ones, bytes in
    order; then a_0 + ... + a_7 + b_0 + ... + b_7 left to right."""
    z = xe.dtype.type(0)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = z
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = z
    for g in range(srow.shape[0]):
        f = factor[srow[g]]
        for u in range(2):
            i = 16 * g + 8 * u
            lo, hi, el, od = lof[i:i + 8], hif[i:i + 8], xe[i:i + 8], xo[i:i + 8]   # constant indices below:
            a0 += (lo[0] * f) * el[0]                                 # no negative-index fix-ups, so LLVM
            a1 += (lo[1] * f) * el[1]                                 # packs the 8 sums into vector lanes
            a2 += (lo[2] * f) * el[2]
            a3 += (lo[3] * f) * el[3]
            a4 += (lo[4] * f) * el[4]
            a5 += (lo[5] * f) * el[5]
            a6 += (lo[6] * f) * el[6]
            a7 += (lo[7] * f) * el[7]
            b0 += (hi[0] * f) * od[0]
            b1 += (hi[1] * f) * od[1]
            b2 += (hi[2] * f) * od[2]
            b3 += (hi[3] * f) * od[3]
            b4 += (hi[4] * f) * od[4]
            b5 += (hi[5] * f) * od[5]
            b6 += (hi[6] * f) * od[6]
            b7 += (hi[7] * f) * od[7]
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + b0 + b1 + b2 + b3 + b4 + b5 + b6 + b7


@numba.njit(cache=True, nogil=True, inline="always")
def _gemv_item(item, packed, scale, factor, xe, xo, starts, rows_of, out):  # pragma: no cover -- see experts_gemv
    """One work item: the rows of one (expert, block of ROW_BLOCK rows) for every pair of that expert."""
    R, half = packed.shape[1], packed.shape[2]
    blocks = (R + ROW_BLOCK - 1) // ROW_BLOCK
    e = item // blocks
    p0, p1 = starts[e], starts[e + 1]
    if p0 == p1:
        return
    lob = np.empty(half, np.int32)
    hib = np.empty(half, np.int32)
    lof, hif = lob.view(np.float32), hib.view(np.float32)
    r0 = (item % blocks) * ROW_BLOCK
    for r in range(r0, min(r0 + ROW_BLOCK, R)):
        _decode_row(packed[e, r], scale[e, r], lob, hib, lof, hif)
        for p in range(p0, p1):                                    # the decoded row serves every pair of e
            out[p, r] = _row_dot(lof, hif, scale[e, r], factor, xe[rows_of[p]], xo[rows_of[p]])


@numba.njit(cache=True, parallel=True, nogil=True)
def _experts_gemv_threads(packed, scale, factor, xe, xo, starts, rows_of, out):  # pragma: no cover
    items = packed.shape[0] * ((packed.shape[1] + ROW_BLOCK - 1) // ROW_BLOCK)
    for item in numba.prange(items):                               # independent (expert, row block) items
        _gemv_item(item, packed, scale, factor, xe, xo, starts, rows_of, out)


@numba.njit(cache=True, nogil=True)
def _experts_gemv_one(packed, scale, factor, xe, xo, starts, rows_of, out):  # pragma: no cover
    items = packed.shape[0] * ((packed.shape[1] + ROW_BLOCK - 1) // ROW_BLOCK)
    for item in range(items):
        _gemv_item(item, packed, scale, factor, xe, xo, starts, rows_of, out)


def split_inputs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] -> (its even elements, its odd elements), each [M, K/2] C-contiguous: the low and the high
    nibble of packed byte i multiply x[2i] and x[2i + 1]."""
    return np.ascontiguousarray(x[:, 0::2]), np.ascontiguousarray(x[:, 1::2])


def experts_gemv(packed: np.ndarray, scale: np.ndarray, x: np.ndarray, starts: np.ndarray, rows_of: np.ndarray,
                 out: np.ndarray) -> np.ndarray:
    """out[p, r] = dequantize(packed[e], scale[e])[r] . x[rows_of[p]] for every pair p of expert e, into out.

    packed u8 [n, R, K/2] and scale u8 [n, R, K/32] (n experts, stacked, or one expert as a [None] view), both
    C-contiguous; x [M, K] float32 or float64; starts int64 [n + 1]: expert e owns pairs starts[e] ..
    starts[e + 1] - 1; rows_of int64 [P]: the row of x each pair reads; out [P, R] in x's dtype, C-contiguous.
    All checked by the caller (`k3ref.mxfp4`, `k3ref.latent_moe`). Each weight row is decoded once for all the
    pairs of its expert, and every byte is read once. Returns out.
    """
    xe, xo = split_inputs(x)
    threaded = packed.nbytes >= THREADS_MIN_BYTES and not forked_after_numba()   # a forked child: serial only
    kernel = _experts_gemv_threads if threaded else _experts_gemv_one
    with superword_vectorizer():
        kernel(packed, scale, _FACTOR, xe, xo, starts, rows_of, out)
    return out


def gemv(packed: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = x @ dequantize(packed, scale).T: packed u8 [N, K/2], scale u8 [N, K/32] C-contiguous, x float32/float64
    [M, K] (checked by the caller) -> y [M, N] in x's dtype."""
    M = x.shape[0]
    out = np.empty((M, packed.shape[0]), x.dtype)
    if M == 0:
        return out
    return experts_gemv(packed[None], scale[None], x, np.array([0, M], np.int64), np.arange(M, dtype=np.int64), out)


@numba.njit(cache=True, nogil=True)
def _mix(outs, pair_tok, pair_w, y):  # pragma: no cover -- compiled; see mix_pairs
    for p in range(outs.shape[0]):                               # in pair order: one fixed order for every token
        t, w = pair_tok[p], pair_w[p]
        for j in range(outs.shape[1]):
            y[t, j] += w * outs[p, j]


def mix_pairs(outs: np.ndarray, pair_tok: np.ndarray, pair_w: np.ndarray, y: np.ndarray) -> np.ndarray:
    """y[pair_tok[p]] += pair_w[p] * outs[p] for p = 0, 1, ... in order (one thread): outs [P, Dl], pair_tok int64
    [P], pair_w [P] and y [T, Dl] in outs' dtype. Returns y."""
    _mix(outs, pair_tok, pair_w, y)
    return y


def lane_order_reference(W: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's sums written in NumPy, for the tests: W = dequantize(packed, scale) [N, K] float32, x [M, K]
    -> y [M, N], every product and addition in the order `_row_dot` states (the weight widened to x's dtype
    first, as the kernel's float32 weight is when it meets x). Slow; the kernel must give the same bits."""
    Wd = W.astype(x.dtype)
    lanes = []
    for parity in (0, 1):                                           # a_0..a_7 (even elements), b_0..b_7 (odd)
        w, xs = Wd[:, parity::2], x[:, parity::2]
        acc = np.zeros((x.shape[0], W.shape[0], 8), x.dtype)
        for i in range(0, w.shape[1], 8):
            acc += xs[:, None, i:i + 8] * w[None, :, i:i + 8]
        lanes += [acc[..., j] for j in range(8)]
    total = lanes[0]
    for lane in lanes[1:]:
        total = total + lane
    return total
