"""The KDA recurrence compiled with numba: the decode step and the prefill over tokens.

The readable statement is `k3ref.kda.kda_recurrent`; `k3ref.kda.kda_decode_core` and `k3ref.kda.kda_chunked`
call `decode_step_jit` and `chunked_jit` here by default (`k3ref.fast.enabled`; K3_FAST=numpy selects the NumPy
forms of `k3ref.fast.kda`). numba is imported, and the kernels compiled (or loaded from numba's cache), on the first
call (`_kernels`), so `import k3ref` does not load it. Both run on at most `k3ref.threads.compute_threads()`
threads (K3_THREADS, else numba's own count).

Why the work splits as it does: each value column v of the state evolves on its own,

    S'[:, v] = exp(g) * S[:, v];   u_v = beta (v_v - k . S'[:, v]);   S[:, v] = S'[:, v] + k u_v;   o_v = q . S[:, v]

so the unit of parallel work is a (sequence, head, block of value columns) triple: `prange` hands whole units to
threads, each unit is computed by one thread in one fixed order, and no sum ever crosses units. The sums over the
key channel c run in order c = 0, 1, ..., K-1 for every value column, with the columns side by side in the
innermost loop: that loop vectorises over columns, so no sum is reassociated and the bits do not depend on the
vector width, the thread count or the block width. No fastmath (it would let LLVM fuse multiply-adds and reorder
sums), no BLAS, and the exponentials are taken by the caller in NumPy (numba's exp could come from SVML on one
machine and libm on another).
"""
from __future__ import annotations

import sys
import threading
import types

import numpy as np

from ..threads import compute_threads, numba_threads
from . import forked_after_numba

# Value columns per unit of the prefill (speed only: the bits do not depend on it). Whole rows of K3's V = 128 were
# the fastest measured here (T=1024, H=4, fp32, one thread: 19 ms at 128, 22 ms at 64, 65 ms at 32 or 16): a
# K x 128 float32 state (64 KB) stays in L2, and shorter column loops spend their time in loop overhead.
PREFILL_COLUMNS = 128
# How the work is spread over threads (speed only: the bits do not depend on it).
# A parallel call waits at its end until every thread it woke has run, and on a busy machine a woken thread may wait
# a scheduler slice (several ms) first: a tiny prefill took 0.16 ms on one thread and a median 15.6 ms on two
# under load here. So a call uses a second thread only for ~1 ms or more of work per thread:
DECODE_BYTES_PER_THREAD = 16 << 20      # of state read (a decode step streams its state: ~25 GB/s a core here)
PREFILL_STEPS_PER_THREAD = 1 << 24      # state entries x tokens (one core updates ~3.5e9 per second here)
# Work handed to a thread at a time (numba's parallel chunk size). Small chunks taken one after another let an
# idle thread take the share of one that the OS has descheduled: with numba's default split (one fixed share per
# thread) a one-token decode at H=96 took 12.8 ms instead of 0.4-0.9 ms on this 2-core machine under load.
DECODE_CHUNK_ROWS = 4
PREFILL_CHUNK_UNITS = 1


