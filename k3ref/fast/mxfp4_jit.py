"""MXFP4 dequantise-and-dot compiled with numba: y = dequantize(W) x reading each packed byte once, never forming
the float matrix, for one matrix or for a batch of routed experts each with its own rows of x.

The readable statement is `k3ref.mxfp4.dequantize` followed by a matmul; `k3ref.mxfp4.mxfp4_gemv` and
`k3ref.latent_moe.routed_experts` call this module by default (`k3ref.fast.enabled()`; K3_FAST=numpy selects the
NumPy forms of `k3ref.fast.mxfp4` and `k3ref.fast.latent_moe`). numba is a base dependency; each kernel compiles
on its first call per type signature and is cached on disk (`cache=True`).

Decoding is a table lookup. `GROUP_TABLES[s]` holds the sixteen float32 weights a group with scale byte s can
take (E2M1 code c times 2^(s - 127), NaN for s = 255, inf where float32 overflows: what `dequantize` gives; a test
compares all 256 x 16). One group of 32 weights is sixteen packed bytes; their low nibbles index the group's
table into one 16-lane vector, their high nibbles into another, so decoding and scaling cost three vector
instructions per 32 weights (`_group_weights`: LLVM turns the lookup into a variable permute where the CPU has
one). The weight is then widened to x's dtype and multiplied in it, as `dequantize(W).astype(x.dtype)` would be.
For float64 x on AVX-512 the table is GROUP_TABLES64, the same values widened once, looked up straight into
float64 lanes (`_group_weights64`), which spares a conversion per weight. A row is decoded once for up to PAIRS
rows of x that read it (an expert's tokens), and each of those dot products keeps its own partial sums; with the
float64 table two rows at a time share each loaded chunk of x (against up to two of its rows), and each row's
bytes are prefetched PREFETCH_BYTES ahead. None of this changes which products a partial sum adds, or in what
order.

Order of every sum (part of the result; no fastmath, so LLVM never reorders sums): a dot product keeps thirty-two
partial sums, a_j over the low-nibble products of bytes i = j mod 16 and b_j over the high-nibble ones, bytes in
order, then adds a_0 + ... + a_15 + b_0 + ... + b_15 left to right. Each product meets its partial sum in
`gemv_jit.multiply_add`: fused in float64 (rounded once), a multiply and an add in float32. The partial sums
are the lanes of two explicit vectors (`_dots` writes LLVM IR), so the bits depend neither on the CPU's vector
width nor on the instructions chosen; `prange` splits only independent output rows between threads, so they do
not depend on the thread count either. `lane_order_reference` states the same order in NumPy for the tests.
"""
from __future__ import annotations

import platform

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import forked_after_numba
from .gemv_jit import LANES, fold_lanes, fused_multiply_add, multiply_add, splat, vector

# LANES (16) is also the partial sums per nibble parity here: one group of 16 bytes adds once to each lane.

ROW_BLOCK = 16      # output rows per parallel work item (speed only)
PREFETCH_BYTES = 4096   # how far ahead of the group being decoded its row's bytes are asked for (speed only:
                        # 150 K3 experts from a memory-mapped file, float64, one core, two rows a tile: 1024
                        # 10.2-10.5, 2048 11.6, 4096 11.6-12.2, 8192 12.1-12.2 G codes/s, none 8.7)
PAIRS = 4           # pairs of one expert that share one decoding of a row, at most (speed only: 4 x 4 float64
                    # accumulators of 8 lanes fill half of AVX-512's 32 vector registers)
THREADS_MIN_BYTES = 1 << 18   # packed bytes from which a call runs on numba's threads (speed only: decoding is
                              # compute-bound, `small`'s 8 chosen experts, 0.5 MB a projection, take ~60 us on one
                              # core; a call much smaller costs less than waking the threads)


