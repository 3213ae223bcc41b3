"""The data of the core cases: seeded float64 builders, one per block, each returning (inputs, kwargs).

Two draws per block. The toy draws (the committed `tiny` and the `small` goldens; their bytes must not change)
expose known bugs at toy magnitudes: a KDA head with tiny-norm q/k (the L2 eps decides its output), gate
pre-activations that saturate at the lower bound, a router bias that changes the selection while keeping the
k-th and (k+1)-th scores apart by more than bf16 rounding, random MXFP4 bytes (never nibble symmetric), MLA
pages in a shuffled order with unused slots and pages full of NaN, odd sizes everywhere.

The k3 draws (param `draw="k3"`, the `k3` and `k3-tp8` shape sets) keep those traps and draw the rest at K3's
magnitudes (conformance.cases.magnitudes): activations at the scale and with the outliers a real layer
produces, KDA gates covering (lower_bound, 0) with long runs at the bound, a decode state built by the float64
reference over a long drawn history, router scores of 896 experts with realistic top-16 margins.
"""
from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

from conformance.cases import magnitudes as mag
from conformance.cases.inputs import cast
from conformance.cases.routes import route_stable
from k3ref import kda, ops
from k3ref.cache import paged_latent_cache
from k3ref.latent_moe import sigmoid_topk

# ---- toy draws (tiny, small)


def _rmsnorm(rng, T, D, eps):
    x = rng.standard_normal((T, D)) * mag.ten_to(rng.uniform(-1, 1, (T, 1)))
    x[0] *= 1e-3          # a row whose mean square is ~1e-6: the eps is not negligible there
    return {"x": x, "w": 1.0 + 0.1 * rng.standard_normal(D)}, {"eps": eps}


def _situ_glu(rng, shape, beta=4.0, linear_beta=25.0):
    # gate spread ~3 reaches the SiTU softcap (4); up spread ~20 reaches the linear softcap (25)
    return {"gate": 3.0 * rng.standard_normal(shape), "up": 20.0 * rng.standard_normal(shape)}, \
        {"beta": beta, "linear_beta": linear_beta}


