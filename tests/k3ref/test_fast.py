"""The tuned CPU forms in k3ref.fast against the readable forms they reorganise (k3ref.kda, k3ref.mxfp4,
k3ref.latent_moe), on inputs small enough that every block boundary is crossed. The KDA functions here are the NumPy
forms (K3_FAST=numpy); the compiled KDA forms are tested in test_fast_jit_kda.py."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from k3ref import fast, mxfp4
from k3ref import latent_moe as lm
from k3ref.fast import kda as kda_fast
from k3ref.fast import latent_moe as moe_fast
from k3ref.fast import mxfp4 as mxfp4_fast
from k3ref.fast import scan_jit
from k3ref.kda import kda_recurrent, l2norm
from k3ref.situ import situ_glu
from tests.support.tolerances import rel_rms, tol


def test_flush_floor_is_two_to_minexp_half_plus_13():
    """2^-50 in float32 and 2^-498 in float64: two kept factors times two entries above 2^-13 stay normal."""
    assert kda_fast.flush_floor(np.float32) == 2.0 ** -50
    assert kda_fast.flush_floor(np.float64) == 2.0 ** -498


@pytest.mark.parametrize("rows_per_block", [pytest.param(1, id="1-row"), pytest.param(4, id="4-rows-last-short"),
                                            pytest.param(64, id="one-block")])
def test_decode_step_equals_one_recurrent_step(rows_per_block, rng, monkeypatch):
    """decode_step over blocks of (sequence, head) rows is one step of kda_recurrent for each row."""
    B, H, K, V = 3, 5, 8, 6
    monkeypatch.setattr(kda_fast, "DECODE_BLOCK_BYTES", rows_per_block * K * V * 8)
    q, k = l2norm(rng.standard_normal((2, B, 1, H, K)))
    q = q * K ** -0.5
    v, g = rng.standard_normal((B, 1, H, V)), -rng.uniform(0.0, 5.0, (B, 1, H, K))
    beta, S0 = rng.uniform(0.0, 1.0, (B, 1, H)), rng.standard_normal((B, H, K, V))
    want_o, want_S = kda_recurrent(q, k, v, g, beta, scale=1.0, initial_state=S0)
    BH = B * H
    o, S = kda_fast.decode_step(q.reshape(BH, K), k.reshape(BH, K), v.reshape(BH, V), beta.reshape(BH, 1),
                                np.exp(g).reshape(BH, K), S0.reshape(BH, K, V))
    assert rel_rms(o.reshape(B, H, V), want_o[:, 0]) <= tol("fp64_same_math")
    assert rel_rms(S.reshape(B, H, K, V), want_S) <= tol("fp64_same_math")


def test_unit_lower_inverse_is_the_inverse(rng):
    """Blocked forward substitution (blocks of 4 over L = 12) against numpy's dense inverse."""
    L = 12
    M = np.eye(L) + np.tril(0.3 * rng.standard_normal((2, L, L)), -1)
    assert rel_rms(kda_fast.unit_lower_inverse(M, 4), np.linalg.inv(M)) <= tol("fp64_same_math")


def test_intra_chunk_scores_equal_the_direct_sums(rng):
    """Akk, Aqk and k_end against their definitions with exp(G_i - G_j) formed directly (moderate decays, so
    nothing is flushed and the direct form is accurate)."""
    L, K, sub = 16, 4, 4
    q, k = rng.standard_normal((2, 3, L, K))
    g = -rng.uniform(0.0, 0.5, (3, L, K))
    G = np.cumsum(g, axis=-2)
    ratio = np.exp(G[:, :, None, :] - G[:, None, :, :])               # [.., i, j, K]: exp(G_i - G_j)
    lower = np.tril(np.ones((L, L)))
    Akk, Aqk, k_end = kda_fast.intra_chunk_scores(q, k, g, G, sub)
    assert rel_rms(Akk, np.einsum("bic,bjc,bijc->bij", k, k, ratio) * lower) <= tol("fp64_same_math")
    assert rel_rms(Aqk, np.einsum("bic,bjc,bijc->bij", q, k, ratio) * lower) <= tol("fp64_same_math")
    want_end = np.einsum("bjc,bjc->bcj", k, np.exp(G[:, -1:, :] - G))
    assert rel_rms(k_end, want_end) <= tol("fp64_same_math")


@pytest.mark.parametrize("chunk_size", [pytest.param(64, id="chunk64"), pytest.param(5, id="chunk5-padded")])
def test_chunked_recurrence_equals_kda_recurrent(chunk_size, rng):
    """The chunked form on prepared inputs (over several chunk groups) against the step-by-step recurrence."""
    B, T, H, K, V = 2, 150, 2, 8, 4
    q, k = l2norm(rng.standard_normal((2, B, T, H, K)))
    v, g = rng.standard_normal((B, T, H, V)), -rng.uniform(0.0, 2.0, (B, T, H, K))
    beta, S0 = rng.uniform(0.0, 1.0, (B, T, H)), rng.standard_normal((B, H, K, V))
    want_o, want_S = kda_recurrent(q, k, v, g, beta, scale=1.0, initial_state=S0)
    o, S = kda_fast.chunked_recurrence(q, k, v, g, beta, S0.copy(), chunk_size)
    assert rel_rms(o, want_o) <= tol("fp64_long_recurrence")
    assert rel_rms(S, want_S) <= tol("fp64_long_recurrence")


