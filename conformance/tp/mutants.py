"""Deliberately wrong tensor-parallel plans and kernels: each must be caught, naming the layer (and the rank).

Plans (`--tp-mutant NAME`) split a tensor wrongly. Kernels are backends whose cores go wrong only on a rank's
slice, so they pass every TP 1 golden and fail only under `--tp N`:

    k3conf run --tp 2 --backend conformance.tp.mutants:kda_global_head_index
"""
from __future__ import annotations

import os

import numpy as np

from conformance.backends.external import Backend
from k3ref.cores import Cores
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


def _rank() -> int:
    """This process's rank in its group (the env:// variable every rank has; 0 in one process)."""
    return int(os.environ.get("RANK", "0") or 0)


def _global_head_gates(core):
    """`core` (kda_decode or kda_prefill) reading the per-head gate parameters A_log [H] and dt_bias [H*K] at the
    global head rank * H + h, clamped to the shard's last head: right on rank 0 (and in one process), wrong
    on every other rank, where each head takes the decay of the shard's last head."""
    def call(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, **kw):
        A_log, dt_bias = np.asarray(A_log), np.asarray(dt_bias)
        H = A_log.shape[0]
        heads = np.minimum(_rank() * H + np.arange(H), H - 1)
        K = dt_bias.shape[0] // H
        return core(q, k, v, g_raw, beta_raw, A_log[heads], dt_bias.reshape(H, K)[heads].reshape(-1), state, **kw)
    return call


def kda_global_head_index() -> Backend:
    """fp64 reference cores but KDA's, which index their gate parameters by the rank's global head (see
    _global_head_gates): passes the TP 1 goldens, fails under --tp 2 on rank 1's heads."""
    def make(base: Cores) -> Cores:
        return base.replace(kda_decode=_global_head_gates(base.kda_decode),
                            kda_prefill=_global_head_gates(base.kda_prefill))
    return Backend.from_cores("tp-mutant-kda-global-head", "fp64", make)
