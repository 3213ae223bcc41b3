"""MLA as engines hold it: decode over an FP8 latent cache, and the prefill attention.

mla_decode_fp8 restates k3ref.mla.mla_decode_core over the cache an FP8 engine keeps (FlashMLA's FP8 KV cache,
vLLM's fp8 kv_cache_dtype): the latent c of each token as e4m3 codes with one float32 scale per group of 128
latent elements (c = code * scale), k_pe beside it unquantised, and a batch padded to a fixed size with rows of
seq_len 0. It addresses each token through the block table on its own (page id = block_table[b, j // page],
slot j % page), so it is right for any page size, 1 included.

mla_prefill is the attention step of the expanded (unabsorbed) MLA prefill: per head, keys [W_UK c | k_pe] and
values W_UV c of all of a sequence's tokens, queries of its new tokens only (flash-attn's varlen interface:
sequences packed along one token axis, delimited by cu_seqlens). It also returns the log-sum-exp of each
softmax, which engines keep to merge a chunked prefill's partial results.
"""
from __future__ import annotations

import numpy as np

from k3ref import fp8
from k3ref.checks import as_float, check_shape, is_finite_real, require

GROUP = 128   # latent elements per FP8 scale (FlashMLA's FP8 cache: one float32 scale per 128 values of c)


