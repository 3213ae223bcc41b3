"""PyTorch forms of the engine-shaped KDA cores: a state pool indexed by slot, the conv state pool, varlen prefill.

Written from docs/spec.md section 3.1 and the contracts of k3ref.engine.kda (the shapes, the slot rules), not from
k3ref's code. Same convention as k3torch.cores: each core is `prepare(p, *numpy args) -> dict` (checks, then
tensors on p.device) and `compute(p, **prepared)` (the torch math); `CORES` maps the core names to the pairs and
k3torch.cores.TorchCore wraps them. Precision as in k3torch.cores: at bf16 the activations (q, k, v, g_raw,
beta_raw, x and the conv history) are rounded to bf16, A_log, dt_bias, the conv weight and the KDA state stay
fp32, o and y are rounded to bf16 on the way out; every step computes in fp32 (fp64 at float64).

Slots and cu_seqlens are host metadata, as in the engines: checked on the host, the slot table moved to the
device, cu_seqlens kept as Python ints that bound the per-sequence loop. Pools come back as new tensors
(index_copy), so the numpy input a CPU tensor may share memory with is never written.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from k3torch.checks import as_float, check_shape, require


class Precision(Protocol):
    """What these cores use of k3torch.cores.Precision (not imported: k3torch.cores builds its table of every
    core from this module's CORES)."""

    device: torch.device

    @property
    def compute(self) -> torch.dtype: ...

    def round(self, t: torch.Tensor) -> torch.Tensor: ...

    def act(self, name: str, x) -> torch.Tensor: ...

    def wide(self, name: str, x) -> torch.Tensor: ...

    def raw(self, t: np.ndarray, dtype: torch.dtype) -> torch.Tensor: ...

KDA_L2_EPS = 1e-6   # docs/spec.md section 3.1: eps inside the sqrt of the q/k L2 norm
STATE_LAYOUTS = ("kv", "vk")
CONV_LAYOUTS = ("cw", "wc")


# ---------------------------------------------------------------------------------------------------
# host-side checks
# ---------------------------------------------------------------------------------------------------


def _slots(name: str, slots, n: int, pool_size: int, *, padded_ok: bool) -> np.ndarray:
    """slots [n] integer, each in 0..pool_size-1 (or -1 when padded_ok), no slot twice -> int64."""
    a = np.asarray(slots)
    require(a.dtype.kind in "iu", f"{name}: expected an integer array (int32 or int64), found dtype {a.dtype}")
    check_shape(name, a, (n,))
    a = a.astype(np.int64)
    low = -1 if padded_ok else 0
    bad = np.flatnonzero((a < low) | (a >= pool_size))
    require(bad.size == 0, f"{name}: expected slots in {low}..{pool_size - 1} (pool of {pool_size}), found "
                           f"{a[bad[0]] if bad.size else 0} at index {bad[0] if bad.size else 0}")
    live = a[a >= 0]
    require(np.unique(live).size == live.size, f"{name}: expected each slot at most once, found {live.tolist()}")
    return a


def _layout(name: str, layout: str, allowed: tuple[str, ...]) -> None:
    require(layout in allowed, f"{name}: expected one of {allowed}, found {layout!r}")


def _pool(p: Precision, name: str, pool, *, activation: bool) -> torch.Tensor:
    """A pool on the device in the compute dtype; unused slots may hold NaN. activation: rounded to the storage
    dtype (the conv history); else kept fp32 or wider (the KDA state)."""
    a = as_float(name, pool, allow_nan=True)
    t = torch.from_numpy(np.ascontiguousarray(a)).to(device=p.device, dtype=p.compute)
    return p.round(t) if activation else t


def _live_states_finite(name: str, pool: np.ndarray, slots: np.ndarray) -> None:
    for s in slots[slots >= 0]:
        as_float(f"{name}[{s}]", pool[s])


def _kda_tensors(p: Precision, q, k, v, g_raw, beta_raw, A_log, dt_bias, lead: tuple) -> tuple[dict, tuple]:
    """The per-token KDA inputs with axes lead + (H, *) checked and on the device -> (tensors, (H, K, V))."""
    q = np.asarray(q)
    dims = check_shape("q", q, lead + ("H", "K"))
    H, K = dims[-2:]
    V = check_shape("v", np.asarray(v), tuple(dims[:-1]) + (None,))[-1]
    check_shape("k", np.asarray(k), dims)
    check_shape("g_raw", np.asarray(g_raw), dims)
    check_shape("beta_raw", np.asarray(beta_raw), tuple(dims[:-1]))
    check_shape("A_log", np.asarray(A_log), (H,))
    check_shape("dt_bias", np.asarray(dt_bias), (H * K,))
    return (dict(q=p.act("q", q), k=p.act("k", k), v=p.act("v", v), g_raw=p.act("g_raw", g_raw),
                 beta_raw=p.act("beta_raw", beta_raw), A_log=p.wide("A_log", A_log),
                 dt_bias=p.wide("dt_bias", dt_bias)), (H, K, V))


def _gate_args(lower_bound, scale, K: int) -> dict:
    require(lower_bound is None or float(lower_bound) < 0, f"lower_bound: expected < 0 or None, found {lower_bound}")
    return dict(lower_bound=None if lower_bound is None else float(lower_bound),
                scale=K ** -0.5 if scale is None else float(scale))


# ---------------------------------------------------------------------------------------------------
# the math
# ---------------------------------------------------------------------------------------------------


def _gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound) -> torch.Tensor:
    """g [..., H, K]: lb * sigma(exp(A_log_h) (g_raw + dt_bias)), or -exp(A_log_h) softplus(...) without a bound."""
    H, K = g_raw.shape[-2:]
    a = torch.exp(A_log)[:, None]
    z = g_raw + dt_bias.reshape(H, K)
    if lower_bound is None:
        return -a * (torch.clamp(z, min=0) + torch.log1p(torch.exp(-torch.abs(z))))   # softplus, exact for large z
    return lower_bound * torch.sigmoid(a * z)


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(torch.sum(x * x, dim=-1, keepdim=True) + KDA_L2_EPS)


