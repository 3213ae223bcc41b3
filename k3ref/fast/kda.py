"""The KDA recurrence in its fast CPU forms: the chunked WY/UT form (the prefill core) and the decode step
over cache-sized blocks of (sequence, head) rows (the decode core).

The readable statement of both is `k3ref.kda.kda_recurrent`; `k3ref.kda.kda_chunked` and
`k3ref.kda.kda_decode_core` validate their arguments and call `chunked_recurrence` and `decode_step` here when
K3_FAST=numpy (by default they call the compiled forms of `k3ref.fast.kda_jit`).
"""
from __future__ import annotations

import numpy as np

CHUNK_GROUP = 4                 # chunks vectorised together in `chunked_recurrence` (speed only)
SUB_BLOCK = 8                   # rows per sub-block inside a chunk (speed only; any value is exact)
DECODE_BLOCK_BYTES = 1 << 19    # state bytes per step of `decode_step`: a block and its temporaries stay in L2


def flush_floor(dtype) -> float:
    """Smallest magnitude a decayed factor of the chunked form keeps: 2^(minexp/2 + 13) (2^-50 in float32,
    2^-498 in float64), so that a product of two kept factors and two unit-bounded entries above 2^-13 stays
    normal.

    Why: on Intel x86 every multiply or add that reads or makes a subnormal float takes a microcode assist
    ~100x slower; at the lower bound about 8% of the within-chunk decays exp(G) land in float32's subnormal
    range. A dropped factor is below 2^-50 of the O(1) terms it is summed with (every sum holds an undecayed
    diagonal or fresh-key term), far under float32's 2^-24 rounding: outputs are bit-identical on the
    benchmark inputs (docs/measurements.md)."""
    return float(np.ldexp(1.0, np.finfo(dtype).minexp // 2 + 13))


_FLOOR = {np.dtype(t): flush_floor(t) for t in (np.float32, np.float64)}
_LOG_FLOOR = {t: float(np.log(f)) for t, f in _FLOOR.items()}


def _decay(x: np.ndarray) -> np.ndarray:
    """exp(x) for log-decays x <= 0, with factors below `flush_floor` set to 0. The exp runs on x clamped
    at the floor, so no subnormal is made or read on the way."""
    log_floor = x.dtype.type(_LOG_FLOOR[x.dtype])
    e = np.exp(np.maximum(x, log_floor))
    e *= x >= log_floor
    return e


def _flush_small(a: np.ndarray) -> np.ndarray:
    """a with entries below `flush_floor` in magnitude set to 0, in place (a is a temporary); returns a."""
    a *= np.abs(a) >= a.dtype.type(_FLOOR[a.dtype])
    return a


# ----------------------------------------------------------------------------------------------- chunked form

def intra_chunk_scores(q, k, g, G, sub):
    """Decay-weighted scores inside each chunk, built so that no exp can exceed 1 (for g <= 0).

    q, k, g, G: [..., L, K] with L a multiple of `sub` (g = per-step log-decay, G = its cumulative sum from
    the chunk start) -> Akk, Aqk [..., L, L] with X_ij = sum_c x_ic k_jc exp(G_ic - G_jc) for i >= j and 0
    above the diagonal; and k_end [..., K, L] = k_j exp(G_{L-1} - G_j), each key decayed to the chunk end.
    Rows go in blocks of `sub`. Inside a block the ratios exist for i >= j only, diagonal by diagonal
    (d = i - j): exp(G_i - G_j) = exp(g_i) exp(G_{i-1} - G_j), one step of decay times the ratio of
    diagonal d - 1 (no cancellation in G_i - G_j; the upper triangle is never formed). Left of a block
    starting at row a, with r = a - 1:  exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j) for i > r >= j; both
    factors are decays over forward spans (<= 1), so the block is one matmul. If a factor underflows, the
    true product is below it and underflows too.
    """
    L, K = G.shape[-2:]
    lead = G.shape[:-2]
    nb = L // sub
    qb, kb, step = (x.reshape(lead + (nb, sub, K)) for x in (q, k, np.exp(g)))
    qk = np.stack([k, q], axis=-2)                                   # [..., L, 2, K]: k and q rows together
    qkb = qk.reshape(lead + (nb, sub, 2, K))
    A = np.zeros(lead + (L, 2, L), G.dtype)                          # [..., i, (k | q), j]
    diag = np.zeros(lead + (nb, sub, 2, sub), G.dtype)
    flat = diag.reshape(lead + (nb, 2 * sub * sub))                  # entry (i, c, j) at i*2sub + c*sub + j
    kE = kb                                                           # d = 0: k_j, no decay
    for d in range(sub):                                              # pairs (i, i - d) inside every block
        if d:
            kE = step[..., d:, :] * kE[..., :-1, :]                   # k_j exp(G_i - G_j), i = j + d
        x = (qkb[..., d:, :, :] @ kE[..., :, None])[..., 0]          # [..., nb, sub - d, 2]: k_i . kE, q_i . kE
        for c in (0, 1):                                              # (i, c, i - d), i = d..sub-1: a strided run
            flat[..., 2 * sub * d + c * sub::2 * sub + 1][..., :sub - d] = x[..., c]
    k_end = None                                                      # [..., K, a]: keys j < a decayed to a - 1
    for n, a in enumerate(range(0, L, sub)):
        b = a + sub
        A[..., a:b, :, a:b] = diag[..., n, :, :, :]
        Gb_end = G[..., b - 1:b, :]                                   # [..., 1, K]
        fresh = np.exp(Gb_end - G[..., a:b, :]) * k[..., a:b, :]      # this block's keys decayed to b - 1
        if a == 0:
            k_end = fresh.swapaxes(-1, -2)
            continue
        Gr = G[..., a - 1:a, :]
        to_i = np.exp(G[..., a:b, None, :] - Gr[..., None, :])        # decay r -> i: [..., sub, 1, K]
        rows = (qk[..., a:b, :, :] * to_i).reshape(lead + (2 * sub, K))
        A[..., a:b, :, :a] = (rows @ k_end).reshape(lead + (sub, 2, a))
        k_end = np.concatenate([_flush_small(k_end * _decay(Gb_end - Gr).swapaxes(-1, -2)), fresh.swapaxes(-1, -2)],
                               axis=-1)
    _flush_small(A)                                                   # far pairs: decayed below the floor
    return A[..., :, 0, :], np.ascontiguousarray(A[..., :, 1, :]), k_end


def unit_lower_inverse(M, sub):
    """M^-1 for unit lower triangular M [..., L, L] (L a multiple of sub), by forward substitution in blocks:
    the diagonal sub x sub blocks row by row, then block row I: T_IJ = -M_II^-1 sum_{J<=K<I} M_IK T_KJ."""
    L = M.shape[-1]
    D = np.stack([M[..., a:a + sub, a:a + sub] for a in range(0, L, sub)], axis=-3)     # [..., nb, sub, sub]
    Dinv = np.zeros_like(D)
    Dinv[..., 0, 0] = 1.0
    for i in range(1, sub):
        Dinv[..., i, :i] = -np.einsum("...j,...jk->...k", D[..., i, :i], Dinv[..., :i, :i])
        Dinv[..., i, i] = 1.0
    T = np.zeros_like(M)
    for n, a in enumerate(range(0, L, sub)):
        b = a + sub
        T[..., a:b, a:b] = Dinv[..., n, :, :]
        if a:
            T[..., a:b, :a] = _flush_small(-Dinv[..., n, :, :] @ (M[..., a:b, :a] @ T[..., :a, :a]))
    return T


def chunked_recurrence(q, k, v, g, beta, S, chunk_size: int):
    """`k3ref.kda.kda_chunked` after validation: q (already scaled), k, g [B, T, H, K], v [B, T, H, V],
    beta [B, T, H], S [B, H, K, V] (a copy the caller gives away), all in one float dtype, chunk_size >= 1
    -> (o [B, T, H, V], final state [B, H, K, V]). Formulas: `kda_chunked`'s docstring."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    sub = min(SUB_BLOCK, chunk_size)
    C = -(-chunk_size // sub) * sub                                   # whole sub-blocks: pad the chunk too
    N = -(-T // chunk_size)
    pad = ((0, 0), (0, C - chunk_size), (0, 0), (0, 0))

    def chunks(a):                                                    # [B, T, H, X] -> [N, B, H, C, X]
        X = a.shape[-1]
        if N * C != T:                                                # zero rows: the tail, then each chunk's
            a = np.pad(a, ((0, 0), (0, N * chunk_size - T), (0, 0), (0, 0))).reshape(B * N, chunk_size, H, X)
            a = np.pad(a, pad)
        return np.ascontiguousarray(a.reshape(B, N, C, H, X).transpose(1, 0, 3, 2, 4))

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta[..., None])[..., 0]
    o = np.full((N, B, H, C, V), np.nan, S.dtype)
    for n0 in range(0, N, CHUNK_GROUP):                               # a few chunks at a time: stays in cache
        grp = slice(n0, n0 + CHUNK_GROUP)
        o[grp], S = _chunk_group(q[grp], k[grp], v[grp], g[grp], beta[grp], S, sub)
    o = o[:, :, :, :chunk_size].transpose(1, 0, 3, 2, 4).reshape(B, N * chunk_size, H, V)
    return o[:, :T], S


def _chunk_group(q, k, v, g, beta, S, sub):
    """`chunked_recurrence` over consecutive chunks: q, k, g [n, B, H, C, K], v [n, B, H, C, V], beta [n, B, H, C],
    S [B, H, K, V] entering the first -> (o [n, B, H, C, V], S leaving the last)."""
    C = q.shape[-2]
    G = g.copy()                                                      # [n, B, H, C, K]: cumsum over the chunk
    for i in range(1, C):                                             # (row by row: np.cumsum is slow on axis -2)
        G[..., i, :] += G[..., i - 1, :]
    Akk, Aqk, k_end = intra_chunk_scores(q, k, g, G, sub)             # k_end: [n, B, H, K, C]
    M = np.eye(C, dtype=S.dtype) + beta[..., :, None] * np.tril(Akk, -1)          # I + A, unit lower triangular
    Tm = unit_lower_inverse(M, sub) * beta[..., None, :]              # UT transform: (I + A)^-1 diag(beta)
    eG = _decay(G)                                                    # decay from the chunk start
    u0 = Tm @ v                                                       # [n, B, H, C, V]
    wq = np.concatenate([Tm @ (eG * k), eG * q], axis=-2)             # [n, B, H, 2C, K]: rows w, then q_in
    decay = eG[..., -1, :, None]                                      # [n, B, H, K, 1]
    o = np.empty(v.shape, S.dtype)
    for n in range(q.shape[0]):                                       # only the state crosses chunks
        wS, qS = np.split(wq[n] @ S, 2, axis=-2)                      # w S0 and (exp(G) * q) S0 in one matmul
        u = u0[n] - wS
        o[n] = qS + Aqk[n] @ u
        S = decay[n] * S + k_end[n] @ u
    return o, S


# ----------------------------------------------------------------------------------------------- decode step

def decode_step(q, k, v, beta, decay, S0):
    """One step of the recurrence for BH independent (sequence, head) rows, a cache-sized block of rows at a
    time so the state leaves memory once and comes back once.

    q (normalised and scaled), k (normalised): [BH, K]; v: [BH, V]; beta: [BH, 1]; decay = exp(g): [BH, K];
    S0: [BH, K, V], all in one float dtype -> (o [BH, V], S [BH, K, V]), with S' = diag(decay) S0,
    u = beta (v - S'^T k), S = S' + k u^T, o = S^T q. S0 is not written.
    """
    BH, K, V = S0.shape
    dt = S0.dtype
    o = np.full((BH, V), np.nan, dt)
    S = np.empty((BH, K, V), dt)                                      # every block written below (np.multiply out=)
    rows = max(1, min(BH, DECODE_BLOCK_BYTES // (K * V * dt.itemsize)))
    outer = np.empty((rows, K, V), dt)                                # scratch for k u^T, reused by every block
    kq_all = np.stack([k, q], axis=-2) * decay[:, None, :]            # [BH, 2, K]: S'^T [k | q] = S^T (exp(g) [k | q])
    kdotq = np.sum(k * q, axis=-1)[:, None]
    for r0 in range(0, BH, rows):                                     # rows in blocks that fit in cache
        r, n = slice(r0, r0 + rows), min(rows, BH - r0)
        kS, qS = np.moveaxis(kq_all[r] @ S0[r], -2, 0)               # S'^T k, S'^T q with S' = diag(exp g) S
        u = beta[r] * (v[r] - kS)                                     # [n, V]
        o[r] = qS + kdotq[r] * u                                      # (S' + k u^T)^T q
        np.multiply(S0[r], decay[r, :, None], out=S[r])               # S'
        np.multiply(k[r, :, None], u[:, None, :], out=outer[:n])
        S[r] += outer[:n]                                             # S' + k u^T
    return o, S
