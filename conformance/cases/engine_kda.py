"""The engine-shaped kda cores' cases (k3ref.engine.kda): specs, input builders and the cases of each shape set.

The pools are laid out as an engine holds them, with its traps: the rows' slots shuffled, some batch rows padded
(slot -1; their output is not judged), the unused slots full of finite junk drawn like the live states (a kernel
that reads or writes a wrong slot shows in o or in the returned pool), both state layouts ("kv" and FlashKDA's "vk"),
varlen prefills whose sequences end just before, on and just after a chunk boundary of 64, and single-token
sequences. The per-token arrays come from conformance.cases.core_data's KDA draws (one tiny-norm head, gates at
the lower bound; K3's magnitudes for draw="k3").

Golden sizes (float64, uncompressed): one slot of a state pool at K3's per-head geometry (K = V = 128) is 128 KiB
per head, and the pool is stored twice (input and returned pool). The tiny cases keep K3's geometry to one head
and one slot, so that the committed goldens of the three cores stay under 1 MB; the k3 set (H = 96,
12 MiB per slot) keeps its pools to a few slots so that each golden stays under ~150 MB.
"""
from __future__ import annotations

import numpy as np

from conformance.cases import core_data
from conformance.cases import magnitudes as mag
from conformance.cases.core_data import drawn, history_state
from conformance.cases.core_spec import CoreSpec
from k3ref.config import K3Config

STATE_SCALE = 0.5   # the toy draws' state spread (conformance.cases.core_data._kda_common)
CONV_WIDTH = 4


# ---- pools

def _slots(rng, B: int, S: int, padded: tuple[int, ...]) -> np.ndarray:
    """[B] int32: distinct shuffled slots of 0..S-1 for the rows, -1 at the `padded` rows."""
    slots = np.full(B, -1, np.int32)
    live = [b for b in range(B) if b not in padded]
    if len(live) > S:
        raise ValueError(f"pool of {S} slots: expected at least {len(live)} (the unpadded rows), found {S}")
    slots[live] = rng.permutation(S)[:len(live)]
    return slots


def _state_pool(rng, states: np.ndarray, slots: np.ndarray, S: int, state_layout: str) -> np.ndarray:
    """A pool of S slots holding states [n, H, K, V] at `slots` (>= 0 entries) in the layout, junk elsewhere.

    The junk is drawn at the states' own RMS: a kernel that reads a wrong slot gets other values of the same size
    (its error shows at full size), and the pool's relative error is not diluted by junk far larger than the
    states a kernel updates (the pool is judged whole)."""
    _, H, K, V = states.shape
    scale = float(np.sqrt(np.mean(states ** 2))) if states.size else STATE_SCALE
    pool = scale * rng.standard_normal((S, H, K, V))
    pool[slots[slots >= 0]] = states
    return pool if state_layout == "kv" else np.ascontiguousarray(pool.transpose(0, 1, 3, 2))


def _check_layout(state_layout: str) -> None:
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"state_layout: expected 'kv' or 'vk', found {state_layout!r}")


# ---- kda_decode_pool

def _decode_pool(rng, B, S, H, K, V, padded=(), state_layout="kv", lower_bound=-5.0):
    _check_layout(state_layout)
    slots = _slots(rng, B, S, padded)
    q, k, v, g_raw, beta_raw = core_data._kda_arrays(rng, (B,), H, K, V)
    common, kwargs = core_data._kda_common(rng, int(np.sum(slots >= 0)), H, K, V, lower_bound)
    pool = _state_pool(rng, common.pop("state"), slots, S, state_layout)
    return ({"q": q, "k": k, "v": v, "g_raw": g_raw, "beta_raw": beta_raw, **common, "state_pool": pool,
             "slots": slots}, {**kwargs, "state_layout": state_layout})


def _decode_pool_k3(rng, B, S, H, K, V, history, padded=(), state_layout="kv", lower_bound=-5.0):
    """The rows' states after a drawn history of `history` tokens (core_data.history_state), this token at K3's
    magnitudes."""
    _check_layout(state_layout)
    slots = _slots(rng, B, S, padded)
    A_log, dt_bias = core_data._kda_params(rng, H, K)
    states = history_state(rng, int(np.sum(slots >= 0)), H, K, V, history, A_log, dt_bias, lower_bound)
    token = core_data._kda_token_k3(rng, (B,), H, K, V, A_log, dt_bias)
    return ({**token, "A_log": A_log, "dt_bias": dt_bias, "state_pool": _state_pool(rng, states, slots, S,
                                                                                     state_layout),
             "slots": slots}, {"lower_bound": lower_bound, "scale": None, "state_layout": state_layout})


