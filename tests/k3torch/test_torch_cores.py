"""The PyTorch baseline (conformance.backends): agreement with k3ref, bf16/fp32 error budgets, mutants.

The torch cores are a second implementation written from docs/spec.md; in float64 they must agree with the
k3ref cores to rounding on fresh random inputs. In bf16 and fp32 their error against the float64 reference is
measured and capped (the caps below are data: measured value and reason). A deliberately wrong torch core
must fail the same agreement comparison, which shows the comparison can catch each mistake.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.strict import import_or_skip  # noqa: E402

torch = import_or_skip("torch")

from conformance.backends import builtin  # noqa: E402
from conformance.backends import pytorch as torch_backend  # noqa: E402
from conformance.backends.pytorch import torch_cores  # noqa: E402
from k3ref import checks as ref_checks  # noqa: E402
from k3ref.cache import paged_latent_cache  # noqa: E402
from k3ref.cores import reference_cores  # noqa: E402
from k3ref.mla import check_decode_args  # noqa: E402
from k3torch import checks  # noqa: E402
from k3torch.bundle import torch_core  # noqa: E402
from tests.support.tolerances import rel_rms  # noqa: E402

pytestmark = pytest.mark.torch

# name: (relative-RMS tolerance, reason)
AGREE_TOL: dict[str, tuple[float, str]] = {
    "fp64_agreement": (1e-10, "two independent float64 implementations (NumPy k3ref, torch) of one formula; the "
                              "longest path is a 200-token KDA recurrence vs a chunked WY solve"),
}

# core: (cap on relative RMS vs the float64 reference, measured value, reason). Measured on the
# BUDGET_CASES below (seed 0, CPU); a cap is ~2.5x the measurement: bf16 keeps 8 significant bits (unit
# roundoff 2^-8 = 3.9e-3), one rounding of normal data costs 1.7e-3 relative RMS, and roundings that partly
# average out inside a core land at 2-4e-3.
BF16_CAP: dict[str, tuple[float, float, str]] = {
    "rmsnorm": (8e-3, 3.5e-3, "x, w, the normalised x and the output each rounded to bf16"),
    "situ_glu": (6e-3, 2.1e-3, "gate and up rounded to bf16 (the up softcap is near-linear, so its rounding "
                               "passes through) and the output rounded"),
    "kda_decode": (8e-3, 2.6e-3, "q, k, v, g_raw, beta_raw rounded to bf16; state and gate fp32; o rounded"),
    "kda_prefill": (1e-2, 3.6e-3, "as kda_decode over 65 tokens; the error grows only mildly along the "
                                  "sequence (2.6e-3 for one token)"),
    "mla_decode": (8e-3, 3.0e-3, "q_abs and cache rounded to bf16, probabilities rounded to bf16 for the PV "
                                 "product (FlashMLA), o_lat rounded"),
    "mxfp4_gemv": (5e-3, 1.6e-3, "only x is rounded (E2M1 x 2^e weights are bf16-exact); fp32 accumulation "
                                 "and an unrounded fp32 result"),
    "moe_route": (2e-7, 4.5e-8, "the router stays fp32 in K3 (logits and bias are not rounded): only fp32 "
                                "rounding of the sigmoid and the renormalisation"),
    "attnres_mix": (8e-3, 2.6e-3, "sources and weights rounded to bf16, fp32 softmax mix, output rounded"),
}

# core: (cap on relative RMS vs the float64 reference, measured value, reason); same cases, fp32 unit
# roundoff 6e-8.
FP32_CAP: dict[str, tuple[float, float, str]] = {
    "rmsnorm": (3e-7, 6.7e-8, "a mean of squares and one rsqrt per row"),
    "situ_glu": (3e-7, 6.2e-8, "three transcendental nonlinearities per element"),
    "kda_decode": (5e-7, 9.0e-8, "gate exp/sigmoid, L2 norms and one rank-1 state update"),
    "kda_prefill": (5e-6, 1.4e-6, "a unit-triangular 64x64 solve per chunk amplifies fp32 rounding with the "
                                  "chunk length; k3ref's own float32 chunked form errs 1.0e-6 on these inputs"),
    "mla_decode": (1e-6, 2.2e-7, "dot products over 576-wide rows and a softmax over <= 130 positions"),
    "mxfp4_gemv": (1e-6, 1.6e-7, "exact dequantisation; dot products over K = 256"),
    "moe_route": (2e-7, 4.5e-8, "sigmoid and a renormalising division in fp32"),
    "attnres_mix": (1e-6, 2.4e-7, "RMS keys, a softmax over 4 sources and a weighted sum"),
}

def reference(core: str) -> Callable:
    """The k3ref core of that name (docs/interfaces.md)."""
    return getattr(reference_cores(), core)


# ------------------------------------------------------------------------------------------- input makers


def make_rmsnorm(rng, lead=(3,), D=203):
    return dict(x=rng.normal(size=lead + (D,)) * 2.0, w=1 + 0.1 * rng.normal(size=D), eps=1e-5)


def make_situ_glu(rng, lead=(2,), width=113):
    # gate spans the softcap-4 knee, up the softcap-25 knee.
    return dict(gate=rng.normal(size=lead + (width,)) * 5.0, up=rng.normal(size=lead + (width,)) * 30.0)


def _kda_tensors(rng, lead, H, K, V, tiny_head):
    q, k = rng.normal(size=lead + (H, K)), rng.normal(size=lead + (H, K))
    if tiny_head:   # one head with |q|, |k| ~ sqrt(eps): the L2 eps visibly matters there
        q[..., 0, :] *= 1e-3
        k[..., 0, :] *= 1e-3
    return dict(q=q, k=k, v=rng.normal(size=lead + (H, V)), g_raw=rng.normal(size=lead + (H, K)),
                beta_raw=rng.normal(size=lead + (H,)), A_log=np.log(rng.uniform(1, 16, size=H)),
                dt_bias=rng.normal(size=H * K))


def make_kda_decode(rng, B=2, H=3, K=16, V=12, lower_bound=-5.0, tiny_head=True):
    d = _kda_tensors(rng, (B,), H, K, V, tiny_head)
    return dict(d, state=0.3 * rng.normal(size=(B, H, K, V)), lower_bound=lower_bound)


def make_kda_prefill(rng, B=2, T=65, H=3, K=16, V=12, lower_bound=-5.0, tiny_head=True, at_bound=False):
    d = _kda_tensors(rng, (B, T), H, K, V, tiny_head)
    if at_bound:    # sigma(exp(A_log) * 60) = 1: every gate at the lower bound (cumulative -5 per step)
        d["g_raw"] = np.full_like(d["g_raw"], 60.0)
    return dict(d, state=0.3 * rng.normal(size=(B, H, K, V)), lower_bound=lower_bound)


def make_mla_decode(rng, seq_lens=(65, 1), H=3, R=32, P=8, page=16):
    """A page pool shuffled across sequences; unused slots NaN-poisoned (they must never be read)."""
    B, W = len(seq_lens), R + P
    cache, table = paged_latent_cache(rng, seq_lens, W, page, spare_pages=2)
    return dict(q_abs=rng.normal(size=(B, H, W)) * 0.5, kv_cache=cache, block_table=table,
                seq_lens=np.asarray(seq_lens, dtype=np.int32), scale=1 / math.sqrt(192), kv_rank=R)


def make_mxfp4_gemv(rng, N=37, K=256, lead=(2,)):
    return dict(packed=rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8),
                scale=rng.integers(118, 134, size=(N, K // 32), dtype=np.uint8),
                x=rng.normal(size=lead + (K,)))


def make_moe_route(rng, T=5, E=64, top_k=6, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
    return dict(logits=rng.normal(size=(T, E)) * 2.0, bias=rng.normal(size=E) * 0.3, top_k=top_k,
                n_group=n_group, topk_group=topk_group, renormalize=renormalize, scaling=scaling)


def make_attnres_mix(rng, S=4, lead=(3,), D=113, mix=1.0, proj_2d=False):
    proj = rng.normal(size=(1, D) if proj_2d else D) * 0.3
    scales = rng.uniform(0.5, 3, size=(S,) + (1,) * (len(lead) + 1))     # sources of different magnitude
    return dict(sources=rng.normal(size=(S,) + lead + (D,)) * scales, proj_w=proj,
                norm_w=1 + 0.1 * rng.normal(size=D), mix=mix)


@dataclasses.dataclass(frozen=True)
class Case:
    core: str            # the core name (docs/interfaces.md)
    make: Callable       # rng -> the core's keyword arguments
    seed: int = 0        # each case draws fresh inputs from its own seed


def case(core, cid, seed=0, **shape):
    maker = globals()[f"make_{core}"]
    return pytest.param(Case(core, lambda rng: maker(rng, **shape), seed), id=f"{core}-{cid}")


AGREEMENT_CASES = [
    case("rmsnorm", "L3-D203"),
    case("rmsnorm", "L2x1-D7168", 1, lead=(2, 1), D=7168),
    case("rmsnorm", "D1", 2, lead=(), D=1),
    case("situ_glu", "L2-I113"),
    case("situ_glu", "L1x3-I33", 1, lead=(1, 3), width=33),
    case("kda_decode", "B2-H3-K16-V12"),
    case("kda_decode", "B1-H1-K128-V128", 1, B=1, H=1, K=128, V=128, tiny_head=False),
    case("kda_decode", "B3-H2-K8-V5-softplus", 2, B=3, H=2, K=8, V=5, lower_bound=None),
    case("kda_prefill", "B2-T65-H3-K16-V12"),
    case("kda_prefill", "B1-T1-H2-K8-V8", 1, B=1, T=1, H=2, K=8, V=8),
    case("kda_prefill", "B1-T200-H1-K32-V16-bound", 2, B=1, T=200, H=1, K=32, V=16, at_bound=True),
    case("kda_prefill", "B2-T63-H2-K16-V8-softplus", 3, B=2, T=63, H=2, K=16, V=8, lower_bound=None),
    case("mla_decode", "L65,1-H3-page16"),
    case("mla_decode", "L130,64,3-H4-R512-P64-page64", 1, seq_lens=(130, 64, 3), H=4, R=512, P=64, page=64),
    case("mla_decode", "L1-H1", 2, seq_lens=(1,), H=1),
    case("mxfp4_gemv", "N37-K256"),
    case("mxfp4_gemv", "N1-K32-vec", 1, N=1, K=32, lead=()),
    case("moe_route", "T5-E64-k6"),
    case("moe_route", "T7-E64-k8-g8-tg3", 1, T=7, top_k=8, n_group=8, topk_group=3),
    case("moe_route", "T3-E9-k9-norenorm-s2.5", 2, T=3, E=9, top_k=9, renormalize=False, scaling=2.5),
    case("attnres_mix", "S4-L3-D113"),
    case("attnres_mix", "S1-L2x2-D33-mix0.5", 1, S=1, lead=(2, 2), D=33, mix=0.5, proj_2d=True),
    case("attnres_mix", "S5-L1-D64-mix0", 2, S=5, lead=(1,), D=64, mix=0.0),
]

# One representative case per core for the bf16 / fp32 error budgets.
BUDGET_CASES = [
    case("rmsnorm", "L3-D203"),
    case("situ_glu", "L2-I113"),
    case("kda_decode", "B2-H3-K16-V12", tiny_head=False),
    case("kda_prefill", "B2-T65-H3-K16-V12", tiny_head=False),
    case("mla_decode", "L130,64,3-H4-R512-P64-page64", seq_lens=(130, 64, 3), H=4, R=512, P=64, page=64),
    case("mxfp4_gemv", "N37-K256"),
    case("moe_route", "T5-E64-k6"),
    case("attnres_mix", "S4-L3-D113"),
]


def outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def compare(core: str, got, ref) -> float:
    """Largest relative RMS error over a core's float outputs; integer outputs (router indices) must be equal
    (a differing selection returns inf)."""
    worst = 0.0
    for g, r in zip(outputs(got), outputs(ref), strict=True):
        assert np.shape(g) == np.shape(r), f"{core}: shape {np.shape(g)} != reference {np.shape(r)}"
        if np.asarray(r).dtype.kind in "iu":
            if not np.array_equal(g, r):
                return math.inf
            continue
        worst = max(worst, rel_rms(g, r))
    return worst


def run_case(c: Case, fn):
    return fn(**c.make(np.random.default_rng(c.seed)))


# ------------------------------------------------------------------------------------------- agreement


@pytest.mark.parametrize("c", AGREEMENT_CASES)
def test_fp64_torch_agrees_with_reference(c):
    ref = run_case(c, reference(c.core))
    got = run_case(c, getattr(torch_cores(torch.float64), c.core))
    for g in outputs(got):
        assert g.dtype in (np.float64, np.int64), f"{c.core}: float64 core returned {g.dtype}"
    err = compare(c.core, got, ref)
    assert err <= AGREE_TOL["fp64_agreement"][0], f"{c.core}: torch float64 vs k3ref rel RMS {err:.3g}"


@pytest.mark.parametrize("c", BUDGET_CASES)
@pytest.mark.parametrize("dtype, caps", [
    pytest.param("bfloat16", BF16_CAP, id="bf16"),
    pytest.param("float32", FP32_CAP, id="fp32"),
])
def test_low_precision_error_within_cap(c, dtype, caps):
    ref = run_case(c, reference(c.core))
    got = run_case(c, getattr(torch_cores(getattr(torch, dtype)), c.core))
    assert all(g.dtype in (np.float32, np.int64) for g in outputs(got)), f"{c.core}: {dtype} must return float32"
    err = compare(c.core, got, ref)
    cap, measured, why = caps[c.core]
    assert 0.0 < err <= cap, (f"{c.core} {dtype}: rel RMS {err:.3g} vs float64; cap {cap:g} ({why}); "
                              f"measured {measured:g}")


# ------------------------------------------------------------------------------------------- mutants


def _fixed(core: Callable, **fixed) -> Callable:
    """A core that ignores the caller's value for the `fixed` keyword arguments."""
    return lambda **kw: core(**{**kw, **fixed})


