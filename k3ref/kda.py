"""KDA (Kimi Delta Attention): the K3 linear-attention mixer (docs/spec.md section 3.1 "KDA").

Per token t and head h (K = V = head_dim in K3; the core functions accept any K, V):

    q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x))      depthwise causal conv, width 4
    q^ = L2(q_h) * K^-1/2,  k^ = L2(k_h),  L2(x) = x / sqrt(sum(x^2) + KDA_L2_EPS)
    g  = lb * sigma(exp(A_log_h) * (W_fb W_fa x + dt_bias))                  lb = -5, so exp(g) in (e^-5, 1)
         (lower bound None: g = -exp(A_log_h) * softplus(...), the Kimi Linear form)
    beta = sigma(W_b x)_h
    S <- Diag(exp g) S;  S <- S + beta k^ (v - S^T k^)^T;  o = S^T q^          S: [K, V]
    y = W_o concat_h[ RMSNorm_1e-5(o_h; w_onorm) * sigma(G_h) ],  G = W_g x

The recurrence follows flash-linear-attention (`fla/ops/kda/naive.py`): q, k [B, T, H, K], v [B, T, H, V],
g [B, T, H, K] (log-decay per key channel), beta [B, T, H], state [B, H, K, V]. Independent forms test each
other: `kda_recurrent` (one step at a time), `kda_chunked` (WY/UT transform in chunks of 64; the prefill core)
and the step written out in `kda_decode_core` (the decode core). The layer functions `kda_prefill` and
`kda_decode_token` call the cores through `k3ref.cores`, so a CUDA core can replace either one.

Fast paths: `kda_decode_core` (float32 and float64) and `kda_chunked` (float64: see JIT_PREFILL_DTYPES) run the
numba-compiled forms of `k3ref.fast.kda_jit` by default (BLAS-free, same bits on any thread count) and the NumPy
forms of `k3ref.fast.kda` with K3_FAST=numpy (`k3ref.fast.backend`); `kda_recurrent` is always the readable NumPy
loop the others are tested against.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

import numpy as np

from . import fast
from .checks import as_float, check_shape, is_finite_real, is_int_value, require
from .fast import kda as kda_fast
from .fast import kda_jit, scan_jit
from .ops import linear, rmsnorm, sigmoid, silu, softplus
from .threads import fixed_blas

KDA_L2_EPS = 1e-6          # L2(x) = x / sqrt(sum(x^2) + eps): eps inside the sqrt (fla's l2norm), not max(|x|, eps)
KDA_GATE_LOWER_BOUND = -5.0  # K3's gate_lower_bound: exp(g) in (e^-5, 1)
# dtypes whose `kda_chunked` runs the compiled token-by-token form by default. float32 keeps the NumPy WY/UT form:
# the judge's fp32 baseline (numpy32) must err as a chunked fp32 kernel does, and the token-by-token form errs 2-15x
# less in float32 (rel RMS 1.5e-7 against 5e-7 - 3e-6 on the tiny prefill cases), which tightened torch's fp32 bound
# below its chunked prefill's error (kda_prefill/B2-T63-H2-K16: 1.4e-6 > 1.3e-6). float64 (the goldens) gains the
# speed and loses nothing: both forms sit at float64 rounding.
JIT_PREFILL_DTYPES = (np.dtype(np.float64),)


# ----------------------------------------------------------------------------------------------- config, state

@dataclasses.dataclass(frozen=True)
class KdaConfig:
    """Geometry of one KDA layer (names follow config.json's linear_attn_config).

    num_heads: H; head_dim: K = V; conv_size: W of the depthwise causal conv; gate_lower_bound: lb of the
    sigmoid gate (None = Kimi Linear softplus gate); use_full_rank_gate: output gate G = g_proj x (True) or
    g_b(g_a x); norm_eps: eps of the per-head output RMSNorm.
    """

    num_heads: int
    head_dim: int
    conv_size: int = 4
    gate_lower_bound: float | None = KDA_GATE_LOWER_BOUND
    use_full_rank_gate: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("num_heads", "head_dim", "conv_size"):
            val = getattr(self, name)
            require(is_int_value(val) and val >= 1,
                    f"KdaConfig.{name}: expected a positive int, found {val!r}")
        check_lower_bound("KdaConfig.gate_lower_bound", self.gate_lower_bound)
        eps = self.norm_eps
        require(is_finite_real(eps) and eps > 0,
                f"KdaConfig.norm_eps: expected a finite positive float, found {eps!r}")

    @property
    def key_dim(self) -> int:
        """H * K: width of q_proj / k_proj and of the q, k conv channels."""
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        """H * V: width of v_proj, g_proj and o_proj's input."""
        return self.num_heads * self.head_dim


@dataclasses.dataclass
class KdaState:
    """The decode state of one KDA layer for a batch of B sequences.

    conv_q: [B, H*K, W-1], conv_k: [B, H*K, W-1], conv_v: [B, H*V, W-1] — the last W-1 *inputs* of each
    depthwise conv channel (the projections before the conv), oldest first, so conv_x[:, :, -1] is the
    previous token; zeros at the start of a sequence. recurrent: [B, H, K, V] — the KDA state S, key
    channel on axis 2, value channel on axis 3 (fla's layout), float32 or wider.
    """

    conv_q: np.ndarray
    conv_k: np.ndarray
    conv_v: np.ndarray
    recurrent: np.ndarray

    @classmethod
    def zeros(cls, cfg: KdaConfig, batch: int, dtype=np.float64) -> KdaState:
        """The state of B fresh sequences: all zeros (recurrent in float32 at least)."""
        require(isinstance(batch, (int, np.integer)) and batch >= 1, f"batch: expected a positive int, found {batch!r}")
        dtype = np.dtype(dtype)
        require(dtype in (np.float32, np.float64), f"dtype: expected float32 or float64, found {dtype}")
        W1, H, K = cfg.conv_size - 1, cfg.num_heads, cfg.head_dim
        return cls(conv_q=np.zeros((batch, cfg.key_dim, W1), dtype),
                   conv_k=np.zeros((batch, cfg.key_dim, W1), dtype),
                   conv_v=np.zeros((batch, cfg.value_dim, W1), dtype),
                   recurrent=np.zeros((batch, H, K, K), np.result_type(dtype, np.float32)))

    def copy(self) -> KdaState:
        """A deep copy (every array copied)."""
        return KdaState(*(np.array(getattr(self, f.name), copy=True) for f in dataclasses.fields(self)))

    def check(self, cfg: KdaConfig, batch: int) -> None:
        """Raise ValueError unless every buffer has the shape of `KdaState.zeros(cfg, batch)`."""
        W1, H, K = cfg.conv_size - 1, cfg.num_heads, cfg.head_dim
        check_shape("state.conv_q", self.conv_q, (batch, cfg.key_dim, W1))
        check_shape("state.conv_k", self.conv_k, (batch, cfg.key_dim, W1))
        check_shape("state.conv_v", self.conv_v, (batch, cfg.value_dim, W1))
        check_shape("state.recurrent", self.recurrent, (batch, H, K, K))


# ----------------------------------------------------------------------------------------------- small steps

def check_lower_bound(name: str, lb) -> float | None:
    """The gate's lower bound as a float (None: the plain softplus gate); anything but a finite negative number
    raises ValueError naming `name`. The CUDA decode core checks its argument with this same rule."""
    if lb is None:
        return None
    require(is_finite_real(lb) and lb < 0,
            f"{name}: expected a finite negative float or None (softplus gate), found {lb!r}")
    return float(lb)


def l2norm(x: np.ndarray, eps: float = KDA_L2_EPS) -> np.ndarray:
    """L2(x) = x / sqrt(sum(x^2) + eps) over the last axis. x: [..., K] -> [..., K] in x's dtype.

    eps sits inside the sqrt (fla's `l2norm`), so ||L2(x)|| = |x| / sqrt(|x|^2 + eps) < 1 and L2(0) = 0.
    """
    x = as_float("x", x)
    require(x.ndim >= 1, "x: expected shape [..., K], found a scalar")
    require(is_finite_real(eps) and eps >= 0,
            f"eps: expected a finite float >= 0, found {eps!r}")
    return x * (1.0 / np.sqrt(np.einsum("...k,...k->...", x, x)[..., None] + eps)).astype(x.dtype, copy=False)


def kda_gate(g_raw: np.ndarray, A_log: np.ndarray, dt_bias: np.ndarray,
             lower_bound: float | None = KDA_GATE_LOWER_BOUND) -> np.ndarray:
    """Log-decay per key channel from the f_b_proj output.

    g_raw: [..., H, K]; A_log: [H]; dt_bias: [H*K] (flat, head-major) -> g [..., H, K] in g_raw's dtype.
    lower_bound lb:  g = lb * sigma(exp(A_log_h) * (g_raw + dt_bias_h))      in (lb, 0)
    lower_bound None: g = -exp(A_log_h) * softplus(g_raw + dt_bias_h)        in (-inf, 0)  (Kimi Linear)
    """
    g_raw = as_float("g_raw", g_raw)
    require(g_raw.ndim >= 2, f"g_raw: expected shape [..., H, K], found {g_raw.shape}")
    H, K = g_raw.shape[-2:]
    A_log = as_float("A_log", A_log).astype(g_raw.dtype, copy=False)
    check_shape("A_log", A_log, (H,))
    dt_bias = as_float("dt_bias", dt_bias).astype(g_raw.dtype, copy=False)
    check_shape("dt_bias", dt_bias, (H * K,))
    lb = check_lower_bound("lower_bound", lower_bound)
    a = np.exp(A_log)[:, None]                       # [H, 1]
    z = g_raw + dt_bias.reshape(H, K)
    g = -a * softplus(z) if lb is None else lb * sigmoid(a * z)
    return g.astype(g_raw.dtype, copy=False)


def short_conv(x: np.ndarray, weight: np.ndarray, conv_state: np.ndarray | None = None):
    """Depthwise causal conv, no activation (the layer applies SiLU).

    x: [B, T, C]; weight: [C, 1, W] (as checkpoints store it) or [C, W]; conv_state: [B, C, W-1] (the last
    W-1 inputs per channel, oldest first) or None (zero history) -> (y [B, T, C], new_state [B, C, W-1]).
    y_t[c] = sum_{j=0..W-1} w[c, j] x_{t-W+1+j}[c]; w[:, W-1] hits the current token.
    The sum below is the statement; by default `k3ref.fast.kda_jit.short_conv_jit` computes it in one compiled call
    to the same bits (K3_FAST=numpy runs the NumPy form).
    """
    x = as_float("x", x)
    B, T, C = check_shape("x", x, (None, None, None))
    w = as_float("weight", weight).astype(x.dtype, copy=False)
    require(w.ndim in (2, 3), f"weight: expected [C, 1, W] or [C, W], found shape {w.shape}")
    if w.ndim == 3:
        check_shape("weight", w, (C, 1, None))
        w = w[:, 0, :]
    W = check_shape("weight", w, (C, None))[1]
    require(W >= 1, f"weight: expected a kernel width W >= 1, found shape {w.shape}")
    if conv_state is None:
        conv_state = np.zeros((B, C, W - 1), x.dtype)
    else:
        conv_state = as_float("conv_state", conv_state)
        check_shape("conv_state", conv_state, (B, C, W - 1))
        conv_state = conv_state.astype(x.dtype, copy=False)
    if fast.enabled():
        return kda_jit.short_conv_jit(x, w, conv_state)                # the same sums in one compiled call
    hist = conv_state.transpose(0, 2, 1)
    xp = np.concatenate([hist, x], axis=1)                            # [B, W-1+T, C]; row s is x_{s-W+1}
    y = sum(w[:, j] * xp[:, j:j + T] for j in range(W))              # tap j sees x_{t-W+1+j}
    new_state = np.ascontiguousarray(xp[:, xp.shape[1] - (W - 1):].transpose(0, 2, 1))
    return y.astype(x.dtype, copy=False), new_state


# ----------------------------------------------------------------------------------------------- recurrence


def query_scale(scale, K: int) -> float:
    """The query scale: K**-0.5 when None, else a finite float (shared with the CUDA decode core)."""
    scale = K ** -0.5 if scale is None else scale
    require(is_finite_real(scale),
            f"scale: expected a finite float or None (K**-0.5), found {scale!r}")
    return float(scale)


def _recurrence_inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm):
    """Validate fla-convention inputs; return (q * scale, k, v, g, beta, S0) in one float dtype."""
    q, k, v, g, beta = (as_float(n, a) for n, a in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta), strict=True))
    B, T, H, K = check_shape("q", q, (None, None, None, None))
    check_shape("k", k, (B, T, H, K))
    V = check_shape("v", v, (B, T, H, None))[3]
    check_shape("g", g, (B, T, H, K))
    check_shape("beta", beta, (B, T, H))
    arrays = [q, k, v, g, beta]
    if initial_state is not None:
        initial_state = as_float("initial_state", initial_state)
        check_shape("initial_state", initial_state, (B, H, K, V))
        arrays.append(initial_state)
    dt = np.result_type(*arrays)
    scale = query_scale(scale, K)
    # C order: NumPy's reductions (the L2 norms) sum in another order over strided memory, and the same values
    # must give the same bits whatever their layout
    q, k, v, g, beta = (np.ascontiguousarray(a, dt) for a in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    S0 = np.zeros((B, H, K, V), dt) if initial_state is None else initial_state.astype(dt)  # always a copy
    return q * dt.type(scale), k, v, g, beta, S0


@fixed_blas
def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None, use_qk_l2norm=False):
    """The KDA recurrence one token at a time (fla `naive_recurrent_kda`).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] (log-decay); beta: [B, T, H];
    initial_state: [B, H, K, V] or None (zeros) -> (o [B, T, H, V], final_state [B, H, K, V]).
    Per step:  S <- diag(exp g_t) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;  o_t = S^T (scale q_t).
    scale defaults to K**-0.5; use_qk_l2norm applies `l2norm` to q and k first. Computes in the widest
    input dtype (float32 or float64).
    """
    q, k, v, g, beta, S = _recurrence_inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    B, T, H, K = q.shape
    o = np.full((B, T, H, v.shape[-1]), np.nan, S.dtype)             # NaN so an unwritten row shows
    for t in range(T):
        S = np.exp(g[:, t])[..., None] * S                            # [B, H, K, V]
        kS = (k[:, t, :, None, :] @ S)[..., 0, :]                     # S^T k: [B, H, V]
        u = beta[:, t, :, None] * (v[:, t] - kS)                      # [B, H, V]
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = (q[:, t, :, None, :] @ S)[..., 0, :]
    return o, S


