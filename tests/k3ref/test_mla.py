"""Gated NoPE MLA: absorbed decode through the paged cache == expanded form; scale, NoPE, causality, errors."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3ref import cores as cores_mod
from k3ref import engine, mla, ops
from k3ref.cache import MlaKv
from k3ref.cores import CORE_NAMES, Cores
from tests.support.tolerances import effect, rel_rms, tol


@dataclasses.dataclass(frozen=True)
class Geo:
    """A small MLA geometry (odd sizes on purpose; K3's roles, toy widths)."""

    H: int = 3        # heads
    q_lora: int = 24  # q_a bottleneck
    R: int = 16       # kv_lora_rank (latent width)
    n: int = 8        # qk_nope_head_dim
    r: int = 4        # qk_rope_head_dim (kept, unrotated)
    v: int = 6        # v_head_dim
    D: int = 20       # hidden
    page: int = 4     # page_size (small so tokens cross pages)

    def cfg(self) -> mla.MlaConfig:
        return mla.MlaConfig(self.H, self.q_lora, self.R, self.n, self.r, self.v, page_size=self.page)


def mla_cores(**swaps) -> Cores:
    """Reference rmsnorm + mla_decode (and k3ref's mla_prefill: the expanded form then attends inline); every other
    core fails loudly (MLA must not touch them)."""
    def unused(*args, **kwargs):
        raise AssertionError("an MLA layer called a core it does not own")
    fns = {name: unused for name in CORE_NAMES} | {"rmsnorm": ops.rmsnorm, "mla_decode": mla.mla_decode_core,
                                                   "mla_prefill": engine.mla_prefill}
    return Cores(**(fns | swaps))


def make(geo: Geo, seed: int, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return geo.cfg(), mla.random_mla_weights(geo.cfg(), geo.D, rng, dtype), rng


def decode_all(weights, X, cfg, num_pages=64, cores=None, dtype=np.float64):
    """Feed X [T, D] token by token through mla_decode_token on a fresh cache -> (Y [T, D], cache, sid)."""
    cache = MlaKv(num_pages, cfg.page_size, cfg.cache_width, dtype)
    sid = cache.add_sequence()
    Y = np.concatenate([mla.mla_decode_token(weights, X[t:t + 1], cache, [sid], cfg, cores or mla_cores())
                        for t in range(X.shape[0])])
    return Y, cache, sid


# --- absorbed == expanded -------------------------------------------------------------------

@pytest.mark.parametrize("geo, T", [
    pytest.param(Geo(), 1, id="H3-T1"),
    pytest.param(Geo(H=1), 7, id="H1-T7-P4"),
    pytest.param(Geo(), 13, id="H3-T13-P4"),           # crosses 3 page boundaries, last page partial
    pytest.param(Geo(page=64), 13, id="H3-T13-P64"),   # one K3-sized page
    pytest.param(Geo(page=1), 5, id="H3-T5-P1"),       # every token its own page
    pytest.param(Geo(H=2, n=5, r=3, v=7, R=11, page=3), 10, id="H2-odd-T10-P3"),
    pytest.param(Geo(H=2, q_lora=40, R=512, n=128, r=64, v=128, D=48, page=64), 70,
                 id="K3-heads-H2-T70-P64"),       # K3's per-head widths, crossing one 64-token page
])
def test_absorbed_decode_equals_expanded(geo, T):
    cfg, w, rng = make(geo, 11)
    X = rng.standard_normal((T, geo.D))
    Y, _, _ = decode_all(w, X, cfg)
    assert rel_rms(Y, mla.gated_mla_attend(w, X, cfg)) < tol("fp64_same_math")


@given(T=st.integers(1, 9), H=st.integers(1, 3), page=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_absorbed_equals_expanded_property(T, H, page, seed):
    cfg, w, rng = make(Geo(H=H, page=page), seed)
    X = rng.standard_normal((T, Geo.D))
    assert rel_rms(decode_all(w, X, cfg)[0], mla.gated_mla_attend(w, X, cfg)) < tol("fp64_same_math")


def test_interleaved_sequences_of_different_lengths():
    """Three sequences share one pool (page 4): A runs 10 steps, B joins at step 2 for 6, C is freed mid-way
    so its pages are reused; the batch order changes from step to step. Each sequence must equal its own
    expanded pass."""
    geo = Geo()
    cfg, w, rng = make(geo, 5)
    cache = MlaKv(12, geo.page, cfg.cache_width)
    A, B, C = (cache.add_sequence() for _ in range(3))
    X = {A: rng.standard_normal((10, geo.D)), B: rng.standard_normal((6, geo.D)), C: rng.standard_normal((5, geo.D))}
    Y = {s: [] for s in X}
    steps = {t: [s for s, (start, stop) in {A: (0, 10), B: (2, 8), C: (0, 5)}.items() if start <= t < stop]
             for t in range(10)}
    for t, active in steps.items():
        active = active[::-1] if t % 2 else active
        rows = np.stack([X[s][len(Y[s])] for s in active])
        for s, y in zip(active, mla.mla_decode_token(w, rows, cache, active, cfg, mla_cores()), strict=True):
            Y[s].append(y)
        if t == 4:
            pages_of_C = set(cache.block_table([C])[0].tolist())
            cache.free(C)
    table = cache.block_table([A, B])
    assert pages_of_C & set(table.ravel().tolist())                 # a freed page was reused
    assert np.any(np.diff(table[0][table[0] >= 0]) != 1)            # A's pages are not one contiguous run
    for s in X:
        assert rel_rms(np.stack(Y[s]), mla.gated_mla_attend(w, X[s], cfg)) < tol("fp64_same_math"), s


def test_float32_decode_within_budget_of_float64():
    geo = Geo()
    cfg, w64, rng = make(geo, 3)
    X = rng.standard_normal((9, geo.D))
    w32 = {k: v.astype(np.float32) for k, v in w64.items()}
    Y32, cache, _ = decode_all(w32, X.astype(np.float32), cfg, dtype=np.float32)
    assert Y32.dtype == np.float32 and cache.pages.dtype == np.float32
    assert rel_rms(Y32, mla.gated_mla_attend(w64, X, cfg)) < tol("fp32_vs_fp64")


# --- the softmax scale ----------------------------------------------------------------------

def test_k3_softmax_scale_is_over_qk_nope_plus_rope():
    assert mla.K3_MLA.qk_head_dim == 192 and mla.K3_MLA.cache_width == 576
    assert mla.K3_MLA.softmax_scale == pytest.approx(1 / math.sqrt(192), rel=1e-15)


def test_core_one_score_by_hand_at_k3_scale():
    """Two cached rows whose scores are 0 and a = sqrt(192) ln 3 before scaling: at scale 1/sqrt(192) the
    weights are exactly 1/4, 3/4 (at 1/sqrt(128) they would be 0.207/0.793). Only the k_pe slot carries
    the score, so this also fails if the core ignored the columns past kv_rank."""
    R, P = 4, 2
    c0, c1 = np.array([1.0, 2.0, 3.0, 4.0]), np.array([-4.0, 0.5, 0.0, 8.0])
    kv = np.zeros((1, 64, R + P))
    kv[0, 0], kv[0, 1] = np.r_[c0, 0.0, 0.0], np.r_[c1, 1.0, 0.0]
    q = np.zeros((1, 1, R + P))
    q[0, 0, R] = math.sqrt(192) * math.log(3)
    o = mla.mla_decode_core(q, kv, np.array([[0]], np.int32), np.array([2], np.int32),
                            scale=mla.K3_MLA.softmax_scale, kv_rank=R)
    np.testing.assert_allclose(o[0, 0], 0.25 * c0 + 0.75 * c1, rtol=tol("fp64_same_math"))


def test_decode_token_passes_cfg_scale_and_rank_to_core():
    seen = {}

    def recording_core(q_abs, kv_cache, block_table, seq_lens, *, scale, kv_rank):
        seen.update(scale=scale, kv_rank=kv_rank, q_abs=q_abs, seq_lens=seq_lens.copy())
        return mla.mla_decode_core(q_abs, kv_cache, block_table, seq_lens, scale=scale, kv_rank=kv_rank)

    geo = Geo()
    cfg, w, rng = make(geo, 2)
    decode_all(w, rng.standard_normal((3, geo.D)), cfg, cores=mla_cores(mla_decode=recording_core))
    assert seen["scale"] == pytest.approx(1 / math.sqrt(geo.n + geo.r), rel=1e-15)   # not 1/sqrt(n)
    assert seen["kv_rank"] == geo.R and seen["seq_lens"].tolist() == [3]               # current token included


def test_decode_token_output_goes_through_the_core():
    geo = Geo()
    cfg, w, rng = make(geo, 2)
    zero_core = lambda q_abs, kv, bt, sl, *, scale, kv_rank: np.zeros(q_abs.shape[:2] + (kv_rank,))  # noqa: E731
    Y, _, _ = decode_all(w, rng.standard_normal((2, geo.D)), cfg, cores=mla_cores(mla_decode=zero_core))
    assert np.all(Y == 0.0)


def test_default_cores_match_explicit_reference():
    ref = cores_mod.reference_cores()
    geo = Geo()
    cfg, w, rng = make(geo, 9)
    X = rng.standard_normal((5, geo.D))
    assert rel_rms(decode_all(w, X, cfg, cores=ref)[0], decode_all(w, X, cfg)[0]) == 0.0


# --- NoPE: k_pe kept and unrotated ----------------------------------------------------------

def _rms(z, w, eps):
    return w * z / np.sqrt(np.mean(z ** 2, axis=-1, keepdims=True) + eps)


def test_cache_rows_are_normed_latent_and_raw_k_pe():
    """Row t of the cache is [RMSNorm_1e-6(c_raw_t) | k_pe_t] with k_pe exactly the projection (no rotation
    at any position t > 0, no normalisation)."""
    geo = Geo()
    cfg, w, rng = make(geo, 4)
    X = rng.standard_normal((9, geo.D))
    _, cache, sid = decode_all(w, X, cfg)
    kv = X @ w["kv_a_proj_with_mqa.weight"].T
    want = np.concatenate([_rms(kv[:, :geo.R], w["kv_a_layernorm.weight"], 1e-6), kv[:, geo.R:]], axis=1)
    np.testing.assert_allclose(cache.gather(sid), want, rtol=0, atol=tol("fp64_same_math"))


def test_q_pe_enters_the_core_unrotated():
    seen = []

    def recording_core(q_abs, *args, **kwargs):
        seen.append(q_abs.copy())
        return mla.mla_decode_core(q_abs, *args, **kwargs)

    geo = Geo()
    cfg, w, rng = make(geo, 6)
    X = rng.standard_normal((5, geo.D))
    decode_all(w, X, cfg, cores=mla_cores(mla_decode=recording_core))
    q = (_rms(X @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], 1e-6) @ w["q_b_proj.weight"].T)
    q_pe = q.reshape(5, geo.H, geo.n + geo.r)[..., geo.n:]
    np.testing.assert_allclose(np.concatenate(seen)[..., geo.R:], q_pe, rtol=0, atol=tol("fp64_same_math"))


def test_k_pe_participates_in_scores():
    geo = Geo()
    cfg, w, rng = make(geo, 8)
    X = rng.standard_normal((6, geo.D))
    w_no_kpe = dict(w)
    w_no_kpe["kv_a_proj_with_mqa.weight"] = w["kv_a_proj_with_mqa.weight"].copy()
    w_no_kpe["kv_a_proj_with_mqa.weight"][geo.R:] = 0.0
    Y, Y_no = decode_all(w, X, cfg)[0], decode_all(w_no_kpe, X, cfg)[0]
    assert rel_rms(Y_no, mla.gated_mla_attend(w_no_kpe, X, cfg)) < tol("fp64_same_math")
    assert rel_rms(Y[1:], Y_no[1:]) > effect("k_pe_moves_y")   # t = 0 attends to itself only


# --- causality ------------------------------------------------------------------------------

@pytest.mark.parametrize("T, t", [pytest.param(8, 3, id="T8-cut3"), pytest.param(5, 1, id="T5-cut1"),
                                  pytest.param(6, 5, id="T6-cut5")])
def test_expanded_is_causal(T, t):
    geo = Geo()
    cfg, w, rng = make(geo, 12)
    X = rng.standard_normal((T, geo.D))
    X_changed = X.copy()
    X_changed[t:] = rng.standard_normal((T - t, geo.D))
    Y, Y_changed = mla.gated_mla_attend(w, X, cfg), mla.gated_mla_attend(w, X_changed, cfg)
    assert rel_rms(Y_changed[:t], Y[:t]) < tol("fp64_same_math")
    assert rel_rms(mla.gated_mla_attend(w, X[:t], cfg), Y[:t]) < tol("fp64_same_math")
    assert rel_rms(Y_changed[t:], Y[t:]) > effect("changed_tokens_move_y")   # the changed tokens do change


def test_core_ignores_poisoned_slots_past_seq_len():
    """Unused slots of the last page (NaN-filled pool) must never reach the output."""
    geo = Geo()
    cfg, w, rng = make(geo, 13)
    X = rng.standard_normal((6, geo.D))
    cache = MlaKv(8, geo.page, cfg.cache_width, fill=np.nan)
    sid = cache.add_sequence()
    Y = np.concatenate([mla.mla_decode_token(w, X[t:t + 1], cache, [sid], cfg, mla_cores()) for t in range(6)])
    assert rel_rms(Y, mla.gated_mla_attend(w, X, cfg)) < tol("fp64_same_math")


# --- bad input ------------------------------------------------------------------------------

def _core_args(**over):
    args = dict(q_abs=np.ones((1, 2, 6)), kv_cache=np.ones((3, 4, 6)), block_table=np.array([[2, 0]], np.int32),
                seq_lens=np.array([5], np.int32), scale=0.5, kv_rank=4)
    return args | over


@pytest.mark.parametrize("over, match", [
    pytest.param({"seq_lens": np.array([9], np.int32)}, r"seq_lens\[0\].*<= 8", id="seq_len-gt-mapped-rows"),
    pytest.param({"seq_lens": np.array([0], np.int32)}, r"seq_lens\[0\]", id="seq_len-zero"),
    pytest.param({"seq_lens": np.array([5.0])}, r"seq_lens: expected an integer", id="seq_lens-float"),
    pytest.param({"block_table": np.array([[2, -1]], np.int32)}, r"block_table\[0\]", id="unmapped-page"),
    pytest.param({"block_table": np.array([[2, 3]], np.int32)}, r"block_table\[0\]", id="page-out-of-pool"),
    pytest.param({"block_table": np.array([2, 0], np.int32)}, r"block_table: expected rank 2", id="bt-rank"),
    pytest.param({"q_abs": np.ones((1, 2, 5))}, r"kv_cache: expected", id="width-mismatch"),
    pytest.param({"q_abs": np.ones((2, 6))}, r"q_abs: expected rank 3", id="q-rank"),
    pytest.param({"q_abs": np.full((1, 2, 6), np.nan)}, r"q_abs: expected finite", id="q-nan"),
    pytest.param({"kv_rank": 7}, r"kv_rank", id="kv_rank-too-big"),
    pytest.param({"scale": -1.0}, r"scale", id="scale-negative"),
])
def test_core_rejects_bad_input(over, match):
    with pytest.raises(ValueError, match=match):
        mla.mla_decode_core(**_core_args(**over))


def test_core_rejects_nan_in_rows_it_reads():
    kv = np.ones((3, 4, 6))
    kv[0, 0, 1] = np.nan   # token 4 of the sequence (page 0 is its second page)
    with pytest.raises(ValueError, match=r"kv_cache: expected finite rows"):
        mla.mla_decode_core(**_core_args(kv_cache=kv))


def _decode_setup():
    geo = Geo()
    cfg, w, rng = make(geo, 1)
    cache = MlaKv(4, geo.page, cfg.cache_width)
    return geo, cfg, w, cache, cache.add_sequence()


@pytest.mark.parametrize("case, match", [
    pytest.param("x-rank", r"x: expected rank 2", id="x-rank"),
    pytest.param("x-nan", r"x: expected finite", id="x-nan"),
    pytest.param("x-width", r"weights\['q_a_proj.weight'\]", id="x-width"),
    pytest.param("ids", r"seq_ids: expected 1 ids", id="seq_ids-count"),
    pytest.param("cache", r"cache: expected width 20", id="cache-width"),
    pytest.param("missing", r"missing 'g_proj.weight'", id="weight-missing"),
    pytest.param("shape", r"weights\['kv_b_proj.weight'\]", id="weight-shape"),
    pytest.param("late", r"missing 'o_proj.weight'", id="o_proj-missing"),
])
def test_decode_token_rejects_bad_input(case, match):
    geo, cfg, w, cache, sid = _decode_setup()
    x, ids = np.ones((1, geo.D)), [sid]
    if case == "x-rank":
        x = np.ones(geo.D)
    elif case == "x-nan":
        x[0, 3] = np.nan
    elif case == "x-width":
        x = np.ones((1, geo.D + 1))
    elif case == "ids":
        ids = [sid, sid]
    elif case == "cache":
        cache = MlaKv(4, geo.page, cfg.cache_width + 1)
        ids = [cache.add_sequence()]
    elif case == "missing":
        w = {k: v for k, v in w.items() if k != "g_proj.weight"}
    elif case == "late":
        w = {k: v for k, v in w.items() if k != "o_proj.weight"}
    elif case == "shape":
        w = w | {"kv_b_proj.weight": np.ones((geo.H * (geo.n + geo.v), geo.R + 1))}
    with pytest.raises(ValueError, match=match):
        mla.mla_decode_token(w, x, cache, ids, cfg, mla_cores())
    assert cache.seq_lens(cache.sequences).tolist() == [0]   # rejected before anything was appended


@pytest.mark.parametrize("kwargs, match", [
    pytest.param({"num_heads": 0}, r"MlaConfig.num_heads", id="heads-zero"),
    pytest.param({"v_head_dim": 2.5}, r"MlaConfig.v_head_dim", id="v-float"),
    pytest.param({"q_norm_eps": 0.0}, r"MlaConfig.q_norm_eps", id="eps-zero"),
    pytest.param({"kv_norm_eps": True}, r"MlaConfig.kv_norm_eps", id="eps-bool"),
])
def test_config_rejects_bad_values(kwargs, match):
    base = dict(num_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    with pytest.raises(ValueError, match=match):
        mla.MlaConfig(**(base | kwargs))


def test_config_accepts_numpy_float_eps():
    cfg = mla.MlaConfig(2, 8, 8, 4, 2, 4, q_norm_eps=np.float32(1e-6), kv_norm_eps=np.float64(1e-6))
    assert cfg.q_norm_eps == np.float32(1e-6)


def test_absorb_q_rejects_wrong_heads():
    geo = Geo()
    cfg, w, _ = make(geo, 1)
    with pytest.raises(ValueError, match=r"q_nope: expected"):
        mla.absorb_q(np.ones((1, geo.H + 1, geo.n)), np.ones((1, geo.H + 1, geo.r)), w["kv_b_proj.weight"], cfg)


# --- NaN/Inf policy: weights are checked through their products, core outputs by name ----------------

def _pages_snapshot(cache):
    return cache.pages.copy(), cache.num_free_pages, cache.seq_lens(cache.sequences).tolist()


def _assert_cache_as_before(cache, snap):
    pages, free, lens = snap
    np.testing.assert_array_equal(cache.pages, pages)       # bitwise, NaN fill included
    assert cache.num_free_pages == free and cache.seq_lens(cache.sequences).tolist() == lens


def _bad_weight_index(geo, name, part):
    """An index into weights[name] that the decode step reads: kv_b_proj rows 0..n-1 of head 0 are W_UK
    (used before the append), rows n.. are W_UV (used after the core)."""
    if name.endswith("layernorm.weight"):
        return (3,)
    if name == "kv_b_proj.weight":
        return (1, 2) if part == "UK" else (geo.n + 1, 2)
    return (1, 2)


NAN_WEIGHT_CASES = [pytest.param(name, part, bad, id=f"{name}-{part}-{bad}" if part else f"{name}-{bad}")
                    for name in mla.mla_weight_shapes(mla.K3_MLA, 7)
                    for part in (("UK", "UV") if name == "kv_b_proj.weight" else ("",))
                    for bad in ("nan", "inf")]


@pytest.mark.parametrize("name, part, bad", NAN_WEIGHT_CASES)
def test_decode_token_names_a_non_finite_weight_and_leaves_the_cache_alone(name, part, bad):
    """A NaN/Inf in any weight raises ValueError naming the weight and the index of its first NaN/Inf, and the
    cache is as it was (empty here): nothing appended, or the append taken back (W_UV, o_proj act after it)."""
    geo, cfg, w, cache, sid = _decode_setup()
    x = np.random.default_rng(0).standard_normal((1, geo.D))
    idx = _bad_weight_index(geo, name, part)
    w[name] = w[name].copy()
    w[name][idx] = {"nan": np.nan, "inf": -np.inf}[bad]
    snap = _pages_snapshot(cache)
    found = r"nan" if bad == "nan" else r"-inf"
    with pytest.raises(ValueError, match=rf"weights\['{name}'\]: expected finite values, found {found} at index "
                                         rf"\({', '.join(map(str, idx))},?\)"):
        mla.mla_decode_token(w, x, cache, [sid], cfg, mla_cores())
    assert cache.seq_lens(cache.sequences).tolist() == [0]
    _assert_cache_as_before(cache, snap)


@pytest.mark.parametrize("name, part, bad", [c for c in NAN_WEIGHT_CASES if c.values[2] == "nan"])
def test_expanded_form_names_a_nan_weight(name, part, bad):
    geo, cfg, w, _, _ = _decode_setup()
    idx = _bad_weight_index(geo, name, part)
    w[name] = w[name].copy()
    w[name][idx] = np.nan
    with pytest.raises(ValueError, match=rf"weights\['{name}'\]: expected finite values, found nan at index"):
        mla.gated_mla_attend(w, np.random.default_rng(0).standard_normal((3, geo.D)), cfg, mla_cores())


def test_a_failed_step_leaves_a_used_cache_unchanged_and_usable():
    """Token 4 of a page-4 cache takes a new page; an o_proj NaN after the append must give the page back and
    leave every slot bitwise as it was; the next good step then matches a run that never failed."""
    geo = Geo()
    cfg, w, rng = make(geo, 7)
    X = rng.standard_normal((6, geo.D))
    cache = MlaKv(8, geo.page, cfg.cache_width, fill=np.nan)
    sid = cache.add_sequence()
    Y = [mla.mla_decode_token(w, X[t:t + 1], cache, [sid], cfg, mla_cores()) for t in range(4)]
    snap = _pages_snapshot(cache)
    bad = w | {"o_proj.weight": w["o_proj.weight"].copy()}
    bad["o_proj.weight"][0, 0] = np.nan
    with pytest.raises(ValueError, match=r"weights\['o_proj.weight'\]: expected finite values, found nan"):
        mla.mla_decode_token(bad, X[4:5], cache, [sid], cfg, mla_cores())
    _assert_cache_as_before(cache, snap)
    Y += [mla.mla_decode_token(w, X[t:t + 1], cache, [sid], cfg, mla_cores()) for t in (4, 5)]
    assert rel_rms(np.concatenate(Y), mla.gated_mla_attend(w, X, cfg)) < tol("fp64_same_math")


def test_decode_token_names_an_overflowing_projection():
    """A finite float32 weight whose product overflows is not a NaN in the weight: the error says so."""
    geo, cfg, w, _, _ = _decode_setup()
    w32 = {k: v.astype(np.float32) for k, v in w.items()}
    w32["g_proj.weight"] = np.full_like(w32["g_proj.weight"], 1e38)
    cache = MlaKv(4, geo.page, cfg.cache_width, np.float32)
    sid = cache.add_sequence()
    with np.errstate(over="ignore"), \
            pytest.raises(ValueError,
                          match=r"weights\['g_proj.weight'\]: expected finite outputs.*overflow in float32"):
        mla.mla_decode_token(w32, np.ones((1, geo.D), np.float32), cache, [sid], cfg, mla_cores())
    assert cache.seq_lens([sid]).tolist() == [0]


def test_decode_token_rejects_rows_that_overflow_a_float16_cache():
    """k_pe of ~1e6 is finite in float64 but inf in a float16 cache: rejected before the append, named."""
    geo, cfg, w, _, _ = _decode_setup()
    w["kv_a_proj_with_mqa.weight"] = w["kv_a_proj_with_mqa.weight"].copy()
    w["kv_a_proj_with_mqa.weight"][geo.R:] *= 1e6
    cache = MlaKv(4, geo.page, cfg.cache_width, np.float16)
    sid = cache.add_sequence()
    with pytest.raises(ValueError, match=r"cache rows: .*float16.*kv_a_proj_with_mqa"):
        mla.mla_decode_token(w, np.ones((1, geo.D)), cache, [sid], cfg, mla_cores())
    assert cache.seq_lens([sid]).tolist() == [0]


def _nan_core(q_abs, kv_cache, block_table, seq_lens, *, scale, kv_rank):
    o = mla.mla_decode_core(q_abs, kv_cache, block_table, seq_lens, scale=scale, kv_rank=kv_rank)
    o[0, 1, 2] = np.nan
    return o


def _short_core(q_abs, kv_cache, block_table, seq_lens, *, scale, kv_rank):
    return mla.mla_decode_core(q_abs, kv_cache, block_table, seq_lens, scale=scale, kv_rank=kv_rank)[..., 1:]


@pytest.mark.parametrize("core, match", [
    pytest.param(_nan_core, r"mla_decode core output: expected finite values, found nan at index \(0, 1, 2\)",
                 id="nan"),
    pytest.param(_short_core, r"mla_decode core output: expected \[1, 3, 16\], found shape \(1, 3, 15\)", id="shape"),
])
def test_decode_token_names_a_bad_core_output(core, match):
    """As the KDA layer does: a core's NaN or misshaped output is named, not passed on into y; the step is
    taken back out of the cache (here after two good tokens)."""
    geo, cfg, w, cache, sid = _decode_setup()
    X = np.random.default_rng(3).standard_normal((3, geo.D))
    for t in range(2):
        mla.mla_decode_token(w, X[t:t + 1], cache, [sid], cfg, mla_cores())
    snap = _pages_snapshot(cache)
    with pytest.raises(ValueError, match=match):
        mla.mla_decode_token(w, X[2:3], cache, [sid], cfg, mla_cores(mla_decode=core))
    _assert_cache_as_before(cache, snap)


@pytest.mark.parametrize("form", ["decode", "expanded"])
def test_a_nan_from_the_rmsnorm_core_is_named(form):
    geo, cfg, w, cache, sid = _decode_setup()

    def nan_rmsnorm(x, w_, eps):
        y = ops.rmsnorm(x, w_, eps)
        if y.shape[-1] == geo.q_lora:
            y[..., 1] = np.nan
        return y

    with pytest.raises(ValueError, match=r"rmsnorm core output \(q_a_layernorm\): expected finite values, found nan"):
        if form == "decode":
            mla.mla_decode_token(w, np.ones((1, geo.D)), cache, [sid], cfg, mla_cores(rmsnorm=nan_rmsnorm))
        else:
            mla.gated_mla_attend(w, np.ones((2, geo.D)), cfg, mla_cores(rmsnorm=nan_rmsnorm))
    assert cache.seq_lens([sid]).tolist() == [0]