def _token(q, k, v, g_raw, beta_raw, A_log, dt_bias, S, *, lower_bound, scale):
    """One token of the delta rule for n rows: q, k, g_raw [n, H, K]; v [n, H, V]; beta_raw [n, H];
    S [n, H, K, V] -> (o [n, H, V], S').  S <- Diag(e^g) S;  S <- S + beta k^ (v - S^T k^)^T;  o = S^T q^."""
    qh, kh = _l2(q) * scale, _l2(k)
    beta = torch.sigmoid(beta_raw)
    S = torch.exp(_gate(g_raw, A_log, dt_bias, lower_bound))[..., None] * S
    recalled = torch.einsum("nhk,nhkv->nhv", kh, S)
    S = S + torch.einsum("nhk,nhv->nhkv", kh, beta[..., None] * (v - recalled))
    return torch.einsum("nhk,nhkv->nhv", qh, S), S


def _as_kv(S: torch.Tensor, state_layout: str) -> torch.Tensor:
    """A slot's [.., K, V] view of a pool slice in `state_layout` (its own inverse)."""
    return S if state_layout == "kv" else S.transpose(-1, -2)


# ---------------------------------------------------------------------------------------------------
# kda_decode_pool
# ---------------------------------------------------------------------------------------------------


def _prep_decode_pool(p: Precision, q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slots, *,
                      lower_bound=-5.0, scale=None, state_layout="kv") -> dict:
    _layout("state_layout", state_layout, STATE_LAYOUTS)
    t, (H, K, V) = _kda_tensors(p, q, k, v, g_raw, beta_raw, A_log, dt_bias, ("B",))
    B = np.shape(q)[0]
    pool = np.asarray(state_pool)
    n_slots = check_shape("state_pool", pool, (None, H, K, V) if state_layout == "kv" else (None, H, V, K))[0]
    slots = _slots("slots", slots, B, n_slots, padded_ok=True)
    _live_states_finite("state_pool", pool, slots)
    return dict(**t, state_pool=_pool(p, "state_pool", pool, activation=False),
                slots=p.raw(slots, torch.long), state_layout=state_layout, **_gate_args(lower_bound, scale, K))


def kda_decode_pool(p: Precision, q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slots, *, lower_bound,
                    scale, state_layout):
    """One KDA token for B rows whose states live in a pool. q, k, g_raw: [B,H,K]; v: [B,H,V]; beta_raw: [B,H];
    state_pool: [S,H,K,V] ("kv") or [S,H,V,K] ("vk"); slots: [B] (-1: padded) -> (o [B,H,V], new pool).

    The live rows' states are gathered from their slots, stepped once, and written back to the same slots; a
    padded row reads and writes nothing and its o is zero.
    """
    live = torch.nonzero(slots >= 0).flatten()
    idx = slots[live]
    S = _as_kv(state_pool.index_select(0, idx), state_layout)
    o_live, S = _token(q[live], k[live], v[live], g_raw[live], beta_raw[live], A_log, dt_bias, S,
                       lower_bound=lower_bound, scale=scale)
    o = torch.zeros(v.shape, dtype=o_live.dtype, device=v.device).index_copy(0, live, o_live)
    return p.round(o), state_pool.index_copy(0, idx, _as_kv(S, state_layout))


# ---------------------------------------------------------------------------------------------------
# kda_conv_pool
# ---------------------------------------------------------------------------------------------------


def _prep_conv_pool(p: Precision, x, weight, conv_pool, slots, *, layout="cw") -> dict:
    _layout("layout", layout, CONV_LAYOUTS)
    x = np.asarray(x)
    B, C = check_shape("x", x, (None, None))
    W = check_shape("weight", np.asarray(weight), (C, None))[1]
    require(W >= 2, f"weight: expected a kernel width W >= 2, found shape {np.shape(weight)}")
    pool = np.asarray(conv_pool)
    n_slots = check_shape("conv_pool", pool, (None, C, W - 1) if layout == "cw" else (None, W - 1, C))[0]
    slots = _slots("slots", slots, B, n_slots, padded_ok=True)
    _live_states_finite("conv_pool", pool, slots)
    return dict(x=p.act("x", x), weight=p.wide("weight", weight),
                conv_pool=_pool(p, "conv_pool", pool, activation=True), slots=p.raw(slots, torch.long),
                layout=layout)