@fixed_blas
def kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, use_qk_l2norm=False, chunk_size=64):
    """The same recurrence as `kda_recurrent`, chunk by chunk with the WY/UT transform (fla `naive_chunk_kda`).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state [B, H, K, V] -> (o [B, T, H, V],
    final state [B, H, K, V]), as `kda_recurrent`; any T (the sequence is padded to whole chunks with g = 0,
    k = q = v = 0, beta = 0, which leaves the state unchanged). Within a chunk of L tokens, with G_i = sum_{s<=i} g_s
    (cumulative log-decay from the chunk start, per key channel) and S0 the state entering the chunk:
        A_ij   = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)     (i > j)     key-key
        Aqk_ij = sum_c q_ic k_jc exp(G_ic - G_jc)            (i >= j)    query-key
        T = (I + A)^-1 diag(beta)                                        UT transform
        w = T (exp(G) * k),  u = T v - w S0                              WY form: u_i = beta_i (v_i - S'_i^T k_i)
        o = (exp(G) * q) S0 + Aqk u
        S = exp(G_L) * S0 + (exp(G_L - G) * k)^T u
    Every decay factor is over a forward span (exp(G_i - G_j) with i >= j, exp(G_i), exp(G_L - G_j); inside
    a sub-block of 8 rows, exp(G_i - G_j) is the product of the one-step decays exp(g_s), j < s <= i), never
    exp(-G) alone, so with g <= 0 every factor is <= 1 and float32 stays finite at cumulative log-decay -320
    per chunk. Computed by `k3ref.fast.kda.chunked_recurrence` (see its `intra_chunk_scores`); factors that
    decay below its `flush_floor` (2^-50 in float32) are set to 0, so no subnormal is made or read.

    In float64 (`JIT_PREFILL_DTYPES`), by default (`k3ref.fast.enabled()`), the compiled
    `k3ref.fast.kda_jit.chunked_jit` computes the same result token by token over cache-resident blocks of value
    columns (chunk_size is still checked; that form is exact for every chunking and flushes nothing). float32 and
    K3_FAST=numpy run the WY/UT form above.
    """
    q, k, v, g, beta, S = _recurrence_inputs(q, k, v, g, beta, scale, initial_state, use_qk_l2norm)
    require(is_int_value(chunk_size) and chunk_size >= 1, f"chunk_size: expected a positive int, found {chunk_size!r}")
    if S.dtype in JIT_PREFILL_DTYPES and fast.enabled():
        return kda_jit.chunked_jit(q, k, v, g, beta, S)
    return kda_fast.chunked_recurrence(q, k, v, g, beta, S, int(chunk_size))


