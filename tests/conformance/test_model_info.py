"""`k3conf model info --tp N`: per-rank bytes per layer (adding up to the rank's totals) and the binding-memory
plan (the F32 tensors that get BF16 device copies when bound to the kernels, their bytes per rank)."""
from __future__ import annotations

import math

import pytest

from conformance.cli import main as cli_main
from k3ref.config import K3Config
from k3ref.tp import BINDING_BF16_COPIES, GLOBAL, GROUPS, TpPlan
from k3ref.weights import inventory


@pytest.mark.parametrize("config, tp", [("tiny", 1), ("tiny", 2), ("tiny", 4), ("k3geom", 2)])
def test_layer_bytes_add_up_to_each_ranks_bytes(config, tp):
    cfg = K3Config.preset(config)
    plan = TpPlan(cfg, tp)
    for r in range(tp):
        layers = plan.layer_bytes(r)
        assert set(layers) == {*range(cfg.num_hidden_layers), GLOBAL}
        held = plan.rank_bytes(r)
        for g in (*GROUPS, "total"):
            assert sum(row[g] for row in layers.values()) == held[g], (r, g)
        lo, hi = plan.expert_range(r)
        moe = [i for i in range(cfg.num_hidden_layers) if not cfg.mlp_is_dense(i)]
        one = plan._expert_bytes[lo] // len(moe)
        assert all(layers[i]["experts"] == (hi - lo) * one for i in moe) and layers[0]["experts"] == 0


def test_the_binding_plan_copies_exactly_the_three_kda_convolutions_per_rank():
    """Each is F32 in the checkpoint; its BF16 copy is 2 bytes per element of the rank's column shard, in every
    KDA layer; nothing else is copied."""
    cfg = K3Config.preset("k3")
    specs = {s.name: s for s in inventory(cfg) if ".self_attn." in s.name}
    convs = [n for n in specs if n.split(".self_attn.")[1] in BINDING_BF16_COPIES]
    assert len(convs) == 3 * len(cfg.kda_layers) and all(specs[n].dtype == "F32" for n in convs)
    for tp in (1, 8):
        plan = TpPlan(cfg, tp)
        want = {t: sum(math.prod(specs[n].shape) // tp * 2 for n in convs if n.endswith("self_attn." + t))
                for t in BINDING_BF16_COPIES}
        for r in (0, tp - 1):
            b = plan.binding_bytes(r)
            assert {t: b[t] for t in BINDING_BF16_COPIES} == want and b["total"] == sum(want.values())
    # K3 at TP 8: 12 heads x 128 channels x 4 taps x 2 bytes, 3 tensors, 45 KDA layers
    assert TpPlan(cfg, 8).binding_bytes(0)["total"] == 3 * 12 * 128 * 4 * 2 * len(cfg.kda_layers)


def test_model_info_prints_layers_and_the_binding_plan(capsys):
    assert cli_main(["model", "info", "--config", "tiny", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    plan = TpPlan(K3Config.preset("tiny"), 2)
    first, last = plan.layer_bytes(0), plan.layer_bytes(1)
    lines = out.splitlines()
    for layer in (0, 1, GLOBAL):
        row = next(x for x in lines if x.split()[:1] == [str(layer)])
        assert f"{first[layer]['total']:,}" in row
        if last[layer]["total"] != first[layer]["total"]:
            assert row.endswith(f"rank 1: {last[layer]['total']:,}")
    for r in range(2):
        b = plan.binding_bytes(r)
        row = next(x for x in lines if x.strip().startswith(f"rank {r} ") and "q_conv1d.weight" in x)
        assert f"total {b['total']:,} B" in row
