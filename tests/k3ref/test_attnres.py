"""k3ref.attnres: the AttnRes softmax mix, the blend lever, and the hub against an explicit depth recurrence."""
from __future__ import annotations

import dataclasses
import math
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3ref import attnres
from k3ref.config import K3Config
from k3ref.cores import reference_cores
from k3ref.cpu_forward import K3CpuModel, forward_prefill
from tests.support.tolerances import effect, rel_rms, tol

# Test-local tolerance rows (name: (value, reason)).
LOCAL_TOL = {
    "hull_slack": (1e-12, "float64 rounding of a convex combination of O(1) values, relative to the range"),
    "boundary_moved_min": (1e-3, "moving one AttnRes block boundary changes h by O(0.1) relative; 1e-3 is far "
                                 "above rounding (1e-15) and far below the effect"),
    "eps_moved_min": (1e-3, "eps 1 against 1e-5 on sources of RMS 0.3 and 3 shrinks one key by ~3x and the other "
                            "by ~5%, moving the mix by O(0.1) relative; a hub that ignored its eps shows 0"),
}


def _ar_loop(sources, proj_w, norm_w, eps=1e-5):
    """AR written per source and per token: softmax over i of (V_i / rms(V_i)) . (norm_w * proj_w), mix V_i."""
    V = np.asarray(sources, np.float64)
    S, D = V.shape[0], V.shape[-1]
    q = [norm_w[d] * np.ravel(proj_w)[d] for d in range(D)]
    flat = V.reshape(S, -1, D)
    out = np.zeros(flat.shape[1:])
    for t in range(flat.shape[1]):
        logits = []
        for i in range(S):
            v = flat[i, t]
            rms = math.sqrt(sum(c * c for c in v) / D + eps)
            logits.append(sum(v[d] / rms * q[d] for d in range(D)))
        m = max(logits)
        w = [math.exp(layer - m) for layer in logits]
        out[t] = sum(w[i] / sum(w) * flat[i, t] for i in range(S))
    return out.reshape(V.shape[1:])


@pytest.mark.parametrize("S, batch, D", [
    pytest.param(1, (), 7, id="S1-D7"),
    pytest.param(2, (3,), 8, id="S2-T3-D8"),
    pytest.param(5, (2, 3), 33, id="S5-B2x3-D33"),
])
def test_softmax_mix_matches_loop(rng, S, batch, D):
    V = rng.standard_normal((S,) + batch + (D,)) * rng.uniform(0.1, 10, size=(S,) + batch + (1,))
    proj_w, norm_w = rng.standard_normal(D), 1 + 0.1 * rng.standard_normal(D)
    got = attnres.attnres_softmax_mix(V, proj_w[None, :], norm_w)       # checkpoint shape [1, D]
    assert got.shape == batch + (D,)
    assert rel_rms(got, _ar_loop(V, proj_w, norm_w)) <= tol("fp64_same_math")


def test_softmax_mix_accepts_a_list_of_sources(rng):
    V = rng.standard_normal((3, 2, 6))
    proj_w, norm_w = rng.standard_normal(6), rng.standard_normal(6)
    from_list = attnres.attnres_softmax_mix(list(V), proj_w, norm_w)
    assert (from_list == attnres.attnres_softmax_mix(V, proj_w, norm_w)).all()


def test_logit_shift_invariance(rng):
    # Sources with equal RMS and an equal component a on axis 0: shifting proj_w along axis 0 adds the same
    # t * a / rms to every logit, which softmax must ignore (even for a huge t). Shifting along axis 1, where
    # the sources differ, must change the output -- so the check can fail.
    S, D, a = 4, 8, 0.7
    rest = rng.standard_normal((S, D - 1))
    rest *= 1.3 / np.linalg.norm(rest, axis=1, keepdims=True)
    V = np.concatenate([np.full((S, 1), a), rest], axis=1)
    proj_w, norm_w = rng.standard_normal(D), 1 + 0.1 * rng.standard_normal(D)
    base = attnres.attnres_softmax_mix(V, proj_w, norm_w)
    for axis, t in ((0, 3.0), (0, 500.0)):
        shifted = proj_w.copy()
        shifted[axis] += t / norm_w[axis]
        assert rel_rms(attnres.attnres_softmax_mix(V, shifted, norm_w), base) <= tol("fp64_same_math")
    moved = proj_w.copy()
    moved[1] += 3.0 / norm_w[1]
    assert rel_rms(attnres.attnres_softmax_mix(V, moved, norm_w), base) > effect("attnres_moved_projection")