# ----------------------------------------------------------------------------------------------- cores

def _core_gates(g_raw, beta_raw, A_log, dt_bias, lower_bound):
    """g = kda_gate(...) and beta = sigma(beta_raw) for the cores (shapes checked by the recurrence)."""
    g = kda_gate(g_raw, A_log, dt_bias, lower_bound)
    beta = sigmoid(as_float("beta_raw", beta_raw))
    return g, beta


@fixed_blas
def kda_decode_core(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *,
                    lower_bound=KDA_GATE_LOWER_BOUND, scale=None):
    """The `kda_decode` core: one token of KDA for B sequences.

    q, k: [B, H, K] (after conv + SiLU, before L2); v: [B, H, V]; g_raw: [B, H, K] (f_b_proj output);
    beta_raw: [B, H]; A_log: [H]; dt_bias: [H*K]; state: [B, H, K, V] -> (o [B, H, V], new_state [B, H, K, V]).
    g = kda_gate(g_raw, A_log, dt_bias, lower_bound); q^ = L2(q) * scale, k^ = L2(k) (eps KDA_L2_EPS);
    beta = sigma(beta_raw); then one step of the recurrence, a third form next to `kda_recurrent` and `kda_chunked`:
    `k3ref.fast.kda_jit.decode_step_jit` (compiled, one pass per (sequence, head) row; the default) or, with
    K3_FAST=numpy, `k3ref.fast.kda.decode_step` (NumPy over blocks of rows that fit in cache).
    The state is read from memory once and written once; a NaN/Inf in it reaches o, which is scanned instead of
    the state. Inputs are never mutated.
    """
    q, k, v, g_raw, beta_raw = (np.ascontiguousarray(as_float(n, a)) for n, a in  # C order: see _recurrence_inputs
                                zip(("q", "k", "v", "g_raw", "beta_raw"), (q, k, v, g_raw, beta_raw), strict=True))
    B, H, K = check_shape("q", q, (None, None, None))
    V = check_shape("v", v, (B, H, None))[2]
    for name, a, shape in (("k", k, (B, H, K)), ("g_raw", g_raw, (B, H, K)), ("beta_raw", beta_raw, (B, H))):
        check_shape(name, a, shape)
    state = as_float("state", state, allow_nan=True)                  # scanned through o below, not here
    check_shape("state", state, (B, H, K, V))
    g, beta = _core_gates(g_raw, beta_raw, A_log, dt_bias, lower_bound)
    dt = np.result_type(q, k, v, g, beta, state)
    BH = B * H                                                        # (sequence, head) pairs: one row each
    q = (l2norm(q.astype(dt, copy=False)) * dt.type(query_scale(scale, K))).reshape(BH, K)
    k, v = l2norm(k.astype(dt, copy=False)).reshape(BH, K), v.astype(dt, copy=False).reshape(BH, V)
    beta = beta.astype(dt, copy=False).reshape(BH, 1)
    decay = np.exp(g.astype(dt, copy=False)).reshape(BH, K)
    S0 = state.astype(dt, copy=False).reshape(BH, K, V)
    step = kda_jit.decode_step_jit if fast.enabled() else kda_fast.decode_step
    o, S = step(q, k, v, beta, decay, S0)
    if not scan_jit.all_finite(o):                                    # o reads every S entry: a NaN/Inf in the
        as_float("state", state)                                      # state shows here; name its first index
    return o.reshape(B, H, V), S.reshape(B, H, K, V)