@dataclasses.dataclass(frozen=True)
class Mutant:
    core: str                        # which core is wrong
    build: Callable[[], Callable]    # -> the wrong torch core (float64)
    make: Callable                   # rng -> inputs that expose it


MUTANTS = [
    pytest.param(Mutant("kda_decode", lambda: torch_core("kda_decode", _l2_eps=1e-12), make_kda_decode),
                 id="kda_decode-l2-eps-1e-12"),
    pytest.param(Mutant("kda_decode", lambda: _fixed(torch_core("kda_decode"), lower_bound=None),
                        make_kda_decode), id="kda_decode-no-lower-bound"),
    pytest.param(Mutant("kda_prefill", lambda: torch_core("kda_prefill", _l2_eps=1e-12), make_kda_prefill),
                 id="kda_prefill-l2-eps-1e-12"),
    pytest.param(Mutant("mla_decode", lambda: _fixed(torch_core("mla_decode"), scale=1 / math.sqrt(128)),
                        make_mla_decode), id="mla_decode-scale-1/sqrt(128)"),
    pytest.param(Mutant("moe_route", lambda: torch_core("moe_route", _bias_in_weights=True), make_moe_route),
                 id="moe_route-bias-in-weights"),
    pytest.param(Mutant("mxfp4_gemv", lambda: torch_core("mxfp4_gemv", _high_nibble_first=True),
                        make_mxfp4_gemv), id="mxfp4_gemv-nibbles-swapped"),
]


