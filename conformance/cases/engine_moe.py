"""The engine-shaped moe cores' cases (k3ref.engine.moe, k3ref.engine.norm): specs, input builders and the cases of
each shape set.

moe_experts: T tokens routed to k distinct experts each out of a stack of E, in router order (not sorted). Token 0
picks the stack's last expert (a kernel that bounds its loop by E - 1 shows), token 1 shares an expert with token
0 (an expert's token group holds several rows), and where E > k one expert in the middle of the stack is chosen by
no token and holds NaN scales: a kernel that runs every expert and zeroes the unchosen terms turns NaN. The experts
are quantised Gaussians (k3ref.mxfp4.quantize); at the toy draw W1 and W3 at gains that reach the SiTU softcap (4)
and the linear softcap (25), W1 and W3 different enough that a swap of the two halves shows. The routing weights
are fp32 in K3 (the router's output) and are not rounded to bf16.

add_rmsnorm: a block output x about half the residual stream's RMS (a residual_out that drops either shows), rows
at different scales, one row ~1e-3 smaller (its mean square ~1e-6: the eps matters there).
"""
from __future__ import annotations

import numpy as np

from conformance.cases import magnitudes as mag
from conformance.cases.core_data import drawn
from conformance.cases.core_spec import CoreSpec
from k3ref import mxfp4, ops
from k3ref.config import K3Config

# (w1, w3, w2) gains of the toy draw's experts: W1 z spreads ~3 (the SiTU cap is 4), W3 z ~15 (the linear cap 25)
TOY_GAINS = (3.0, 15.0, 1.0)
K3_GAINS = (1.0, 1.0, 1.0)      # N(0, 1/in) weights, as the synthetic K3 checkpoints are drawn
NAN_SCALE = mxfp4.E8M0_NAN


# ---- moe_experts


def _indices(rng, T: int, E: int, k: int) -> tuple[np.ndarray, int | None]:
    """[T, k] int32 distinct experts per token in router order, and the stack row no token chose (None if E = k).
    Token 0 has expert E - 1; token 1 shares one expert with token 0."""
    unused = E // 2 if E > k and E // 2 != E - 1 else None
    pool = np.array([e for e in range(E) if e != unused])
    idx = np.stack([rng.choice(pool, k, replace=False) for _ in range(T)])
    if E - 1 not in idx[0]:
        idx[0, rng.integers(k)] = E - 1
    if T > 1 and not np.intersect1d(idx[0], idx[1]).size:
        idx[1, rng.integers(k)] = idx[0, 0]
    return idx.astype(np.int32), unused