def test_one_source_returns_it(rng):
    V = rng.standard_normal((1, 3, 5))
    proj_w, norm_w = rng.standard_normal(5), rng.standard_normal(5)
    assert (attnres.attnres_softmax_mix(V, proj_w, norm_w) == V[0]).all()
    assert rel_rms(attnres.attnres_mix(V, proj_w, norm_w, mix=0.37), V[0]) <= tol("fp64_same_math")  # 0.63 V + 0.37 V


def test_mix_zero_is_the_plain_residual_sum(rng):
    V = rng.standard_normal((4, 2, 9))
    proj_w, norm_w = rng.standard_normal(9), rng.standard_normal(9)
    assert (attnres.attnres_mix(V, proj_w, norm_w, mix=0.0) == V.sum(axis=0)).all()
    assert (attnres.attnres_mix(V, proj_w, norm_w, mix=1.0) == attnres.attnres_softmax_mix(V, proj_w, norm_w)).all()


def test_partial_mix_is_the_blend(rng):
    V = rng.standard_normal((3, 9))
    proj_w, norm_w = rng.standard_normal(9), rng.standard_normal(9)
    want = 0.75 * V.sum(axis=0) + 0.25 * _ar_loop(V, proj_w, norm_w)
    assert rel_rms(attnres.attnres_mix(V, proj_w, norm_w, mix=0.25), want) <= tol("fp64_same_math")


@given(st.integers(1, 6), st.integers(0, 2 ** 32 - 1), st.floats(0.0, 30.0))
def test_softmax_mix_stays_in_the_hull_of_the_sources(S, seed, scale):
    r = np.random.default_rng(seed)
    V = r.standard_normal((S, 5)) * 10
    out = attnres.attnres_softmax_mix(V, scale * r.standard_normal(5), r.standard_normal(5))
    slack = LOCAL_TOL["hull_slack"][0] * (1 + np.abs(V).max())
    assert np.isfinite(out).all()
    assert (out >= V.min(axis=0) - slack).all() and (out <= V.max(axis=0) + slack).all()


# ---- the depth recurrence: the hub against an explicit, from-scratch form --------------------------------

class Toy:
    """A toy decoder: per layer random AttnRes queries and tanh 'mixers'/'MLPs' (so h feeds back into outputs)."""

    def __init__(self, L: int, D: int, seed: int):
        r = np.random.default_rng(seed)
        self.L, self.D = L, D
        self.A = r.standard_normal((L, D, D)) / np.sqrt(D)
        self.F = r.standard_normal((L, D, D)) / np.sqrt(D)
        self.q_attn, self.q_mlp = r.standard_normal((2, L, D))          # proj_w
        self.n_attn, self.n_mlp = 1 + 0.3 * r.standard_normal((2, L, D))  # norm_w
        self.q_out, self.n_out = r.standard_normal(D), 1 + 0.3 * r.standard_normal(D)

    def mixer(self, layer, h):
        return np.tanh(h @ self.A[layer])

    def mlp(self, layer, m):
        return 0.5 * np.tanh(m @ self.F[layer])


def run_hub(toy: Toy, emb, block_size: int):
    """Trajectory (mixer inputs, mlp inputs, final input) through AttnResHub."""
    hub = attnres.AttnResHub(block_size)
    hub.start(emb)
    hs, ms = [], []
    for layer in range(toy.L):
        hs.append(hub.mixer_input(layer, toy.q_attn[layer], toy.n_attn[layer]))
        hub.add_mixer(toy.mixer(layer, hs[-1]))
        ms.append(hub.mlp_input(toy.q_mlp[layer], toy.n_mlp[layer]))
        hub.add_mlp(toy.mlp(layer, ms[-1]))
    return np.array(hs), np.array(ms), hub.final_input(toy.q_out, toy.n_out)