@pytest.mark.parametrize("m", MUTANTS)
def test_mutant_fails_agreement(m):
    """The wrong core fails the agreement comparison on inputs where the right one passes it."""
    inputs = m.make(np.random.default_rng(7))
    ref = reference(m.core)(**inputs)
    tol = AGREE_TOL["fp64_agreement"][0]
    assert compare(m.core, torch_core(m.core)(**inputs), ref) <= tol, "control: the correct core must agree"
    err = compare(m.core, m.build()(**inputs), ref)
    assert err > tol, f"mutant {m.core} agrees with the reference (rel RMS {err:.3g}): the check cannot catch it"


# ------------------------------------------------------------------------------------------- torch's own forms


@given(T=st.integers(1, 70), H=st.integers(1, 3), softplus=st.booleans(), seed=st.integers(0, 2**16))
def test_kda_prefill_chunked_equals_decode_steps(T, H, softplus, seed):
    """The torch chunked form == the torch one-token form applied T times (output and final state)."""
    inputs = make_kda_prefill(np.random.default_rng(seed), B=1, T=T, H=H, K=8, V=4,
                              lower_bound=None if softplus else -5.0)
    o, S = torch_core("kda_prefill")(**inputs)
    step = torch_core("kda_decode")
    state, outs = inputs["state"], []
    per_token = ("q", "k", "v", "g_raw", "beta_raw")
    for t in range(T):
        ot, state = step(**{**inputs, **{n: inputs[n][:, t] for n in per_token}, "state": state})
        outs.append(ot)
    tol = AGREE_TOL["fp64_agreement"][0]
    assert rel_rms(o, np.stack(outs, axis=1)) <= tol
    assert rel_rms(S, state) <= tol