def _group_tables() -> np.ndarray:
    """[256, 16] float32: row s = the E2M1 values of codes 0..15 (sign in bit 3) times 2^(s - 127), one float32
    multiply each as `dequantize` does (exact but where 6 x 2^127 overflows to inf); row 255 is NaN."""
    magnitude = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    values = np.concatenate([magnitude, -magnitude])                          # codes 8..15: the same, negated
    with np.errstate(over="ignore", invalid="ignore"):
        scales = np.ldexp(1.0, np.arange(256) - 127).astype(np.float32)      # 2^-127 is a float32 subnormal: exact
        scales[255] = np.nan
        tables = scales[:, None] * values[None, :]
    tables.setflags(write=False)
    return tables


GROUP_TABLES = _group_tables()
GROUP_TABLES64 = GROUP_TABLES.astype(np.float64)       # the same values (float32 to float64 is exact), for float64 x
GROUP_TABLES64.setflags(write=False)


def _target_has(feature: str) -> bool:
    """True when numba compiles for an x86 CPU with `feature` ("avx2", "avx512f"); speed only (see
    `_group_weights`). An explicit numba target (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, e.g. "generic" for a
    portable cache) counts only when its feature string names +feature."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    name, features = (getattr(numba.config, key, None) for key in ("CPU_NAME", "CPU_FEATURES"))
    if name or features:
        return f"+{feature}" in (features or "")
    return bool(llvmlite.binding.get_host_cpu_features().get(feature, False))


_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _lookup(builder, table, index):
    """out[k] = table[index[k]] for k < LANES: written as element moves, which LLVM's x86 back end lowers to one
    variable permute (vpermd) and any other back end to what it has."""
    out = ir.Constant(vector(table.type.element), ir.Undefined)
    for k in range(LANES):
        i = builder.extract_element(index, ir.Constant(_I32, k))
        out = builder.insert_element(out, builder.extract_element(table, i), ir.Constant(_I32, k))
    return out


def _group_weights(builder, table, packed16, permute: bool, opaque: bool):
    """The group's 16 low-nibble and 16 high-nibble weights (float32 vectors) from its table and its 16 bytes.

    `permute` (a CPU with a variable permute: x86 AVX2 and later): a table lookup per vector. Elsewhere LLVM
    would lower the lookup as 16 scalar moves, so the weights are computed instead, to the same values: the
    E2M1 code's bits placed in a float32 (code e m -> e << 23 | m << 22, which is E2M1 x 2^-126), times 2^126
    (exact: the E2M1 value), times the group's scale (table[2] = 1.0 x scale: one float32 multiply, as
    `dequantize` does). With `opaque`, each looked-up vector passes through an empty inline-asm statement:
    without it, widening to float64 makes LLVM split the lookup in halves and lower one as scalar moves."""
    def ints(v: int):
        return ir.Constant(vector(_I32), [v] * LANES)

    def field(mask: int, shift: int):
        return builder.shl(builder.and_(codes, ints(mask)), ints(shift))

    codes = builder.zext(packed16, vector(_I32))
    if permute:
        weights = [_lookup(builder, table, builder.and_(codes, ints(15))),
                   _lookup(builder, table, builder.lshr(codes, ints(4)))]
        if opaque:
            weights = [builder.asm(ir.FunctionType(w.type, [w.type]), "", "=v,0", [w], False) for w in weights]
        return weights
    two_126 = splat(builder, ir.Constant(_F32, 2.0 ** 126))
    scale = splat(builder, builder.extract_element(table, ir.Constant(_I32, 2)))
    low = builder.or_(field(0x07, 22), field(0x08, 28))          # magnitude e m -> e << 23 | m << 22, sign -> 31
    high = builder.or_(field(0x70, 18), field(0x80, 24))
    return [builder.fmul(builder.fmul(builder.bitcast(bits, vector(_F32)), two_126), scale) for bits in (low, high)]


_PERMUTE = _target_has("avx2")
_OPAQUE = _PERMUTE and _target_has("avx512f")   # the empty asm names an AVX-512 register class ("v")


_PERMUTE64 = _target_has("avx512f")   # vpermi2pd: one lookup into a 16-entry float64 table held in two registers
_V8D, _V8Q = ir.VectorType(ir.DoubleType(), 8), ir.VectorType(_I64, 8)


def _group_weights64(builder, table_at, row_at):
    """The group's 16 low-nibble and 16 high-nibble weights as float64 vectors, looked up in its float64 table
    (GROUP_TABLES64[s]) with AVX-512's two-register permute: eight bytes zero-extended to eight 64-bit lanes index
    the low nibbles as they are (the permute reads an index's low four bits only) and, shifted right by 4, the
    high ones. The values are GROUP_TABLES' widened exactly, so the products are those of the float32 lookup
    widened (`_group_weights` + fpext) without a conversion per weight: ~1.5x the speed on one core."""
    permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8D, [_V8D, _V8Q, _V8D]),
                                             "llvm.x86.avx512.vpermi2var.pd.512")
    table = [builder.load(builder.bitcast(builder.gep(table_at, [ir.Constant(_I64, 8 * h)]), _V8D.as_pointer()),
                          align=8) for h in range(2)]
    low, high = [], []
    for h in range(2):                                               # bytes 0-7, then 8-15 of the group
        at = builder.bitcast(builder.gep(row_at, [ir.Constant(_I64, 8 * h)]), ir.VectorType(_I8, 8).as_pointer())
        codes = builder.zext(builder.load(at, align=1), _V8Q)
        low.append(builder.call(permute, [table[0], codes, table[1]]))
        high.append(builder.call(permute, [table[0], builder.lshr(codes, ir.Constant(_V8Q, [4] * 8)), table[1]]))
    joined = ir.Constant(vector(_I32), list(range(LANES)))
    return [builder.shuffle_vector(halves[0], halves[1], joined) for halves in (low, high)]


def _prefetch(builder, at):
    """Ask for the cache line at `at` ahead of its use (llvm.prefetch: a hint, which never faults, so an address past
    the array's end is harmless). A routed expert's bytes come from memory once each: without it one core decodes
    them ~30% slower than from cache."""
    hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [at.type, _I32, _I32, _I32]),
                                          "llvm.prefetch.p0i8")
    builder.call(hint, [at, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])   # read, keep, data


def _dots(n: int, rows: int = 1):
    """The compiled dot products of `rows` packed rows with `n` rows of x, each row decoded once for all of them
    and each chunk of x loaded once for all the rows: out[p0 + i, r + q] = packed[r + q] . x[rows_of[p0 + i]] for
    i < n, q < rows, with x split into its even and odd elements xe, xo [M, K/2] (float32 or float64); packed u8
    [R, K/2] and scale u8 [R, K/32] are the matrix's bytes; tables is GROUP_TABLES, or GROUP_TABLES64 for float64
    x on AVX-512 (`tables_for`); shapes checked by the caller. Emits the group loop in LLVM IR on two explicit
    vectors of LANES partial sums per dot product (a_j, b_j: the module docstring's order), then reduces each left
    to right."""

    @intrinsic
    def dots(typingctx, packed, scale, tables, xe, xo, rows_of, p0, out, r):
        if any(a.layout != "C" for a in (packed, scale, tables, xe, xo, rows_of, out)):
            return None                               # the IR walks raw pointers: a strided view fails to type
        if tables.dtype == types.float64 and xe.dtype != types.float64:
            return None                               # the float64 table serves float64 x only
        sig = types.void(packed, scale, tables, xe, xo, rows_of, p0, out, r)

        def codegen(context, builder, signature, args):
            arrays = [context.make_array(ty)(context, builder, a)
                      for ty, a in zip(signature.args[:6], args[:6], strict=True)]
            p_packed, p_scale, p_tables, p_even, p_odd, p_rows = (a.data for a in arrays)
            o = context.make_array(signature.args[7])(context, builder, args[7])
            row_bytes, groups = (builder.extract_value(a.shape, 1) for a in arrays[:2])
            half, width = builder.extract_value(arrays[3].shape, 1), builder.extract_value(o.shape, 1)
            out_rows = [builder.add(args[8], ir.Constant(_I64, q)) for q in range(rows)]
            row_at = [builder.gep(p_packed, [builder.mul(r, row_bytes)]) for r in out_rows]
            scale_at = [builder.gep(p_scale, [builder.mul(r, groups)]) for r in out_rows]
            pairs = [builder.add(args[6], ir.Constant(_I64, i)) for i in range(n)]
            x_rows = [builder.mul(builder.load(builder.gep(p_rows, [p])), half) for p in pairs]
            dtype = signature.args[3].dtype
            wide = vector(context.get_value_type(dtype))
            sums = [[[cgutils.alloca_once_value(builder, ir.Constant(wide, [0.0] * LANES)) for _ in range(2)]
                     for _ in pairs] for _ in out_rows]
            lookup64 = signature.args[2].dtype == types.float64
            opaque = _OPAQUE and dtype != types.float32
            with cgutils.for_range(builder, groups) as loop:
                g = loop.index
                start = builder.mul(g, ir.Constant(g.type, LANES))
                xs = [[builder.load(builder.bitcast(builder.gep(p_x, [builder.add(x_at, start)]), wide.as_pointer()),
                                    align=1) for p_x in (p_even, p_odd)] for x_at in x_rows]
                for row, srow, acc_row in zip(row_at, scale_at, sums, strict=True):
                    _prefetch(builder, builder.gep(row, [builder.add(start, ir.Constant(_I64, PREFETCH_BYTES))]))
                    _prefetch(builder, builder.gep(srow, [builder.add(g, ir.Constant(_I64, PREFETCH_BYTES // 16))]))
                    s = builder.zext(builder.load(builder.gep(srow, [g])), _I64)
                    table_at = builder.gep(p_tables, [builder.mul(s, ir.Constant(_I64, LANES))])
                    if lookup64:
                        weights = _group_weights64(builder, table_at, builder.gep(row, [start]))
                    else:
                        table = builder.load(builder.bitcast(table_at, vector(_F32).as_pointer()), align=4)
                        bytes16 = builder.load(builder.bitcast(builder.gep(row, [start]), vector(_I8).as_pointer()),
                                               align=1)
                        weights = _group_weights(builder, table, bytes16, _PERMUTE, opaque)
                        if dtype != types.float32:
                            weights = [builder.fpext(w, wide) for w in weights]
                    for x_pair, acc_pair in zip(xs, acc_row, strict=True):
                        for w, x, acc in zip(weights, x_pair, acc_pair, strict=True):
                            builder.store(multiply_add(builder, builder.load(acc), w, x), acc)
            for r, acc_row in zip(out_rows, sums, strict=True):
                for p, acc_pair in zip(pairs, acc_row, strict=True):
                    total = fold_lanes(builder, [builder.load(acc) for acc in acc_pair])   # a_0 + ... + b_15
                    builder.store(total, builder.gep(o.data, [builder.add(builder.mul(p, width), r)]))
            return context.get_dummy_value()

        return sig, codegen

    return dots


_dots1, _dots2, _dots3, _dots4 = (_dots(n) for n in range(1, PAIRS + 1))
_two_rows1, _two_rows2 = _dots(1, 2), _dots(2, 2)


@intrinsic
def _u8_at(typingctx, address):
    """The uint8 pointer at the integer `address` (an array's data address, taken by `experts_gemv`)."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.CPointer(types.uint8)(address)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _gemv_item(item, at_packed, at_scale, R, K, tables, xe, xo, starts, rows_of, out, two_rows):  # pragma: no cover
    """One work item: the rows of one (expert j, block of ROW_BLOCK rows) for every pair of that expert, its
    packed and scale bytes found at the addresses at_packed[j] and at_scale[j] (see experts_gemv); with
    `two_rows`, two rows at a time against up to 2 pairs, else one row against up to PAIRS pairs."""
    blocks = (R + ROW_BLOCK - 1) // ROW_BLOCK
    j = item // blocks
    packed = numba.carray(_u8_at(at_packed[j]), (R, K // 2))
    scale = numba.carray(_u8_at(at_scale[j]), (R, K // 32))
    r, end_r = (item % blocks) * ROW_BLOCK, min((item % blocks + 1) * ROW_BLOCK, R)
    while r < end_r:
        p, end = starts[j], starts[j + 1]
        if two_rows and r + 1 < end_r:                                 # two rows share each chunk of x
            while p < end:
                n = min(2, end - p)
                if n == 2:
                    _two_rows2(packed, scale, tables, xe, xo, rows_of, p, out, r)
                else:
                    _two_rows1(packed, scale, tables, xe, xo, rows_of, p, out, r)
                p += n
            r += 2
            continue
        while p < end:                                                 # each row decoded once per PAIRS pairs of j
            n = min(PAIRS, end - p)
            if n == 4:
                _dots4(packed, scale, tables, xe, xo, rows_of, p, out, r)
            elif n == 3:
                _dots3(packed, scale, tables, xe, xo, rows_of, p, out, r)
            elif n == 2:
                _dots2(packed, scale, tables, xe, xo, rows_of, p, out, r)
            else:
                _dots1(packed, scale, tables, xe, xo, rows_of, p, out, r)
            p += n
        r += 1


@numba.njit(cache=True, parallel=True, nogil=True)
def _experts_gemv_threads(at_packed, at_scale, R, K, tables, xe, xo, starts, rows_of, out,
                          two_rows):  # pragma: no cover
    for item in numba.prange(at_packed.shape[0] * ((R + ROW_BLOCK - 1) // ROW_BLOCK)):   # (expert, row block)
        _gemv_item(item, at_packed, at_scale, R, K, tables, xe, xo, starts, rows_of, out, two_rows)


@numba.njit(cache=True, nogil=True)
def _experts_gemv_one(at_packed, at_scale, R, K, tables, xe, xo, starts, rows_of, out, two_rows):  # pragma: no cover
    for item in range(at_packed.shape[0] * ((R + ROW_BLOCK - 1) // ROW_BLOCK)):
        _gemv_item(item, at_packed, at_scale, R, K, tables, xe, xo, starts, rows_of, out, two_rows)


def split_inputs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] -> (its even elements, its odd elements), each [M, K/2] C-contiguous: the low and the high
    nibble of packed byte i multiply x[2i] and x[2i + 1]."""
    return np.ascontiguousarray(x[:, 0::2]), np.ascontiguousarray(x[:, 1::2])


def experts_gemv(packed: list[np.ndarray], scale: list[np.ndarray], x: np.ndarray, starts: np.ndarray,
                 rows_of: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[p, r] = dequantize(packed[j], scale[j])[r] . x[rows_of[p]] for every pair p of the call's j-th expert,
    into out.

    packed[j] u8 [R, K/2] and scale[j] u8 [R, K/32]: each expert's own arrays, all of one shape, read where they
    lie (by address: no stack, no copy of a contiguous one); x [M, K] float32 or float64; starts int64 [n + 1]:
    expert j owns pairs starts[j] .. starts[j + 1] - 1; rows_of int64 [P]: the row of x each pair reads; out [P, R]
    in x's dtype, C-contiguous; checked by the caller (`k3ref.mxfp4`, `k3ref.latent_moe`), the shapes again here.
    One compiled call for every expert, its (expert, row block) items split between numba's threads. Every byte is
    read once per pair of its expert, from cache after the first. Returns out.
    """
    n = len(packed)
    if n == 0:
        return out
    held = [np.ascontiguousarray(a) for a in (*packed, *scale)]      # alive until the kernel returns
    R, K = held[0].shape[0], 2 * held[0].shape[1]
    if any(a.shape != (R, K // 2) for a in held[:n]) or any(a.shape != (R, K // 32) for a in held[n:]):
        raise ValueError(f"experts_gemv: expected every expert's packed [{R}, {K // 2}] and scale "
                         f"[{R}, {K // 32}] (the kernel reads that many bytes at each address), found "
                         f"{[a.shape for a in held]}")
    at = np.array([a.ctypes.data for a in held], np.int64)
    experts_gemv_at(at[:n], at[n:], R, K, x, starts, rows_of, out)
    del held
    return out


def experts_gemv_at(at_packed: np.ndarray, at_scale: np.ndarray, R: int, K: int, x: np.ndarray, starts: np.ndarray,
                    rows_of: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`experts_gemv` for experts given by address: at_packed[j], at_scale[j] (int64) are the data addresses of
    expert j's C-contiguous packed u8 [R, K/2] and scale u8 [R, K/32], which the caller has checked and keeps alive
    until this returns (`addresses` takes them once for a model's experts: ~1 us an array, 16 arrays a
    projection). Returns out."""
    if len(at_packed) == 0:
        return out
    xe, xo = split_inputs(x)
    threaded = (len(at_packed) * (R * K // 2 + R * K // 32) >= THREADS_MIN_BYTES
                and not forked_after_numba())                       # a forked child: serial only
    kernel = _experts_gemv_threads if threaded else _experts_gemv_one
    tables = tables_for(x.dtype)
    kernel(at_packed, at_scale, R, K, tables, xe, xo, starts, rows_of, out, tables.dtype == np.float64)
    return out


def tables_for(dtype: np.dtype) -> np.ndarray:
    """The decoding table the kernel takes for x of `dtype`: GROUP_TABLES64 for float64 on AVX-512 (no
    conversion per weight, `_group_weights64`), GROUP_TABLES otherwise. Both give the same bits."""
    return GROUP_TABLES64 if dtype == np.float64 and _PERMUTE64 else GROUP_TABLES


def addresses(packed: np.ndarray, scale: np.ndarray) -> tuple[int, int] | None:
    """(packed's, scale's) data addresses for `experts_gemv_at`, or None when either is not C-contiguous (the kernel
    walks rows by pointer: such an expert goes through `experts_gemv`, which copies it)."""
    if not (packed.flags.c_contiguous and scale.flags.c_contiguous):
        return None
    return packed.ctypes.data, scale.ctypes.data


def gemv(packed: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = x @ dequantize(packed, scale).T: packed u8 [N, K/2], scale u8 [N, K/32] C-contiguous, x float32/float64
    [M, K] (checked by the caller) -> y [M, N] in x's dtype."""
    M = x.shape[0]
    out = np.empty((M, packed.shape[0]), x.dtype)
    if M == 0:
        return out
    return experts_gemv([packed], [scale], x, np.array([0, M], np.int64), np.arange(M, dtype=np.int64), out)


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
    -> y [M, N], every product and addition in the order the module docstring states (the weight widened to x's dtype
    first, as the kernel's float32 weight is when it meets x). Slow; the kernel must give the same bits."""
    Wd = W.astype(x.dtype)
    lanes = []
    for parity in (0, 1):                                           # a_0..a_15 (even elements), b_0..b_15 (odd)
        w, xs = Wd[:, parity::2], x[:, parity::2]
        acc = np.zeros((x.shape[0], W.shape[0], LANES), x.dtype)
        for i in range(0, w.shape[1], LANES):
            if x.dtype == np.float64:
                acc = fused_multiply_add(xs[:, None, i:i + LANES], w[None, :, i:i + LANES], acc)
            else:
                acc += xs[:, None, i:i + LANES] * w[None, :, i:i + LANES]
        lanes += [acc[..., j] for j in range(LANES)]
    total = lanes[0]
    for lane in lanes[1:]:
        total = total + lane
    return total
