"""Known mistakes of fused MoE and fused add + RMSNorm kernels, as mutants of the engine-shaped cores.

ENGINE_MUTANTS: name -> (block, description, make, base, shows_on), the fields of conformance.backends.mutants'
Mutant: make(base: Cores) -> Cores swaps one core of `base`; `block` is the case block that must fail first; base
is the backend whose cores are mutated; shows_on the smallest shape set whose goldens catch it.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from k3ref.cores import Cores


def _moe_w13_halves_swapped(base: Cores) -> Cores:
    """moe_experts reading the stack's W3 half as the gate and W1 as the up projection (a fused gate/up weight
    whose [gate | up] order was taken as [up | gate])."""
    def moe(x, weights, indices, w13_packed, w13_scale, w2_packed, w2_scale, **kw):
        p, s = np.asarray(w13_packed), np.asarray(w13_scale)
        Di = p.shape[1] // 2
        return base.moe_experts(x, weights, indices, np.concatenate([p[:, Di:], p[:, :Di]], axis=1),
                                np.concatenate([s[:, Di:], s[:, :Di]], axis=1), w2_packed, w2_scale, **kw)

    return base.replace(moe_experts=moe)


def _moe_last_weight_dropped(base: Cores) -> Cores:
    """moe_experts leaving out each token's k-th expert term (a loop over slots bounded by k - 1)."""
    def moe(x, weights, indices, *rest, **kw):
        w = np.array(weights, copy=True)
        w[:, -1] = 0.0
        return base.moe_experts(x, w, indices, *rest, **kw)

    return base.replace(moe_experts=moe)


def _add_rmsnorm_returns_input_residual(base: Cores) -> Cores:
    """add_rmsnorm that normalises x + residual but hands back the residual it was given, not the sum (a kernel
    that writes its sum to a scratch buffer and returns the input pointer)."""
    def add_norm(x, residual, w, eps):
        y, r = base.add_rmsnorm(x, residual, w, eps)
        return y, np.asarray(residual).astype(np.asarray(r).dtype)

    return base.replace(add_rmsnorm=add_norm)


# name -> (block, description, make, base, shows_on)
ENGINE_MUTANTS: dict[str, tuple[str, str, Callable[[Cores], Cores], str, str]] = {
    "moe-experts-w13-halves-swapped": ("moe_experts", "fused MoE with the stacked W1 and W3 halves swapped",
                                       _moe_w13_halves_swapped, "numpy64", "tiny"),
    "moe-experts-last-weight-dropped": ("moe_experts", "fused MoE leaving out each token's k-th expert term",
                                        _moe_last_weight_dropped, "numpy64", "tiny"),
    "add-rmsnorm-returns-input-residual": ("add_rmsnorm",
                                           "fused add + RMSNorm returning the input residual, not x + residual",
                                           _add_rmsnorm_returns_input_residual, "numpy64", "tiny"),
}

__all__ = ["ENGINE_MUTANTS"]