def test_fp32_prefill_stays_finite_with_every_gate_at_the_lower_bound():
    """Two chunks with cumulative log-decay -5 per step (-320 per chunk): decay ratios must never overflow."""
    inputs = make_kda_prefill(np.random.default_rng(3), B=1, T=128, H=2, K=16, V=8, at_bound=True)
    o32, S32 = torch_core("kda_prefill", torch.float32)(**inputs)
    o64, S64 = torch_core("kda_prefill")(**inputs)
    assert np.all(np.isfinite(o32)) and np.all(np.isfinite(S32))
    assert rel_rms(o32, o64) <= FP32_CAP["kda_prefill"][0]


def test_mxfp4_e8m0_255_gives_nan_rows():
    inputs = make_mxfp4_gemv(np.random.default_rng(4), N=3, K=64, lead=())
    inputs["scale"][1, 1] = 255
    y = torch_core("mxfp4_gemv")(**inputs)
    assert np.isnan(y[1]) and np.all(np.isfinite(y[[0, 2]]))


def test_mxfp4_low_nibble_is_the_even_element():
    """Byte 0x21 holds code 1 (0.5) in element 0 and code 2 (1.0) in element 1; scale 127 is 2^0."""
    packed = np.zeros((1, 16), dtype=np.uint8)
    packed[0, 0] = 0x21
    scale = np.full((1, 1), 127, dtype=np.uint8)
    x = np.zeros(32)
    x[0], x[1] = 1.0, 10.0
    assert torch_core("mxfp4_gemv")(packed, scale, x)[0] == pytest.approx(0.5 * 1.0 + 1.0 * 10.0)


