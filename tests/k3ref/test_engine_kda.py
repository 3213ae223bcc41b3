"""The engine-shaped KDA references (k3ref.engine.kda) against the host-graph references they restate, float64.

kda_decode_pool's rows are kda_decode_core on their slots' states (its one step written out by k3ref.fast);
kda_prefill_varlen's sequences are kda_prefill_core (the chunked WY/UT form) on their tokens; kda_conv_pool is
short_conv + SiLU on the slot's history. Slots are shuffled, unused slots hold NaN (so a read of a wrong slot
shows), padded rows sit between live ones, and everything not a live row's slot must come back bit-identical.
"""
from __future__ import annotations

import numpy as np
import pytest

from k3ref import kda
from k3ref.engine.kda import (
    decode_through_pool,
    kda_conv_pool,
    kda_decode_pool,
    kda_prefill_varlen,
    prefill_through_varlen,
)
from k3ref.ops import silu

RTOL = 1e-12   # float64 reference against float64 reference: rounding of reordered sums only


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if want.size == 0:
        return
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300)
    assert err <= RTOL, f"{what}: relative error {err:.3g} > {RTOL}"


def _kda_inputs(rng, lead, H, K, V):
    """q, k, v, g_raw, beta_raw with axes lead + (H, ...); gates partly at the lower bound."""
    g_raw = 2.0 * rng.standard_normal(lead + (H, K))
    g_raw[..., 0, : K // 2] = 12.0
    return dict(q=rng.standard_normal(lead + (H, K)), k=rng.standard_normal(lead + (H, K)),
                v=rng.standard_normal(lead + (H, V)), g_raw=g_raw, beta_raw=rng.standard_normal(lead + (H,)))


def _params(rng, H, K):
    return dict(A_log=np.log(rng.uniform(1.0, 16.0, H)), dt_bias=0.5 * rng.standard_normal(H * K))


def _pool(states, slots, n_slots, layout):
    """A NaN pool of n_slots holding states [n, H, K, V] at slots, in the layout."""
    n, H, K, V = states.shape
    pool = np.full((n_slots, H, K, V), np.nan)
    pool[slots] = states
    return pool if layout == "kv" else np.ascontiguousarray(pool.transpose(0, 1, 3, 2))


def _as_kv(S, layout):
    return S if layout == "kv" else S.transpose(0, 1, 3, 2)


def _assert_untouched(new_pool, pool, used):
    others = np.setdiff1d(np.arange(pool.shape[0]), used)
    np.testing.assert_array_equal(new_pool[others], pool[others])   # NaN == NaN here: bit-identical slots


# ---- decode

DECODE = [
    pytest.param(3, 2, 16, 16, (1,), 7, "kv", -5.0, id="B3-H2-K16-pad1-kv"),
    pytest.param(3, 2, 16, 16, (1,), 7, "vk", -5.0, id="B3-H2-K16-pad1-vk"),
    pytest.param(4, 1, 32, 16, (0, 3), 5, "vk", -5.0, id="B4-H1-K32-V16-pad2-vk"),
    pytest.param(2, 3, 16, 24, (), 2, "kv", None, id="B2-H3-K16-V24-nolb-kv"),
    pytest.param(1, 1, 128, 128, (), 3, "vk", -5.0, id="B1-H1-K128-vk"),
]


@pytest.mark.parametrize("B, H, K, V, padded, n_slots, layout, lb", DECODE)
def test_decode_pool_is_the_decode_core_on_each_row(B, H, K, V, padded, n_slots, layout, lb):
    rng = np.random.default_rng(B * 100 + K)
    x, p = _kda_inputs(rng, (B,), H, K, V), _params(rng, H, K)
    live = np.array([b for b in range(B) if b not in padded])
    slots = np.full(B, -1, np.int32)
    slots[live] = rng.permutation(n_slots)[:live.size]
    states = 0.5 * rng.standard_normal((live.size, H, K, V))
    pool = _pool(states, slots[live], n_slots, layout)
    kw = dict(lower_bound=lb, scale=None)
    o, new_pool = kda_decode_pool(**x, **p, state_pool=pool, slots=slots, state_layout=layout, **kw)
    want_o, want_S = kda.kda_decode_core(*(x[n][live] for n in ("q", "k", "v", "g_raw", "beta_raw")), **p,
                                         state=states, **kw)
    _close(o[live], want_o, "o")
    _close(_as_kv(new_pool[slots[live]], layout), want_S, "state")
    assert np.all(o[list(padded)] == 0), "a padded row's o is zeros in the reference"
    _assert_untouched(new_pool, pool, slots[live])
    assert np.isnan(pool[np.setdiff1d(np.arange(n_slots), slots[live])]).all(), "the input pool was mutated"


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_decode_and_prefill_through_the_pool_adapters_equal_the_host_cores(layout):
    rng = np.random.default_rng(7)
    B, T, H, K, V = 3, 65, 2, 16, 8
    p, kw = _params(rng, H, K), dict(lower_bound=-5.0, scale=None)
    x, state = _kda_inputs(rng, (B,), H, K, V), 0.5 * rng.standard_normal((B, H, K, V))
    got = decode_through_pool(kda_decode_pool, layout)(**x, **p, state=state, **kw)
    for g, w, what in zip(got, kda.kda_decode_core(**x, **p, state=state, **kw), ("o", "state"), strict=True):
        _close(g, w, f"decode {what}")
    x = _kda_inputs(rng, (B, T), H, K, V)
    got = prefill_through_varlen(kda_prefill_varlen, layout)(**x, **p, state=state, **kw)
    for g, w, what in zip(got, kda.kda_prefill_core(**x, **p, state=state, **kw), ("o", "state"), strict=True):
        _close(g, w, f"prefill {what}")


# ---- conv

@pytest.mark.parametrize("layout", ["cw", "wc"])
@pytest.mark.parametrize("B, C, W, padded, n_slots", [
    pytest.param(3, 24, 4, (1,), 5, id="B3-C24-W4-pad1"),
    pytest.param(1, 17, 2, (), 1, id="B1-C17-W2"),
    pytest.param(4, 33, 4, (0, 2), 4, id="B4-C33-W4-pad2"),
])
def test_conv_pool_is_short_conv_and_silu_on_the_slot_history(B, C, W, padded, n_slots, layout):
    rng = np.random.default_rng(C)
    x, w = rng.standard_normal((B, C)), rng.standard_normal((C, W))
    live = np.array([b for b in range(B) if b not in padded])
    slots = np.full(B, -1, np.int32)
    slots[live] = rng.permutation(n_slots)[:live.size]
    hist = rng.standard_normal((live.size, C, W - 1))                # [n, C, W-1], oldest first
    pool = np.full((n_slots, C, W - 1), np.nan)
    pool[slots[live]] = hist
    pool = pool if layout == "cw" else np.ascontiguousarray(pool.transpose(0, 2, 1))
    y, new_pool = kda_conv_pool(x, w, pool, slots, layout=layout)
    want_y, want_hist = kda.short_conv(x[live, None, :], w, hist)
    _close(y[live], silu(want_y[:, 0]), "y")
    got_hist = new_pool[slots[live]]
    _close(got_hist if layout == "cw" else got_hist.transpose(0, 2, 1), want_hist, "conv state")
    assert np.all(y[list(padded)] == 0)
    _assert_untouched(new_pool, pool, slots[live])


# ---- varlen prefill

VARLEN = [
    pytest.param((1, 63, 64, 65), 2, 16, 16, 6, "kv", id="L1-63-64-65-kv"),
    pytest.param((65, 1, 64, 63), 2, 16, 8, 5, "vk", id="L65-1-64-63-V8-vk"),
    pytest.param((3, 0, 2), 1, 16, 16, 3, "kv", id="L3-0-2-empty-kv"),
    pytest.param((70,), 1, 128, 128, 1, "vk", id="L70-K128-vk"),
]


@pytest.mark.parametrize("lens, H, K, V, n_slots, layout", VARLEN)
def test_varlen_is_the_prefill_core_on_each_sequence(lens, H, K, V, n_slots, layout):
    rng = np.random.default_rng(sum(lens))
    N, T = len(lens), sum(lens)
    x, p = _kda_inputs(rng, (1, T), H, K, V), _params(rng, H, K)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = rng.permutation(n_slots)[:N].astype(np.int32)
    states = 0.5 * rng.standard_normal((N, H, K, V))
    pool = _pool(states, slots, n_slots, layout)
    kw = dict(lower_bound=-5.0, scale=None)
    o, new_pool = kda_prefill_varlen(**x, **p, state_pool=pool, cu_seqlens=cu, slots=slots, state_layout=layout,
                                     **kw)
    for n in range(N):
        tokens = slice(cu[n], cu[n + 1])
        seq = {name: a[:, tokens] for name, a in x.items()}
        if lens[n] == 0:
            want_o, want_S = np.zeros((1, 0, H, V)), states[n:n + 1]
        else:
            want_o, want_S = kda.kda_prefill_core(**seq, **p, state=states[n:n + 1], **kw)
        _close(o[:, tokens], want_o, f"o of sequence {n}")
        _close(_as_kv(new_pool[slots[n:n + 1]], layout), want_S, f"state of sequence {n}")
    _assert_untouched(new_pool, pool, slots)


# ---- bad input

def _decode_args(rng, B=2, S=3):
    x, p = _kda_inputs(rng, (B,), 1, 8, 8), _params(rng, 1, 8)
    return dict(**x, **p, state_pool=rng.standard_normal((S, 1, 8, 8)), slots=np.array([0, 2], np.int32)[:B])


@pytest.mark.parametrize("change, message", [
    pytest.param(dict(slots=np.array([0, 3], np.int32)), r"slots: expected slots in -1 \(padded\) or 0..2", id="range"),
    pytest.param(dict(slots=np.array([1, 1], np.int32)), "slots: expected each slot at most once, found slot 1",
                 id="duplicate"),
    pytest.param(dict(slots=np.array([0.0, 1.0])), "slots: expected an integer array", id="float-slots"),
    pytest.param(dict(slots=np.array([0], np.int32)), r"slots: expected \[2\]", id="slots-shape"),
    pytest.param(dict(state_pool=np.zeros((3, 1, 8, 4))), r"state_pool: expected \[\*, 1, 8, 8\]", id="pool-shape"),
    pytest.param(dict(state_layout="kvk"), "state_layout: expected one of", id="layout"),
])
def test_decode_pool_bad_input_is_named(change, message):
    args = {**_decode_args(np.random.default_rng(0)), **change}
    with pytest.raises(ValueError, match=message):
        kda_decode_pool(**args)


def test_decode_pool_names_a_live_slot_holding_nan():
    args = _decode_args(np.random.default_rng(0))
    args["state_pool"][2, 0, 3, 4] = np.nan
    with pytest.raises(ValueError, match=r"state_pool\[2\]: expected finite values"):
        kda_decode_pool(**args)
    args["slots"] = np.array([0, -1], np.int32)                      # slot 2 unused now: its NaN is never read
    assert np.all(np.isfinite(kda_decode_pool(**args)[0]))


@pytest.mark.parametrize("cu, slots, message", [
    pytest.param([0, 3, 2, 5], [0, 1, 2], "cu_seqlens: expected non-decreasing offsets, found 3 then 2", id="drop"),
    pytest.param([1, 3, 5], [0, 1], "cu_seqlens: expected to run from 0 to T=5, found 1 .. 5", id="start"),
    pytest.param([0, 3, 4], [0, 1], "cu_seqlens: expected to run from 0 to T=5, found 0 .. 4", id="end"),
    pytest.param([0, 3, 5], [0, -1], r"slots: expected slots in 0..2", id="padded-sequence"),
    pytest.param([0, 3, 5], [0, 1, 2], r"slots: expected \[2\]", id="slots-count"),
    pytest.param(np.array([0.0, 5.0]), [0], "cu_seqlens: expected an integer array", id="float-cu"),
])
def test_varlen_bad_input_is_named(cu, slots, message):
    rng = np.random.default_rng(0)
    x, p = _kda_inputs(rng, (1, 5), 1, 8, 8), _params(rng, 1, 8)
    with pytest.raises(ValueError, match=message):
        kda_prefill_varlen(**x, **p, state_pool=rng.standard_normal((3, 1, 8, 8)),
                           cu_seqlens=np.asarray(cu) if isinstance(cu, np.ndarray) else np.array(cu, np.int32),
                           slots=np.array(slots, np.int32))


@pytest.mark.parametrize("change, message", [
    pytest.param(dict(weight=np.zeros((5, 4))), r"weight: expected \[4, \*\]", id="weight-channels"),
    pytest.param(dict(weight=np.zeros((4, 1))), "weight: expected a kernel width W >= 2", id="width-1"),
    pytest.param(dict(conv_pool=np.zeros((2, 3, 4))), r"conv_pool: expected \[\*, 4, 3\]", id="pool-layout"),
    pytest.param(dict(layout="cwx"), "layout: expected one of", id="layout"),
])
def test_conv_pool_bad_input_is_named(change, message):
    rng = np.random.default_rng(0)
    args = {**dict(x=rng.standard_normal((2, 4)), weight=rng.standard_normal((4, 4)),
                   conv_pool=rng.standard_normal((2, 4, 3)), slots=np.array([1, -1], np.int32)), **change}
    with pytest.raises(ValueError, match=message):
        kda_conv_pool(**args)


def test_float32_inputs_compute_in_float32_and_keep_the_pool_dtype():
    rng = np.random.default_rng(3)
    args = {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in _decode_args(rng).items()}
    o, pool = kda_decode_pool(**args)
    assert o.dtype == np.float32 and pool.dtype == np.float32
    o64, pool64 = kda_decode_pool(**{k: (v.astype(np.float64) if v.dtype.kind == "f" else v)
                                     for k, v in args.items()})
    assert o64.dtype == np.float64
    np.testing.assert_allclose(o, o64, rtol=1e-4, atol=1e-5)