def kda_prefill_core(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *,
                     lower_bound=KDA_GATE_LOWER_BOUND, scale=None):
    """The `kda_prefill` core: T tokens of KDA in the chunked form (chunk 64).

    q, k: [B, T, H, K]; v: [B, T, H, V]; g_raw: [B, T, H, K]; beta_raw: [B, T, H]; A_log: [H]; dt_bias: [H*K];
    state: [B, H, K, V] -> (o [B, T, H, V], final_state [B, H, K, V]). Same math as `kda_decode_core` per token,
    computed by `kda_chunked`. Inputs are never mutated.
    """
    q, v = as_float("q", q), as_float("v", v)
    B, T, H, K = check_shape("q", q, (None, None, None, None))
    V = check_shape("v", v, (B, T, H, None))[3]
    for name, a, shape in (("k", k, (B, T, H, K)), ("g_raw", g_raw, (B, T, H, K)), ("beta_raw", beta_raw, (B, T, H)),
                           ("state", state, (B, H, K, V))):
        check_shape(name, a, shape)                                   # named as the caller passed them
    g, beta = _core_gates(g_raw, beta_raw, A_log, dt_bias, lower_bound)
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=state, use_qk_l2norm=True, chunk_size=64)


# ----------------------------------------------------------------------------------------------- the layer