# ------------------------------------------------------------------------------------------- bad input


BAD_INPUTS = [
    pytest.param("rmsnorm", lambda d: {**d, "w": d["w"][:-1]}, "w", id="rmsnorm-w-length"),
    pytest.param("situ_glu", lambda d: {**d, "up": d["up"][..., :-1]}, "up", id="situ_glu-up-shape"),
    pytest.param("kda_decode", lambda d: {**d, "state": d["state"][..., :-1]}, "state", id="kda_decode-state"),
    pytest.param("kda_decode", lambda d: {**d, "A_log": np.zeros(7)}, "A_log", id="kda_decode-A_log"),
    pytest.param("kda_prefill", lambda d: {**d, "q": d["q"][0]}, "q", id="kda_prefill-q-rank"),
    pytest.param("kda_prefill", lambda d: {**d, "v": np.full_like(d["v"], np.nan)}, "v", id="kda_prefill-v-nan"),
    pytest.param("mla_decode", lambda d: {**d, "seq_lens": d["seq_lens"] + 1000}, "seq_lens",
                 id="mla_decode-seq-too-long"),
    pytest.param("mla_decode", lambda d: {**d, "block_table": np.full_like(d["block_table"], 99)},
                 "block_table", id="mla_decode-page-out-of-pool"),
    pytest.param("mxfp4_gemv", lambda d: {**d, "packed": d["packed"].astype(np.int16)}, "packed",
                 id="mxfp4_gemv-dtype"),
    pytest.param("mxfp4_gemv", lambda d: {**d, "x": d["x"][..., :-1]}, "x", id="mxfp4_gemv-x-length"),
    pytest.param("moe_route", lambda d: {**d, "top_k": 65}, "top_k", id="moe_route-top_k"),
    pytest.param("moe_route", lambda d: {**d, "n_group": 5}, "n_group", id="moe_route-n_group"),
    pytest.param("attnres_mix", lambda d: {**d, "norm_w": d["norm_w"][:-1]}, "norm_w", id="attnres_mix-norm_w"),
]


