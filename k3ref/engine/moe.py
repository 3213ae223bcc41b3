"""The routed experts of a LatentMoE layer in one fused step, as engines run them (docs/spec.md sections 3.4, 3.5).

An engine holds the routed experts stacked: one [E, 2I, Dl/2] byte tensor of every expert's W1 rows then W3 rows
(the fused gate/up projection), one [E, Dl, I/2] of the W2s, each with its E8M0 scales. A fused MoE kernel takes
the router's (weights, indices) of T tokens, groups the tokens by expert, runs each selected expert once on its
tokens and scatters the weighted outputs back:

    y[t] = sum_j weights[t, j] * E_{indices[t, j]}(x[t]),   E_e(z) = W2_e situ_glu(W1_e z, W3_e z)

The routing weight multiplies the expert's output (after W2), as k3ref.latent_moe mixes them. Only the selected
experts' bytes are read: an expert no token chose may hold anything (the cases fill one with NaN scales).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from k3ref import mxfp4
from k3ref.checks import as_float, check_shape, require
from k3ref.situ import situ_glu


class ExpertGeometry(Protocol):
    """The two widths of a routed expert (k3ref.latent_moe.LatentMoeConfig has them)."""

    @property
    def latent_size(self) -> int: ...              # Dl

    @property
    def moe_intermediate_size(self) -> int: ...    # Di, the expert's intermediate width


def _stack_dims(w13_packed, w13_scale, w2_packed, w2_scale, Dl: int) -> tuple[int, int]:
    """Check the stacked MXFP4 tensors against the latent width Dl; returns (E, Di)."""
    for name, a in (("w13_packed", w13_packed), ("w13_scale", w13_scale), ("w2_packed", w2_packed),
                    ("w2_scale", w2_scale)):
        require(np.asarray(a).dtype == np.uint8, f"{name}: expected dtype uint8 (MXFP4 bytes), found "
                                                 f"{np.asarray(a).dtype}")
    require(Dl % mxfp4.GROUP == 0, f"x: expected a last dim Dl that is a multiple of {mxfp4.GROUP}, found {Dl}")
    E, two_i, _ = check_shape("w13_packed", w13_packed, (None, None, Dl // 2))
    require(E >= 1 and two_i % 2 == 0 and two_i // 2 % mxfp4.GROUP == 0,
            f"w13_packed: expected [E >= 1, 2I, {Dl // 2}] with I a multiple of {mxfp4.GROUP} (W1's rows then "
            f"W3's), found shape {np.shape(w13_packed)}")
    Di = two_i // 2
    check_shape("w13_scale", w13_scale, (E, 2 * Di, Dl // mxfp4.GROUP))
    check_shape("w2_packed", w2_packed, (E, Dl, Di // 2))
    check_shape("w2_scale", w2_scale, (E, Dl, Di // mxfp4.GROUP))
    return E, Di


def _check_route(weights, indices, T: int, E: int) -> tuple[np.ndarray, np.ndarray]:
    weights = as_float("weights", weights)
    _, k = check_shape("weights", weights, (T, None))
    indices = np.asarray(indices)
    require(indices.dtype.kind in "iu", f"indices: expected an integer dtype, found {indices.dtype}")
    check_shape("indices", indices, (T, k))
    bad = np.argwhere((indices < 0) | (indices >= E))
    if len(bad):
        t, j = (int(i) for i in bad[0])
        raise ValueError(f"indices: expected expert ids in [0, {E}) (the stack's experts), found {indices[t, j]} "
                         f"at [{t}, {j}]")
    return weights, indices


def expert(x: np.ndarray, w13: np.ndarray, w2: np.ndarray, Di: int, beta: float, linear_beta: float) -> np.ndarray:
    """E(x) = W2 situ_glu(W1 x, W3 x) on dense weights: x [n, Dl]; w13 [2I, Dl] (W1 rows then W3 rows); w2 [Dl, I]
    -> [n, Dl] in x's dtype."""
    gate_up = x @ w13.astype(x.dtype, copy=False).T                  # [n, 2I]: W1 x | W3 x
    h = situ_glu(gate_up[:, :Di], gate_up[:, Di:], beta=beta, linear_beta=linear_beta)
    return np.asarray(h).astype(x.dtype, copy=False) @ w2.astype(x.dtype, copy=False).T