def _kda_arrays(rng, lead: tuple, H: int, K: int, V: int):
    """q, k, v, g_raw, beta_raw with axes lead + (H, ...): one tiny-norm head, saturated gates."""
    q = rng.standard_normal(lead + (H, K))
    k = rng.standard_normal(lead + (H, K))
    q[..., H - 1, :] *= 1e-5      # sum(q^2) ~ K * 1e-10 << eps 1e-6: L2 gives ~q/1e-3, not a unit vector
    k[..., H - 1, :] *= 1e-5
    v = rng.standard_normal(lead + (H, V))
    g_raw = 2.0 * rng.standard_normal(lead + (H, K))
    g_raw[..., 0, : K // 2] = 12.0   # sigma(exp(A) * (12 + dt)) ~ 1: g sits at the lower bound
    beta_raw = rng.standard_normal(lead + (H,))
    return q, k, v, g_raw, beta_raw


def _kda_common(rng, B, H, K, V, lower_bound, scale=None):
    """A_log, dt_bias, the state; kwargs with `scale` (None: the core's default 1/sqrt(K); a number: the
    explicit scale a caller passes, which a kernel must not ignore)."""
    A_log = np.log(rng.uniform(1.0, 16.0, H))
    dt_bias = 0.5 * rng.standard_normal(H * K)
    state = 0.5 * rng.standard_normal((B, H, K, V))
    return {"A_log": A_log, "dt_bias": dt_bias, "state": state}, {"lower_bound": lower_bound, "scale": scale}


def _kda_decode(rng, B, H, K, V, lower_bound=-5.0, scale=None):
    q, k, v, g_raw, beta_raw = _kda_arrays(rng, (B,), H, K, V)
    common, kwargs = _kda_common(rng, B, H, K, V, lower_bound, scale)
    return {"q": q, "k": k, "v": v, "g_raw": g_raw, "beta_raw": beta_raw, **common}, kwargs


def _kda_prefill(rng, B, T, H, K, V, lower_bound=-5.0, scale=None):
    q, k, v, g_raw, beta_raw = _kda_arrays(rng, (B, T), H, K, V)
    common, kwargs = _kda_common(rng, B, H, K, V, lower_bound, scale)
    return {"q": q, "k": k, "v": v, "g_raw": g_raw, "beta_raw": beta_raw, **common}, kwargs


def _mla_decode(rng, H, R, P, seq_lens, page=64, qk_head=192, bf16_cache=False):
    """Pages of each sequence in a shuffled order; unused slots and one spare page hold NaN (never read).
    bf16_cache: the cache holds bf16 values (K3's cache dtype), so the bf16 entry computes the same math."""
    B, W = len(seq_lens), R + P
    cache, table = paged_latent_cache(rng, seq_lens, W, page)   # one spare page, one unused block-table column
    if bf16_cache:
        cache = cache.astype(ml_dtypes.bfloat16).astype(np.float64)
    q_abs = 3.0 * rng.standard_normal((B, H, W))   # peaked softmax: scores ~ 3 sqrt(W) / sqrt(192)
    return ({"q_abs": q_abs, "kv_cache": cache, "block_table": table, "seq_lens": np.asarray(seq_lens, np.int32)},
            {"scale": qk_head ** -0.5, "kv_rank": R})


def _mxfp4_gemv(rng, N, K, lead=()):
    packed = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    packed[0, 0] = 0x71   # codes 1 (0.5) and 7 (6.0): a nibble swap changes this row for certain
    scale = rng.integers(122, 131, (N, K // 32), dtype=np.uint8)    # 2^-5 .. 2^3, never 255 (NaN)
    return {"packed": packed, "scale": scale, "x": rng.standard_normal(tuple(lead) + (K,))}, {}


def _moe_route(rng, T, E, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0, ties=False):
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, renormalize=renormalize, scaling=scaling)
    if ties:
        return _tied_route(rng, T, E, top_k, kw)
    for _ in range(1000):
        logits = 1.5 * rng.standard_normal((T, E))
        bias = 0.2 * rng.standard_normal(E)
        # the bias must change the selection somewhere, or a bias bug would go unseen
        changed = not np.array_equal(sigmoid_topk(logits, bias, **kw)[1], sigmoid_topk(logits, 0 * bias, **kw)[1])
        if changed and route_stable(logits, bias, kw):
            return {"logits": logits, "bias": bias}, kw
    raise RuntimeError(f"no stable routing found for T={T} E={E} k={top_k}")


# how far the tied pair's choice stays from the other experts' (selection-score units): far past bf16's rounding of
# a score near 1 (2^-8) and of the bias, so that only the tie decides which of the two is chosen
TIE_GAP = 0.02


def _tied_route(rng, T: int, E: int, top_k: int, kw: dict) -> tuple[dict, dict]:
    """Every token's k-th choice a tie (spec 3.4: ties to the lower expert id): experts 2i and 2i+1 share a bias
    value, and each token gives one such pair the same logit, placed so that top_k - 1 other experts score above it
    and the rest below (TIE_GAP apart). The pair's lower id is chosen; a kernel that breaks the tie the other way
    picks the higher id, with the same weight. Plain top-k (n_group 1)."""
    if kw["n_group"] != 1 or E < 3 or not 1 <= top_k < E - 1:
        raise ValueError(f"a tied route needs n_group 1 and 1 <= top_k < E - 1, found E={E} top_k={top_k} {kw}")
    pairs = E // 2
    bias = np.repeat(0.05 * rng.standard_normal(pairs), 2)
    if E % 2:
        bias = np.append(bias, 0.05 * rng.standard_normal())
    logits = np.empty((T, E))
    for t in range(T):
        for _ in range(1000):
            row = 1.5 * rng.standard_normal(E)
            pair = 2 * int(rng.integers(pairs))
            others = np.sort(ops.sigmoid(np.delete(row, [pair, pair + 1])) + np.delete(bias, [pair, pair + 1]))[::-1]
            below = others[top_k - 1]
            above = others[top_k - 2] if top_k > 1 else below + 4 * TIE_GAP   # top-1: just above the best other
            target = (above + below) / 2 - bias[pair]
            if above - below > 2 * TIE_GAP and 0.02 < target < 0.98:
                row[pair] = row[pair + 1] = np.log(target / (1 - target))
                break
        else:
            raise RuntimeError(f"no tied route found for T={T} E={E} k={top_k}")
        logits[t] = row
    return {"logits": logits, "bias": bias}, kw


def _attnres_mix(rng, S, lead, D, mix=1.0, eps=1e-5):
    scales = mag.ten_to(rng.uniform(-1, 1, (S,) + (1,) * (len(lead) + 1)))   # sources of very different size
    return ({"sources": scales * rng.standard_normal((S,) + tuple(lead) + (D,)),
             "proj_w": 0.5 * rng.standard_normal(D), "norm_w": 1.0 + 0.1 * rng.standard_normal(D)},
            {"mix": mix, "eps": eps})



# ---- k3 draws (the k3 and k3-tp8 shape sets): K3's magnitudes

HISTORY_SEGMENT = 256   # steps of a drawn history drawn and run at a time (bounds the memory it takes)


def _rmsnorm_k3(rng, T, D, eps):
    x = mag.activations(rng, (T, D), "rmsnorm.x")
    x[0] *= 1e-3          # a row whose mean square is ~1e-6: the eps is not negligible there
    return {"x": x, "w": 1.0 + 0.1 * rng.standard_normal(D)}, {"eps": eps}


def _situ_glu_k3(rng, shape, beta=4.0, linear_beta=25.0):
    gate, up = mag.activations(rng, shape, "situ_glu.gate"), mag.activations(rng, shape, "situ_glu.up")
    # the measured outliers reach the SiTU softcap (4) but not the linear one (25): the last token's `up` does
    last = up.reshape(-1, up.shape[-1])[-1]       # a view: up is contiguous
    last[::97] = 30.0 * np.sign(last[::97])
    return {"gate": gate, "up": up}, {"beta": beta, "linear_beta": linear_beta}


def _kda_token_k3(rng, lead: tuple, H: int, K: int, V: int, A_log, dt_bias) -> dict[str, np.ndarray]:
    """q, k, v, g_raw, beta_raw [lead..., H, ...] at K3's magnitudes (gates over (lb, 0), long runs at the bound
    along a time axis), the last head's q/k at a tiny norm (the L2 eps decides it)."""
    q, k = mag.activations(rng, lead + (H, K), "kda.q"), mag.activations(rng, lead + (H, K), "kda.q")
    q[..., H - 1, :] *= 1e-5
    k[..., H - 1, :] *= 1e-5
    return {"q": q, "k": k, "v": mag.activations(rng, lead + (H, V), "kda.v"),
            "g_raw": mag.gate_raw(rng, lead, H, K, A_log, dt_bias), "beta_raw": rng.standard_normal(lead + (H,))}


def _kda_params(rng, H, K):
    return np.log(rng.uniform(1.0, 16.0, H)), 0.5 * rng.standard_normal(H * K)


def history_state(rng, B: int, H: int, K: int, V: int, steps: int, A_log, dt_bias, lower_bound) -> np.ndarray:
    """The float64 KDA state after `steps` drawn tokens from a zero state ([B, H, K, V]): the recurrence token by
    token (k3ref.kda.kda_recurrent, the spec's own statement; on K3's gates it is faster here than the chunked
    form) over segments of HISTORY_SEGMENT steps, each drawn at K3's magnitudes with a run of steps at the gate's
    lower bound. Only the case's own token has the tiny-norm head."""
    state = np.zeros((B, H, K, V))
    done = 0
    while done < steps:
        n = min(HISTORY_SEGMENT, steps - done)
        seg = _kda_token_k3(rng, (B, n), H, K, V, A_log, dt_bias)
        seg["q"][..., H - 1, :] *= 1e5
        seg["k"][..., H - 1, :] *= 1e5
        g = kda.kda_gate(seg["g_raw"], A_log, dt_bias, lower_bound)
        _, state = kda.kda_recurrent(seg["q"], seg["k"], seg["v"], g, ops.sigmoid(seg["beta_raw"]),
                                     initial_state=state, use_qk_l2norm=True)
        done += n
    return state


def _kda_decode_k3(rng, B, H, K, V, history, lower_bound=-5.0):
    A_log, dt_bias = _kda_params(rng, H, K)
    state = history_state(rng, B, H, K, V, history, A_log, dt_bias, lower_bound)
    token = _kda_token_k3(rng, (B,), H, K, V, A_log, dt_bias)
    return ({**token, "A_log": A_log, "dt_bias": dt_bias, "state": state},
            {"lower_bound": lower_bound, "scale": None})


def _kda_prefill_k3(rng, B, T, H, K, V, lower_bound=-5.0):
    A_log, dt_bias = _kda_params(rng, H, K)
    seq = _kda_token_k3(rng, (B, T), H, K, V, A_log, dt_bias)
    return ({**seq, "A_log": A_log, "dt_bias": dt_bias, "state": 0.5 * rng.standard_normal((B, H, K, V))},
            {"lower_bound": lower_bound, "scale": None})


def _mla_decode_k3(rng, H, R, P, seq_lens, page=64, qk_head=192, bf16_cache=False):
    """As the toy draw (shuffled pages, NaN in unused pages and slots), the cache rows and the absorbed query
    at the measured scales."""
    B, W = len(seq_lens), R + P
    cache, table = paged_latent_cache(rng, seq_lens, W, page)
    cache *= mag.MEASURED["mla.kv"]["scale"]
    if bf16_cache:
        cache = cache.astype(ml_dtypes.bfloat16).astype(np.float64)
    q_abs = mag.activations(rng, (B, H, W), "mla.q_abs")
    return ({"q_abs": q_abs, "kv_cache": cache, "block_table": table, "seq_lens": np.asarray(seq_lens, np.int32)},
            {"scale": qk_head ** -0.5, "kv_rank": R})


def _mxfp4_gemv_k3(rng, N, K, lead=()):
    inputs, kwargs = _mxfp4_gemv(rng, N, K, lead)
    inputs["x"] = mag.activations(rng, tuple(lead) + (K,), "mxfp4_gemv.x")
    return inputs, kwargs


def _moe_route_k3(rng, T, E, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
    """Logits and bias at the measured scales (each token's row at its own scale, the measured spread); the rows
    whose top-k a bf16 rounding or small noise would change (route_stable's tests) are redrawn until none is, and
    the bias must change the selection somewhere."""
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, renormalize=renormalize, scaling=scaling)
    bias = mag.MEASURED["router.bias"]["scale"] * rng.standard_normal(E)
    spread = mag.MEASURED["router.logits"]["spread"]

    def rows(n):
        return mag.activations(rng, (n, E), "router.logits") * mag.ten_to(rng.uniform(-spread / 2, spread / 2, (n, 1)))

    logits = rows(T)
    for _ in range(1000):
        bad = _unstable_rows(logits, bias, kw)
        if not bad.any():
            break
        logits[bad] = rows(int(bad.sum()))
    if not route_stable(logits, bias, kw):
        raise RuntimeError(f"no stable routing found for T={T} E={E} k={top_k}")
    if np.array_equal(sigmoid_topk(logits, bias, **kw)[1], sigmoid_topk(logits, 0 * bias, **kw)[1]):
        raise RuntimeError(f"the router bias changes no selection at T={T} E={E} k={top_k}")
    return {"logits": logits, "bias": bias}, kw


def _unstable_rows(logits, bias, kw) -> np.ndarray:
    """[T] bool: the tokens whose top-k changes under one of route_stable's perturbations (logits rounded to bf16
    or fp32, +-0.005 noise drawn as route_stable draws it; the bias in bf16)."""
    _, ref = sigmoid_topk(logits, bias, **kw)
    noise = np.random.default_rng(0)
    variants = [cast(logits, "bf16").astype(np.float64), cast(logits, "fp32").astype(np.float64)]
    variants += [logits + noise.uniform(-0.005, 0.005, logits.shape) for _ in range(4)]
    want = np.sort(ref, -1)
    bad = np.zeros(len(logits), bool)
    for v in variants:
        bad |= np.any(np.sort(sigmoid_topk(v, cast(bias, "bf16"), **kw)[1], -1) != want, axis=-1)
    return bad


def _attnres_mix_k3(rng, S, lead, D, mix=1.0, eps=1e-5):
    return ({"sources": mag.activations(rng, (S,) + tuple(lead) + (D,), "attnres.sources"),
             "proj_w": 0.5 * rng.standard_normal(D), "norm_w": 1.0 + 0.1 * rng.standard_normal(D)},
            {"mix": mix, "eps": eps})


def drawn(toy: Callable[..., tuple[dict, dict]], k3: Callable[..., tuple[dict, dict]]):
    """A block's builder: the k3 draw for param draw="k3", the toy draw otherwise (toy params unchanged)."""
    def make(rng, draw="toy", **params):
        if draw not in ("toy", "k3"):
            raise ValueError(f"draw: expected 'toy' or 'k3', found {draw!r}")
        return (k3 if draw == "k3" else toy)(rng, **params)
    return make


BUILDERS: dict[str, Callable[..., tuple[dict, dict]]] = {
    "rmsnorm": drawn(_rmsnorm, _rmsnorm_k3),
    "situ_glu": drawn(_situ_glu, _situ_glu_k3),
    "kda_decode": drawn(_kda_decode, _kda_decode_k3),
    "kda_prefill": drawn(_kda_prefill, _kda_prefill_k3),
    "mla_decode": drawn(_mla_decode, _mla_decode_k3),
    "mxfp4_gemv": drawn(_mxfp4_gemv, _mxfp4_gemv_k3),
    "moe_route": drawn(_moe_route, _moe_route_k3),
    "attnres_mix": drawn(_attnres_mix, _attnres_mix_k3),
}
