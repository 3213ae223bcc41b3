"""Router data the core and LatentMoE cases share: a selection far from any tie, and one order for it.

A golden's routing must survive bf16 rounding and small noise on the logits, so that a flipped expert in a
backend's result is a bug and never the rounding of a near-tie.
"""
from __future__ import annotations

import numpy as np

from conformance.cases.inputs import cast
from k3ref.latent_moe import sigmoid_topk


def route_stable(logits, bias, kw) -> bool:
    """True when the selection survives bf16 rounding and +-0.005 noise on the logits (no near-ties)."""
    _, ref = sigmoid_topk(logits, bias, **kw)
    variants = [cast(logits, "bf16").astype(np.float64), cast(logits, "fp32").astype(np.float64)]
    noise = np.random.default_rng(0)
    variants += [logits + noise.uniform(-0.005, 0.005, logits.shape) for _ in range(4)]
    return all(np.array_equal(np.sort(sigmoid_topk(v, cast(bias, "bf16"), **kw)[1], -1), np.sort(ref, -1))
               for v in variants)


def route_canonical(out: dict) -> dict:
    """Sort each token's (index, weight) pairs by expert index: any top-k order is right."""
    order = np.argsort(out["indices"], axis=-1, kind="stable")
    return {"weights": np.take_along_axis(out["weights"], order, -1),
            "indices": np.take_along_axis(out["indices"], order, -1)}
