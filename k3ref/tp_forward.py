"""A simulated tensor-parallel forward: every rank runs its shard, the partial sums are added.

This is the check that `k3ref.tp.TpPlan` splits every tensor on the right axis: each rank holds
rank-local heads (column-split q/k/v/gate projections, row-split o_proj), so its mixer output is a
partial sum that the all-reduce (here: a plain sum over ranks) completes. The latent MLA cache is
replicated and the KDA state is split by heads. Routed experts are expert-parallel: each rank adds the
contributions of the experts it holds into a partial latent, and the all-reduce completes it before the
routed norm; the router, the latent projections and the dense/shared MLPs are replicated (they run on
rank 0's copy). The result must equal the TP = 1 forward.
"""
from __future__ import annotations


import numpy as np

from ._check import require
from .cores import reference_cores
from .cpu_forward import PRODUCTION, Ablation, ForwardContext, K3CpuModel, _mixer, _mlp, embed, final_logits
from .layer import MlpKind
from .ops import linear


def rank_models(model: K3CpuModel, plan) -> list[K3CpuModel]:
    """One K3CpuModel per rank: rank-local head counts and the rank's shard of every tensor it holds."""
    local_cfg = plan.local_config()
    return [K3CpuModel(local_cfg, {name: plan.shard(name, np.asarray(w), rank) for name, w in model.weights.items()
                                   if plan.holds(name, rank)}, model.dtype) for rank in range(plan.tp)]


def _expert_parallel_moe(ranks: list[K3CpuModel], plan, layer: int, x: np.ndarray, cores) -> np.ndarray:
    """LatentMoE with experts spread over ranks: partial latents summed (the all-reduce), then the rest."""
    from .latent_moe import routed_expert
    from .situ import situ_glu_vec

    cfg = ranks[0].moe_cfg
    views = [r.layer(layer).sub("block_sparse_moe.") for r in ranks]
    w0 = views[0]
    weights, idx = cores.moe_route(linear(x, w0["gate.weight"]), w0["gate.e_score_correction_bias"], cfg.top_k,
                                   n_group=cfg.n_group, topk_group=cfg.topk_group, renormalize=cfg.renormalize,
                                   scaling=cfg.routed_scaling_factor)
    weights, idx = np.asarray(weights), np.asarray(idx)
    z = linear(x, w0["routed_expert_down_proj.weight"])
    y_lat = np.zeros_like(z)
    for rank, view in enumerate(views):
        lo, hi = plan.expert_range(rank)
        partial = np.zeros_like(z)
        for e in np.unique(idx[(idx >= lo) & (idx < hi)]):
            tok, slot = np.nonzero(idx == e)  # a token picks an expert at most once: tok has no repeats
            partial[tok] += weights[tok, slot, None] * routed_expert(view, int(e), z[tok], cfg, cores)
        y_lat += partial
    if cfg.use_norm:
        y_lat = cores.rmsnorm(y_lat, w0["routed_expert_norm.weight"], cfg.norm_eps)
    y = linear(y_lat, w0["routed_expert_up_proj.weight"])
    if cfg.n_shared_experts:
        y = y + situ_glu_vec(x, w0["shared_experts.gate_proj.weight"], w0["shared_experts.up_proj.weight"],
                             w0["shared_experts.down_proj.weight"], beta=cfg.situ_beta, linear_beta=cfg.linear_beta,
                             cores=cores)
    return y


def tp_forward_prefill(model: K3CpuModel, tokens, tp: int, ablation: Ablation = PRODUCTION) -> np.ndarray:
    """Prefill `tokens` [T] on `tp` simulated ranks; returns logits [T, vocab] (== the TP 1 forward)."""
    from .tp import TpPlan

    plan = TpPlan(model.cfg, tp)
    ranks = rank_models(model, plan)
    cores = reference_cores()
    caches = [r.new_cache() for r in ranks]
    for c in caches:
        c.add_sequence()
    ctxs = [ForwardContext(r, cores, 0, True, ablation) for r in ranks]
    full = ForwardContext(model, cores, 0, True, ablation)  # embedding and lm_head (vocab-split: not simulated)
    hub = cores.attnres_hub(model.cfg.attn_res_block_size)
    hub.start(embed(model, np.asarray(tokens)))
    eps, mix = model.cfg.rms_norm_eps, ablation.attnres_mix
    for spec in model.graph.layers:
        w = model.layer(spec.index)
        h = hub.mixer_input(spec.index, w["self_attention_res_proj.weight"], w["self_attention_res_norm.weight"],
                            mix=mix, cores=cores)
        x = cores.rmsnorm(h, w["input_layernorm.weight"], eps)
        # Row-parallel o_proj: each rank's output is a partial sum; the all-reduce adds them.
        hub.add_mixer(sum(_mixer(ctx, spec.index, x, cache) for ctx, cache in zip(ctxs, caches)))
        m = hub.mlp_input(w["mlp_res_proj.weight"], w["mlp_res_norm.weight"], mix=mix, cores=cores)
        xm = cores.rmsnorm(m, w["post_attention_layernorm.weight"], eps)
        if spec.mlp == MlpKind.LATENT_MOE:
            hub.add_mlp(_expert_parallel_moe(ranks, plan, spec.index, xm, cores))
        else:
            hub.add_mlp(_mlp(ctxs[0], spec.index, xm))  # the dense MLP is replicated: rank 0's copy
    require(all(c.mla[i].seq_lens([0])[0] == len(tokens) for c in caches for i in c.mla),
            "every rank's replicated MLA cache must hold every token")
    return final_logits(full, hub)
