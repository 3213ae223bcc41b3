"""PyTorch forms of the engine-shaped `moe_experts` and `add_rmsnorm` cores (the TorchCore convention of
k3torch.cores: a numpy-checking `prepare` and a pure torch `compute` per core).

Written from docs/spec.md sections 3.3-3.5 (SiTU-GLU experts in MXFP4, mixed by the routing weights after W2) and
the engines' fused layouts: experts stacked [E, 2I, Dl/2] with W1's rows then W3's, tokens grouped per expert.
bf16 policy (docs/spec.md section 1.4): x rounded to bf16, MXFP4 weights exact, fp32 accumulation, the expert's
hidden activation stored in bf16 between its two GEMMs, the routing weights fp32 (the router's output), the
mixed output rounded to bf16. add_rmsnorm forms r in fp32 and stores it as bf16 (the residual stream an engine
writes back), and normalises that stored r with fp32 statistics.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from k3torch.checks import check_shape, require
from k3torch.cores import Precision, mxfp4_dequantize, rmsnorm, situ_glu

GROUP = 32     # MXFP4 elements per E8M0 scale


def _u8(name: str, a) -> np.ndarray:
    a = np.asarray(a)
    require(a.dtype == np.uint8, f"{name}: expected uint8 (MXFP4 bytes), found {a.dtype}")
    return a


def _prep_moe_experts(p: Precision, x, weights, indices, w13_packed, w13_scale, w2_packed, w2_scale, *,
                      beta=4.0, linear_beta=25.0) -> dict:
    x = np.asarray(x)
    T, Dl = check_shape("x", x, (None, None))
    require(Dl % GROUP == 0, f"x: expected a last dim Dl that is a multiple of {GROUP}, found {Dl}")
    w13_packed, w13_scale = _u8("w13_packed", w13_packed), _u8("w13_scale", w13_scale)
    w2_packed, w2_scale = _u8("w2_packed", w2_packed), _u8("w2_scale", w2_scale)
    E, two_i, _ = check_shape("w13_packed", w13_packed, (None, None, Dl // 2))
    require(two_i % 2 == 0 and (two_i // 2) % GROUP == 0,
            f"w13_packed: expected [E, 2I, {Dl // 2}] with I a multiple of {GROUP}, found shape {w13_packed.shape}")
    inter = two_i // 2
    check_shape("w13_scale", w13_scale, (E, two_i, Dl // GROUP))
    check_shape("w2_packed", w2_packed, (E, Dl, inter // 2))
    check_shape("w2_scale", w2_scale, (E, Dl, inter // GROUP))
    weights, indices = np.asarray(weights), np.asarray(indices)
    _, k = check_shape("weights", weights, (T, None))
    require(indices.dtype.kind in "iu", f"indices: expected an integer dtype, found {indices.dtype}")
    check_shape("indices", indices, (T, k))
    require(indices.size == 0 or (indices.min() >= 0 and indices.max() < E),
            f"indices: expected expert ids in [0, {E}), found {indices.min()} .. {indices.max()}")
    require(beta > 0 and linear_beta > 0, f"beta, linear_beta: expected > 0, found {beta}, {linear_beta}")
    return dict(x=p.act("x", x), weights=p.wide("weights", weights), indices=p.raw(indices, torch.long),
                w13_packed=p.raw(w13_packed, torch.uint8), w13_scale=p.raw(w13_scale, torch.uint8),
                w2_packed=p.raw(w2_packed, torch.uint8), w2_scale=p.raw(w2_scale, torch.uint8),
                selected=sorted({int(e) for e in indices.ravel()}), beta=float(beta), linear_beta=float(linear_beta))


def moe_experts(p: Precision, x, weights, indices, w13_packed, w13_scale, w2_packed, w2_scale, *, selected,
                beta, linear_beta) -> torch.Tensor:
    """y[t] = sum_j weights[t, j] E_{indices[t, j]}(x[t]), E_e(z) = W2_e situ_glu(W1_e z, W3_e z).

    x: [T, Dl]; weights: [T, k]; indices: [T, k]; w13_packed: u8 [E, 2I, Dl/2] (W1 rows then W3 rows), w13_scale:
    u8 [E, 2I, Dl/32]; w2_packed: u8 [E, Dl, I/2], w2_scale: u8 [E, Dl, I/32]; selected: the distinct ids in
    indices (known on the host: no device sync) -> y [T, Dl]. Each selected expert runs once on its tokens.
    """
    inter = w13_packed.shape[1] // 2
    y = torch.zeros_like(x)
    for e in selected:
        tok, slot = torch.nonzero(indices == e, as_tuple=True)
        w13 = mxfp4_dequantize(p, w13_packed[e], w13_scale[e])            # [2I, Dl], exact
        gate_up = torch.matmul(x[tok], w13.transpose(0, 1))               # [n, 2I]
        h = situ_glu(p, gate_up[:, :inter], gate_up[:, inter:], beta, linear_beta)    # stored bf16 at bf16
        out = torch.matmul(h, mxfp4_dequantize(p, w2_packed[e], w2_scale[e]).transpose(0, 1))   # [n, Dl]
        y.index_add_(0, tok, weights[tok, slot, None] * out)
    return p.round(y)


def _prep_add_rmsnorm(p: Precision, x, residual, w, eps) -> dict:
    x, residual = np.asarray(x), np.asarray(residual)
    require(x.ndim >= 1, f"x: expected rank >= 1 [..., D], found shape {x.shape}")
    check_shape("residual", residual, x.shape)
    check_shape("w", np.asarray(w), (x.shape[-1],))
    require(float(eps) >= 0, f"eps: expected >= 0, found {eps}")
    return dict(x=p.act("x", x), residual=p.act("residual", residual), w=p.act("w", w), eps=float(eps))


def add_rmsnorm(p: Precision, x, residual, w, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """r = x + residual; y = RMSNorm_eps(r; w). x, residual: [..., D]; w: [D] -> (y, r), both [..., D].

    Same as k3torch.cores.rmsnorm applied to r as stored: at bf16 the fp32 sum rounded to bf16 first.
    """
    r = p.round(x + residual)
    return rmsnorm(p, r, w, eps), r


CORES: dict[str, tuple[Callable[..., dict], Callable[..., Any]]] = {
    "moe_experts": (_prep_moe_experts, moe_experts),
    "add_rmsnorm": (_prep_add_rmsnorm, add_rmsnorm),
}

__all__ = ["CORES", "add_rmsnorm", "moe_experts"]