def test_dequantize_rows_equals_dequantize(rng):
    """The whole-item lookup gives dequantize's exact float32 values, NaN (byte 255) and the subnormal scale
    2^-127 (byte 0) included."""
    packed = rng.integers(0, 256, (4, 32), dtype=np.uint8)
    scale = rng.integers(0, 256, (4, 2), dtype=np.uint8)
    scale[0, 0], scale[1, 1], scale[2, 0] = 255, 0, 254
    out = np.empty((4, 64), np.float32)
    with np.errstate(over="ignore"):                                  # byte 254: 6 * 2^127 is inf in both
        got = mxfp4_fast.dequantize_rows(packed, scale, out, mxfp4._TABLES)
        want = mxfp4.dequantize(packed, scale)
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("rows_per_block", [pytest.param(1, id="1-row"), pytest.param(3, id="3-rows-last-short"),
                                            pytest.param(100, id="one-block")])
def test_gemv_rows_equals_the_dequantised_product(rows_per_block, rng, monkeypatch):
    """Row blocks of any size give x @ dequantize(W).T, row for row."""
    monkeypatch.setattr(mxfp4_fast, "GEMV_BLOCK_BYTES", rows_per_block * 64 * 4)
    packed, scale = mxfp4.quantize(rng.standard_normal((7, 64)))
    x = rng.standard_normal((3, 64))
    want = x @ mxfp4.dequantize(packed, scale).astype(np.float64).T
    assert rel_rms(mxfp4_fast.gemv_rows(packed, scale, x, mxfp4._TABLES), want) <= tol("fp64_same_math")


def test_one_token_experts_equal_routed_expert_one_at_a_time(monkeypatch):
    """All experts of one token at once give exactly what `routed_expert` gives for each expert alone (both in
    their NumPy forms: K3_FAST=numpy)."""
    monkeypatch.setenv("K3_FAST", "numpy")
    cfg = lm.LatentMoeConfig(hidden_size=19, num_experts=6, top_k=2, latent_size=64, moe_intermediate_size=32,
                             n_shared_experts=0, shared_intermediate_size=0)
    r = np.random.default_rng(7)
    weights = lm.random_moe_weights(cfg, r, np.float64)
    z = r.standard_normal((1, cfg.latent_size))
    chosen = [0, 3, 5]
    tensors = {e: lm._expert_tensors(weights, e, cfg) for e in chosen}
    glu = functools.partial(situ_glu, beta=cfg.situ_beta, linear_beta=cfg.linear_beta)
    got = moe_fast.one_token_experts(tensors, z, cfg.latent_size, cfg.moe_intermediate_size, glu)
    assert sorted(got) == chosen
    for e in chosen:
        assert np.array_equal(got[e], lm.routed_expert(weights, e, z, cfg)), e


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_answers_as_isfinite_all(dtype):
    """The compiled scan gives np.isfinite(a).all()'s answer: a NaN or an Inf anywhere (first, last, middle) in
    arrays of 1-4 dims, C-contiguous or strided (which go to NumPy), 0-d, 5-d and past SMALL elements."""
    rng = np.random.default_rng(3)
    shapes = [(1,), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 5), (), (1, 2, 1, 2, 3), (scan_jit.SMALL + 3,)]
    for shape in shapes:
        a = rng.standard_normal(shape).astype(dtype)
        views = [a, a[..., ::2]] if a.ndim else [a]
        for bad in (np.nan, np.inf, -np.inf):
            for at in sorted({0, a.size // 2, max(a.size - 1, 0)}):
                b = a.copy()
                b.reshape(-1)[at] = bad
                views += [b, b[..., ::2]] if b.ndim else [b]
        for v in views:
            assert scan_jit.all_finite(v) is bool(np.isfinite(v).all()), (shape, v.strides)


def test_held_reads_k3_fast_once_for_the_block(monkeypatch):
    """Inside `held()` the backend read on entering holds (nested blocks keep it); outside, every call reads the
    environment; an unknown value is refused when the block is entered."""
    monkeypatch.setenv("K3_FAST", "jit")
    with fast.held() as chosen:
        monkeypatch.setenv("K3_FAST", "numpy")
        assert chosen == "jit" and fast.backend() == "jit" and fast.enabled()
        with fast.held() as inner:
            assert inner == "jit"
        assert fast.backend() == "jit"
    assert fast.backend() == "numpy" and not fast.enabled()
    monkeypatch.setenv("K3_FAST", "cuda")
    with pytest.raises(ValueError, match="K3_FAST: expected one of jit, numpy"):
        with fast.held():
            pass
    monkeypatch.setenv("K3_FAST", "numpy")
    assert fast.backend() == "numpy"


def test_fits_one_batch_counts_float32_bytes_of_one_projection():
    assert moe_fast.fits_one_batch(8, 512, 256)                       # 4 MiB exactly
    assert not moe_fast.fits_one_batch(9, 512, 256)
