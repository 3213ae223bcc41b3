"""The absorbed MLA decode core compiled with numba: `k3ref.mla.mla_decode_readable` (NumPy, the statement)
reorganised as one pass per (sequence, block of heads) over the paged cache.

For sequence b and head h (rows j < seq_lens[b], gathered page by page through the block table):
    s_hj = (q_abs_h . row_j) * scale;   p_h = exp(s_h - max s_h) / sum exp(s_h - max s_h)
    o_lat_h = sum_j p_hj row_j[:kv_rank]
Two passes over the sequence's rows per block of heads: the scores (and their max) first, then the
weighted sum of latent rows with the normalised weights, as the readable form divides before it sums.

Same bits on any machine and thread count: each (sequence, head) output is computed by one thread in a
fixed order (each score a plain sum over the row in ascending index, ROWS rows side by side in the lanes of
a vector; the softmax sum and the weighted sum over rows in ascending row order);
`prange` only spreads whole (sequence, head block) tasks over threads. No fastmath (it would let LLVM
reorder the sums) and no BLAS (its blocking depends on its thread count).

The rows read must be finite (the readable form's argument check scans them); the kernel reports per
sequence whether every value it read was finite, so the caller scans only when one was not and raises the
readable check's error.

It runs on `k3ref.threads.compute_threads()` threads (K3_THREADS, else numba's own count).
numba is a base dependency; its functions compile on first call (cached on disk by `cache=True`).
"""
from __future__ import annotations

import numba
import numpy as np

from ..threads import compute_threads, numba_threads
from . import forked_after_numba

# Heads per task: their query rows (HEAD_BLOCK x 576 values) stay in L1/L2 while every cache row is read
# once per block; speed only (each head's arithmetic does not depend on it).
HEAD_BLOCK = 16
ROWS = 8        # cache rows scored side by side (one per vector lane)


@numba.njit(cache=True, inline="always")
def _gather_tile(kv_cache, table_row, j0, L, tile):
    """tile[i, k] = row j0 + k of the sequence (column i), for the ROWS rows from j0 (zeros past L); returns
    whether every value gathered was finite."""
    page = kv_cache.shape[1]
    finite = True
    for k in range(ROWS):
        j = j0 + k
        if j < L:
            row = kv_cache[table_row[j // page], j % page]
            for i in range(row.shape[0]):
                tile[i, k] = row[i]
                finite &= np.isfinite(row[i])
        else:
            tile[:, k] = 0
    return finite


@numba.njit(cache=True, inline="always")
def _scores(q, tile, acc):
    """acc[k] = sum_i q[i] tile[i, k] for the ROWS columns, each a plain sum in ascending i: the ROWS sums run
    side by side in the lanes of a vector (an element-wise update per i), so nothing is reordered."""
    acc[:] = 0
    for i in range(q.shape[0]):
        x = q[i]
        for k in range(ROWS):
            acc[k] += x * tile[i, k]


@numba.njit(cache=True, inline="always")
def _axpy(p, x, y, n):
    """y[:n] += p x[:n], element by element (no sum across lanes: vectorises without reordering)."""
    for i in range(n):
        y[i] += p * x[i]


@numba.njit(cache=True)
def _head_block(q_abs, kv_cache, table_row, L, scale, kv_rank, b, h0, h1, o_lat):
    """Heads h0..h1-1 of sequence b: o_lat[b, h] for each; returns whether every row value read is finite."""
    page = kv_cache.shape[1]
    W = kv_cache.shape[2]
    nh = h1 - h0
    s = np.empty((nh, L), q_abs.dtype)
    finite = True
    zero = scale - scale                                 # 0 in the compute dtype
    tile = np.empty((W, ROWS), q_abs.dtype)
    part = np.empty(ROWS, q_abs.dtype)
    for j0 in range(0, L, ROWS):                         # pass 1: scores, in the readable form's order of ops
        finite &= _gather_tile(kv_cache, table_row, j0, L, tile)
        n = min(ROWS, L - j0)
        for h in range(nh):
            _scores(q_abs[b, h0 + h], tile, part)
            for k in range(n):
                s[h, j0 + k] = part[k] * scale
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
    for h in range(nh):
        o_lat[b, h0 + h, :] = zero
    for j in range(L):                                   # pass 2: weighted sum of latent rows, j ascending
        row = kv_cache[table_row[j // page], j % page]
        for h in range(nh):
            _axpy(s[h, j], row, o_lat[b, h0 + h], kv_rank)
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
