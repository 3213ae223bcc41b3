"""The absorbed MLA decode core compiled with numba: `k3ref.mla.mla_decode_readable` (NumPy, the statement)
reorganised as one pass per (sequence, block of heads) over the paged cache.

For sequence b and head h (rows j < seq_lens[b], gathered page by page through the block table):
    s_hj = (q_abs_h . row_j) * scale;   p_h = exp(s_h - max s_h) / sum exp(s_h - max s_h)
    o_lat_h = sum_j p_hj row_j[:kv_rank]
Two passes over the sequence's pages per block of heads: the scores (and their max) first, then the weighted sum
of latent rows with the normalised weights, as the readable form divides before it sums.

Order of every sum (part of the result; no fastmath, so LLVM never reorders sums):
- a score is `k3ref.fast.gemv_jit`'s dot product, the page's rows as the weight and the block's query rows as x:
  sixteen partial sums over the elements i = j mod 16 in order (in float64 each product added by a fused
  multiply-add, `gemv_jit.multiply_add`), added left to right, then times scale;
- the softmax's max and sum run over the rows in ascending order;
- o_lat_h[i] is a plain sum over the rows in ascending order, from 0 (`_accumulate`: sixteen columns of four heads
  held in vector registers while the page's rows stream past, each product added in row order).
Each (sequence, head) output is computed by one thread, and `prange` only spreads whole (sequence, head block)
tasks over threads, so the bits depend neither on the thread count nor on the head blocking; no BLAS (its blocking
depends on its thread count).

The rows read must be finite (the readable form's argument check scans them); the kernel reports per sequence
whether every score it made was finite (a NaN or Inf in a row read makes its score so), so the caller scans only
when one was not and raises the readable check's error.

It runs on `k3ref.threads.compute_threads()` threads (K3_THREADS, else numba's own count).
numba is a base dependency; its functions compile on first call (cached on disk by `cache=True`).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..threads import compute_threads, numba_threads
from . import forked_after_numba
from .gemv_jit import LANES, ROWS, splat, tile_rows, vector

# Heads per task: their query rows (HEAD_BLOCK x 576 values) stay in L1/L2 while every page is read once per
# block; speed only (each head's arithmetic does not depend on it).
HEAD_BLOCK = 16
HEADS = 4           # heads whose sums `_accumulate` holds in registers at once (speed only)
AHEAD = 2 * LANES   # `_accumulate` asks for the cache lines this many columns ahead of the ones it reads (speed
                    # only: float64, 96 heads x 4096 rows, the weighted sum took 26 ms without, 11 ms with)

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)


def _prefetch(builder, pointer) -> None:
    """llvm.prefetch (read, all cache levels) of the line at `pointer`: it never faults, so it may point past an
    array, and it changes no value."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32,
                                                                                         _I32]), "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(pointer, _I8.as_pointer()), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                      ir.Constant(_I32, 1)])


@intrinsic
def _accumulate(typingctx, rows, p, o, n, h0, c0):
    """o[h, c0:c0+LANES] += p[h, j] rows[j, c0:c0+LANES] for j = 0, 1, ..., n-1 in that order, for the HEADS heads
    from h0: each head's LANES sums stay in one vector register while the rows go by. Heads past the last are
    computed as copies of it (loaded, summed and stored alike: the same value, written again). rows [page, W],
    p [heads, page], o [heads, R]; c0 + LANES <= R <= W, n <= page (checked by the caller)."""
    if any(a.layout != "C" for a in (rows, p, o)):
        return None                                   # the IR walks raw pointers: a strided view fails to type
    sig = types.void(rows, p, o, n, h0, c0)

    def codegen(context, builder, signature, args):
        ar, ap, ao = (context.make_array(ty)(context, builder, a)
                      for ty, a in zip(signature.args[:3], args[:3], strict=True))
        n, h0, c0 = args[3:]
        element = context.get_value_type(signature.args[0].dtype)
        wide = vector(element)
        lines = range(0, LANES, 512 // signature.args[0].dtype.bitwidth)   # the chunk's cache lines (64 bytes)
        W = builder.extract_value(ar.shape, 1)
        H, page = (builder.extract_value(ap.shape, i) for i in (0, 1))
        R = builder.extract_value(ao.shape, 1)
        last = builder.sub(H, ir.Constant(_I64, 1))
        heads = [builder.add(h0, ir.Constant(_I64, g)) for g in range(HEADS)]
        heads = [builder.select(builder.icmp_signed("<", h, H), h, last) for h in heads]
        o_at = [builder.bitcast(builder.gep(ao.data, [builder.add(builder.mul(h, R), c0)]), wide.as_pointer())
                for h in heads]
        p_rows = [builder.gep(ap.data, [builder.mul(h, page)]) for h in heads]
        sums = [cgutils.alloca_once_value(builder, builder.load(at, align=1)) for at in o_at]
        with cgutils.for_range(builder, n) as loop:
            at = builder.add(builder.mul(loop.index, W), c0)
            for line in lines:
                _prefetch(builder, builder.gep(ar.data, [builder.add(at, ir.Constant(_I64, AHEAD + line))]))
            row = builder.load(builder.bitcast(builder.gep(ar.data, [at]), wide.as_pointer()), align=1)
            for p_row, acc in zip(p_rows, sums, strict=True):
                weight = splat(builder, builder.load(builder.gep(p_row, [loop.index])))
                builder.store(builder.fadd(builder.load(acc), builder.fmul(weight, row)), acc)
        for at, acc in zip(o_at, sums, strict=True):
            builder.store(builder.load(acc), at, align=1)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, inline="always")