@pytest.mark.parametrize("core, spoil, name", BAD_INPUTS)
def test_bad_input_raises_naming_the_argument(core, spoil, name):
    inputs = spoil(globals()[f"make_{core}"](np.random.default_rng(5)))
    with pytest.raises(ValueError, match=name):
        torch_core(core)(**inputs)


# k3torch keeps its own copy of the input rules (it imports nothing of k3ref): the same argument must get the
# same answer from both, and a bad one the same message word for word.
CHECK_CALLS = [
    pytest.param("as_float", ("x", np.array([1, 2], dtype=complex)), {}, id="as_float-complex"),
    pytest.param("as_float", ("x", np.array([[0.0, np.inf]])), {}, id="as_float-inf"),
    pytest.param("as_float", ("x", np.array([np.nan, 2.0])), {"allow_nan": True}, id="as_float-nan-allowed"),
    pytest.param("as_float", ("x", np.array([1, 2], dtype=np.int16)), {}, id="as_float-int-widened"),
    pytest.param("check_shape", ("q", np.zeros((2, 3)), ("B", "T", "H")), {}, id="check_shape-rank"),
    pytest.param("check_shape", ("q", np.zeros((2, 3)), ("B", "B")), {}, id="check_shape-named"),
    pytest.param("check_shape", ("w", np.zeros(5), (4,)), {}, id="check_shape-exact"),
    pytest.param("check_shape", ("v", np.zeros((2, 3, 4)), (2, None, "V")), {}, id="check_shape-fits"),
    pytest.param("require", (False, "top_k: expected 1..8, found 9"), {}, id="require"),
]


def _answer(fn: Callable, *args, **kwargs) -> tuple[str, object]:
    try:
        return "returned", fn(*args, **kwargs)
    except ValueError as e:
        return "ValueError", str(e)


@pytest.mark.parametrize("check, args, kwargs", CHECK_CALLS)
def test_input_checks_answer_as_the_reference_checks_do(check, args, kwargs):
    mine = _answer(getattr(checks, check), *args, **kwargs)
    ref = _answer(getattr(ref_checks, check), *args, **kwargs)
    assert mine[0] == ref[0], f"{check}: k3torch {mine}, k3ref {ref}"
    if mine[0] == "ValueError":
        assert mine[1] == ref[1]
    else:
        assert np.array_equal(np.asarray(mine[1]), np.asarray(ref[1]), equal_nan=True)
        assert np.asarray(mine[1]).dtype == np.asarray(ref[1]).dtype


def _poison_a_used_row(d):
    cache = d["kv_cache"].copy()
    cache[d["block_table"][0, 0], 0, 0] = np.nan
    return {**d, "kv_cache": cache}


MLA_SPOILS = [
    pytest.param(lambda d: d, id="valid"),
    pytest.param(lambda d: {**d, "seq_lens": d["seq_lens"] + 1000}, id="seq-too-long"),
    pytest.param(lambda d: {**d, "block_table": np.full_like(d["block_table"], 99)}, id="page-out-of-pool"),
    pytest.param(lambda d: {**d, "block_table": d["block_table"].astype(float)}, id="block-table-float"),
    pytest.param(lambda d: {**d, "seq_lens": d["seq_lens"][:1]}, id="seq-lens-length"),
    pytest.param(lambda d: {**d, "q_abs": d["q_abs"][0]}, id="q-rank"),
    pytest.param(lambda d: {**d, "kv_cache": d["kv_cache"][..., :-1]}, id="cache-width"),
    pytest.param(lambda d: {**d, "kv_rank": 0}, id="kv-rank-0"),
    pytest.param(lambda d: {**d, "scale": -1.0}, id="scale-negative"),
    pytest.param(_poison_a_used_row, id="nan-in-a-used-row"),
]