# ---- kda_conv_pool

def _conv_pool(rng, B, S, C, padded=(), layout="cw", W=CONV_WIDTH, x_scale=1.0):
    if layout not in ("cw", "wc"):
        raise ValueError(f"layout: expected 'cw' or 'wc', found {layout!r}")
    slots = _slots(rng, B, S, padded)
    pool = x_scale * rng.standard_normal((S, C, W - 1))          # junk at the inputs' size (see _state_pool)
    live = slots[slots >= 0]
    pool[live] = x_scale * rng.standard_normal((live.size, C, W - 1))
    if layout == "wc":
        pool = np.ascontiguousarray(pool.transpose(0, 2, 1))
    return ({"x": x_scale * rng.standard_normal((B, C)), "weight": rng.standard_normal((C, W)) / np.sqrt(W),
             "conv_pool": pool, "slots": slots}, {"layout": layout})


def _conv_pool_k3(rng, B, S, C, padded=(), layout="cw", W=CONV_WIDTH):
    """The projections before the conv at the scale of the measured KDA streams (the conv keeps their size)."""
    return _conv_pool(rng, B, S, C, padded, layout, W, x_scale=mag.MEASURED["kda.v"]["scale"])


# ---- kda_prefill_varlen

def _cu_seqlens(lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _prefill_varlen(rng, lens, S, H, K, V, state_layout="kv", lower_bound=-5.0):
    _check_layout(state_layout)
    N, T = len(lens), int(sum(lens))
    slots = _slots(rng, N, S, ())
    q, k, v, g_raw, beta_raw = core_data._kda_arrays(rng, (1, T), H, K, V)
    common, kwargs = core_data._kda_common(rng, N, H, K, V, lower_bound)
    pool = _state_pool(rng, common.pop("state"), slots, S, state_layout)
    return ({"q": q, "k": k, "v": v, "g_raw": g_raw, "beta_raw": beta_raw, **common, "state_pool": pool,
             "cu_seqlens": _cu_seqlens(lens), "slots": slots}, {**kwargs, "state_layout": state_layout})


def _prefill_varlen_k3(rng, lens, S, H, K, V, state_layout="kv", lower_bound=-5.0):
    """Tokens at K3's magnitudes (gates over (lb, 0) with long runs at the bound), initial states as the host
    prefill's k3 draw."""
    _check_layout(state_layout)
    N, T = len(lens), int(sum(lens))
    slots = _slots(rng, N, S, ())
    A_log, dt_bias = core_data._kda_params(rng, H, K)
    seq = core_data._kda_token_k3(rng, (1, T), H, K, V, A_log, dt_bias)
    pool = _state_pool(rng, 0.5 * rng.standard_normal((N, H, K, V)), slots, S, state_layout)
    return ({**seq, "A_log": A_log, "dt_bias": dt_bias, "state_pool": pool, "cu_seqlens": _cu_seqlens(lens),
             "slots": slots}, {"lower_bound": lower_bound, "scale": None, "state_layout": state_layout})


# ---- specs

def _padded_rows_zeroed(name: str):
    """unjudged: output `name`'s padded rows (slot -1) set to zero; the pool is judged whole (no slot but the
    rows' own may change)."""
    def unjudged(inputs: dict, outputs: dict) -> dict:
        out = np.array(outputs[name], copy=True)
        out[np.asarray(inputs["slots"]) < 0] = 0
        return {**outputs, name: out}
    return unjudged


_KDA_FP32 = ("A_log", "dt_bias", "state_pool")   # F32 in the checkpoint; the recurrent state is fp32

SPECS: dict[str, CoreSpec] = {
    "kda_decode_pool": CoreSpec("kda_decode_pool", ("o", "state_pool"), drawn(_decode_pool, _decode_pool_k3),
                                fp32_inputs=_KDA_FP32, unjudged=_padded_rows_zeroed("o")),
    # the conv weight is F32 in the checkpoint; the conv state holds activations (bf16 in a bf16 engine)
    "kda_conv_pool": CoreSpec("kda_conv_pool", ("y", "conv_pool"), drawn(_conv_pool, _conv_pool_k3),
                              fp32_inputs=("weight",), unjudged=_padded_rows_zeroed("y")),
    "kda_prefill_varlen": CoreSpec("kda_prefill_varlen", ("o", "state_pool"),
                                   drawn(_prefill_varlen, _prefill_varlen_k3), fp32_inputs=_KDA_FP32),
}


# ---- cases

def _decode_case(B, S, H, K, V=None, padded=(), state_layout="kv", lower_bound=-5.0, **k3):
    V = K if V is None else V
    name = f"kda_decode_pool/B{B}-S{S}-H{H}-K{K}" + (f"-V{V}" if V != K else "") + f"-{state_layout}"
    name += (f"-pad{len(padded)}" if padded else "") + ("-nolb" if lower_bound is None else "")
    name += f"-hist{k3['history']}" if "history" in k3 else ""
    return name, dict(B=B, S=S, H=H, K=K, V=V, padded=tuple(padded), state_layout=state_layout,
                      lower_bound=lower_bound, **k3)


def _conv_case(B, S, C, padded=(), layout="cw", **k3):
    name = f"kda_conv_pool/B{B}-S{S}-C{C}-{layout}" + (f"-pad{len(padded)}" if padded else "")
    return name, dict(B=B, S=S, C=C, padded=tuple(padded), layout=layout, **k3)


def _varlen_case(lens, S, H, K, V=None, state_layout="kv", lower_bound=-5.0, **k3):
    V = K if V is None else V
    name = (f"kda_prefill_varlen/N{len(lens)}-T{sum(lens)}-S{S}-H{H}-K{K}" + (f"-V{V}" if V != K else "")
            + f"-{state_layout}" + ("-nolb" if lower_bound is None else ""))
    return name, dict(lens=tuple(lens), S=S, H=H, K=K, V=V, state_layout=state_layout, lower_bound=lower_bound,
                      **k3)


TINY = [
    _decode_case(3, 5, 2, 16, padded=(1,), state_layout="vk"),
    _decode_case(4, 6, 2, 16, padded=(0, 3)),
    _decode_case(2, 3, 1, 32, 16),
    _decode_case(2, 4, 2, 16, state_layout="vk", lower_bound=None),
    # K3's per-head geometry: one head, one live slot and a padded row (a K = V = 128 slot is 128 KiB)
    _decode_case(2, 1, 1, 128, padded=(0,), state_layout="vk"),
    _conv_case(3, 5, 24, padded=(1,)),
    _conv_case(4, 7, 40, padded=(0, 2), layout="wc"),
    _conv_case(1, 2, 17),
    _conv_case(2, 2, 384, padded=(1,), layout="wc"),           # q | k | v of one K = 128 head
    # sequences ending before, on and after a chunk of 64; one token alone; one sequence
    _varlen_case((1, 63, 65), 5, 1, 16),
    _varlen_case((3, 1, 2), 4, 2, 16, 8, state_layout="vk"),
    _varlen_case((17,), 2, 2, 16, state_layout="vk", lower_bound=None),
    _varlen_case((3,), 1, 1, 128, state_layout="vk"),         # K3's per-head geometry
    # empty sequences (repeated offsets in cu_seqlens) between, before and after others: each slot's state comes
    # back as it went in
    _varlen_case((0, 5, 0, 1, 3, 0), 7, 2, 16),
]


def _k3_sets() -> dict[str, list[tuple[str, dict]]]:
    """K3's KDA geometry (H = 96 heads, K = V = 128; one rank's 12 heads under TP 8) at K3's magnitudes. The conv
    pool holds q | k | v of every head of the rank (vLLM's one conv state per layer): C = 3 H K."""
    c = K3Config.preset("k3")
    Kd, lb = c.kda_head_dim, c.gate_lower_bound
    sets: dict[str, list[tuple[str, dict]]] = {}
    for name, tp in (("k3", 1), ("k3-tp8", 8)):
        H = c.kda_num_heads // tp
        k3 = dict(lower_bound=lb, draw="k3")
        if tp == 1:
            # a [96, 128, 128] float64 slot is 12.6 MB, stored twice: 5 slots make a 126 MB golden
            cases = [_decode_case(4, 5, H, Kd, padded=(2,), state_layout="vk", history=64, **k3),
                     _varlen_case((65, 1, 62), 3, H, Kd, **k3)]
        else:
            cases = [_decode_case(8, 16, H, Kd, padded=(1, 6), history=64, **k3),
                     _decode_case(8, 16, H, Kd, padded=(0, 7), state_layout="vk", history=64, **k3),
                     _varlen_case((100, 1, 155), 5, H, Kd, state_layout="vk", **k3)]
        cases.append(_conv_case(8, 16, 3 * H * Kd, padded=(3, 5), draw="k3"))
        sets[name] = cases
    return sets


TABLE: dict[str, list[tuple[str, dict]]] = {"tiny": TINY, **_k3_sets()}

__all__ = ["SPECS", "TABLE"]