def _score_page(rows, xq, out):
    """out[h, r] = rows[r] . xq[h] for every row of the page and every head of the block, in gemv_jit's order
    (tiles of ROWS rows and up to 4 heads; rows past seq_len are scored too and never used)."""
    for r0 in range(0, rows.shape[0], ROWS):
        tile_rows(rows, xq, out, r0, 4)


@numba.njit(cache=True)
def _head_block(q_abs, kv_cache, table_row, L, scale, kv_rank, b, h0, h1, o_lat):
    """Heads h0..h1-1 of sequence b: o_lat[b, h] for each; returns whether every score is finite."""
    page, W = kv_cache.shape[1], kv_cache.shape[2]
    nh = h1 - h0
    pages = (L + page - 1) // page
    xq = np.zeros((nh, (W + LANES - 1) // LANES * LANES), q_abs.dtype)   # padded with zeros, as gemv_jit reads x
    xq[:, :W] = q_abs[b, h0:h1]
    s = np.empty((nh, L), q_abs.dtype)
    buf = np.empty((nh, page), q_abs.dtype)
    finite = True
    for pg in range(pages):                              # pass 1: scores, page by page
        _score_page(kv_cache[table_row[pg]], xq, buf)
        for h in range(nh):
            for k in range(min(page, L - pg * page)):
                s[h, pg * page + k] = buf[h, k] * scale
                finite &= np.isfinite(s[h, pg * page + k])
    for h in range(nh):                                  # stable softmax per head, normalised before the sum
        m = s[h, 0]
        for j in range(1, L):
            m = max(m, s[h, j])
        for j in range(L):
            s[h, j] = np.exp(s[h, j] - m)
        total = s[h, 0]
        for j in range(1, L):
            total += s[h, j]
        for j in range(L):
            s[h, j] = s[h, j] / total
    o = np.zeros((nh, kv_rank), q_abs.dtype)
    full = kv_rank // LANES * LANES                      # columns in whole vectors; the rest one at a time
    for pg in range(pages):                              # pass 2: weighted sum of latent rows, rows ascending
        n = min(page, L - pg * page)
        rows = kv_cache[table_row[pg]]
        for h in range(nh):
            buf[h, :n] = s[h, pg * page:pg * page + n]
        for c0 in range(0, full, LANES):
            for hh in range(0, nh, HEADS):
                _accumulate(rows, buf, o, n, hh, c0)
        for h in range(nh):
            for j in range(n):
                for i in range(full, kv_rank):
                    o[h, i] += buf[h, j] * rows[j, i]
    o_lat[b, h0:h1, :] = o
    return finite


def _decode_tasks(q_abs, kv_cache, block_table, seq_lens, scale, kv_rank, head_block, o_lat, finite):
    B, H = q_abs.shape[0], q_abs.shape[1]
    blocks = (H + head_block - 1) // head_block
    for task in numba.prange(B * blocks):
        b = task // blocks
        h0 = (task % blocks) * head_block
        ok = _head_block(q_abs, kv_cache, block_table[b], seq_lens[b], scale, kv_rank, b, h0,
                         min(H, h0 + head_block), o_lat)
        finite[task] = ok


# The same tasks compiled twice: spread over threads, and serial for a process forked after numba started its
# threads (k3ref.fast.forked_after_numba: a parallel region there would kill it). Each task is computed whole by one
# thread either way, so both give the same bits.
_decode = numba.njit(cache=True, parallel=True)(_decode_tasks)
_decode_serial = numba.njit(cache=True)(_decode_tasks)


def mla_decode(q_abs: np.ndarray, kv_cache: np.ndarray, block_table: np.ndarray, seq_lens: np.ndarray,
               scale: float, kv_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """o_lat [B, H, kv_rank] in q_abs's dtype, and finite [B] (every row value the sequence read was finite).

    q_abs [B, H, W] and kv_cache [N, page, W] share a float dtype (float32 or float64); block_table [B, pages]
    and seq_lens [B] hold ids and lengths the caller has checked (in range, seq_len >= 1)."""
    dt = q_abs.dtype
    B, H = q_abs.shape[:2]
    o_lat = np.empty((B, H, kv_rank), dt)
    blocks = -(-H // HEAD_BLOCK)
    finite = np.empty(B * blocks, np.bool_)
    kernel = _decode_serial if forked_after_numba() else _decode
    with numba_threads(compute_threads()):
        kernel(np.ascontiguousarray(q_abs), np.ascontiguousarray(kv_cache),
                np.ascontiguousarray(block_table, dtype=np.int64), np.ascontiguousarray(seq_lens, dtype=np.int64),
                dt.type(scale), int(kv_rank), HEAD_BLOCK, o_lat, finite)
    return o_lat, np.asarray(finite.reshape(B, blocks).all(axis=1))
