"""Naming the rank: which rank's partial sum goes wrong first, from the golden layer inputs.

Every all-reduce input of every rank is gathered (`tp.partial.NNNN`, [tp, ...], in call order: per step
the embedding rows, then per layer the mixer's o_proj partial and, on a MoE layer, the routed latent). For a
layerwise trace each layer's golden inputs are known, so each rank's expected share is the same k3ref code
run on that rank's slice of the golden weights (cut by the correct plan) with the golden input and cache;
the first (step, layer, sum) where a rank's partial differs names the rank.
"""
from __future__ import annotations

import numpy as np

from conformance.cases.trace_run import PROMPT, GoldenFeed
from conformance.tp.rank import kda_slices
from k3ref.config import K3Config
from k3ref.cores import reference_cores
from k3ref.cpu_forward import ForwardContext, K3CpuModel, mixer_forward
from k3ref.latent_moe import latent_moe_forward
from k3ref.tp import TpPlan

# How far an honest rank's partial sum may sit from its float64 share of the golden (relative L2), by the
# precision of the backend the ranks ran. fp64: the same math on the same slices differs by summation order
# only (~1e-15). fp32 / bf16: 3x the worst honest partial measured over every partial of the layerwise
# traces (tiny at --tp 2 and 4, k3geom at --tp 2; `partial_errors` on the ranks' outputs): fp32 1.18e-6
# (numpy32; torch 9.6e-7, cuda-emu 1.1e-6), bf16 2.77e-2 (torch-bf16, tp 4, step 2 layer 0 mixer).
PARTIAL_RTOL = {"fp64": 1e-9, "fp32": 3.5e-6, "bf16": 8.3e-2}


class _Captured(Exception):
    def __init__(self, value):
        self.value = value


class _CaptureComm:
    """A comm whose all_reduce hands back the partial it was given by raising: the rank's share, no more."""

    def all_reduce(self, a):
        raise _Captured(np.array(a, copy=True))

    def all_gather(self, a):
        raise _Captured(np.array(a, copy=True))


def schedule(cfg: K3Config, steps: int) -> list[tuple[int, int | None, str]]:
    """(step, layer, sum) of every all-reduce of a trace of `steps` steps (the prefill + one per decoded
    token), in call order."""
    out: list[tuple[int, int | None, str]] = []
    for s in range(steps):
        out.append((s, None, "embedding"))
        for layer in range(cfg.num_hidden_layers):
            out.append((s, layer, "mixer"))
            if not cfg.mlp_is_dense(layer):
                out.append((s, layer, "routed latent"))
    return out


def _expected(plan: TpPlan, rank: int, weights: dict, inter: dict, outputs: dict, s: int, layer: int, what: str):
    model = K3CpuModel(plan.local_config(), {n: plan.shard(n, w, rank) for n, w in weights.items()
                                             if plan.holds(n, rank)}, np.float64,
                       tp=plan.rank(rank, _CaptureComm()))
    key = f"step{s}.layer{layer:02d}"
    cores = reference_cores()
    if what == "mixer":
        cache = model.new_cache()
        seq = cache.add_sequence()
        GoldenFeed(kda_slices(inter, plan, rank, plan.cfg.kda_head_dim), "fp64").layer_cache(cache, seq, s, layer)
        ctx = ForwardContext(model, cores, seq, prefill=(s == 0))
        return mixer_forward(ctx, layer, outputs[f"{key}.2_x_mixer"], cache)
    try:
        latent_moe_forward(model.layer(layer).sub("block_sparse_moe."), outputs[f"{key}.5_x_mlp"], model.moe_cfg, cores,
                           experts=model.tp.experts, all_reduce=model.tp.comm.all_reduce)
    except _Captured as c:
        return c.value
    raise AssertionError("latent_moe_forward returned without reducing its routed latent")


def partial_errors(case, golden, outs: dict, tp: int):
    """Per all-reduce of a layer, in call order: (step, layer, sum, [per rank: its relative error against its
    share of the golden, or the text of a shape mismatch]); a str item instead when the ranks' partials stop
    early. Layerwise traces only (each layer's golden input is known)."""
    cfg = K3Config.preset(golden.kwargs.get("config", case.config))
    plan = TpPlan(cfg, tp)
    weights, inter, outputs = golden.group("weights"), golden.group("inter"), golden.group("outputs")
    steps = len(golden.group("inputs")["tokens"]) - golden.kwargs.get("prompt", len(PROMPT)) + 1
    for i, (s, layer, what) in enumerate(schedule(cfg, steps)):
        got = outs.get(f"tp.partial.{i:04d}")
        if got is None:
            yield f"rank partials stop at all-reduce #{i}: the ranks ran another schedule than step {s}"
            return
        if layer is None:
            continue
        errs: list[float | str] = []
        for r in range(tp):
            want = _expected(plan, r, weights, inter, outputs, s, layer, what)
            if got[r].shape != want.shape:
                errs.append(f"has shape {list(got[r].shape)}, its share of the golden {list(want.shape)}")
                continue
            errs.append(float(np.linalg.norm(got[r] - want)) / max(float(np.linalg.norm(want)), 1e-300))
        yield s, layer, what, errs


def blame_ranks(case, golden, outs: dict, tp: int, precision: str = "fp64") -> list[str]:
    """Lines naming the first rank whose partial sum differs from its share (layerwise cases) by more than the
    precision's PARTIAL_RTOL."""
    if golden.kwargs.get("mode") != "layerwise":
        return [f"{case.name} runs freely (errors accumulate): the layerwise trace names the rank"]
    tol = PARTIAL_RTOL[precision]
    for item in partial_errors(case, golden, outs, tp):
        if isinstance(item, str):
            return [item]
        s, layer, what, errs = item
        bad = []
        for r, err in enumerate(errs):
            if isinstance(err, str):
                bad.append(f"rank {r}: its {what} partial sum at step {s} layer {layer} {err}")
            elif not err <= tol:
                bad.append(f"rank {r}: its {what} partial sum at step {s} layer {layer} differs from its share of the "
                           f"golden (rel err {err:.1e} > {tol:g} at {precision}): that rank's shard, its heads or "
                           "the cores on its slice are what goes wrong")
        if bad:
            return bad
    return ["every rank's partial sums match their shares of the golden: the fault is after the all-reduce"]
