"""Every public name the issues promise imports and says what it computes (shapes and formula)."""
from __future__ import annotations

import importlib
import inspect

import pytest

from conformance.cli.blocks import BLOCKS

PUBLIC = {
    "k3ref.ops": ["rmsnorm", "silu", "sigmoid", "softplus", "softmax", "linear"],
    "k3ref.situ": ["softcap", "situ", "situ_glu", "situ_glu_vec"],
    "k3ref.kda": ["KDA_L2_EPS", "KdaConfig", "KdaState", "l2norm", "kda_gate", "short_conv", "kda_recurrent",
                  "kda_chunked", "kda_decode_token", "kda_prefill", "kda_decode_core", "kda_prefill_core"],
    "k3ref.mla": ["MlaConfig", "gated_mla_attend", "mla_decode_token", "mla_decode_core"],
    "k3ref.attnres": ["attnres_softmax_mix", "attnres_blend", "attnres_mix", "AttnResHub"],
    "k3ref.latent_moe": ["LatentMoeConfig", "sigmoid_topk", "mix_routed_experts", "latent_moe_forward"],
    "k3ref.mxfp4": ["E2M1_VALUES", "unpack_fp4", "e8m0_to_float", "dequantize", "quantize", "mxfp4_gemv"],
    "k3ref.config": ["K3Config"],
    "k3ref.layer": ["MixerKind", "MlpKind", "K3LayerSpec", "K3Graph"],
    "k3ref.weights": ["inventory", "synthetic_checkpoint", "admit_checkpoint"],
    "k3ref.expert_backend": ["MmapExpertStore", "PrefetchPlanner", "kind_from_env"],
    "k3ref.cache": ["HybridCache", "MlaKv"],
    "k3ref.cpu_forward": ["K3CpuModel", "forward_one_layer", "forward_token", "Ablation"],
    "k3ref.greedy": ["greedy_decode"],
    "k3ref.tp": ["TpPlan"],
}
CONSTANTS = {"KDA_L2_EPS", "E2M1_VALUES"}
# The math functions' docstrings carry shapes ([B, T, H, K] style) or say "any shape".
SHAPED = {("k3ref.kda", n) for n in ("l2norm", "kda_gate", "short_conv", "kda_recurrent", "kda_chunked",
                                     "kda_decode_token", "kda_prefill", "kda_decode_core")} | {
    ("k3ref.mla", "mla_decode_core"), ("k3ref.mla", "gated_mla_attend"), ("k3ref.mla", "mla_decode_token"),
    ("k3ref.attnres", "attnres_softmax_mix"), ("k3ref.latent_moe", "sigmoid_topk"),
    ("k3ref.latent_moe", "latent_moe_forward"), ("k3ref.mxfp4", "dequantize"), ("k3ref.mxfp4", "mxfp4_gemv"),
    ("k3ref.ops", "rmsnorm"), ("k3ref.ops", "linear"), ("k3ref.situ", "situ_glu_vec")}


@pytest.mark.parametrize("module, name", [pytest.param(m, n, id=f"{m}.{n}") for m, ns in PUBLIC.items() for n in ns])
def test_public_name_imports_with_a_docstring(module, name):
    obj = getattr(importlib.import_module(module), name)
    if name in CONSTANTS:
        return
    doc = inspect.getdoc(obj) or ""
    assert len(doc) > 20, f"{module}.{name} has no real docstring"
    if (module, name) in SHAPED:
        assert "[" in doc and "]" in doc, f"{module}.{name}: docstring gives no shapes"


def test_every_listed_block_points_at_a_real_reference():
    for block, (ref, formula) in BLOCKS.items():
        module, name = ref.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name)), (block, ref)
        assert formula.strip()
