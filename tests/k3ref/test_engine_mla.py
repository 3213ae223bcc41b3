"""The engine-shaped MLA cores (k3ref.engine.mla) against the host-graph forms they restate.

mla_decode_fp8 == mla_decode_core over the dequantised cache (page sizes 1, 16, 64; padded rows; NaN in every
slot it must not read); mla_prefill == a per-token softmax written out here, its lse == log-sum-exp, and the
expanded MLA of k3ref.mla (gated_mla_attend) rebuilt around it gives the same layer output.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from k3ref import mla
from k3ref.cache import paged_latent_cache
from k3ref.engine.mla import GROUP, dequantize_latent, mla_decode_fp8, mla_prefill, quantize_latent
from tests.support.tolerances import rel_rms, tol


@dataclasses.dataclass(frozen=True)
class Fp8Case:
    """One FP8 decode batch."""

    H: int                     # heads
    R: int                     # latent width (a multiple of 128: one scale per 128)
    P: int                     # k_pe width
    page: int                  # tokens per page
    seq_lens: tuple[int, ...]  # 0: a padded row


FP8_CASES = [
    pytest.param(Fp8Case(2, 128, 16, 1, (5, 0, 9)), id="B3-H2-R128-P16-page1-padded-middle"),
    pytest.param(Fp8Case(3, 256, 8, 16, (0, 17, 1, 40)), id="B4-H3-R256-P8-page16-padded-first"),
    pytest.param(Fp8Case(1, 128, 16, 64, (65, 64, 0, 0)), id="B4-H1-R128-P16-page64-padded-last"),
    pytest.param(Fp8Case(2, 512, 64, 64, (33, 130)), id="B2-H2-R512-P64-page64"),
]


def fp8_batch(case: Fp8Case, rng: np.random.Generator):
    """(kwargs of mla_decode_fp8, the dequantised float64 cache [N, page, R + P]): shuffled pages, NaN in the
    unused pages and slots (codes 0x7f, NaN scales and k_pe), padded rows' block-table rows all -1."""
    real = [L for L in case.seq_lens if L > 0]
    cache, table = paged_latent_cache(rng, real, case.R + case.P, case.page)
    codes, scales = quantize_latent(cache[..., :case.R])
    full = np.full((len(case.seq_lens), table.shape[1]), -1, dtype=table.dtype)
    full[[b for b, L in enumerate(case.seq_lens) if L > 0]] = table
    q_abs = 3.0 * rng.standard_normal((len(case.seq_lens), case.H, case.R + case.P))
    kwargs = dict(q_abs=q_abs, kv_fp8=codes, kv_scale=scales, k_pe=cache[..., case.R:], block_table=full,
                  seq_lens=np.asarray(case.seq_lens, np.int32), scale=192 ** -0.5)
    dequantised = np.concatenate([dequantize_latent(codes, scales), cache[..., case.R:]], axis=-1)
    return kwargs, dequantised


@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_decode_equals_mla_decode_core_on_the_dequantised_cache(case, rng):
    kw, dequantised = fp8_batch(case, rng)
    assert np.isnan(dequantised).any() and (kw["kv_fp8"] == 0x7F).any()      # poison the core must not read
    o_lat = mla_decode_fp8(**kw)
    assert o_lat.shape == (len(case.seq_lens), case.H, case.R) and o_lat.dtype == np.float64
    real = kw["seq_lens"] > 0
    want = mla.mla_decode_core(kw["q_abs"][real], dequantised, kw["block_table"][real], kw["seq_lens"][real],
                               scale=kw["scale"], kv_rank=case.R)
    assert rel_rms(o_lat[real], want) <= tol("fp64_same_math")
    assert np.all(o_lat[~real] == 0)


def test_fp8_decode_reads_the_codes_it_is_given():
    """A cache quantised from other rows gives another output: the codes and scales are read, not ignored."""
    case = Fp8Case(2, 128, 16, 16, (20, 7))
    kw, _ = fp8_batch(case, np.random.default_rng(1))
    moved = dict(kw, kv_scale=kw["kv_scale"] * 2.0)
    assert rel_rms(mla_decode_fp8(**moved), mla_decode_fp8(**kw)) > 1e-2


