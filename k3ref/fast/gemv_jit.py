"""A weight times a few rows of float activations compiled with numba: y = x @ W.astype(x.dtype).T for a weight
stored as bf16 (ml_dtypes.bfloat16 or its uint16 bits, as the checkpoint reader hands it out), float32 or float64,
without a float copy of W and without BLAS (whose sums depend on the CPU and its thread count).

The readable statement is `k3ref.ops.linear` (x @ w.astype(x.dtype).T); `linear` calls `linear_jit` here by
default for a bf16 weight, or a float32 one times float32 x, and up to `k3ref.ops.JIT_MAX_ROWS` rows of x
(`k3ref.fast.enabled()`; K3_FAST=numpy keeps the cast and BLAS); `k3ref.cpu_weights.table_matmul` calls it for a
float32 lm_head. float64 weights are taken too, for a caller that wants no BLAS. Each kernel
compiles on its first call per type signature and is cached on disk (`cache=True`).

Each weight is converted as astype does (a bf16 value is the top half of a float32: bits << 16, exact; float32 to
float64 exact; float64 to float32 rounded), then multiplied in x's dtype. Order of every sum (part of the result;
no fastmath, so LLVM never reorders sums): sixteen partial sums, a_j over the elements k = j mod 16 in order, then
a_0 + a_1 + ... + a_15 left to right; x is padded with zeros to a multiple of 16 and the weight's missing tail
reads as +0 (adding 0 x 0 leaves a partial sum as it is). Each product meets its partial sum in `multiply_add`:
in float64 one fused multiply-add (rounded once), in float32 a multiply and an add (rounded twice).
`lane_order_reference` states the same order in NumPy.

The kernel (`_tile`, written in LLVM IR on explicit 16-lane vectors) computes a tile of a few weight rows against
up to four rows of x at once (TILES: 4 x 4 in float32, 3 x 4 in float64): each weight chunk is widened once for
every token of the tile and each chunk of x serves the tile's rows, which is what keeps a 16-token prefill from
re-reading x from L2 for every weight row. A single
row of x against short weight rows (a decode step's projections) goes one weight row at a time instead, which
reads the matrix as one stream (`SHORT_ROW_BYTES`). The tiling changes which products are computed together,
never the order in which one dot product adds them, and `prange` splits only independent row blocks between
threads: the bits depend neither on the tile sizes, the vector width nor the thread count.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import forked_after_numba

LANES = 16          # partial sums per dot product (fixed: it defines the summation order)
ROWS = 4            # weight rows per tile of `tile_rows` (speed only)
TILES = {np.dtype(np.float32): (4, 4), np.dtype(np.float64): (3, 4)}   # (weight rows, rows of x at most) per
                    # tile (speed only): that many accumulators of 16 lanes fill 16 (float32) or 24 (float64: two
                    # registers each) of AVX-512's 32 vector registers. float64 takes 3 weight rows so that a
                    # 16-token prefill widens each weight chunk 4 times, not 6: bf16 [3072, 7168] x 16 tokens on one
                    # core, 3 x 4 15.6-16.2 ms, 4 x 3 18.8-19.1 ms
ROW_BLOCK = 24      # weight rows per parallel work item, a multiple of every tile's weight rows (speed only)
SHORT_ROW_BYTES = 16384  # one row of x against a weight whose rows, widened to x's dtype, take at most this many
                         # bytes goes row by row instead of in tiles (speed only; the matrix is then read
                         # as one sequential stream). Measured on one core (AVX-512 EPYC, 8 MB matrices, GB/s of
                         # weight, one row / four rows at a time): float32 K=256 24 / 8, K=1024 28 / 16, K=4096
                         # 23 / 23, K=7168 19 / 27; bf16 into float64 K=2048 15 / 11, K=4096 9 / 12.
THREADS_MIN_BYTES = 1 << 19   # weight bytes from which a call runs on numba's threads (speed only: a smaller one
                              # costs less than waking the threads; the small model's 0.5-1.5 MB float32
                              # matrices gain ~2 ms a decode step on 2 cores from 2 MB down to 512 KB)

_I16, _I32, _I64, _F32, _F64 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType(), ir.DoubleType()


def vector(element) -> ir.VectorType:
    """The LLVM type of LANES `element`s: the partial sums of one dot product (here and in `mxfp4_jit`)."""
    return ir.VectorType(element, LANES)


def splat(builder, value):
    """`value` in every one of LANES lanes (here in `mla_jit` and `mxfp4_jit`)."""
    v = builder.insert_element(ir.Constant(vector(value.type), ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(vector(_I32), [0] * LANES))


def fold_lanes(builder, vectors):
    """lane 0 + lane 1 + ... of the first vector, then of the next, left to right: the final sum of the stated
    order (here and in `mxfp4_jit`)."""
    lanes = [builder.extract_element(v, ir.Constant(_I32, j)) for v in vectors for j in range(LANES)]
    total = lanes[0]
    for lane in lanes[1:]:
        total = builder.fadd(total, lane)
    return total


def multiply_add(builder, acc, a, b):
    """acc + a x b on vectors of partial sums (here and in `mxfp4_jit`; `mla_jit`'s scores through `tile_rows`).
    float64: IEEE 754's fusedMultiplyAdd (llvm.fma), the exact a x b + acc rounded once. It is correctly rounded by
    definition, so the bits are the same on a CPU without an FMA unit (LLVM calls libm's fma there, slowly); on one
    with it the float64 kernels run faster, one instruction where there were two (one core: the bf16 GEMM of 16
    tokens 1.4x, the MXFP4 experts 1.15x).
    float32: a multiply, then an add, each rounded -- the bits the float32 baselines' measured gate rows were
    taken with (conformance.judge.measured)."""
    if acc.type.element == _F64:
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(acc.type, [acc.type] * 3),
                                             f"llvm.fma.v{LANES}f64")
        return builder.call(fma, [a, b, acc])
    return builder.fadd(acc, builder.fmul(a, b))


def fused_multiply_add(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a x b + c for float64 arrays (broadcast), each element rounded once from the exact value, as the kernels'
    float64 `multiply_add` computes it; for the tests' `lane_order_reference`s. Exact rational arithmetic
    (fractions.Fraction, whose float() is correctly rounded), so it depends on no FMA unit; an exact zero takes
    the sign a x b + c has in float arithmetic (IEEE: -0 only when both terms are -0), and a NaN or inf operand,
    or a result past float64's range, the float arithmetic's answer (one NaN operand or an infinity decide it
    alike in either form). Slow: test sizes only."""
    def one(x: float, y: float, z: float) -> float:
        plain = x * y + z
        if not (math.isfinite(x) and math.isfinite(y) and math.isfinite(z)):
            return plain
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        if exact == 0:
            return plain
        try:
            return float(exact)
        except OverflowError:
            return plain

    with np.errstate(all="ignore"):
        return np.frompyfunc(one, 3, 1)(a, b, c).astype(np.float64)


def _widened(builder, stored, wide):
    """A chunk of weights as stored (<16 x i16> bf16 bits, or float32 / float64) -> floats of `wide`, as
    `w.astype(x.dtype)` converts them (bf16: bits << 16 is the float32, exact; float64 to float32: rounded)."""
    if stored.type.element == _I16:
        stored = builder.bitcast(builder.shl(builder.zext(stored, vector(_I32)),
                                             ir.Constant(vector(_I32), [16] * LANES)), vector(_F32))
    if stored.type == wide:
        return stored
    if isinstance(stored.type.element, ir.FloatType):                      # float32 -> float64: exact
        return builder.fpext(stored, wide)
    return builder.fptrunc(stored, wide)


def _tail(builder, row, start, K, element):
    """The weight row's last K - start (< LANES) stored elements from `start`, the other lanes zero: loaded one by
    one at indices clamped into the row, so nothing past it is read."""
    zero = ir.Constant(element, 0)
    chunk = ir.Constant(vector(element), [0] * LANES)
    last = builder.sub(K, ir.Constant(_I64, 1))
    for k in range(LANES):
        at = builder.add(start, ir.Constant(_I64, k))
        inside = builder.icmp_signed("<", at, K)
        value = builder.load(builder.gep(row, [builder.select(inside, at, last)]))
        chunk = builder.insert_element(chunk, builder.select(inside, value, zero), ir.Constant(_I32, k))
    return chunk


def _tile(tokens: int, rows_per_tile: int = ROWS):
    """The compiled tile of `rows_per_tile` weight rows from r0 and `tokens` rows of x from t0: out[t, r] = w[r] .
    x[t]. Rows past the weight's last are computed as copies of the last (the same value, written again)."""

    @intrinsic
    def tile(typingctx, w, x, out, r0, t0):
        if any(a.layout != "C" for a in (w, x, out)):
            return None                               # the IR walks raw pointers: a strided view fails to type
        sig = types.void(w, x, out, r0, t0)

        def codegen(context, builder, signature, args):
            aw, ax, ao = (context.make_array(ty)(context, builder, a)
                          for ty, a in zip(signature.args[:3], args[:3], strict=True))
            wide = vector(context.get_value_type(signature.args[1].dtype))
            stored = context.get_value_type(signature.args[0].dtype)              # i16 (bf16 bits) or a float
            (N, K), K16 = (builder.extract_value(aw.shape, i) for i in (0, 1)), builder.extract_value(ax.shape, 1)
            rows = [builder.add(args[3], ir.Constant(_I64, i)) for i in range(rows_per_tile)]
            rows = [builder.select(builder.icmp_signed("<", r, N), r, builder.sub(N, ir.Constant(_I64, 1)))
                    for r in rows]
            toks = [builder.add(args[4], ir.Constant(_I64, j)) for j in range(tokens)]
            w_rows = [builder.gep(aw.data, [builder.mul(r, K)]) for r in rows]
            x_rows = [builder.gep(ax.data, [builder.mul(t, K16)]) for t in toks]
            sums = [[cgutils.alloca_once_value(builder, ir.Constant(wide, [0.0] * LANES)) for _ in toks]
                    for _ in rows]

            def chunk(start, weights):
                xs = [builder.load(builder.bitcast(builder.gep(p, [start]), wide.as_pointer()), align=1)
                      for p in x_rows]
                for w_i, acc_row in zip(weights, sums, strict=True):
                    for x_j, acc in zip(xs, acc_row, strict=True):
                        builder.store(multiply_add(builder, builder.load(acc), w_i, x_j), acc)

            full = builder.udiv(K, ir.Constant(_I64, LANES))
            with cgutils.for_range(builder, full) as loop:
                start = builder.mul(loop.index, ir.Constant(_I64, LANES))
                chunk(start, [_widened(builder, builder.load(builder.bitcast(builder.gep(p, [start]),
                                                                              vector(stored).as_pointer()), align=1),
                                       wide) for p in w_rows])
            start = builder.mul(full, ir.Constant(_I64, LANES))
            with builder.if_then(builder.icmp_signed("<", start, K), likely=False):
                chunk(start, [_widened(builder, _tail(builder, p, start, K, stored), wide) for p in w_rows])
            for r, acc_row in zip(rows, sums, strict=True):
                for t, acc in zip(toks, acc_row, strict=True):
                    total = fold_lanes(builder, [builder.load(acc)])          # a_0 + a_1 + ... + a_15
                    builder.store(total, builder.gep(ao.data, [builder.add(builder.mul(t, N), r)]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


_tile1, _tile2, _tile3, _tile4 = (_tile(n) for n in range(1, 5))
_tile3r1, _tile3r2, _tile3r3, _tile3r4 = (_tile(n, 3) for n in range(1, 5))
_row = _tile(1, 1)


@numba.njit(cache=True, nogil=True, inline="always")
def tile_rows(w, x, out, r0, most):  # pragma: no cover -- compiled; see linear_jit
    """out[t, r] = w[r] . x[t] for the ROWS weight rows from r0 and every row of x, in tiles of at most `most`
    (1-4) rows of x (here and in `mla_jit`'s score pass)."""
    M = x.shape[0]
    t0 = 0
    while t0 < M:
        n = min(most, M - t0)
        if n == 4:
            _tile4(w, x, out, r0, t0)
        elif n == 3:
            _tile3(w, x, out, r0, t0)
        elif n == 2:
            _tile2(w, x, out, r0, t0)
        else:
            _tile1(w, x, out, r0, t0)
        t0 += n


@numba.njit(cache=True, nogil=True, inline="always")
def _tile_rows3(w, x, out, r0, most):  # pragma: no cover -- compiled; see linear_jit
    """`tile_rows` for the 3 weight rows from r0."""
    M = x.shape[0]
    t0 = 0
    while t0 < M:
        n = min(most, M - t0)
        if n == 4:
            _tile3r4(w, x, out, r0, t0)
        elif n == 3:
            _tile3r3(w, x, out, r0, t0)
        elif n == 2:
            _tile3r2(w, x, out, r0, t0)
        else:
            _tile3r1(w, x, out, r0, t0)
        t0 += n


@numba.njit(cache=True, nogil=True, inline="always")
def _gemv_item(item, w, x, out, rows, most):  # pragma: no cover -- compiled; see linear_jit
    """One work item: weight rows item * ROW_BLOCK ... (at most ROW_BLOCK) for every row of x, in tiles of `rows`
    (3 or 4) weight rows and at most `most` rows of x; `most` = 0: one row of x against one weight row at a time."""
    first, end = item * ROW_BLOCK, min((item + 1) * ROW_BLOCK, w.shape[0])
    if most == 0:
        for r in range(first, end):
            _row(w, x, out, r, 0)
    elif rows == 3:
        for r0 in range(first, end, 3):
            _tile_rows3(w, x, out, r0, most)
    else:
        for r0 in range(first, end, ROWS):
            tile_rows(w, x, out, r0, most)


@numba.njit(cache=True, parallel=True, nogil=True)
def _gemv_threads(w, x, out, rows, most):  # pragma: no cover -- compiled; see linear_jit
    for item in numba.prange((w.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):   # independent row blocks
        _gemv_item(item, w, x, out, rows, most)


@numba.njit(cache=True, nogil=True)
def _gemv_one(w, x, out, rows, most):  # pragma: no cover -- compiled; see linear_jit
    for item in range((w.shape[0] + ROW_BLOCK - 1) // ROW_BLOCK):
        _gemv_item(item, w, x, out, rows, most)


def padded_inputs(x: np.ndarray) -> np.ndarray:
    """x [M, K] -> [M, K16] C-contiguous, K16 = K rounded up to a multiple of LANES, zeros after K."""
    M, K = x.shape
    K16 = -(-K // LANES) * LANES
    if K16 == K and x.flags.c_contiguous:
        return x
    xp = np.zeros((M, K16), x.dtype)
    xp[:, :K] = x
    return xp


def is_bf16(w: np.ndarray) -> bool:
    """True for an ml_dtypes.bfloat16 array (dtype kind first: dtype.name costs ~3 us)."""
    return w.dtype.kind == "V" and w.dtype.name == "bfloat16"


def weight_operand(w: np.ndarray) -> np.ndarray:
    """The weight as the kernel reads it, C-contiguous: a bf16 one (ml_dtypes.bfloat16 or uint16) as its uint16
    bits, a float32 / float64 one as it is (a view, no copy, where w is C-contiguous)."""
    w = np.ascontiguousarray(w)
    return w.view(np.uint16) if is_bf16(w) else w


def linear_jit(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x @ w.astype(x.dtype).T: x float32/float64 [M, K], w [N, K] bf16 (ml_dtypes.bfloat16 or its uint16
    bits), float32 or float64, checked by the caller -> y [M, N] in x's dtype. Reads w once and makes no float
    copy of it; no BLAS, so the bits are the same on every machine."""
    M, N = x.shape[0], w.shape[0]
    out = np.empty((M, N), x.dtype)
    if M and N:
        threaded = w.nbytes >= THREADS_MIN_BYTES and not forked_after_numba()   # a forked child: serial only
        kernel = _gemv_threads if threaded else _gemv_one
        one_row = M == 1 and w.shape[1] * x.itemsize <= SHORT_ROW_BYTES
        rows, most = TILES[x.dtype]
        kernel(weight_operand(w), padded_inputs(x), out, rows, 0 if one_row else most)
    return out



def lane_order_reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's sums written in NumPy, for the tests: w [N, K] (bf16, float32 or float64), x [M, K] -> y [M, N],
    every product and addition in the order the module docstring states. Slow; the kernel must give the same bits."""
    w = np.asarray(w)
    if is_bf16(w) or w.dtype == np.uint16:
        w = (w.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    W = padded_inputs(w.astype(x.dtype))
    xp = padded_inputs(x)
    acc = np.zeros((x.shape[0], W.shape[0], LANES), x.dtype)
    for k in range(0, xp.shape[1], LANES):
        if x.dtype == np.float64:
            acc = fused_multiply_add(xp[:, None, k:k + LANES], W[None, :, k:k + LANES], acc)
        else:
            acc += xp[:, None, k:k + LANES] * W[None, :, k:k + LANES]
    total = acc[..., 0]
    for j in range(1, LANES):
        total = total + acc[..., j]
    return total
