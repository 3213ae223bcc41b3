"""K3Config and the layer schedule: presets, the K3 schedule, JSON round trips, validation."""
from __future__ import annotations

import dataclasses
import json

import pytest

from k3ref.config import PRESETS, K3Config
from k3ref.layer import K3Graph, MixerKind, MlpKind
from k3ref.weights import active_parameters, inventory, num_parameters

# docs/spec.md section 2: MLA at 1-indexed 4, 8, ..., 92 and 93 -> 0-indexed below.
K3_MLA_0 = tuple(range(3, 92, 4)) + (92,)

# name: (bound, reason)
BOUNDS = {
    "small_params": ((0.38e9, 0.42e9), "the small config keeps K3's structure at 0.40B parameters +/- 5%, "
                                       "small enough for a CPU"),
    "tiny_float64_bytes": (1 << 20, "the tiny model stays well under 1 MB of float64 weights, so its goldens stay "
                                    "small enough to commit"),
}


def check_k3_schedule(graph: K3Graph) -> None:
    """Raise AssertionError unless `graph` is K3's published schedule (docs/spec.md section 2)."""
    assert len(graph) == 93
    assert graph.indices(mixer=MixerKind.MLA) == K3_MLA_0
    assert graph.indices(mixer=MixerKind.KDA) == tuple(i for i in range(93) if i not in K3_MLA_0)
    assert graph.indices(mlp=MlpKind.DENSE) == (0,)
    assert graph.counts() == {"kda": 69, "mla": 24, "dense": 1, "latent_moe": 92}
    assert graph.block_starts == tuple(range(0, 93, 12))


def test_k3_schedule():
    cfg = K3Config.preset("k3")
    check_k3_schedule(K3Graph.from_config(cfg))
    assert [cfg.is_mla(i) for i in range(93)] == [i in K3_MLA_0 for i in range(93)]
    assert len(cfg.kda_layers) == 69 and cfg.mla_layers == K3_MLA_0


@pytest.mark.parametrize("change", [
    pytest.param({"full_attn_layers": tuple(range(4, 93, 4))}, id="last-layer-not-MLA"),
    pytest.param({"full_attn_layers": tuple(i - 1 for i in range(4, 93, 4)) + (92,)}, id="read-as-0-indexed"),
    pytest.param({"first_k_dense_replace": 2}, id="two-dense-layers"),
    pytest.param({"attn_res_block_size": 11}, id="block-size-11"),
])
def test_wrong_k3_schedule_fails(change):
    cfg = dataclasses.replace(K3Config.preset("k3"), **change)
    with pytest.raises(AssertionError):
        check_k3_schedule(K3Graph.from_config(cfg))


def test_tiny_exercises_every_feature():
    cfg = K3Config.preset("tiny")
    g = K3Graph.from_config(cfg)
    mla = g.indices(mixer=MixerKind.MLA)
    assert len(g.indices(mixer=MixerKind.KDA)) >= 2 and len(mla) >= 2
    assert mla[-2:] == (cfg.num_hidden_layers - 2, cfg.num_hidden_layers - 1), "two MLA layers in a row at the end"
    assert g.indices(mlp=MlpKind.DENSE) == (0,), "only layer 0 is dense"
    assert g.indices(mlp=MlpKind.LATENT_MOE) == tuple(range(1, len(g.layers))), "every later layer is latent MoE"
    assert len(g.indices(mlp=MlpKind.LATENT_MOE)) >= 2
    assert len([b for b in g.block_starts if b > 0]) >= 2, "at least two AttnRes block boundaries after layer 0"
    assert cfg.vocab_size % 2 == 1 and cfg.n_routed_experts % 2 == 1 and cfg.intermediate_size % 2 == 1
    cfg.validate_tp(2), cfg.validate_tp(4)  # heads even on purpose: the simulated TP 2 / TP 4 forwards
    assert cfg.a_log_size > cfg.kda_num_heads, "A_log padding exercised"
    assert cfg.moe_intermediate_size % 32 == 0 and cfg.routed_expert_hidden_size % 32 == 0
    float_bytes = sum(8 * t.numel for t in inventory(cfg) if t.dtype != "U8")
    assert float_bytes < BOUNDS["tiny_float64_bytes"][0]


