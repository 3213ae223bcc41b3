"""Deliberately wrong tensor-parallel plans: each must be caught, naming the layer (and the rank)."""
from __future__ import annotations

import numpy as np

from k3ref.tp import TpPlan


class _RowSplitGProj(TpPlan):
    """KDA / MLA g_proj split on its input axis (a row split) instead of by heads: the wrong split axis."""

    def shard(self, name, array, rank):
        if name.endswith("self_attn.g_proj.weight"):
            a = np.asarray(array)
            n = a.shape[1] // self.tp
            return a[:, rank * n:(rank + 1) * n]
        return super().shard(name, array, rank)


class _NeighbourQProj(TpPlan):
    """KDA q_proj takes the next rank's heads (a rank reading another rank's heads): shapes all fit."""

    def shard(self, name, array, rank):
        if name.endswith("self_attn.q_proj.weight") and self.tp > 1:
            return super().shard(name, array, (rank + 1) % self.tp)
        return super().shard(name, array, rank)


PLAN_MUTANTS = {
    "g_proj-row-split": _RowSplitGProj,
    "q_proj-neighbour-heads": _NeighbourQProj,
}


def plan_mutant(name: str):
    if name not in PLAN_MUTANTS:
        raise ValueError(f"--tp-mutant: expected one of {sorted(PLAN_MUTANTS)}, found {name!r}")
    return PLAN_MUTANTS[name]