def moe_experts(x, weights, indices, w13_packed, w13_scale, w2_packed, w2_scale, *, beta=4.0, linear_beta=25.0):
    """y = sum_j weights[t, j] * E_{indices[t, j]}(x_t), E_e(z) = W2_e situ_glu(W1_e z, W3_e z), MXFP4 weights.

    x: [T, Dl]; weights: [T, k] float; indices: [T, k] int into the stack's E experts;
    w13_packed: [E, 2I, Dl/2] uint8 (W1's rows then W3's, k3ref's MXFP4 layout), w13_scale: [E, 2I, Dl/32] uint8;
    w2_packed: [E, Dl, I/2] uint8, w2_scale: [E, Dl, I/32] uint8 -> y [T, Dl].

    y is float64 for float64 x (the weighted sum too), float32 otherwise. Each selected expert is dequantised
    once (exact in float32) and run on the tokens that chose it; an expert chosen twice by one token counts twice.
    """
    x = as_float("x", x)
    T, Dl = check_shape("x", x, (None, None))
    w13_packed, w13_scale, w2_packed, w2_scale = (np.asarray(a) for a in (w13_packed, w13_scale, w2_packed, w2_scale))
    E, Di = _stack_dims(w13_packed, w13_scale, w2_packed, w2_scale, Dl)
    weights, indices = _check_route(weights, indices, T, E)
    require(beta > 0 and linear_beta > 0, f"beta, linear_beta: expected > 0, found {beta}, {linear_beta}")
    y = np.zeros((T, Dl), x.dtype)
    for e in np.unique(indices):
        tok, slot = np.nonzero(indices == e)                            # the (token, slot) pairs that chose e
        w13 = mxfp4.dequantize(w13_packed[e], w13_scale[e])              # [2I, Dl]
        w2 = mxfp4.dequantize(w2_packed[e], w2_scale[e])                 # [Dl, I]
        out = expert(x[tok], w13, w2, Di, beta, linear_beta)
        np.add.at(y, tok, weights[tok, slot, None].astype(x.dtype) * out)   # add.at: a token may repeat
    return y


def stack_experts(weights: Mapping, expert_ids, cfg: ExpertGeometry) -> tuple[np.ndarray, ...]:
    """The engine's stacked layout of the experts `expert_ids` (in that order) from k3ref's per-expert tensors.

    weights: `experts.{e}.w{1,3}.weight_packed` u8 [I, Dl/2] + `.weight_scale` u8 [I, Dl/32], `experts.{e}.w2.*`
    u8 [Dl, I/2], [Dl, I/32] -> (w13_packed [n, 2I, Dl/2], w13_scale [n, 2I, Dl/32], w2_packed [n, Dl, I/2],
    w2_scale [n, Dl, I/32]); stack row i is expert expert_ids[i], its W1 rows before its W3 rows.
    """
    Dl, Di = cfg.latent_size, cfg.moe_intermediate_size
    ids = [int(e) for e in expert_ids]
    require(len(ids) >= 1, "expert_ids: expected at least one expert, found none")

    def read(e: int, proj: str, part: str, shape: tuple[int, int]) -> np.ndarray:
        name = f"experts.{e}.{proj}.weight_{part}"
        try:
            a = np.asarray(weights[name])
        except KeyError:
            raise ValueError(f"weights: missing tensor {name!r} (expected shape {list(shape)})") from None
        require(a.dtype == np.uint8, f"{name}: expected dtype uint8, found {a.dtype}")
        check_shape(name, a, shape)
        return a

    def both(e: int, part: str, cols: int) -> np.ndarray:
        return np.concatenate([read(e, "w1", part, (Di, cols)), read(e, "w3", part, (Di, cols))], axis=0)

    return (np.stack([both(e, "packed", Dl // 2) for e in ids]),
            np.stack([both(e, "scale", Dl // mxfp4.GROUP) for e in ids]),
            np.stack([read(e, "w2", "packed", (Dl, Di // 2)) for e in ids]),
            np.stack([read(e, "w2", "scale", (Dl, Di // mxfp4.GROUP)) for e in ids]))


__all__ = ["ExpertGeometry", "expert", "moe_experts", "stack_experts"]