def _launch(name: str, work: int, per_thread: int, chunk: int, *args) -> None:
    """Run kernel `name` on one thread per `per_thread` of `work` (at most `compute_threads()`), each taking `chunk`
    iterations at a time; on one thread, or in a process forked while numba was loaded (whose parallel regions
    numba's OpenMP layer would kill: `k3ref.fast.forked_after_numba`), its serial twin runs (the same bits)."""
    kernels = _kernels()
    n = 1 if forked_after_numba() else max(1, min(compute_threads(), work // per_thread))
    if n == 1:
        getattr(kernels, name + "_serial")(*args)
        return
    with numba_threads(n), kernels.numba.parallel_chunksize(chunk):
        getattr(kernels, name)(*args)


class _Recycler:
    """Output buffers of earlier calls, handed out again once no one else holds them.

    Why: a new [B, 96, 128, 128] state is 6-50 MB; NumPy takes it from fresh pages of the OS, which the kernel
    faults in and zeroes on first write: one more pass over the state than the step itself makes (measured: B8
    decode at 2.8x the copy floor with a fresh output, 2.0x with a reused one). Between two decode steps the caller
    drops the previous state, so its buffer is free again by the next call.

    A buffer is free when only this pool refers to it: any array that views it (the reshaped state a caller holds)
    keeps a reference to it, so a buffer in use is never handed out. The count of references a free buffer has is
    measured on a probe buffer rather than assumed (it depends on the interpreter)."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.bufs: list[np.ndarray] = []
        self.lock = threading.Lock()
        probe = [np.empty(1)]
        self.free_refs = self._refs(probe, 0)

    @staticmethod
    def _refs(bufs: list, i: int) -> int:
        return sys.getrefcount(bufs[i])

    def empty(self, shape: tuple, dtype) -> np.ndarray:
        """An uninitialised C-order array of `shape` and `dtype`: a free recycled buffer when one fits."""
        with self.lock:
            for i in range(len(self.bufs)):
                b = self.bufs[i]
                if b.shape == shape and b.dtype == dtype:
                    del b
                    if self._refs(self.bufs, i) <= self.free_refs:
                        return self.bufs[i]
            out = np.empty(shape, dtype)
            self.bufs = [out, *self.bufs][:self.keep]
            return out


_STATES = _Recycler()

# The kernels below are plain Python until `_kernels` compiles them: it binds `prange` to numba.prange and each
# helper's module name to its compiled form, so that the compiled callers find compiled callees.
prange = range


_KERNELS: dict[str, types.SimpleNamespace] = {}
_KERNELS_LOCK = threading.Lock()


def _kernels() -> types.SimpleNamespace:
    """numba and the compiled kernels (compiled on the first call per dtype, cached on disk by numba); made once
    per process, under a lock (making them rebinds module names)."""
    kernels = _KERNELS.get("ns")
    if kernels is None:
        with _KERNELS_LOCK:
            kernels = _KERNELS.get("ns") or _make_kernels()
            _KERNELS["ns"] = kernels
    return kernels


def _make_kernels() -> types.SimpleNamespace:
    import numba  # noqa: PLC0415 -- optional compiled path: loaded on the first call, not with k3ref

    serial = numba.njit(cache=True, nogil=True)
    parallel = numba.njit(cache=True, parallel=True, nogil=True)
    glb = globals()
    glb["prange"] = numba.prange
    for helper in ("_decode_row", "_prefill_unit", "_prefill_one"):
        glb[helper] = serial(glb[helper])
    # a serial twin is its own Python function: numba's disk cache keys a function by its name and types, not by
    # the parallel flag, so one function compiled both ways would load either from the cache
    return types.SimpleNamespace(numba=numba, decode_rows=parallel(_decode_rows), prefill=parallel(_prefill),
                                 decode_rows_serial=serial(_decode_rows_serial), prefill_serial=serial(_prefill_serial),
                                 short_conv=serial(_short_conv))


def _short_conv(x, w, conv_state, y, new_state):  # compiled by _kernels
    """x [B, T, C], w [C, W], conv_state [B, C, W-1] (oldest first) -> y [B, T, C] (zeroed by the caller),
    new_state [B, C, W-1]. Input row s of a sequence is conv_state[:, :, s] for s < W-1, else x[:, s - W + 1]."""
    B, T, C = x.shape
    W = w.shape[1]
    for b in range(B):
        for t in range(T):
            for j in range(W):                                        # y = 0 + tap 0 + tap 1 + ...: the taps in order
                s = t + j
                if s < W - 1:
                    for c in range(C):
                        y[b, t, c] = y[b, t, c] + w[c, j] * conv_state[b, c, s]
                else:
                    for c in range(C):
                        y[b, t, c] = y[b, t, c] + w[c, j] * x[b, s - W + 1, c]
        for i in range(W - 1):                                        # the last W-1 input rows
            s = T + i
            for c in range(C):
                new_state[b, c, i] = conv_state[b, c, s] if s < W - 1 else x[b, s - W + 1, c]


def short_conv_jit(x: np.ndarray, w: np.ndarray, conv_state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`k3ref.kda.short_conv` after validation, compiled: x [B, T, C], w [C, W], conv_state [B, C, W-1], one float
    dtype -> (y [B, T, C], new_state [B, C, W-1]). Each output is 0 + w[c, 0] x_0 + w[c, 1] x_1 + ... in that order
    (each product rounded, then added; no fused multiply-add): the bits of the readable form's Python sum, in one
    call instead of ~15 NumPy calls (three such convolutions a KDA layer and decode token)."""
    B, T, C = x.shape
    y = np.zeros((B, T, C), x.dtype)
    new_state = np.empty((B, C, w.shape[1] - 1), x.dtype)
    _kernels().short_conv(x, w, conv_state, y, new_state)
    return y, new_state


def _decode_row(q, k, v, beta, decay, S0, o, S):  # compiled by _kernels
    """One (sequence, head) row: S0 [K, V] read, S [K, V] and o [V] written (the formulas of decode_step_jit)."""
    K, V = S0.shape
    kS = np.zeros(V, S0.dtype)
    for c in range(K):                                                # S'^T k, c in order, columns side by side
        kc, dc = k[c], decay[c]
        for j in range(V):
            kS[j] += kc * (dc * S0[c, j])
    u = np.empty(V, S0.dtype)
    for j in range(V):
        u[j] = beta * (v[j] - kS[j])
    o[:] = 0
    for c in range(K):                                                # S = S' + k u^T (S' recomputed: same bits)
        kc, dc, qc = k[c], decay[c], q[c]                             # and o = S^T q in the same pass
        for j in range(V):
            s = dc * S0[c, j] + kc * u[j]
            S[c, j] = s
            o[j] += qc * s


def _decode_rows(q, k, v, beta, decay, S0, o, S):  # compiled by _kernels
    for r in prange(S0.shape[0]):                                     # independent rows, one thread each
        _decode_row(q[r], k[r], v[r], beta[r], decay[r], S0[r], o[r], S[r])


def _decode_rows_serial(q, k, v, beta, decay, S0, o, S):  # compiled by _kernels
    for r in range(S0.shape[0]):
        _decode_row(q[r], k[r], v[r], beta[r], decay[r], S0[r], o[r], S[r])


def decode_step_jit(q, k, v, beta, decay, S0):
    """One step of the recurrence for BH independent (sequence, head) rows; `k3ref.fast.kda.decode_step`'s contract.

    q (normalised and scaled), k (normalised): [BH, K]; v: [BH, V]; beta: [BH, 1] or [BH]; decay = exp(g): [BH, K];
    S0: [BH, K, V], all in one float dtype -> (o [BH, V], S [BH, K, V]):
        S' = diag(decay) S0,  u = beta (v - S'^T k),  S = S' + k u^T,  o = S^T q.
    Each row reads its S0 from memory once (the second pass finds it in cache) and writes S once. S0 is not written.
    """
    BH, K, V = S0.shape
    dt = S0.dtype
    args = [np.ascontiguousarray(a, dt) for a in (q, k, v, np.reshape(beta, (BH,)), decay, S0)]
    o = np.empty((BH, V), dt)
    S = _STATES.empty((BH, K, V), dt)
    _launch("decode_rows", S0.nbytes, DECODE_BYTES_PER_THREAD, DECODE_CHUNK_ROWS, *args, o, S)
    return o, S


def _prefill_unit(q, k, v, decay, beta, S, o, j0, j1):  # compiled by _kernels
    """Value columns j0:j1 of one (sequence, head): q, k, decay [T, K], v, o [T, V], beta [T], S [K, V] in/out."""
    T, K = q.shape
    w = j1 - j0
    blk = np.empty((K, w), S.dtype)                                   # this unit's state columns, cache-resident
    for c in range(K):
        for j in range(w):
            blk[c, j] = S[c, j0 + j]
    kS = np.empty(w, S.dtype)
    u = np.empty(w, S.dtype)
    acc = np.empty(w, S.dtype)
    for t in range(T):
        kS[:] = 0
        for c in range(K):                                            # S' = diag(decay) S (kept), S'^T k
            kc, dc = k[t, c], decay[t, c]
            for j in range(w):
                s = dc * blk[c, j]
                blk[c, j] = s
                kS[j] += kc * s
        bt = beta[t]
        for j in range(w):
            u[j] = bt * (v[t, j0 + j] - kS[j])
        acc[:] = 0
        for c in range(K):                                            # S = S' + k u^T, o = S^T q
            kc, qc = k[t, c], q[t, c]
            for j in range(w):
                s = blk[c, j] + kc * u[j]
                blk[c, j] = s
                acc[j] += qc * s
        for j in range(w):
            o[t, j0 + j] = acc[j]
    for c in range(K):
        for j in range(w):
            S[c, j0 + j] = blk[c, j]


def _prefill_one(q, k, v, decay, beta, S, o, cols, unit):  # compiled by _kernels
    """Unit `unit` of `_prefill`: (sequence b, head h, value columns j0:j0+cols), in that nesting order."""
    H, V = q.shape[2], v.shape[3]
    nblk = (V + cols - 1) // cols
    b = unit // (H * nblk)
    h = unit // nblk - b * H
    j0 = (unit - (unit // nblk) * nblk) * cols
    _prefill_unit(q[b, :, h], k[b, :, h], v[b, :, h], decay[b, :, h], beta[b, :, h], S[b, h], o[b, :, h],
                  j0, min(V, j0 + cols))


def _prefill(q, k, v, decay, beta, S, o, cols):  # compiled by _kernels
    """q, k, decay [B, T, H, K]; v, o [B, T, H, V]; beta [B, T, H]; S [B, H, K, V] in/out."""
    units = q.shape[0] * q.shape[2] * ((v.shape[3] + cols - 1) // cols)
    for unit in prange(units):                                        # independent units, one thread each
        _prefill_one(q, k, v, decay, beta, S, o, cols, unit)


def _prefill_serial(q, k, v, decay, beta, S, o, cols):  # compiled by _kernels
    units = q.shape[0] * q.shape[2] * ((v.shape[3] + cols - 1) // cols)
    for unit in range(units):
        _prefill_one(q, k, v, decay, beta, S, o, cols, unit)


def chunked_jit(q, k, v, g, beta, S):
    """`k3ref.kda.kda_chunked` after validation, compiled: q (already scaled), k, g [B, T, H, K], v [B, T, H, V],
    beta [B, T, H], S [B, H, K, V] (a copy the caller gives away), one float dtype -> (o [B, T, H, V], final S).

    The recurrence token by token, split over value columns rather than tokens: each unit keeps K x
    PREFILL_COLUMNS state entries in cache for the whole sequence, so the state crosses memory once per call.
    Measured here it beats the WY/UT form of `k3ref.fast.kda.chunked_recurrence` (whose matmuls need BLAS to pay
    off), and it computes exactly the readable steps, with no flushed factors.
    """
    dt = S.dtype
    q, k, v, decay, beta = (np.ascontiguousarray(a, dt) for a in (q, k, v, np.exp(g), beta))
    S = np.ascontiguousarray(S, dt)
    o = np.empty(v.shape, dt)
    _launch("prefill", S.size * q.shape[1], PREFILL_STEPS_PER_THREAD, PREFILL_CHUNK_UNITS,
            q, k, v, decay, beta, S, o, PREFILL_COLUMNS)
    return o, S
