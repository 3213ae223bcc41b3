"""The k3 and k3-tp8 shape sets: K3's block sizes read from its config, every batched kernel entry forced on a
B > 1 case, `--shapes` on run and regen, goldens in the cache (never golden/), regeneration byte-identical."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

import k3cuda
from conformance import pytest_plugin
from conformance.cases.catalog import all_cases, select
from conformance.cases.core import CORE_SPECS
from conformance.cases.core_data import history_state
from conformance.cases.protocol import CONFIGS
from conformance.cli import app
from conformance.cli.usage import UsageError
from conformance.golden.regen import regenerate
from conformance.golden.store import COMMITTED_ROOT, default_root, load_manifest
from k3ref.config import K3Config

K3 = K3Config.preset("k3")
SETS = {"k3": 1, "k3-tp8": 8}   # set -> tensor-parallel ranks whose one share it runs


def _core(config: str, block: str):
    return [c for c in all_cases(config) if c.kind == "core" and c.block == block]


def test_the_k3_sets_are_case_sets():
    assert {"tiny", "small", "k3", "k3-tp8"} <= set(CONFIGS)
    blocks = {c.block for c in all_cases("k3")}
    assert set(CORE_SPECS) <= blocks, f"blocks without a k3 case: {set(CORE_SPECS) - blocks}"
    assert {"kda_decode", "kda_prefill", "mla_decode", "rmsnorm", "situ_glu"} <= {c.block for c in all_cases("k3-tp8")}


@pytest.mark.parametrize("config, tp", SETS.items())
def test_attention_cases_run_k3s_heads_with_batches(config, tp):
    for c in _core(config, "kda_decode") + _core(config, "kda_prefill"):
        assert c.params["K"] == c.params["V"] == K3.kda_head_dim, c.name
        assert c.params["B"] > 1 or c.params.get("T", 0) >= 8192, c.name
        assert c.params["lower_bound"] == K3.gate_lower_bound and c.params["draw"] == "k3", c.name
    heads = {c.params["H"] for c in _core(config, "kda_decode")}
    assert heads == {K3.kda_num_heads // tp}
    assert {c.params["history"] for c in _core(config, "kda_decode")} & {1024, 8192}
    for c in _core(config, "mla_decode"):
        p = c.params
        qk_head = K3.qk_nope_head_dim + K3.qk_rope_head_dim
        assert (p["H"], p["R"], p["P"], p["qk_head"]) == (K3.num_attention_heads // tp, K3.kv_lora_rank,
                                                          K3.qk_rope_head_dim, qk_head)
        assert len(p["seq_lens"]) > 1, c.name
    lens = [len(c.params["seq_lens"]) for c in _core(config, "mla_decode")]
    longest = max(max(c.params["seq_lens"]) for c in _core(config, "mla_decode"))
    assert max(lens) == 64 and longest == 32768


def test_k3_other_blocks_at_k3s_widths():
    k3 = {c.name: c.params for c in all_cases("k3") if c.kind == "core"}
    dims = {(p.get("N"), p.get("K")) for n, p in k3.items() if n.startswith("mxfp4_gemv/")}
    assert {(K3.moe_intermediate_size, K3.routed_expert_hidden_size),
            (K3.routed_expert_hidden_size, K3.moe_intermediate_size)} <= dims
    [route] = [p for n, p in k3.items() if n.startswith("moe_route/")]
    assert (route["E"], route["top_k"], route["n_group"], route["topk_group"]) == (
        K3.n_routed_experts, K3.num_experts_per_tok, K3.n_group, K3.topk_group)
    assert K3.hidden_size in {p["D"] for n, p in k3.items() if n.startswith(("rmsnorm/", "attnres_mix/"))}
    assert max(p["S"] for n, p in k3.items() if n.startswith("attnres_mix/")) == 9   # 8 blocks + the prefix


@pytest.mark.parametrize("block", ["kda_decode", "mla_decode"])
def test_every_entry_of_a_batched_kernel_is_forced_on_a_b_gt_1_case(block):
    """A kernel reading sequence 0's row passes every B = 1 case: each entry runs at B > 1 somewhere in tiny,
    forced by the case (param `entry`) or, for MLA, picked by the cache dtype (an fp32 cache: the f32 entry; the
    kda_decode pick depends on the GPU's SM count, so its entries are forced)."""
    module = k3cuda.kernel_module(block)
    entries = module.CHOOSABLE_ENTRIES
    assert entries
    forced: dict[str, list[str]] = {}
    for c in _core("tiny", block):
        batch = c.params["B"] if block == "kda_decode" else len(c.params["seq_lens"])
        entry = c.params.get("entry")
        if entry is None and block == "mla_decode" and not c.params.get("bf16_cache"):
            entry = module.ENTRY_F32
        if entry is not None and batch > 1:
            forced.setdefault(entry, []).append(c.name)
    assert set(entries) <= set(forced), f"{block}: entries never forced at B > 1: {set(entries) - set(forced)}"
    if block == "kda_decode":   # at the kernel's own head size (it is built for K = V = 128 only)
        assert all(_core_param("tiny", n, "K") == 128 for names in forced.values() for n in names)


def _core_param(config: str, name: str, key: str):
    [case] = select(all_cases(config), [name])
    return case.params[key]


def _parse(argv: list[str]) -> argparse.Namespace:
    return app.build_parser().parse_args(argv)


@pytest.mark.parametrize("command", ["run", "regen"])
def test_shapes_is_another_name_for_config(command):
    assert _parse([command, "--shapes", "k3"]).config == "k3"
    assert _parse([command, "--shapes", "k3-tp8"]).config == "k3-tp8"
    assert _parse([command, "--config", "small"]).config == "small"
    assert _parse([command]).config == "tiny"
    with pytest.raises(SystemExit) as e:
        _parse([command, "--shapes", "k4"])
    assert e.value.code == 2


def test_k3_goldens_live_in_the_cache_never_in_golden(tmp_path, monkeypatch):
    monkeypatch.setenv("K3CONF_CACHE", str(tmp_path))
    for config in SETS:
        assert default_root(config) == tmp_path / "golden" / config
    assert not any(f.get("config") in SETS for f in load_manifest(COMMITTED_ROOT)["files"].values())
    args = _parse(["regen", "--shapes", "k3", "--out", str(COMMITTED_ROOT), "--cases", "rmsnorm/T32-D7168"])
    with pytest.raises(UsageError, match="tiny set only"):
        args.func(args)


def test_regeneration_is_byte_identical(tmp_path):
    [case] = select(all_cases("k3-tp8"), ["rmsnorm/T24-D128"])
    for d in ("a", "b"):
        assert [o.status for o in regenerate([case], tmp_path / d)] == ["new"]
    a, b = (tmp_path / d / "rmsnorm" / "T24-D128.safetensors" for d in ("a", "b"))
    assert a.read_bytes() == b.read_bytes()
    assert load_manifest(tmp_path / "a") == load_manifest(tmp_path / "b")
    assert [o.status for o in regenerate([case], tmp_path / "a", check=True)] == ["unchanged"]


def test_a_drawn_history_is_deterministic_and_its_own_per_sequence():
    """The decode state built over a drawn history: the same bytes for the same seed, a different state per
    sequence (a kernel that reads sequence 0's state shows), at the magnitudes a long run reaches."""
    def draw():
        rng = np.random.default_rng(5)
        A_log, dt_bias = np.log(rng.uniform(1.0, 16.0, 2)), 0.5 * rng.standard_normal(2 * 128)
        return history_state(rng, 2, 2, 128, 128, 300, A_log, dt_bias, -5.0)

    s1, s2 = draw(), draw()
    assert s1.tobytes() == s2.tobytes()
    assert not np.allclose(s1[0], s1[1])
    assert 0.01 < float(np.sqrt(np.mean(s1 * s1))) < 100


def test_the_pytest_plugin_offers_every_shape_set():
    assert pytest_plugin._SHAPE_SETS == CONFIGS
