"""Routed experts of one token, all at once: the fast CPU form of `k3ref.latent_moe.routed_experts` for a
decode step whose experts are small enough that a call per matrix costs more than its bytes.

The readable statement is one expert at a time (`k3ref.latent_moe.routed_expert`); each output element
here is the same dot product, in the same order.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..mxfp4 import dequantize_rows
from . import mxfp4_jit

BATCH_BYTES = 4 << 20   # one token's experts are dequantised together when a projection of all of them fits here


def fits_one_batch(n_experts: int, latent_size: int, intermediate_size: int) -> bool:
    """True when one projection of `n_experts` experts [I, Dl], dequantised to float32, fits in BATCH_BYTES."""
    return n_experts * latent_size * intermediate_size * 4 <= BATCH_BYTES


# "w1" | "w2" | "w3" -> (packed, scale); optionally "at" -> {projection: (packed's, scale's) address or None}
ExpertTensors = dict[str, Any]
addresses = mxfp4_jit.addresses


def one_token_experts(tensors: dict[int, ExpertTensors], z: np.ndarray, latent_size: int, intermediate_size: int,
                      glu: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> dict[int, np.ndarray]:
    """Every expert in `tensors` ({e: {"w1" | "w2" | "w3": (packed, scale)}}, checked) on the one row z [1, Dl]
    -> {e: E_e(z) [1, Dl]} with E_e(z) = W2 glu(W1 z, W3 z) (a decode step of `small`: 8 experts of
    [128 x 512] per layer). w1 and w3 of all experts are dequantised into one buffer each and multiplied at once,
    glu runs once, and w2 is dequantised at once and multiplied per expert."""
    Dl, Di, n = latent_size, intermediate_size, len(tensors)

    def stacked(proj: str, rows: int, cols: int) -> np.ndarray:
        W = np.empty((n * rows, cols), np.float32)
        for j, t in enumerate(tensors.values()):
            packed, scale = t[proj]
            dequantize_rows(packed, scale, W[j * rows:(j + 1) * rows])
        return W.astype(z.dtype, copy=False)

    gate = (z @ stacked("w1", Di, Dl).T).reshape(n, Di)
    up = (z @ stacked("w3", Di, Dl).T).reshape(n, Di)
    h = np.asarray(glu(gate, up)).astype(z.dtype, copy=False)
    W2 = stacked("w2", Dl, Di).reshape(n, Dl, Di)
    return {e: (h[j:j + 1] @ W2[j].T).astype(z.dtype, copy=False) for j, e in enumerate(tensors)}


def expert_pairs(idx: np.ndarray, w: np.ndarray, chosen: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (token, expert) pairs of the experts in `chosen` (ascending), grouped by expert, tokens ascending
    within one: idx int [T, k], w [T, k] -> (starts int64 [len(chosen) + 1], tokens int64 [P], weights [P]).
    A token then meets its experts in ascending order, as `k3ref.latent_moe.mix_routed_experts` adds them."""
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = np.argsort(flat, kind="stable")            # by expert; a stable sort keeps tokens ascending within one
    chosen_ids = np.asarray(chosen, flat.dtype)
    if len(chosen_ids) and flat.size:
        held = np.zeros(max(int(flat.max()), int(chosen_ids.max())) + 1, bool)
        held[chosen_ids] = True                          # the experts taken (under expert parallelism, this rank's)
        order = order[held[flat[order]]]
    else:
        order = order[:0]
    bounds = np.searchsorted(flat[order], chosen_ids, side="left")
    starts = np.append(bounds, len(order)).astype(np.int64)
    toks, slots = np.divmod(order, k)
    return starts, toks.astype(np.int64, copy=False), w[toks, slots].astype(w.dtype, copy=False)


def routed_pairs_jit(tensors: list[ExpertTensors], z: np.ndarray, w: np.ndarray, idx: np.ndarray,
                     chosen: list[int], glu: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """y_lat = sum_k w_k E_idx_k(z) over the experts in `chosen` (ascending; tensors[j]: checked (packed,
    scale) of chosen[j] per projection), compiled: for every (token, expert) pair, gate and up by
    `k3ref.fast.mxfp4_jit.experts_gemv` (one call for every expert, each read where it lies, its bytes once for
    all its tokens), glu once over all pairs (the caller's SiTU-GLU: the nonlinearity stays NumPy's), the down
    projection likewise, then the pairs mixed into y in order (`mix_pairs`). z float [T, Dl], w [T, k], idx int
    [T, k] -> y_lat [T, Dl] in z's dtype."""
    y = np.zeros(z.shape, z.dtype)
    if not chosen:
        return y
    starts, toks, ws = expert_pairs(idx, w, chosen)
    P = len(toks)

    def project(proj: str, x: np.ndarray, rows_of: np.ndarray) -> np.ndarray:
        packed = tensors[0][proj][0]
        out = np.empty((P, packed.shape[0]), z.dtype)
        at = [t["at"][proj] for t in tensors if "at" in t]              # taken when the experts were checked
        if len(at) == len(tensors) and None not in at:
            where = np.array(at, np.int64).T.copy()                  # [2, n]: packed's row, scale's row
            return mxfp4_jit.experts_gemv_at(where[0], where[1], packed.shape[0], 2 * packed.shape[1], x, starts,
                                             rows_of, out)
        return mxfp4_jit.experts_gemv([t[proj][0] for t in tensors], [t[proj][1] for t in tensors], x, starts,
                                      rows_of, out)

    gate = project("w1", z, toks)
    up = project("w3", z, toks)
    h = np.ascontiguousarray(np.asarray(glu(gate, up)).astype(z.dtype, copy=False))
    down = project("w2", h, np.arange(P, dtype=np.int64))
    return mxfp4_jit.mix_pairs(down, toks, ws.astype(z.dtype, copy=False), y)