def test_small_size_and_structure():
    cfg = K3Config.preset("small")
    lo, hi = BOUNDS["small_params"][0]
    assert lo <= num_parameters(cfg) <= hi
    assert cfg.kda_head_dim == 128
    L = cfg.num_hidden_layers
    assert cfg.is_mla(L - 1) and cfg.is_mla(L - 2) and cfg.mlp_is_dense(0) and not cfg.mlp_is_dense(1)


def _k3_params_by_hand() -> tuple[int, int]:
    """Total and active K3 parameters re-derived from docs/spec.md section 7 (MXFP4 counted per weight)."""
    D, V, H, K = 7168, 163840, 96, 128
    kda = 3 * H * K * D + 3 * H * K * 4 + 128 + H * K + K * D + H * K * K + H * D + H * K * D + K + D * H * K
    mla = 1536 * D + 1536 + H * 192 * 1536 + 576 * D + 512 + H * 256 * 512 + H * 128 * D + D * H * 128
    norms = 4 * D + 2 * D
    dense = 3 * 33792 * D
    moe_fixed = 896 * D + 896 + 3584 * D + 3584 + D * 3584 + 3 * 6144 * D
    expert = 3 * 3072 * 3584
    glob = 2 * V * D + 3 * D
    fixed = glob + 93 * norms + 69 * kda + 24 * mla + dense + 92 * moe_fixed
    return fixed + 92 * 896 * expert, fixed + 92 * 16 * expert


def test_k3_parameter_counts():
    cfg = K3Config.preset("k3")
    total, active = _k3_params_by_hand()
    assert num_parameters(cfg) == total
    assert active_parameters(cfg) == active


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in PRESETS])
def test_json_round_trip(name, tmp_path):
    cfg = K3Config.preset(name)
    assert K3Config.from_json(cfg.to_json()) == cfg
    path = cfg.save(tmp_path)
    assert path.name == "config.json"
    assert K3Config.from_json(path) == cfg
    assert K3Config.from_json(tmp_path) == cfg
    assert K3Config.from_json({"model_type": "kimi_k3", "text_config": json.loads(path.read_text()),
                               "vision_config": {"vt_hidden_size": 1024}}) == cfg