def _weight(weights: Mapping[str, np.ndarray], name: str, shape: tuple, *, scan: bool = False) -> np.ndarray:
    """weights[name] checked against `shape`; a missing or misshaped tensor raises ValueError naming it.
    scan=True also rejects NaN/Inf (cheap for vectors); matrices go through `_proj`, which scans outputs."""
    if name not in weights:
        raise ValueError(f"KDA weights: missing tensor {name!r} (module-local names, e.g. 'q_proj.weight')")
    w = as_float(name, weights[name]) if scan else np.asarray(weights[name])
    check_shape(name, w, shape)
    return w


def _proj(x: np.ndarray, weights: Mapping[str, np.ndarray], name: str, shape: tuple) -> np.ndarray:
    """linear(x, weights[name]). The output is scanned, not the weight: scanning a [1024, 1024] float32 weight
    took 0.47 ms here against 0.18 ms for the decode GEMV itself, on every token. A NaN/Inf out of a finite x
    names the weight's first NaN/Inf (or says the product overflowed) instead of surfacing as a non-finite
    `x` in some later step."""
    w = _weight(weights, name, shape)
    y = linear(x, w)
    if not scan_jit.all_finite(y) and scan_jit.all_finite(x):
        as_float(name, w)                                             # raises at the weight's first NaN/Inf
        raise ValueError(f"{name}: expected finite outputs, found NaN/Inf from finite inputs and weight "
                         f"(overflow in {y.dtype})")
    return y


