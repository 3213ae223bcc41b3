"""The `latent_moe` kind: the LatentMoE layer `k3ref.latent_moe.latent_moe_forward` over a small config.

Its weights are in the golden (`weights.*`); a backend runs the layer on its own cores (router, MXFP4 GEMV,
SiTU, RMSNorm), inputs and weights cast to its precision (F32 checkpoint tensors stay fp32 at bf16).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from conformance.cases.engine_routes import route_notes, through_engine
from conformance.cases.inputs import cast, cast_weights
from conformance.cases.protocol import Case, Content, Evaluation, KindBase, Timed, Timer, case_seed
from conformance.cases.routes import route_canonical, route_stable
from k3ref.latent_moe import LatentMoeConfig, latent_moe_forward, random_moe_weights, sigmoid_topk


class LatentMoeKind(KindBase):
    """`latent_moe/*`: latent_moe_forward(weights, x, cfg, cores) with the backend's cores."""

    name = "latent_moe"
    TABLE: dict[str, list[tuple[str, dict]]] = {
        "tiny": [
            ("latent_moe/T5-D67-E8-k2-L32-I32-S1", dict(T=5, cfg=dict(
                hidden_size=67, num_experts=8, top_k=2, latent_size=32, moe_intermediate_size=32,
                n_shared_experts=1, shared_intermediate_size=48))),
            ("latent_moe/T3-D48-E8-k2-G2-g1-norenorm", dict(T=3, cfg=dict(
                hidden_size=48, num_experts=8, top_k=2, latent_size=64, moe_intermediate_size=32,
                n_shared_experts=2, shared_intermediate_size=16, n_group=2, topk_group=1,
                renormalize=False, routed_scaling_factor=2.5))),
        ],
        "small": [
            ("latent_moe/T8-D512-E32-k4-L256-I256-S2", dict(T=8, cfg=dict(
                hidden_size=512, num_experts=32, top_k=4, latent_size=256, moe_intermediate_size=256,
                n_shared_experts=2, shared_intermediate_size=256))),
        ],
    }

    def cases(self, config: str) -> list[Case]:
        return [Case(n, self.name, config, case_seed(n), p) for n, p in self.TABLE.get(config, [])]

    @staticmethod
    def _cfg(kwargs: Mapping) -> LatentMoeConfig:
        return LatentMoeConfig(**kwargs)

    def generate(self, case: Case) -> Content:
        cfg = self._cfg(case.params["cfg"])
        rng = np.random.default_rng(case.seed)
        kw: dict[str, Any] = dict(top_k=cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                  renormalize=cfg.renormalize, scaling=cfg.routed_scaling_factor)
        for _ in range(1000):
            weights = random_moe_weights(cfg, rng, dtype=np.float64)
            weights["gate.e_score_correction_bias"] = weights["gate.e_score_correction_bias"].astype(np.float64)
            x = rng.standard_normal((case.params["T"], cfg.hidden_size))
            logits = x @ weights["gate.weight"].T
            if route_stable(logits, weights["gate.e_score_correction_bias"], kw):
                break
        else:
            raise RuntimeError(f"{case.name}: no stable routing found")
        y = latent_moe_forward(weights, x, cfg)
        route = sigmoid_topk(logits, weights["gate.e_score_correction_bias"], **kw)
        w, idx = route_canonical(dict(zip(("weights", "indices"), route, strict=True))).values()
        tensors = {"inputs.x": x, "outputs.y": y, "inter.route_weights": w, "inter.route_indices": idx}
        tensors.update({f"weights.{k}": v for k, v in weights.items()})
        return Content(tensors, dict(case.params["cfg"]))

    def evaluate(self, case: Case, golden, backend) -> Evaluation:
        golden.require(["inputs.x", "outputs.y"])
        weights = cast_weights(golden.group("weights"), backend.precision)
        x = cast(golden.group("inputs")["x"], backend.precision)
        cores, _, routed = through_engine(backend.cores(), backend.kernel_cores())
        y = latent_moe_forward(weights, x, self._cfg(golden.kwargs), cores=cores)
        return Evaluation({"y": np.asarray(y)}, route_notes(routed, backend.name))

    def cores_of(self, case: Case) -> frozenset[str]:
        return frozenset({"moe_route", "mxfp4_gemv", "situ_glu", "rmsnorm", "moe_experts", "add_rmsnorm"})

    def timing(self, case: Case, goldens: list, backend, timer: Timer) -> Timed | None:
        return None   # a composite of many cores: the cores are timed in their own cases