def run_explicit(toy: Toy, emb, is_boundary):
    """The same trajectory from explicitly listed partial sums, recomputed from scratch at every step.

    pieces = [emb, o_0, o_1, ...] with o_j = a_j + f_j. With boundary layers c_1 < c_2 < ..., the block
    committed at c_m is sum(pieces[c_{m-1} + 1 .. c_m]) (c_0 = -1). At layer l: mixer sources = blocks
    committed at c < l, then sum(pieces[last + 1 .. l]); h_l = that partial alone if no block is committed.
    MLP sources = blocks committed at c <= l, then sum(pieces[last + 1 .. l]) + a_l.
    """
    pieces, hs, ms = [emb], [], []

    def sources(upto_layer, partial_extra=None):
        cs = [c for c in range(upto_layer + 1) if is_boundary(c)]
        edges = [-1] + cs
        done = [sum(pieces[edges[m] + 1: edges[m + 1] + 1]) for m in range(len(cs))]
        part = pieces[edges[-1] + 1: len(pieces)]
        if partial_extra is not None:
            part = part + [partial_extra]
        return done, sum(part)

    for layer in range(toy.L):
        done, part = sources(layer - 1)
        hs.append(part if not done else _ar_loop(np.array(done + [part]), toy.q_attn[layer], toy.n_attn[layer]))
        a = toy.mixer(layer, hs[-1])
        done, part = sources(layer, partial_extra=a)
        ms.append(_ar_loop(np.array(done + [part]), toy.q_mlp[layer], toy.n_mlp[layer]))
        pieces.append(a + toy.mlp(layer, ms[-1]))
    done, part = sources(toy.L - 1)
    return np.array(hs), np.array(ms), _ar_loop(np.array(done + [part]), toy.q_out, toy.n_out)


DEPTH_CASES = [
    pytest.param(8, 3, (), id="L8-B3"),
    pytest.param(7, 2, (2,), id="L7-B2-T2"),
    pytest.param(9, 4, (), id="L9-B4"),
    pytest.param(4, 1, (), id="L4-B1"),
]


@pytest.mark.parametrize("L, B, batch", DEPTH_CASES)
def test_hub_matches_explicit_recurrence(L, B, batch):
    assert L > 2 * B or B == 1                                # at least two boundaries after the embedding
    toy = Toy(L, 6, seed=L * 10 + B)
    emb = np.random.default_rng(B).standard_normal(batch + (6,))
    got = run_hub(toy, emb, B)
    want = run_explicit(toy, emb, lambda layer: layer % B == 0)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert rel_rms(g, w) <= tol("fp64_same_math")


@pytest.mark.parametrize("shift", [pytest.param(-1, id="boundary-minus-1"), pytest.param(1, id="boundary-plus-1")])
def test_explicit_recurrence_notices_a_moved_boundary(shift):
    # the same comparison as above, against a recurrence whose block boundaries sit one layer off
    toy = Toy(8, 6, seed=83)
    emb = np.random.default_rng(3).standard_normal(6)
    got = run_hub(toy, emb, 3)
    want = run_explicit(toy, emb, lambda layer: (layer + shift) % 3 == 0)
    assert rel_rms(got[0], want[0]) > LOCAL_TOL["boundary_moved_min"][0]


def test_hub_commits_at_block_starts():
    hub = attnres.AttnResHub(3)
    hub.start(np.ones(4))
    counts = []
    for layer in range(7):
        hub.mixer_input(layer, np.ones(4), np.ones(4))
        counts.append(len(hub.blocks))
        hub.add_mixer(np.ones(4))
        hub.mlp_input(np.ones(4), np.ones(4))
        hub.add_mlp(np.ones(4))
    assert counts == [1, 1, 1, 2, 2, 2, 3]
    assert (hub.blocks[1] == 6.0).all() and (hub.prefix == 2.0).all()  # layers 0..2 output 2 each