def _kda_in(weights, X: np.ndarray, state: KdaState, cfg: KdaConfig):
    """Everything before the core: conv'd q, k, v [B,T,H,*], g_raw [B,T,H,K], beta_raw [B,T,H], A_log [H],
    dt_bias [H*K] and the new conv buffers."""
    B, T, D = X.shape
    H, K, W = cfg.num_heads, cfg.head_dim, cfg.conv_size
    state.check(cfg, B)
    streams, conv = [], []
    for name, width, buf in (("q", cfg.key_dim, state.conv_q), ("k", cfg.key_dim, state.conv_k),
                             ("v", cfg.value_dim, state.conv_v)):
        proj = _proj(X, weights, f"{name}_proj.weight", (width, D))
        y, new_buf = short_conv(proj, _weight(weights, f"{name}_conv1d.weight", (width, 1, W)), buf)
        streams.append(silu(y).reshape(B, T, H, K))
        conv.append(new_buf)
    f_a = _proj(X, weights, "f_a_proj.weight", (K, D))
    g_raw = _proj(f_a, weights, "f_b_proj.weight", (cfg.key_dim, K)).reshape(B, T, H, K)
    beta_raw = _proj(X, weights, "b_proj.weight", (H, D))
    A_log = _weight(weights, "A_log", (None,), scan=True)
    require(A_log.shape[0] >= H, f"A_log: expected at least H={H} entries (first H are the heads), found {A_log.shape}")
    dt_bias = _weight(weights, "dt_bias", (cfg.key_dim,), scan=True)
    return (*streams, g_raw, beta_raw, A_log[:H], dt_bias), conv