def _published_k3_text_config() -> dict:
    """K3's text_config in the published spelling (moonshotai/Kimi-K3 config.json; abridged)."""
    full = list(range(4, 93, 4)) + [93]
    return {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 33792,
        "num_hidden_layers": 93, "num_attention_heads": 96, "num_key_value_heads": 96, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "num_experts": 896,
        "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "attn_res_block_size": 12,
        "linear_attn_config": {"kda_layers": [i for i in range(1, 94) if i not in full], "full_attn_layers": full,
                               "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    }


def test_from_published_wrapper_is_k3():
    assert K3Config.from_json({"text_config": _published_k3_text_config()}) == K3Config.preset("k3")


def test_from_flat_spelling():
    flat = {f.name: getattr(K3Config.preset("tiny"), f.name) for f in dataclasses.fields(K3Config)}
    assert K3Config.from_json(flat) == K3Config.preset("tiny")


def test_from_kda_layers_only():
    text = _published_k3_text_config()
    del text["linear_attn_config"]["full_attn_layers"]
    assert K3Config.from_json(text).full_attn_layers == K3Config.preset("k3").full_attn_layers


def _published_with(**lac_or_top):
    text = _published_k3_text_config()
    for k, v in lac_or_top.items():
        if k.startswith("lac_"):
            text["linear_attn_config"][k[4:]] = v
        else:
            text[k] = v
    return text


@pytest.mark.parametrize("raw, match", [
    pytest.param(_published_with(layer_types=["kda"] * 92 + ["swa"]), "unknown layer kind", id="unknown-layer-kind"),
    pytest.param(_published_with(lac_kda_layers=[i for i in range(2, 94) if i % 4 and i != 93]), "no known kind",
                 id="layer-of-no-kind"),
    pytest.param(_published_with(lac_kda_layers=list(range(1, 94))), "in both", id="layer-of-two-kinds"),
    pytest.param(_published_with(num_key_value_heads=7), "not divisible by num_key_value_heads", id="kv-heads"),
    pytest.param(_published_with(n_routed_experts=895), "disagrees", id="alias-conflict"),
    pytest.param(_published_with(moe_router_activation_func="softmax"), "sigmoid", id="softmax-router"),
    pytest.param({"text_config": {"vocab_size": 10}}, "missing required", id="missing-fields"),
])
def test_from_json_rejects(raw, match):
    with pytest.raises(ValueError, match=match):
        K3Config.from_json(raw)


def test_from_json_bad_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        K3Config.from_json(tmp_path)


@pytest.mark.parametrize("change, match", [
    pytest.param({"full_attn_layers": (0, 3)}, "out of range", id="layer-0-is-not-1-indexed"),
    pytest.param({"full_attn_layers": (3, 8)}, "out of range", id="past-last-layer"),
    pytest.param({"full_attn_layers": (3, 3, 6)}, "more than once", id="duplicate"),
    pytest.param({"n_group": 4}, "not divisible by n_group", id="experts-vs-groups"),
    pytest.param({"num_experts_per_tok": 8}, "exceeds", id="topk-gt-experts"),
    pytest.param({"n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 5}, "exceeds",
                 id="topk-gt-reachable"),
    pytest.param({"moe_intermediate_size": 48}, "multiple of 32", id="mxfp4-intermediate"),
    pytest.param({"routed_expert_hidden_size": 40}, "multiple of 32", id="mxfp4-latent"),
    pytest.param({"a_log_size": 2}, "a_log_size", id="a-log-too-short"),
    pytest.param({"kda_num_heads": 0}, "positive int", id="zero-heads"),
    pytest.param({"first_k_dense_replace": 8}, "first_k_dense_replace", id="dense-past-end"),
])
def test_validation_errors(change, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(K3Config.preset("tiny"), **change)


@pytest.mark.parametrize("name, tp, ok", [
    pytest.param("k3", 8, True, id="k3-tp8"),
    pytest.param("k3", 5, False, id="k3-tp5"),
    pytest.param("small", 4, True, id="small-tp4"),
    pytest.param("small", 3, False, id="small-tp3"),
    pytest.param("tiny", 4, True, id="tiny-tp4"),
    pytest.param("tiny", 2, True, id="tiny-tp2"),
    pytest.param("tiny", 3, False, id="tiny-tp3"),
    pytest.param("tiny", 0, False, id="tiny-tp0"),
])
def test_validate_tp(name, tp, ok):
    cfg = K3Config.preset(name)
    if ok:
        cfg.validate_tp(tp)
    else:
        with pytest.raises(ValueError, match="tp"):
            cfg.validate_tp(tp)


def test_layer_index_checked():
    cfg = K3Config.preset("tiny")
    with pytest.raises(ValueError, match="layer index"):
        cfg.is_mla(cfg.num_hidden_layers)
    with pytest.raises(ValueError, match="unknown name"):
        K3Config.preset("huge")


def test_block_configs_carry_the_geometry():
    cfg = K3Config.preset("k3")
    kda, mla, moe = cfg.kda_config(), cfg.mla_config(), cfg.moe_config()
    assert (kda.num_heads, kda.head_dim, kda.conv_size, kda.gate_lower_bound, kda.use_full_rank_gate) == \
        (96, 128, 4, -5.0, True)
    assert (mla.num_heads, mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.v_head_dim) == (96, 1536, 512, 128, 64, 128)
    assert (moe.hidden_size, moe.num_experts, moe.top_k, moe.latent_size, moe.moe_intermediate_size,
            moe.n_shared_experts, moe.shared_intermediate_size) == (7168, 896, 16, 3584, 3072, 2, 6144)


def test_to_json_uses_published_spelling():
    published = _published_k3_text_config()
    written = K3Config.preset("k3").to_json()
    shared = set(published) & set(written)
    assert {"num_experts", "num_experts_per_token", "num_shared_experts", "num_expert_group", "moe_renormalize",
            "activation_situ_beta", "linear_attn_config"} <= shared
    assert {k: written[k] for k in shared} == {k: published[k] for k in shared}