def kda_conv_pool(p: Precision, x, weight, conv_pool, slots, *, layout):
    """One step of the depthwise causal conv + SiLU. x: [B,C]; weight: [C,W]; conv_pool: [S,C,W-1] ("cw") or
    [S,W-1,C] ("wc"), oldest input first; slots: [B] (-1: padded) -> (y [B,C], new pool).

    y[c] = SiLU(sum_j w[c, j] window[c, j]) over the window [history | x] (tap W-1 on the current input); the
    slot keeps the window's last W-1 inputs.
    """
    live = torch.nonzero(slots >= 0).flatten()
    idx = slots[live]
    hist = conv_pool.index_select(0, idx)
    hist = hist if layout == "cw" else hist.transpose(-1, -2)                  # [n, C, W-1]
    window = torch.cat([hist, x[live, :, None]], dim=-1)                       # [n, C, W]
    y_live = torch.nn.functional.silu(torch.sum(window * weight, dim=-1))
    y = torch.zeros(x.shape, dtype=y_live.dtype, device=x.device).index_copy(0, live, y_live)
    kept = window[..., 1:]
    return p.round(y), conv_pool.index_copy(0, idx, kept if layout == "cw" else kept.transpose(-1, -2))


# ---------------------------------------------------------------------------------------------------
# kda_prefill_varlen
# ---------------------------------------------------------------------------------------------------


def _prep_prefill_varlen(p: Precision, q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, cu_seqlens, slots, *,
                         lower_bound=-5.0, scale=None, state_layout="kv") -> dict:
    _layout("state_layout", state_layout, STATE_LAYOUTS)
    t, (H, K, V) = _kda_tensors(p, q, k, v, g_raw, beta_raw, A_log, dt_bias, (1, "T"))
    T = np.shape(q)[1]
    cu = np.asarray(cu_seqlens)
    require(cu.dtype.kind in "iu", f"cu_seqlens: expected an integer array, found dtype {cu.dtype}")
    check_shape("cu_seqlens", cu, (None,))
    require(cu.size >= 2 and cu[0] == 0 and cu[-1] == T and bool(np.all(np.diff(cu) >= 0)),
            f"cu_seqlens: expected [N+1] offsets non-decreasing from 0 to T={T}, found {cu.tolist()}")
    pool = np.asarray(state_pool)
    n_slots = check_shape("state_pool", pool, (None, H, K, V) if state_layout == "kv" else (None, H, V, K))[0]
    slots = _slots("slots", slots, cu.size - 1, n_slots, padded_ok=False)
    _live_states_finite("state_pool", pool, slots)
    return dict(**t, state_pool=_pool(p, "state_pool", pool, activation=False), cu_seqlens=[int(c) for c in cu],
                slots=p.raw(slots, torch.long), state_layout=state_layout, **_gate_args(lower_bound, scale, K))


def kda_prefill_varlen(p: Precision, q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, cu_seqlens, slots, *,
                       lower_bound, scale, state_layout):
    """N sequences packed on one time axis. q, k, g_raw: [1,T,H,K]; v: [1,T,H,V]; beta_raw: [1,T,H];
    cu_seqlens: N+1 offsets; slots: [N] -> (o [1,T,H,V], new pool).

    Sequence n runs the recurrence over tokens cu_seqlens[n] .. cu_seqlens[n+1]-1 from its slot's state and
    leaves its final state there; no state crosses a boundary.
    """
    S = _as_kv(state_pool.index_select(0, slots), state_layout).clone()     # [N, H, K, V]
    o = torch.zeros(v.shape, dtype=S.dtype, device=v.device)
    for n, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)):
        Sn = S[n:n + 1]
        for t in range(start, end):
            o_t, Sn = _token(q[:, t], k[:, t], v[:, t], g_raw[:, t], beta_raw[:, t], A_log, dt_bias, Sn,
                             lower_bound=lower_bound, scale=scale)
            o[:, t] = o_t
        S[n] = Sn[0]
    return p.round(o), state_pool.index_copy(0, slots, _as_kv(S, state_layout))


# name -> (prepare, compute), merged into k3torch.cores' table of every core
CORES: dict[str, tuple[Callable[..., dict], Callable[..., Any]]] = {
    "kda_decode_pool": (_prep_decode_pool, kda_decode_pool),
    "kda_conv_pool": (_prep_conv_pool, kda_conv_pool),
    "kda_prefill_varlen": (_prep_prefill_varlen, kda_prefill_varlen),
}

__all__ = ["CORES", "kda_conv_pool", "kda_decode_pool", "kda_prefill_varlen"]