def _kda_out(weights, X: np.ndarray, o: np.ndarray, cfg: KdaConfig, cores) -> np.ndarray:
    """y = W_o concat_h[RMSNorm(o_h; w_onorm) * sigma(G_h)]; X: [B, T, D], o: [B, T, H, V] -> [B, T, D]."""
    B, T, D = X.shape
    H, V = cfg.num_heads, cfg.head_dim
    if cfg.use_full_rank_gate:
        G = _proj(X, weights, "g_proj.weight", (cfg.value_dim, D))
    else:
        G = _proj(_proj(X, weights, "g_a_proj.weight", (V, D)), weights, "g_b_proj.weight", (cfg.value_dim, V))
        if "g_b_proj.bias" in weights:                                # Kimi Linear's g_b_proj has a bias
            G = G + _weight(weights, "g_b_proj.bias", (cfg.value_dim,), scan=True).astype(G.dtype)
    o = o.astype(np.result_type(o.dtype, X.dtype), copy=False)
    normed = cores.rmsnorm(o, _weight(weights, "o_norm.weight", (V,), scan=True), cfg.norm_eps)
    gated = normed * sigmoid(G.reshape(B, T, H, V))
    return _proj(gated.reshape(B, T, H * V), weights, "o_proj.weight", (D, cfg.value_dim))


def _core_result(core: str, o, S, o_shape: tuple, S_shape: tuple):
    """A core's (o, S) checked by name: a swapped-in kernel that returns a wrong shape or a NaN output is named
    here (`kda_decode core output: ...`), not in some later step. S may hold NaN: the next core call rejects it."""
    o = as_float(f"{core} core output", o)
    check_shape(f"{core} core output", o, o_shape)
    S = as_float(f"{core} core state", S, allow_nan=True)
    check_shape(f"{core} core state", S, S_shape)
    return o, S


def _layer_cores(state, cfg, cores):
    """Check cfg and state types; the reference cores when cores is None."""
    require(isinstance(cfg, KdaConfig), f"cfg: expected a KdaConfig, found {type(cfg).__name__}")
    require(isinstance(state, KdaState), f"state: expected a KdaState, found {type(state).__name__}")
    if cores is None:                        # this module's own steps: the registry k3ref.cores imports this module
        return types.SimpleNamespace(rmsnorm=rmsnorm, kda_prefill=kda_prefill_core, kda_decode=kda_decode_core)
    return cores


@fixed_blas
def kda_prefill(weights: Mapping[str, np.ndarray], X: np.ndarray, state: KdaState, cfg: KdaConfig,
                cores=None):
    """The whole KDA layer over T tokens (docs/spec.md section 3.1), through `cores.kda_prefill` and `cores.rmsnorm`.

    weights: module-local names (docs/interfaces.md); X: [B, T, D] (the normalised sublayer input);
    state: KdaState for B sequences -> (Y [B, T, D], new KdaState). The input state is not mutated.
    """
    cores = _layer_cores(state, cfg, cores)
    X = as_float("X", X)
    check_shape("X", X, (None, None, None))
    (q, k, v, g_raw, beta_raw, A_log, dt_bias), conv = _kda_in(weights, X, state, cfg)
    o, S = cores.kda_prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, state.recurrent,
                             lower_bound=cfg.gate_lower_bound, scale=None)
    o, S = _core_result("kda_prefill", o, S, v.shape, state.recurrent.shape)
    return _kda_out(weights, X, o, cfg, cores), KdaState(conv_q=conv[0], conv_k=conv[1], conv_v=conv[2], recurrent=S)