def test_mla_decode_core_takes_page_size_1():
    """The host graph's core at page 1 over the same rows as at page 16 (one block-table column a token)."""
    rng = np.random.default_rng(2)
    lens, W = (5, 1, 18), 40
    c16, t16 = paged_latent_cache(rng, lens, W, 16)
    rows = [c16[t16[b]].reshape(-1, W)[:L] for b, L in enumerate(lens)]
    c1 = np.concatenate(rows)[:, None, :]                                     # [sum L, 1, W]
    t1 = np.zeros((len(lens), max(lens)), np.int32)
    starts = np.cumsum((0,) + lens[:-1])
    for b, L in enumerate(lens):
        t1[b, :L] = starts[b] + np.arange(L)
    q_abs = rng.standard_normal((len(lens), 3, W))
    args = dict(scale=0.2, kv_rank=32)
    want = mla.mla_decode_core(q_abs, c16, t16, np.array(lens), **args)
    assert rel_rms(mla.mla_decode_core(q_abs, c1, t1, np.array(lens), **args), want) <= tol("fp64_same_math")


def test_quantize_latent_is_flashmla_amax_scaling():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((3, 5, 256)) * 10.0 ** rng.uniform(-3, 3, (3, 5, 1))
    rows[0, 0, :GROUP] = 0.0                                                 # an all-zero group
    rows[1, 2] = np.nan                                                      # a poisoned (unused) slot
    codes, scales = quantize_latent(rows)
    assert codes.dtype == np.uint8 and codes.shape == rows.shape
    assert scales.dtype == np.float32 and scales.shape == (3, 5, 2)
    amax = np.max(np.abs(rows.reshape(3, 5, 2, GROUP)), axis=-1)
    np.testing.assert_array_equal(scales, (amax / 448.0).astype(np.float32))
    assert scales[0, 0, 0] == 0 and np.all(codes[0, 0, :GROUP] == 0)
    assert np.all(np.isnan(scales[1, 2])) and np.all(codes[1, 2] == 0x7F)
    ok = np.isfinite(rows)
    c = dequantize_latent(codes, scales)
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 relative; below 2^-6 (subnormals) a step is 2^-9 scales
    bound = 2.0 ** -4 * np.abs(rows) + 2.0 ** -10 * np.repeat(scales, GROUP, axis=-1)
    assert np.all(np.abs(c - rows)[ok] <= bound[ok])


@pytest.mark.parametrize("change, match", [
    pytest.param(dict(kv_fp8=lambda kw: kw["kv_fp8"].astype(np.int16)), "kv_fp8: expected uint8", id="codes-dtype"),
    pytest.param(dict(seq_lens=lambda kw: np.array([129, 0, 9], np.int32)), r"seq_lens\[0\]: expected 0",
                 id="seq-len-past-the-table"),
    pytest.param(dict(block_table=lambda kw: np.where(np.arange(kw["block_table"].shape[1]) == 0, 10 ** 6,
                                                      kw["block_table"])), r"block_table\[0\]: expected page ids",
                 id="page-out-of-range"),
    pytest.param(dict(kv_scale=lambda kw: kw["kv_scale"][..., :0]), "kv_scale: expected", id="scale-shape"),
    pytest.param(dict(scale=lambda kw: -1.0), "scale: expected a positive", id="negative-scale"),
])
def test_fp8_decode_rejects_bad_arguments(change, match):
    kw, _ = fp8_batch(Fp8Case(2, 128, 16, 1, (5, 0, 9)), np.random.default_rng(4))
    kw.update({k: f(kw) for k, f in change.items()})
    with pytest.raises(ValueError, match=match):
        mla_decode_fp8(**kw)


