"""Routed experts of one token, all at once: the fast CPU form of `k3ref.latent_moe.routed_experts` for a
decode step whose experts are small enough that a call per matrix costs more than its bytes.

The readable statement is one expert at a time (`k3ref.latent_moe.routed_expert`); each output element
here is the same dot product, in the same order.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..mxfp4 import dequantize_rows

BATCH_BYTES = 4 << 20   # one token's experts are dequantised together when a projection of all of them fits here


def fits_one_batch(n_experts: int, latent_size: int, intermediate_size: int) -> bool:
    """True when one projection of `n_experts` experts [I, Dl], dequantised to float32, fits in BATCH_BYTES."""
    return n_experts * latent_size * intermediate_size * 4 <= BATCH_BYTES


ExpertTensors = dict[str, tuple[np.ndarray, np.ndarray]]   # "w1" | "w2" | "w3" -> (packed, scale)


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