@pytest.mark.parametrize("spoil", MLA_SPOILS)
def test_mla_decode_checks_answer_as_the_reference_checks_do(spoil):
    d = spoil(make_mla_decode(np.random.default_rng(8)))
    args = (d["q_abs"], d["kv_cache"], np.asarray(d["block_table"]), np.asarray(d["seq_lens"]))
    mine = _answer(checks.check_mla_decode_args, *args, scale=d["scale"], kv_rank=d["kv_rank"])
    ref = _answer(check_decode_args, *args, scale=d["scale"], kv_rank=d["kv_rank"])
    assert mine[0] == ref[0], f"k3torch {mine}, k3ref {ref}"
    if mine[0] == "ValueError":
        assert mine[1] == ref[1]


def test_unknown_dtype_and_core_raise():
    with pytest.raises(ValueError, match="dtype"):
        torch_cores(torch.float16)
    with pytest.raises(ValueError, match="core"):
        torch_core("kda_decodee")


# ------------------------------------------------------------------------------------------- backend


@pytest.mark.parametrize("name, precision", [
    pytest.param("torch", "fp32", id="torch"),
    pytest.param("torch-bf16", "bf16", id="torch-bf16"),
    pytest.param("torch64", "fp64", id="torch64"),
])
def test_backend_protocol(name, precision):
    be = torch_backend.make_backend(name, device="cpu")
    ok, why = be.available()
    assert ok, why
    assert (be.name, be.precision) == (name, precision)
    inputs = make_rmsnorm(np.random.default_rng(6))
    want = reference("rmsnorm")(**inputs)
    got = be.cores().rmsnorm(**inputs)
    assert got.dtype == (np.float64 if precision == "fp64" else np.float32)
    assert rel_rms(got, want) <= BF16_CAP["rmsnorm"][0]
    seconds = be.time_core("rmsnorm", inputs)
    assert 0 < seconds < 1.0
    assert be.time_core("attnres_hub", {"block_size": 3}) is None


def test_backend_copy_bandwidth_is_positive():
    be = torch_backend.TorchBackend("torch", device="cpu", warmup=1, repeats=3)
    bw = be.copy_bandwidth(nbytes=8 << 20)
    assert 1e8 < bw < 1e13, f"copy bandwidth {bw:.3g} B/s is implausible for a CPU"


def test_backend_unavailable_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)    # `import torch` now raises ImportError
    be = torch_backend.make_backend("torch-bf16", device="cpu")
    ok, why = be.available()
    assert not ok and "not installed" in why
    with pytest.raises(RuntimeError, match="unavailable"):
        be.cores()


def test_backend_unknown_name_and_missing_gpu():
    with pytest.raises(ValueError, match="torch-bf16"):
        torch_backend.make_backend("torch16")
    if not torch.cuda.is_available():
        ok, why = torch_backend.make_backend("torch", device="cuda").available()
        assert not ok and "no CUDA" in why


def test_attnres_hub_comes_from_base():
    base = reference_cores()  # any Cores works as a base; its hub factory is a marker here
    marker = object()
    cores = torch_cores(torch.float64, base=dataclasses.replace(base, attnres_hub=lambda block_size: (marker,
                                                                                                      block_size)))
    assert cores.attnres_hub(3) == (marker, 3)
    assert torch_cores(torch.float64).attnres_hub is reference_cores().attnres_hub


def test_runner_backend_pins_torch_to_one_thread(monkeypatch):
    """The runner's torch backends run torch on one intra-op thread (OpenMP threads stall on busy shared cores)."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    ok, why = builtin.torch_loader("torch")().available()            # the loader, not the per-process cache
    assert ok, why
    assert calls == [1]