def test_fp8_decode_names_a_nan_row_it_must_read():
    kw, _ = fp8_batch(Fp8Case(2, 128, 16, 16, (20, 7)), np.random.default_rng(5))
    page = int(kw["block_table"][1, 0])
    kw["kv_scale"] = kw["kv_scale"].copy()
    kw["kv_scale"][page, 3, 0] = np.nan
    with pytest.raises(ValueError, match=rf"batch row 1 \(seq_len 7\), found NaN/Inf at its token 3 \(page {page}"):
        mla_decode_fp8(**kw)


def test_fp8_decode_keeps_float32():
    kw, _ = fp8_batch(Fp8Case(2, 128, 16, 16, (20, 7)), np.random.default_rng(6))
    kw32 = dict(kw, q_abs=kw["q_abs"].astype(np.float32), k_pe=kw["k_pe"].astype(np.float32))
    o32 = mla_decode_fp8(**kw32)
    assert o32.dtype == np.float32
    assert rel_rms(o32, mla_decode_fp8(**kw)) <= 1e-5


# ---- mla_prefill

PREFILL_CASES = [
    pytest.param(((5, 5),), 1, 8, 8, id="one-sequence-no-prefix"),
    pytest.param(((3, 11), (1, 1), (4, 4)), 2, 16, 12, id="prefix-first"),
    pytest.param(((2, 2), (1, 9), (0, 3)), 3, 8, 5, id="one-new-token-and-an-empty-chunk"),
    pytest.param(((5, 13), (3, 3)), 2, 192, 128, id="k3-head-geometry"),
]


def plain_attention(q, k, v, seqs, scale):
    """Per new token: softmax over its visible keys, written as a Python loop; returns (o, lse)."""
    Tq, H, _ = q.shape
    o, lse = np.zeros((Tq, H, v.shape[-1])), np.zeros((Tq, H))
    tq = tk = 0
    for qn, kn in seqs:
        for i in range(qn):
            visible = slice(tk, tk + kn - qn + i + 1)
            for h in range(H):
                s = scale * (k[visible, h] @ q[tq + i, h])
                w = np.exp(s - s.max())
                o[tq + i, h] = (w / w.sum()) @ v[visible, h]
                lse[tq + i, h] = s.max() + math.log(w.sum())
        tq, tk = tq + qn, tk + kn
    return o, lse