def _stack(rng, E: int, Dl: int, Di: int, gains: tuple[float, float, float], unused: int | None):
    """E quantised Gaussian experts stacked as engines hold them (W1 rows then W3 rows); `unused`'s scales NaN."""
    g1, g3, g2 = gains

    def quant(gain: float, rows: int, cols: int):
        return mxfp4.quantize(gain * rng.standard_normal((rows, cols)) / np.sqrt(cols))

    w13_packed = np.empty((E, 2 * Di, Dl // 2), np.uint8)
    w13_scale = np.empty((E, 2 * Di, Dl // mxfp4.GROUP), np.uint8)
    w2_packed = np.empty((E, Dl, Di // 2), np.uint8)
    w2_scale = np.empty((E, Dl, Di // mxfp4.GROUP), np.uint8)
    for e in range(E):
        w13_packed[e, :Di], w13_scale[e, :Di] = quant(g1, Di, Dl)
        w13_packed[e, Di:], w13_scale[e, Di:] = quant(g3, Di, Dl)
        w2_packed[e], w2_scale[e] = quant(g2, Dl, Di)
    if unused is not None:
        w13_scale[unused] = NAN_SCALE
        w2_scale[unused] = NAN_SCALE
    return {"w13_packed": w13_packed, "w13_scale": w13_scale, "w2_packed": w2_packed, "w2_scale": w2_scale}


def _repeat_one(idx: np.ndarray, repeated: bool) -> np.ndarray:
    """With `repeated`, the last token's last slot chooses its first slot's expert again: an expert chosen twice by
    one token counts twice (spec 3.4), and a kernel that merges the two slots shows."""
    if repeated:
        if idx.shape[1] < 2:
            raise ValueError(f"a repeated id needs k >= 2, found k={idx.shape[1]}")
        idx[-1, -1] = idx[-1, 0]
    return idx


def _moe_experts(rng, T, E, k, Dl, Di, scaling=1.0, repeated=False):
    idx, unused = _indices(rng, T, E, k)
    idx = _repeat_one(idx, repeated)
    s = rng.uniform(0.1, 1.0, (T, k))
    x = rng.standard_normal((T, Dl)) * mag.ten_to(rng.uniform(-0.5, 0.5, (T, 1)))
    return ({"x": x, "weights": s / s.sum(-1, keepdims=True) * scaling, "indices": idx,
             **_stack(rng, E, Dl, Di, TOY_GAINS, unused)}, {})


def _moe_experts_k3(rng, T, E, k, Dl, Di, scaling=1.0, repeated=False):
    """z at the measured scale of the experts' input, routing weights the renormalised sigmoid of router logits
    at the measured scale, N(0, 1/in) experts."""
    idx, unused = _indices(rng, T, E, k)
    idx = _repeat_one(idx, repeated)
    s = ops.sigmoid(mag.activations(rng, (T, k), "router.logits"))
    x = mag.activations(rng, (T, Dl), "mxfp4_gemv.x")
    return ({"x": x, "weights": s / s.sum(-1, keepdims=True) * scaling, "indices": idx,
             **_stack(rng, E, Dl, Di, K3_GAINS, unused)}, {})


# ---- add_rmsnorm


def _add_rmsnorm(rng, T, D, eps):
    row = mag.ten_to(rng.uniform(-1, 1, (T, 1)))   # rows at different scales, x about half the residual's RMS
    x = row * rng.standard_normal((T, D))
    residual = 2.0 * row * rng.standard_normal((T, D))
    x[0] *= 1e-3
    residual[0] *= 1e-3     # a row whose mean square is ~1e-6: the eps is not negligible there
    return {"x": x, "residual": residual, "w": 1.0 + 0.1 * rng.standard_normal(D)}, {"eps": eps}


def _add_rmsnorm_k3(rng, T, D, eps):
    x = mag.activations(rng, (T, D), "rmsnorm.x")
    residual = mag.activations(rng, (T, D), "attnres.sources")   # the residual stream: the depth sources' scale
    x[0] *= 1e-3
    residual[0] *= 1e-3
    return {"x": x, "residual": residual, "w": 1.0 + 0.1 * rng.standard_normal(D)}, {"eps": eps}


SPECS: dict[str, CoreSpec] = {
    "moe_experts": CoreSpec("moe_experts", ("y",), drawn(_moe_experts, _moe_experts_k3), fp32_inputs=("weights",)),
    "add_rmsnorm": CoreSpec("add_rmsnorm", ("y", "residual_out"), drawn(_add_rmsnorm, _add_rmsnorm_k3)),
}


def _moe(T: int, E: int, k: int, Dl: int, Di: int, **extra) -> tuple[str, dict]:
    name = f"moe_experts/T{T}-E{E}-k{k}-Dl{Dl}-I{Di}" + ("-repeated" if extra.get("repeated") else "")
    return name, dict(T=T, E=E, k=k, Dl=Dl, Di=Di, **extra)


def _norm(T: int, D: int, eps: float, suffix: str = "", **extra) -> tuple[str, dict]:
    return f"add_rmsnorm/T{T}-D{D}{suffix}", dict(T=T, D=D, eps=eps, **extra)


def _k3_cases() -> list[tuple[str, dict]]:
    """K3's expert widths (Dl 3584, I 3072) and hidden size. An expert's MXFP4 bytes are 17.5 MB and its float64
    golden holds them as they are: 8 experts in the stack keep the golden under 150 MB, so 6 of them per token
    (K3 routes 16 of 896; the kernel's per-expert work is the same). Experts are not split by tensor parallelism,
    and the residual stream is replicated: k3-tp8 has the same cases."""
    c = K3Config.preset("k3")
    Dl, Di, eps = c.routed_expert_hidden_size, c.moe_intermediate_size, c.rms_norm_eps
    return [_moe(4, 8, 6, Dl, Di, scaling=c.routed_scaling_factor, draw="k3"),
            _norm(32, c.hidden_size, eps, draw="k3")]


# config -> [(case name, builder params)]
TABLE: dict[str, list[tuple[str, dict]]] = {
    "tiny": [
        _moe(1, 8, 1, 64, 32),            # decode, top-1: dropping the last (only) term leaves zero
        _moe(3, 6, 2, 64, 64),
        _moe(5, 8, 4, 64, 96, scaling=2.5),     # I / 32 odd
        _moe(2, 4, 4, 64, 32),            # every expert chosen by every token (k = E: no unused expert)
        _moe(2, 2, 2, 224, 192),          # K3's Dl : I = 7 : 6 (Dl not a multiple of 64); 68 KB per expert
        _moe(3, 6, 3, 64, 32, repeated=True),   # the last token chooses one expert twice: it counts twice
        _norm(1, 113, 1e-5),
        _norm(5, 203, 1e-5),
        _norm(3, 256, 1e-6, "-eps1e-6"),
        _norm(1, 7168, 1e-5),             # K3's hidden size
    ],
    "small": [
        _moe(16, 32, 8, 512, 384),
        _norm(16, 1024, 1e-5),
    ],
    "k3": _k3_cases(),
    "k3-tp8": _k3_cases(),
}