def quantize_latent(rows, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """The FP8 cache entries of latent rows: rows [..., R] -> (codes uint8 [..., R], scales float32 [..., R // group]).

    Per group of `group` elements: scale = amax / 448 (FlashMLA's FP8 cache quantisation, so the group's largest
    element maps to the largest e4m3 magnitude), rounded to float32 as engines store it; codes = e4m3(x / scale),
    round to nearest even. An all-zero group gets scale 0 and codes 0; a group holding NaN gets a NaN scale and
    NaN codes (an unused cache slot stays poisoned).
    """
    rows = as_float("rows", rows, allow_nan=True)
    R = rows.shape[-1]
    require(isinstance(group, int) and group >= 1 and R % group == 0,
            f"group: expected a positive int dividing the row width {R}, found {group!r}")
    grouped = rows.astype(np.float64).reshape(rows.shape[:-1] + (R // group, group))
    scales = (np.max(np.abs(grouped), axis=-1) / fp8.MAX).astype(np.float32)
    divisor = np.where(scales == 0, 1.0, scales.astype(np.float64))[..., None]
    codes = fp8.encode(grouped / divisor).reshape(rows.shape)
    return codes, scales


def dequantize_latent(codes, scales) -> np.ndarray:
    """codes uint8 [..., R], scales [..., R // G] -> c [..., R] float64 = e4m3 value * its group's scale."""
    codes = np.asarray(codes)
    scales = as_float("kv_scale", scales, allow_nan=True)
    R, G = codes.shape[-1], scales.shape[-1]
    require(G >= 1 and R % G == 0, f"kv_scale: expected one scale per group of a divisor of {R}, found {G} scales")
    values = fp8.decode(codes).reshape(codes.shape[:-1] + (G, R // G))
    return (values * scales.astype(np.float64)[..., None]).reshape(codes.shape)


def _check_fp8_args(q_abs, kv_fp8, kv_scale, k_pe, block_table, seq_lens, scale):
    """Shapes, dtypes and ranges of mla_decode_fp8's arguments -> (B, H, R, P, page, block_table, seq_lens)."""
    B, H, W = check_shape("q_abs", q_abs, (None, None, None))
    kv_fp8 = np.asarray(kv_fp8)
    require(kv_fp8.dtype == np.uint8, f"kv_fp8: expected uint8 e4m3 codes, found dtype {kv_fp8.dtype}")
    N, page, R = check_shape("kv_fp8", kv_fp8, (None, None, None))
    require(R % GROUP == 0 and R < W,
            f"kv_fp8: expected a latent width R that is a multiple of {GROUP} and below q_abs's width {W}, found {R}")
    check_shape("kv_scale", kv_scale, (N, page, R // GROUP))
    P = W - R
    check_shape("k_pe", k_pe, (N, page, P))
    block_table, seq_lens = np.asarray(block_table), np.asarray(seq_lens)
    require(block_table.dtype.kind in "iu", f"block_table: expected an integer array, found dtype {block_table.dtype}")
    require(seq_lens.dtype.kind in "iu", f"seq_lens: expected an integer array, found dtype {seq_lens.dtype}")
    max_pages = check_shape("block_table", block_table, (B, None))[1]
    check_shape("seq_lens", seq_lens, (B,))
    require(is_finite_real(scale) and scale > 0, f"scale: expected a positive finite float, found {scale!r}")
    for b in range(B):
        L = int(seq_lens[b])
        require(0 <= L <= max_pages * page,
                f"seq_lens[{b}]: expected 0 (a padded row) <= seq_len <= {max_pages * page} (rows the block table "
                f"maps: {max_pages} pages of {page}), found {L}")
        used = block_table[b, : -(-L // page)]
        require(bool(np.all((used >= 0) & (used < N))),
                f"block_table[{b}]: expected page ids in [0, {N}) for the {used.size} page(s) of seq_len {L}, "
                f"found {used.tolist()}")
    return B, H, R, P, page, block_table, seq_lens


def _token_rows(b: int, L: int, page: int, block_table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(page ids [L], slots [L]) of tokens 0 .. L-1 of batch row b."""
    j = np.arange(L)
    return block_table[b, j // page], j % page


def mla_decode_fp8(q_abs, kv_fp8, kv_scale, k_pe, block_table, seq_lens, *, scale):
    """Absorbed MLA decode over an FP8 (e4m3) latent cache.

    q_abs: [B, H, R+P]; kv_fp8: [N_pages, page, R] uint8 e4m3 codes of the latent c; kv_scale:
    [N_pages, page, R // 128] float32, one scale per token and group of 128 latent elements (c = code * scale);
    k_pe: [N_pages, page, P] (bf16 in engines); block_table: [B, max_pages] int; seq_lens: [B] int, 0 for a
    padded row -> o_lat [B, H, R]; a padded row's o_lat is unspecified (not judged).

    For the rows j < seq_lens[b] of batch row b (page block_table[b, j // page], slot j % page):
        c_j = e4m3(code_j) * scale_j per group;  s_hj = scale * q_abs_h . [c_j | k_pe_j];
        o_lat_h = sum_j softmax_j(s_h)_j c_j
    Computed in the wider of q_abs's, k_pe's and kv_scale's dtype (at least float32). Slots past seq_len are never
    read (NaN there is allowed); the rows read must be finite. Here a padded row's o_lat is 0.
    """
    q_abs = as_float("q_abs", q_abs)
    kv_scale = as_float("kv_scale", kv_scale, allow_nan=True)
    k_pe = as_float("k_pe", k_pe, allow_nan=True)
    B, H, R, P, page, block_table, seq_lens = _check_fp8_args(q_abs, kv_fp8, kv_scale, k_pe, block_table, seq_lens,
                                                              scale)
    dt = np.result_type(q_abs.dtype, k_pe.dtype, kv_scale.dtype, np.float32)
    kv_fp8 = np.asarray(kv_fp8)
    o_lat = np.zeros((B, H, R), dtype=dt)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue                                                 # a padded row reads nothing
        pid, slot = _token_rows(b, L, page, block_table)
        c = dequantize_latent(kv_fp8[pid, slot], kv_scale[pid, slot]).astype(dt, copy=False)    # [L, R]
        rows = np.concatenate([c, k_pe[pid, slot].astype(dt, copy=False)], axis=-1)           # [L, R+P]
        if not np.isfinite(rows).all():
            j = int(np.argwhere(~np.isfinite(rows))[0, 0])
            raise ValueError(f"kv_fp8/kv_scale/k_pe: expected finite rows for batch row {b} (seq_len {L}), found "
                             f"NaN/Inf at its token {j} (page {int(pid[j])}, slot {int(slot[j])})")
        s = np.einsum("hw,lw->hl", q_abs[b].astype(dt, copy=False), rows) * dt.type(scale)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        o_lat[b] = (p / p.sum(axis=-1, keepdims=True)) @ c
    return o_lat


def _check_cu(name: str, cu, total: int, tokens: str) -> np.ndarray:
    cu = np.asarray(cu)
    require(cu.dtype.kind in "iu" and cu.ndim == 1 and cu.size >= 2,
            f"{name}: expected an integer array [N+1] (N >= 1 sequences), found dtype {cu.dtype} shape {cu.shape}")
    require(int(cu[0]) == 0 and int(cu[-1]) == total and bool(np.all(np.diff(cu) >= 0)),
            f"{name}: expected non-decreasing offsets from 0 to {total} ({tokens}), found {cu.tolist()}")
    return cu.astype(np.int64)


def mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale):
    """Causal attention of each sequence's new tokens over all of its tokens (flash-attn's varlen form).

    q: [Tq, H, Dqk]; k: [Tk, H, Dqk]; v: [Tk, H, Dv]; cu_seqlens_q, cu_seqlens_k: [N+1] int; sequence n's new
    tokens are its last (q_n) of (k_n >= q_n) tokens (the causal mask aligned bottom-right)
    -> (o [Tq, H, Dv], lse [Tq, H]: the natural log of each softmax's denominator, scale included).

    New token i of sequence n (0 <= i < q_n) is token k_n - q_n + i of it and attends to its tokens 0 .. that one:
        s_hj = scale * q_ih . k_jh;  o_ih = sum_j softmax_j(s_h)_j v_jh;  lse_ih = log sum_j exp(s_hj)
    Computed in the wider of the inputs' dtypes (at least float32).
    """
    q, k, v = as_float("q", q), as_float("k", k), as_float("v", v)
    Tq, H, D = check_shape("q", q, (None, None, None))
    Tk = check_shape("k", k, (None, H, D))[0]
    Dv = check_shape("v", v, (Tk, H, None))[2]
    cu_q = _check_cu("cu_seqlens_q", cu_seqlens_q, Tq, "the new tokens q holds")
    cu_k = _check_cu("cu_seqlens_k", cu_seqlens_k, Tk, "the tokens k and v hold")
    require(cu_q.size == cu_k.size, f"cu_seqlens_k: expected {cu_q.size} offsets (as cu_seqlens_q), found {cu_k.size}")
    q_lens, k_lens = np.diff(cu_q), np.diff(cu_k)
    require(bool(np.all(k_lens >= q_lens)),
            f"cu_seqlens_k: expected each sequence's tokens k_n >= its new tokens q_n, found k_n {k_lens.tolist()} "
            f"and q_n {q_lens.tolist()}")
    require(is_finite_real(scale) and scale > 0, f"scale: expected a positive finite float, found {scale!r}")
    dt = np.result_type(q.dtype, k.dtype, v.dtype, np.float32)
    o, lse = np.zeros((Tq, H, Dv), dtype=dt), np.zeros((Tq, H), dtype=dt)
    for n in range(cu_q.size - 1):
        qn, kn = int(q_lens[n]), int(k_lens[n])
        if qn == 0:
            continue
        qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
        s = np.einsum("ihd,jhd->hij", q[qs].astype(dt), k[ks].astype(dt)) * dt.type(scale)     # [H, qn, kn]
        seen = np.arange(kn)[None, :] <= (kn - qn) + np.arange(qn)[:, None]                   # bottom-right causal
        s = np.where(seen[None], s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        e = np.exp(s - m)
        total = e.sum(axis=-1, keepdims=True)
        o[qs] = np.einsum("hij,jhv->ihv", e / total, v[ks].astype(dt))
        lse[qs] = (m + np.log(total))[..., 0].T
    return o, lse


__all__ = ["GROUP", "dequantize_latent", "mla_decode_fp8", "mla_prefill", "quantize_latent"]
