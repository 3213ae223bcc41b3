"""Teacher-forced routing at near-ties: the reference takes the engine's expert choice where the two differ
only within the rounding of the scores.

A reduced-precision engine can flip a top-k choice whose choice scores (sigmoid + selection bias) sit within
its rounding error of a tie; recomputing that token with the other expert set would show a large divergence
the engine did not make. So where the engine's dumped choice (`router.ids`) differs from the reference's and
the reference's own scores put the engine's set within `tie` of its k-th best (gap = the k-th best choice
score minus the lowest choice score of the engine's set), the reference routes that token to the engine's
experts, weighted by its own scores. A larger gap is a real routing difference and is kept (a dropped
router bias moves choices by the bias's size, far above any rounding).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from k3ref.latent_moe import route_weights, sigmoid_topk
from k3ref.ops import sigmoid


@dataclasses.dataclass
class ForcedRoutes:
    """A `moe_route` core that takes the engine's choice at near-ties; counts what it forced."""

    engine_ids: np.ndarray         # [T, k] the engine's chosen experts
    tie: float
    forced: int = 0
    largest_forced_gap: float = 0.0

    def __call__(self, logits, bias, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
        w, idx = sigmoid_topk(logits, bias, top_k, n_group=n_group, topk_group=topk_group,
                              renormalize=renormalize, scaling=scaling)
        eng = np.asarray(self.engine_ids, np.int64)
        if eng.shape != idx.shape:
            raise ValueError(f"router.ids: expected shape {list(idx.shape)} (tokens x experts per token), "
                             f"found {list(eng.shape)}")
        s = sigmoid(np.asarray(logits, np.float64))
        choice = s + np.asarray(bias, np.float64)
        kth = np.take_along_axis(choice, idx, axis=-1).min(axis=-1)
        gap = kth - np.take_along_axis(choice, eng, axis=-1).min(axis=-1)
        differ = np.any(np.sort(idx, axis=-1) != np.sort(eng, axis=-1), axis=-1)
        take = differ & (gap <= self.tie)
        if np.any(take):
            self.forced += int(take.sum())
            self.largest_forced_gap = max(self.largest_forced_gap, float(gap[take].max()))
            idx = np.where(take[:, None], eng, idx)
            w = route_weights(s, idx, renormalize, scaling).astype(np.asarray(w).dtype)
        return w, idx


def route_core(engine_ids: np.ndarray | None, tie: float) -> ForcedRoutes | None:
    """The forced `moe_route` core for one step of one layer, or None when the dump has no router.ids."""
    return None if engine_ids is None else ForcedRoutes(engine_ids, tie)