def _packed(seqs, H, D, Dv, rng):
    Tq, Tk = sum(s[0] for s in seqs), sum(s[1] for s in seqs)
    q, k, v = 2.0 * rng.standard_normal((Tq, H, D)), rng.standard_normal((Tk, H, D)), rng.standard_normal((Tk, H, Dv))
    cu_q = np.concatenate([[0], np.cumsum([s[0] for s in seqs])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([s[1] for s in seqs])]).astype(np.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("seqs, H, D, Dv", PREFILL_CASES)
def test_prefill_equals_a_per_token_softmax(seqs, H, D, Dv, rng):
    q, k, v, cu_q, cu_k = _packed(seqs, H, D, Dv, rng)
    o, lse = mla_prefill(q, k, v, cu_q, cu_k, scale=D ** -0.5)
    want_o, want_lse = plain_attention(q, k, v, seqs, D ** -0.5)
    assert o.dtype == lse.dtype == np.float64
    assert rel_rms(o, want_o) <= tol("fp64_same_math")
    assert rel_rms(lse, want_lse) <= tol("fp64_same_math")


def test_lse_is_the_log_of_the_softmax_denominator():
    """lse of a one-key query is its scaled score; with the prefix the lse includes every visible key."""
    rng = np.random.default_rng(7)
    q, k, v, cu_q, cu_k = _packed(((1, 1), (2, 4)), 1, 6, 3, rng)
    o, lse = mla_prefill(q, k, v, cu_q, cu_k, scale=0.5)
    assert lse[0, 0] == pytest.approx(0.5 * q[0, 0] @ k[0, 0], rel=1e-15)
    np.testing.assert_array_equal(o[0, 0], v[0, 0])
    s = 0.5 * k[1:4, 0] @ q[1, 0]                         # the second sequence's first new token sees 3 of 4 keys
    assert lse[1, 0] == pytest.approx(np.logaddexp.reduce(s), rel=1e-14)


def test_prefill_with_a_prefix_is_the_tail_of_the_full_prefill():
    """A chunk of new tokens after a cached prefix gives the last rows of the prefill of the whole sequence."""
    rng = np.random.default_rng(8)
    q, k, v, _, _ = _packed(((12, 12),), 2, 8, 4, rng)
    full_o, full_lse = mla_prefill(q, k, v, [0, 12], [0, 12], scale=0.3)
    o, lse = mla_prefill(q[7:], k, v, [0, 5], [0, 12], scale=0.3)
    assert rel_rms(o, full_o[7:]) <= tol("fp64_same_math")
    assert rel_rms(lse, full_lse[7:]) <= tol("fp64_same_math")


def test_expanded_mla_through_mla_prefill_is_gated_mla_attend():
    """k3ref's expanded MLA (the host graph's prefill) with its attention step replaced by mla_prefill: the same
    layer output. This is how the host graph would route its prefill attention through the core."""
    cfg = mla.MlaConfig(3, 24, 16, 8, 4, 6, page_size=4)
    rng = np.random.default_rng(9)
    w = mla.random_mla_weights(cfg, 20, rng)
    X = rng.standard_normal((9, 20))
    T, H, v = 9, cfg.num_heads, cfg.v_head_dim
    q_nope, q_pe, c, k_pe, gate = mla.mla_project(w, X, cfg)
    W_UK, W_UV = mla.split_kv_b(w["kv_b_proj.weight"], cfg)
    q = np.concatenate([q_nope, q_pe], axis=-1)
    K = np.concatenate([np.einsum("hnr,tr->thn", W_UK, c), np.broadcast_to(k_pe[:, None], (T, H, k_pe.shape[-1]))],
                       axis=-1)
    V = np.einsum("hvr,tr->thv", W_UV, c)
    o, _ = mla_prefill(q, K, V, [0, T], [0, T], scale=cfg.softmax_scale)
    y = (o.reshape(T, H * v) * (1 / (1 + np.exp(-gate)))) @ w["o_proj.weight"].T
    assert rel_rms(y, mla.gated_mla_attend(w, X, cfg)) <= tol("fp64_same_math")


@pytest.mark.parametrize("args, match", [
    pytest.param(dict(cu_seqlens_q=np.array([0.0, 3.0, 5.0])), "cu_seqlens_q: expected an integer array",
                 id="float-offsets"),
    pytest.param(dict(cu_seqlens_q=np.array([0, 3, 4])), "cu_seqlens_q: expected non-decreasing offsets from 0 to 5",
                 id="q-end"),
    pytest.param(dict(cu_seqlens_k=np.array([0, 2, 9])), r"each sequence's tokens k_n >= its new tokens q_n",
                 id="fewer-keys-than-queries"),
    pytest.param(dict(cu_seqlens_k=np.array([0, 9])), "cu_seqlens_k: expected 3 offsets", id="sequence-count"),
])
def test_prefill_rejects_bad_offsets(args, match):
    q, k, v, cu_q, cu_k = _packed(((3, 4), (2, 5)), 1, 4, 4, np.random.default_rng(10))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k) | args
    with pytest.raises(ValueError, match=match):
        mla_prefill(q, k, v, scale=0.5, **kw)


def test_fp8_decode_of_padded_rows_is_zero_whatever_their_block_table_holds():
    kw, _ = fp8_batch(Fp8Case(1, 128, 16, 16, (0, 0, 20)), np.random.default_rng(11))
    kw["block_table"] = kw["block_table"].copy()
    kw["block_table"][:2] = 10 ** 6                         # out-of-range ids: a padded row reads nothing
    o_lat = mla_decode_fp8(**kw)
    assert np.all(o_lat[:2] == 0) and np.all(np.isfinite(o_lat[2]))