@fixed_blas
def kda_decode_token(weights: Mapping[str, np.ndarray], x: np.ndarray, state: KdaState, cfg: KdaConfig,
                     cores=None):
    """The whole KDA layer for one token of B sequences, through `cores.kda_decode` and `cores.rmsnorm`.

    weights: module-local names; x: [B, D]; state: KdaState for B sequences -> (y [B, D], new KdaState).
    Equals `kda_prefill` over the same tokens (the conv buffers carry the short-conv history).
    """
    cores = _layer_cores(state, cfg, cores)
    x = as_float("x", x)
    check_shape("x", x, (None, None))
    X = x[:, None]
    (q, k, v, g_raw, beta_raw, A_log, dt_bias), conv = _kda_in(weights, X, state, cfg)
    o, S = cores.kda_decode(q[:, 0], k[:, 0], v[:, 0], g_raw[:, 0], beta_raw[:, 0], A_log, dt_bias,
                            state.recurrent, lower_bound=cfg.gate_lower_bound, scale=None)
    o, S = _core_result("kda_decode", o, S, v[:, 0].shape, state.recurrent.shape)
    new_state = KdaState(conv_q=conv[0], conv_k=conv[1], conv_v=conv[2], recurrent=S)
    return _kda_out(weights, X, o[:, None], cfg, cores)[:, 0], new_state


def random_kda_weights(cfg: KdaConfig, hidden: int, rng: np.random.Generator, dtype=np.float64,
                       a_log_len: int | None = None) -> dict[str, np.ndarray]:
    """Synthetic module-local KDA weights with O(1) activations for unit-RMS inputs.

    Linear weights ~ N(0, 1/in); conv taps ~ N(0, 1/W); A_log = log(uniform(1, 16)) for the H heads, zero
    padded to a_log_len entries (K3 pads to 128; default H); dt_bias ~ uniform(-1, 1); o_norm ~ 1 + N(0, 0.1).
    Low-rank gate configs get g_a_proj / g_b_proj (with bias) instead of g_proj.
    """
    H, K, W, D = cfg.num_heads, cfg.head_dim, cfg.conv_size, hidden
    a_log_len = H if a_log_len is None else a_log_len
    require(a_log_len >= H, f"a_log_len: expected >= H={H}, found {a_log_len}")

    def lin(out, inp):
        return rng.standard_normal((out, inp)) / np.sqrt(inp)

    w = {f"{n}_proj.weight": lin(cfg.key_dim, D) for n in "qkv"}
    w.update({f"{n}_conv1d.weight": rng.standard_normal((cfg.key_dim, 1, W)) / np.sqrt(W) for n in "qkv"})
    w["A_log"] = np.concatenate([np.log(rng.uniform(1.0, 16.0, H)), np.zeros(a_log_len - H)])
    w["dt_bias"] = rng.uniform(-1.0, 1.0, cfg.key_dim)
    w["f_a_proj.weight"] = lin(K, D)
    w["f_b_proj.weight"] = lin(cfg.key_dim, K)
    w["b_proj.weight"] = lin(H, D)
    if cfg.use_full_rank_gate:
        w["g_proj.weight"] = lin(cfg.value_dim, D)
    else:
        w["g_a_proj.weight"] = lin(K, D)
        w["g_b_proj.weight"] = lin(cfg.value_dim, K)
        w["g_b_proj.bias"] = 0.1 * rng.standard_normal(cfg.value_dim)
    w["o_norm.weight"] = 1.0 + 0.1 * rng.standard_normal(K)
    w["o_proj.weight"] = lin(D, cfg.value_dim)
    return {name: a.astype(dtype) for name, a in w.items()}
