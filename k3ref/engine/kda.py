"""KDA as engines hold it: a state pool indexed by slot, the conv state pool, variable-length prefill.

A serving engine (vLLM, SGLang, fla, FlashKDA) keeps one KDA state per running sequence in a pool allocated once,
and each batch row names its sequence's slot; rows that only pad the batch to a captured size carry slot -1.
Prefill packs the new tokens of several sequences along one time axis, cut by `cu_seqlens`. The math is the host
graph's (k3ref.kda, docs/spec.md section 3.1); only the layout differs. Every core here writes the recurrence out
per row / per sequence, one token at a time, so that the tests against `kda_decode_core` (the step written out
by k3ref.fast) and `kda_prefill_core` (the chunked WY/UT form) compare independent forms.

State layouts: "kv" stores S as [K, V] (k3ref's and fla's default), "vk" as its transpose [V, K] (FlashKDA's and
fla's transpose_state_layout). The conv pool: "cw" stores [C, W-1] (vLLM's conv state), "wc" [W-1, C].

`decode_through_pool` and `prefill_through_varlen` turn a pool core back into the host core's signature, so a
model trace can run its KDA layers through an engine-shaped kernel.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from k3ref.checks import as_float, check_shape, require
from k3ref.kda import KDA_GATE_LOWER_BOUND, kda_gate, l2norm, query_scale
from k3ref.ops import sigmoid, silu

STATE_LAYOUTS = ("kv", "vk")
CONV_LAYOUTS = ("cw", "wc")
PADDED = -1   # the slot of a batch row that only pads the batch: no state is read or written for it


# ----------------------------------------------------------------------------------------------- checks

def _int_array(name: str, a, shape: tuple) -> np.ndarray:
    """An integer array of `shape` (bool and floats rejected: a float slot table is a caller's mistake)."""
    a = np.asarray(a)
    require(a.dtype.kind in "iu", f"{name}: expected an integer array (int32 or int64), found dtype {a.dtype}")
    check_shape(name, a, shape)
    return a.astype(np.int64)


def _check_slots(name: str, slots, n: int, pool_size: int, *, padded_ok: bool) -> np.ndarray:
    """slots [n] as int64: each in [0, pool_size) (or PADDED when padded_ok), no slot used twice."""
    slots = _int_array(name, slots, (n,))
    low = PADDED if padded_ok else 0
    bad = np.flatnonzero((slots < low) | (slots >= pool_size))
    if bad.size:
        allowed = f"-1 (padded) or 0..{pool_size - 1}" if padded_ok else f"0..{pool_size - 1}"
        raise ValueError(f"{name}: expected slots in {allowed} (pool of {pool_size}), found {slots[bad[0]]} "
                         f"at index {bad[0]}")
    used = slots[slots >= 0]
    values, counts = np.unique(used, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"{name}: expected each slot at most once, found slot {values[counts > 1][0]} "
                         f"{counts[counts > 1][0]} times")
    return slots


def _check_layout(name: str, layout: str, allowed: tuple[str, ...]) -> None:
    require(layout in allowed, f"{name}: expected one of {allowed}, found {layout!r}")


def _pool_shape(H: int, K: int, V: int, state_layout: str) -> tuple[int, int, int]:
    """One slot's shape: [H, K, V] ("kv") or [H, V, K] ("vk")."""
    return (H, K, V) if state_layout == "kv" else (H, V, K)


def _read_states(pool: np.ndarray, slots: np.ndarray, state_layout: str, dt) -> np.ndarray:
    """The states of `slots` as [n, H, K, V] in dtype dt; a non-finite state is named by its slot (the pool's
    unused slots may hold anything, NaN included)."""
    for s in slots:
        as_float(f"state_pool[{s}]", pool[s])
    S = pool[slots].astype(dt)                                        # fancy indexing: always a copy
    return S if state_layout == "kv" else S.transpose(0, 1, 3, 2)


def _write_states(pool: np.ndarray, slots: np.ndarray, S: np.ndarray, state_layout: str) -> None:
    pool[slots] = S if state_layout == "kv" else S.transpose(0, 1, 3, 2)


def _common_dtype(*arrays: np.ndarray) -> np.dtype:
    """The compute dtype: the widest input, float32 at least (the state is never held below fp32)."""
    return np.result_type(*arrays, np.float32)


# ----------------------------------------------------------------------------------------------- the step

def _delta_step(q: np.ndarray, k: np.ndarray, v: np.ndarray, decay: np.ndarray, beta: np.ndarray,
                S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One token of the delta rule for n rows: q (scaled, normalised), k (normalised), decay = exp(g): [n, H, K];
    v: [n, H, V]; beta: [n, H]; S: [n, H, K, V] -> (o [n, H, V], S').

        S <- Diag(exp g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q
    """
    S = decay[..., None] * S
    recalled = np.einsum("n h k, n h k v -> n h v", k, S)
    S = S + np.einsum("n h k, n h v -> n h k v", k, beta[..., None] * (v - recalled))
    return np.einsum("n h k, n h k v -> n h v", q, S), S


def _step_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, lower_bound, scale, dt):
    """The step's operands from the core's raw inputs, in dtype dt: (q^ scaled, k^, v, exp(g), beta)."""
    K = q.shape[-1]
    q, k, v, g_raw, beta_raw = (a.astype(dt, copy=False) for a in (q, k, v, g_raw, beta_raw))
    g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
    return l2norm(q) * dt.type(query_scale(scale, K)), l2norm(k), v, np.exp(g), sigmoid(beta_raw)


# ----------------------------------------------------------------------------------------------- decode

def kda_decode_pool(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slots, *,
                    lower_bound=KDA_GATE_LOWER_BOUND, scale=None, state_layout="kv"):
    """One KDA decode token for B batch rows whose states live in a pool.

    q, k, g_raw: [B, H, K]; v: [B, H, V]; beta_raw: [B, H]; A_log: [H]; dt_bias: [H*K];
    state_pool: [S, H, K, V] ("kv") or [S, H, V, K] ("vk"), fp32 or wider; slots: [B] int, the pool slot of each
    row, -1 for a padded row -> (o [B, H, V], state_pool [S, H, ...] with the rows' slots updated, every other
    slot unchanged). Row b is `kda_decode_core` on state_pool[slots[b]]. A padded row's o is unspecified (not
    judged; zeros here) and its slot nothing: no slot is read or written for it. Unused slots may hold anything
    (NaN included); the rows' own states must be finite. A kernel may update state_pool in place; this
    reference returns a new pool in the compute dtype (float64 for float64 inputs, float32 at least) and
    mutates nothing.
    """
    _check_layout("state_layout", state_layout, STATE_LAYOUTS)
    q, k, v, g_raw, beta_raw = (as_float(n, a) for n, a in
                                (("q", q), ("k", k), ("v", v), ("g_raw", g_raw), ("beta_raw", beta_raw)))
    B, H, K = check_shape("q", q, (None, None, None))
    V = check_shape("v", v, (B, H, None))[2]
    check_shape("k", k, (B, H, K))
    check_shape("g_raw", g_raw, (B, H, K))
    check_shape("beta_raw", beta_raw, (B, H))
    pool = as_float("state_pool", state_pool, allow_nan=True)
    n_slots = check_shape("state_pool", pool, (None, *_pool_shape(H, K, V, state_layout)))[0]
    slots = _check_slots("slots", slots, B, n_slots, padded_ok=True)
    dt = _common_dtype(q, k, v, g_raw, beta_raw, pool)

    rows = np.flatnonzero(slots != PADDED)
    qh, kh, v, decay, beta = _step_inputs(q[rows], k[rows], v[rows], g_raw[rows], beta_raw[rows], A_log, dt_bias,
                                          lower_bound, scale, dt)
    o_rows, S = _delta_step(qh, kh, v, decay, beta, _read_states(pool, slots[rows], state_layout, dt))
    o = np.zeros((B, H, V), dt)
    o[rows] = o_rows
    new_pool = pool.astype(dt)                                        # a copy, even in the same dtype
    _write_states(new_pool, slots[rows], S, state_layout)
    return o, new_pool


# ----------------------------------------------------------------------------------------------- conv

def kda_conv_pool(x, weight, conv_pool, slots, *, layout="cw"):
    """One decode step of the depthwise causal conv + SiLU for B rows whose conv states live in a pool.

    x: [B, C] (this token's projection); weight: [C, W]; conv_pool: [S, C, W-1] ("cw") or [S, W-1, C] ("wc"),
    the last W-1 inputs of each channel, oldest first; slots: [B] int, -1 padded -> (y [B, C], conv_pool with
    the rows' slots shifted by one input: the oldest dropped, x appended). Per row, with h = the slot's history:
        y[c] = SiLU(sum_{j<W-1} w[c, j] h[c, j] + w[c, W-1] x[c])          (k3ref.kda.short_conv, then SiLU)
    A padded row's y is unspecified (zeros here) and no slot is read or written for it. A kernel may update
    conv_pool in place; this reference returns a new pool and mutates nothing.
    """
    _check_layout("layout", layout, CONV_LAYOUTS)
    x = as_float("x", x)
    B, C = check_shape("x", x, (None, None))
    w = as_float("weight", weight)
    W = check_shape("weight", w, (C, None))[1]
    require(W >= 2, f"weight: expected a kernel width W >= 2 (a history of W-1 >= 1 inputs), found shape {w.shape}")
    pool = as_float("conv_pool", conv_pool, allow_nan=True)
    slot_shape = (C, W - 1) if layout == "cw" else (W - 1, C)
    n_slots = check_shape("conv_pool", pool, (None, *slot_shape))[0]
    slots = _check_slots("slots", slots, B, n_slots, padded_ok=True)
    dt = np.result_type(x, w, pool)

    rows = np.flatnonzero(slots != PADDED)
    for s in slots[rows]:
        as_float(f"conv_pool[{s}]", pool[s])
    hist = pool[slots[rows]].astype(dt)                               # [n, C, W-1] or [n, W-1, C]
    hist = hist if layout == "cw" else hist.transpose(0, 2, 1)
    window = np.concatenate([hist, x[rows, :, None].astype(dt)], axis=2)          # [n, C, W]: oldest first
    y = np.zeros((B, C), dt)
    y[rows] = silu(np.einsum("n c w, c w -> n c", window, w.astype(dt)))
    new_pool = pool.astype(dt)
    shifted = window[:, :, 1:]
    new_pool[slots[rows]] = shifted if layout == "cw" else shifted.transpose(0, 2, 1)
    return y, new_pool


# ----------------------------------------------------------------------------------------------- varlen prefill

def kda_prefill_varlen(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, cu_seqlens, slots, *,
                       lower_bound=KDA_GATE_LOWER_BOUND, scale=None, state_layout="kv"):
    """KDA prefill of N sequences packed along one time axis.

    q, k, g_raw: [1, T, H, K]; v: [1, T, H, V]; beta_raw: [1, T, H]; A_log: [H]; dt_bias: [H*K];
    state_pool: as kda_decode_pool; cu_seqlens: [N+1] int, non-decreasing from 0 to T (sequence n is tokens
    cu_seqlens[n] .. cu_seqlens[n+1]-1; an empty sequence leaves its state as it is); slots: [N] int, each
    sequence's slot in 0..S-1 (its initial state, then its final one; no slot twice) -> (o [1, T, H, V],
    state_pool). Sequence n is `kda_prefill_core` on its tokens from state_pool[slots[n]]; no state crosses a
    sequence boundary. Computed one token at a time (the recurrence); returns a new pool, mutates nothing.
    """
    _check_layout("state_layout", state_layout, STATE_LAYOUTS)
    q, k, v, g_raw, beta_raw = (as_float(n, a) for n, a in
                                (("q", q), ("k", k), ("v", v), ("g_raw", g_raw), ("beta_raw", beta_raw)))
    _, T, H, K = check_shape("q", q, (1, None, None, None))
    V = check_shape("v", v, (1, T, H, None))[3]
    check_shape("k", k, (1, T, H, K))
    check_shape("g_raw", g_raw, (1, T, H, K))
    check_shape("beta_raw", beta_raw, (1, T, H))
    pool = as_float("state_pool", state_pool, allow_nan=True)
    n_slots = check_shape("state_pool", pool, (None, *_pool_shape(H, K, V, state_layout)))[0]
    cu = _int_array("cu_seqlens", cu_seqlens, (None,))
    require(cu.size >= 2, f"cu_seqlens: expected [N+1] with N >= 1 sequences, found shape {cu.shape}")
    require(cu[0] == 0 and cu[-1] == T, f"cu_seqlens: expected to run from 0 to T={T}, found {cu[0]} .. {cu[-1]}")
    drops = np.flatnonzero(np.diff(cu) < 0)
    if drops.size:
        i = drops[0]
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, found {cu[i]} then {cu[i + 1]} at index {i}")
    slots = _check_slots("slots", slots, cu.size - 1, n_slots, padded_ok=False)
    dt = _common_dtype(q, k, v, g_raw, beta_raw, pool)

    qh, kh, v, decay, beta = _step_inputs(q[0], k[0], v[0], g_raw[0], beta_raw[0], A_log, dt_bias, lower_bound,
                                          scale, dt)                 # [T, H, *]
    S = _read_states(pool, slots, state_layout, dt)                   # [N, H, K, V]
    o = np.full((1, T, H, V), np.nan, dt)                             # NaN so an unwritten token shows
    for n, (start, end) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        Sn = S[n:n + 1]
        for t in range(start, end):
            o_t, Sn = _delta_step(qh[None, t], kh[None, t], v[None, t], decay[None, t], beta[None, t], Sn)
            o[0, t] = o_t[0]
        S[n] = Sn[0]
    new_pool = pool.astype(dt)
    _write_states(new_pool, slots, S, state_layout)
    return o, new_pool


# ----------------------------------------------------------------------------------------------- host adapters

def _adapter_slots(B: int) -> tuple[np.ndarray, int]:
    """The pool slots of B sequences in a pool of 2B+1, in a fixed shuffled order. The last slot is always one of
    them: a kernel that takes a padded row's -1 for a Python index clobbers a live state there."""
    n_slots = 2 * B + 1
    rng = np.random.default_rng(B)
    slots = np.append(rng.permutation(n_slots - 1)[:B - 1], n_slots - 1)
    return rng.permutation(slots).astype(np.int32), n_slots


def _scatter(state: np.ndarray, slots: np.ndarray, n_slots: int, state_layout: str) -> np.ndarray:
    """state [B, H, K, V] into a NaN-filled pool of n_slots at `slots`, in the layout's order."""
    B, H, K, V = state.shape
    pool = np.full((n_slots, *_pool_shape(H, K, V, state_layout)), np.nan, state.dtype)
    _write_states(pool, slots, state, state_layout)
    return pool


def _gather(pool, slots: np.ndarray, state_layout: str) -> np.ndarray:
    S = np.asarray(pool)[slots]
    return S if state_layout == "kv" else S.transpose(0, 1, 3, 2)


def decode_through_pool(pool_core: Callable, state_layout: str = "kv") -> Callable:
    """`kda_decode_core`'s signature on top of a `kda_decode_pool`-shaped core.

    The B states go into a pool of 2B+1 slots in a fixed shuffled order (the unused slots NaN, so a kernel that
    reads a wrong slot shows), the batch grows to 2B rows with a padded row (slot -1, another row's inputs) after
    each real one, and (o, new_state) are gathered back from the real rows and their slots.
    """
    _check_layout("state_layout", state_layout, STATE_LAYOUTS)

    def kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=KDA_GATE_LOWER_BOUND,
                   scale=None):
        state = as_float("state", state)
        B = check_shape("state", state, (None, None, None, None))[0]
        slots, n_slots = _adapter_slots(B)
        real = 2 * np.arange(B)                                       # batch row of sequence b; 2b+1 is padding
        other = np.roll(np.arange(B), -1)                             # the padded row after b copies b+1's inputs

        def interleave(a):
            a = np.asarray(a)
            out = np.empty((2 * B, *a.shape[1:]), a.dtype)
            out[real], out[real + 1] = a, a[other]
            return out

        batch_slots = np.full(2 * B, PADDED, np.int32)
        batch_slots[real] = slots
        o, pool = pool_core(*(interleave(a) for a in (q, k, v, g_raw, beta_raw)), A_log, dt_bias,
                            _scatter(state, slots, n_slots, state_layout), batch_slots,
                            lower_bound=lower_bound, scale=scale, state_layout=state_layout)
        return np.asarray(o)[real], _gather(pool, slots, state_layout)

    return kda_decode


def prefill_through_varlen(varlen_core: Callable, state_layout: str = "kv") -> Callable:
    """`kda_prefill_core`'s signature on top of a `kda_prefill_varlen`-shaped core: the B sequences of T tokens
    packed along one time axis (cu_seqlens 0, T, 2T, ...), their states in a NaN-filled pool of 2B+1 slots in a
    fixed shuffled order; o is unpacked and the final states gathered from their slots."""
    _check_layout("state_layout", state_layout, STATE_LAYOUTS)

    def kda_prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=KDA_GATE_LOWER_BOUND,
                    scale=None):
        state = as_float("state", state)
        B, T = check_shape("q", np.asarray(q), (state.shape[0], None, None, None))[:2]
        slots, n_slots = _adapter_slots(B)

        def packed(a):
            a = np.asarray(a)
            return a.reshape(1, B * T, *a.shape[2:])

        cu_seqlens = (T * np.arange(B + 1)).astype(np.int32)
        o, pool = varlen_core(*(packed(a) for a in (q, k, v, g_raw, beta_raw)), A_log, dt_bias,
                              _scatter(state, slots, n_slots, state_layout), cu_seqlens, slots,
                              lower_bound=lower_bound, scale=scale, state_layout=state_layout)
        o = np.asarray(o)
        return o.reshape(B, T, *o.shape[2:]), _gather(pool, slots, state_layout)

    return kda_prefill


__all__ = ["CONV_LAYOUTS", "PADDED", "STATE_LAYOUTS", "decode_through_pool", "kda_conv_pool", "kda_decode_pool",
           "kda_prefill_varlen", "prefill_through_varlen"]