def test_hub_calls_the_core_with_the_sources():
    calls = []

    def core(sources, proj_w, norm_w, mix=1.0, eps=1e-5):
        calls.append((sources.shape[0], mix))
        return sources.sum(axis=0)

    hub = attnres.AttnResHub(2)
    hub.start(np.ones((3, 4)))
    cores = types.SimpleNamespace(attnres_mix=core)
    for layer in range(3):
        hub.mixer_input(layer, np.ones(4), np.ones(4), mix=0.5, cores=cores)
        hub.add_mixer(np.ones((3, 4)))
        hub.mlp_input(np.ones(4), np.ones(4), mix=0.5, cores=cores)
        hub.add_mlp(np.ones((3, 4)))
    hub.final_input(np.ones(4), np.ones(4), mix=0.5, cores=cores)
    # l0: mixer = embedding (no core), mlp [emb, a0]; l1: [emb, p], [emb, p]; l2 commits: [emb, p], [emb, B1, a2]
    assert calls == [(2, 0.5), (2, 0.5), (2, 0.5), (2, 0.5), (3, 0.5), (3, 0.5)]


def _mlp_mix(hub, sources, proj_w, norm_w):
    """The hub's first MLP input: AR([embedding, mixer output]) after layer 0 committed the embedding."""
    hub.start(sources[0])
    hub.mixer_input(0, proj_w, norm_w)
    hub.add_mixer(sources[1])
    return hub.mlp_input(proj_w, norm_w)


def test_hub_mixes_with_its_eps(rng):
    """The hub's keys use the eps it was built with (the config's rms_norm_eps), not the core's default."""
    D = 8
    sources = np.stack([0.3 * rng.standard_normal((2, D)), 3.0 * rng.standard_normal((2, D))])
    proj_w, norm_w = rng.standard_normal(D), 1.0 + 0.1 * rng.standard_normal(D)
    got = _mlp_mix(attnres.AttnResHub(1, eps=1.0), sources, proj_w, norm_w)
    np.testing.assert_array_equal(got, attnres.attnres_mix(sources, proj_w, norm_w, eps=1.0))
    default = _mlp_mix(attnres.AttnResHub(1), sources, proj_w, norm_w)
    assert rel_rms(got, default) > LOCAL_TOL["eps_moved_min"][0]
    assert attnres.AttnResHub(1, eps=1.0).copy().eps == 1.0


def test_host_graph_hub_uses_the_config_eps():
    """Every AttnRes mix of a forward pass gets the config's rms_norm_eps (the spec's AttnRes RMSNorm eps)."""
    cfg = dataclasses.replace(K3Config.preset("tiny"), rms_norm_eps=1e-2)
    seen = []

    def mix(sources, proj_w, norm_w, mix=1.0, eps=1e-5):
        seen.append(eps)
        return attnres.attnres_mix(sources, proj_w, norm_w, mix, eps)

    model = K3CpuModel.synthetic(cfg, seed=7)
    cache = model.new_cache()
    cores = reference_cores().replace(attnres_mix=mix)
    forward_prefill(model, [5, 17, 3], cache, seq=cache.add_sequence(), cores=cores)
    assert seen and set(seen) == {1e-2}


def test_hub_copy_is_independent():
    hub = attnres.AttnResHub(2)
    hub.start(np.ones(4))
    hub.mixer_input(0, np.ones(4), np.ones(4))
    hub.add_mixer(np.ones(4))
    twin = hub.copy()
    hub.add_mlp(np.full(4, 5.0))
    assert (twin.prefix == 1.0).all() and (hub.prefix == 6.0).all() and len(twin.blocks) == 1


@pytest.mark.parametrize("call, needle", [
    pytest.param(lambda: attnres.attnres_softmax_mix(np.ones(4), np.ones(4), np.ones(4)), "sources", id="rank1"),
    pytest.param(lambda: attnres.attnres_softmax_mix(np.ones((2, 4)), np.ones((2, 4)), np.ones(4)), "proj_w",
                 id="proj-2-rows"),
    pytest.param(lambda: attnres.attnres_softmax_mix(np.ones((2, 4)), np.ones(4), np.ones(5)), "norm_w",
                 id="norm-width"),
    pytest.param(lambda: attnres.attnres_blend(np.ones(3), np.ones(4), 0.5), "mixed", id="blend-shape"),
    pytest.param(lambda: attnres.AttnResHub(0), "block_size", id="block-size-0"),
    pytest.param(lambda: attnres.AttnResHub(2, eps=0.0), "eps", id="eps-0"),
    pytest.param(lambda: attnres.AttnResHub(2).mlp_input(np.ones(4), np.ones(4)), "start", id="mlp-before-start"),
])
def test_bad_input_raises(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()
