"""PyTorch forms of the engine-shaped MLA cores: decode over an FP8 (e4m3) latent cache, and the prefill attention.

Written from docs/spec.md section 3.2 and the core contracts (docs/interfaces.md), not from k3ref. Same conventions
as k3torch.cores: `CORES = {name: (prepare, compute)}`, `prepare` validates the numpy inputs and moves them to the
device, `compute` is the torch math. bf16 policy: q, k, v, k_pe and the dequantised latent c rounded to bf16 (the
MMA operands), scores and softmax in fp32, the probabilities rounded to bf16 for the PV product (FlashMLA,
flash-attn), outputs rounded to bf16; the FP8 scales stay fp32 (engines store them in fp32) and lse stays fp32.

FP8 e4m3fn (OCP FP8, torch.float8_e4m3fn): byte s eeee mmm, bias 7; e = 0 subnormal m/8 * 2^-6, else
(1 + m/8) * 2^(e-7); s 1111 111 is NaN. Decoded through a 256-entry table, every entry exact in fp32 and bf16.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from k3torch.checks import as_float, check_shape, require
from k3torch.cores import Precision

FP8_GROUP = 128     # latent elements per scale in the FP8 cache (one float32 scale per token and group)


def e4m3_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """[256] float64: the value of every e4m3fn code (NaN at 0x7f and 0xff)."""
    codes = torch.arange(256, dtype=torch.int64)
    e, m = (codes >> 3) & 0xF, (codes & 0x7).to(torch.float64)
    normal = (1.0 + m / 8.0) * torch.exp2((e - 7).to(torch.float64))
    magnitude = torch.where(e == 0, m / 8.0 * 2.0 ** -6, normal)
    values = torch.where(codes >= 128, -magnitude, magnitude)
    values[(e == 0xF) & (m == 7)] = float("nan")
    return values.to(device)


def _ints(name: str, a, ndim: int) -> np.ndarray:
    a = np.asarray(a)
    require(a.dtype.kind in "iu" and a.ndim == ndim,
            f"{name}: expected an integer array of rank {ndim}, found dtype {a.dtype} shape {a.shape}")
    return a


# ---------------------------------------------------------------------------------------------------
# mla_decode_fp8
# ---------------------------------------------------------------------------------------------------


def _poisoned(p: Precision, name: str, a, *, rounded: bool = True) -> torch.Tensor:
    """A cache array that may hold NaN past the sequences' ends, on the device; rounded to the storage dtype
    unless it is kept in fp32 (the FP8 scales)."""
    t = torch.from_numpy(np.ascontiguousarray(as_float(name, a, allow_nan=True))).to(p.device, p.compute)
    return p.round(t) if rounded else t


def _prep_mla_decode_fp8(p: Precision, q_abs, kv_fp8, kv_scale, k_pe, block_table, seq_lens, *, scale) -> dict:
    q_abs, kv_fp8 = np.asarray(q_abs), np.asarray(kv_fp8)
    B, H, W = check_shape("q_abs", q_abs, (None, None, None))
    require(kv_fp8.dtype == np.uint8, f"kv_fp8: expected uint8 e4m3 codes, found dtype {kv_fp8.dtype}")
    N, page, R = check_shape("kv_fp8", kv_fp8, (None, None, None))
    require(R % FP8_GROUP == 0 and R < W,
            f"kv_fp8: expected a latent width R that is a multiple of {FP8_GROUP} and below q_abs's width {W}, "
            f"found {R}")
    check_shape("kv_scale", np.asarray(kv_scale), (N, page, R // FP8_GROUP))
    check_shape("k_pe", np.asarray(k_pe), (N, page, W - R))
    bt, sl = _ints("block_table", block_table, 2), _ints("seq_lens", seq_lens, 1)
    check_shape("block_table", bt, (B, None))
    check_shape("seq_lens", sl, (B,))
    require(float(scale) > 0 and np.isfinite(float(scale)), f"scale: expected a positive finite float, found {scale!r}")
    for b, L in enumerate(sl.tolist()):
        require(0 <= L <= bt.shape[1] * page,
                f"seq_lens[{b}]: expected 0 (a padded row) <= seq_len <= {bt.shape[1] * page} (rows the block table "
                f"maps: {bt.shape[1]} pages of {page}), found {L}")
        used = bt[b, : -(-L // page)]
        require(bool(np.all((used >= 0) & (used < N))),
                f"block_table[{b}]: expected page ids in [0, {N}) for the {used.size} page(s) of seq_len {L}, "
                f"found {used.tolist()}")
    # Slots past seq_lens are never read, so the scales and k_pe there may hold anything (NaN poison included).
    return dict(q_abs=p.act("q_abs", q_abs), kv_fp8=p.raw(kv_fp8, torch.uint8),
                kv_scale=_poisoned(p, "kv_scale", kv_scale, rounded=False), k_pe=_poisoned(p, "k_pe", k_pe),
                block_table=p.raw(bt, torch.long), seq_lens=p.raw(sl, torch.long), scale=float(scale),
                max_len=int(sl.max(initial=0)))


def mla_decode_fp8(p: Precision, q_abs, kv_fp8, kv_scale, k_pe, block_table, seq_lens, *, scale,
                   max_len: int) -> torch.Tensor:
    """Absorbed MLA decode over an FP8 latent cache. q_abs: [B,H,R+P]; kv_fp8: u8 [N,page,R]; kv_scale:
    [N,page,R/128]; k_pe: [N,page,P]; block_table: [B,max_pages]; seq_lens: [B] (0: padded); max_len =
    max(seq_lens) (known on the host) -> o_lat [B,H,R].

    Token j < seq_lens[b] of row b lives in page block_table[b, j // page], slot j % page;
    c_j = e4m3(code_j) * scale_j per group of 128; s_hj = scale q_abs_h . [c_j | k_pe_j]; o_lat_h = softmax(s_h) c.
    A padded row's o_lat is 0.
    """
    B = q_abs.shape[0]
    N, page, R = kv_fp8.shape
    o = q_abs.new_zeros(B, q_abs.shape[1], R)
    if max_len == 0:
        return o
    j = torch.arange(max_len, device=q_abs.device)
    pid = block_table[:, j // page].clamp(0, N - 1)                 # [B, L]; slots past seq_len are masked below
    slot = (j % page).expand(B, max_len)
    valid = j[None, :] < seq_lens[:, None]                          # [B, L]
    values = e4m3_table(q_abs.device).to(p.compute)[kv_fp8[pid, slot].long()]          # [B, L, R]
    c = (values.reshape(B, max_len, R // FP8_GROUP, FP8_GROUP) * kv_scale[pid, slot][..., None]).reshape(B, max_len, R)
    c = p.round(c.masked_fill(~valid[..., None], 0.0))             # 0 * NaN poison would be NaN
    rows = torch.cat([c, k_pe[pid, slot].masked_fill(~valid[..., None], 0.0)], dim=-1)    # [B, L, R+P]
    s = torch.matmul(q_abs, rows.transpose(-1, -2)) * scale                             # [B, H, L]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    prob = p.round(torch.softmax(s, dim=-1))
    o = p.round(torch.matmul(prob, c))
    return torch.where((seq_lens > 0)[:, None, None], o, torch.zeros_like(o))   # padded rows: softmax of no keys


# ---------------------------------------------------------------------------------------------------
# mla_prefill
# ---------------------------------------------------------------------------------------------------


def _prep_mla_prefill(p: Precision, q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale) -> dict:
    Tq, H, D = check_shape("q", np.asarray(q), (None, None, None))
    Tk = check_shape("k", np.asarray(k), (None, H, D))[0]
    check_shape("v", np.asarray(v), (Tk, H, None))
    offsets = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, Tq), ("cu_seqlens_k", cu_seqlens_k, Tk)):
        cu = _ints(name, cu, 1)
        require(cu.size >= 2 and int(cu[0]) == 0 and int(cu[-1]) == total and bool(np.all(np.diff(cu) >= 0)),
                f"{name}: expected non-decreasing offsets from 0 to {total}, found {cu.tolist()}")
        offsets.append([int(x) for x in cu])
    cu_q, cu_k = offsets
    require(len(cu_q) == len(cu_k), f"cu_seqlens_k: expected {len(cu_q)} offsets (as cu_seqlens_q), found {len(cu_k)}")
    require(all(cu_k[n + 1] - cu_k[n] >= cu_q[n + 1] - cu_q[n] for n in range(len(cu_q) - 1)),
            f"cu_seqlens_k: expected each sequence's tokens k_n >= its new tokens q_n, found {cu_k} and {cu_q}")
    require(float(scale) > 0 and np.isfinite(float(scale)), f"scale: expected a positive finite float, found {scale!r}")
    return dict(q=p.act("q", q), k=p.act("k", k), v=p.act("v", v), cu_q=cu_q, cu_k=cu_k, scale=float(scale))


def mla_prefill(p: Precision, q, k, v, cu_q: list[int], cu_k: list[int], scale: float,
                _top_left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal varlen attention. q: [Tq,H,D]; k: [Tk,H,D]; v: [Tk,H,Dv]; cu_q, cu_k: host offsets [N+1]
    -> (o [Tq,H,Dv], lse [Tq,H]).

    Sequence n's q_n new tokens are the last of its k_n tokens: new token i sees tokens 0 .. k_n - q_n + i
    (bottom-right aligned; `_top_left` aligns the mask top-left instead, a deliberate mistake for the tests).
    lse = log sum_j exp(scale q . k_j) over the visible keys, natural log.
    """
    Tq, H, _ = q.shape
    o = q.new_zeros(Tq, H, v.shape[-1])
    lse = q.new_zeros(Tq, H)
    for n in range(len(cu_q) - 1):
        qn, kn = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        if qn == 0:
            continue
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        s = torch.einsum("ihd,jhd->hij", q[qs], k[ks]) * scale                         # [H, qn, kn]
        shift = 0 if _top_left else kn - qn
        hidden = torch.arange(kn, device=q.device)[None, :] > shift + torch.arange(qn, device=q.device)[:, None]
        s = s.masked_fill(hidden, float("-inf"))
        lse[qs] = torch.logsumexp(s, dim=-1).transpose(0, 1)
        prob = p.round(torch.softmax(s, dim=-1))
        o[qs] = torch.einsum("hij,jhv->ihv", prob, v[ks])
    return p.round(o), lse


CORES: dict[str, tuple[Callable[..., dict], Callable[..., Any]]] = {
    "mla_decode_fp8": (_prep_mla_decode_fp8, mla_decode_fp8),
    "mla_prefill": (_prep_mla_prefill, mla_prefill),
}

__all__ = ["CORES", "FP8_GROUP", "e4m3_table", "mla_decode_fp8", "mla_prefill"]
