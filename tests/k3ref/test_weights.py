"""Inventory, synthetic weights and checkpoints, CheckpointReader, admission, and `k3conf admit`."""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from conformance.cli import main as cli_main
from k3ref.config import K3Config
from k3ref.mxfp4 import dequantize
from k3ref.weights import (
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    admit_checkpoint,
    inventory,
    synthetic_checkpoint,
    synthetic_weights,
)

SEED = 7
# name: (tolerance, reason)
STATS_TOL = {
    "pooled_std": (0.05, "std of ~60k pooled bf16 draws normalised to N(0, 1): sampling error ~0.3%, bf16 0.4%"),
}
L = "language_model.model.layers."


@pytest.fixture(scope="module")
def tiny() -> K3Config:
    return K3Config.preset("tiny")


@pytest.fixture(scope="module")
def tiny_weights(tiny):
    return synthetic_weights(tiny, SEED)


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory) -> Path:
    """A tiny checkpoint cut into several shards (so index.json and cross-shard reads are exercised)."""
    return synthetic_checkpoint(tiny, SEED, tmp_path_factory.mktemp("tiny_ckpt"), shard_bytes=40_000)


# ----- inventory -----

@pytest.fixture(scope="module")
def k3_specs() -> dict:
    return {s.name: s for s in inventory(K3Config.preset("k3"))}


def test_k3_inventory_count(k3_specs):
    assert len(inventory(K3Config.preset("k3"))) == len(k3_specs) == 497_052   # and the names are unique


@pytest.mark.parametrize("name, shape, dtype", [
    pytest.param("language_model.model.embed_tokens.weight", (163840, 7168), "BF16", id="embed"),
    pytest.param("language_model.lm_head.weight", (163840, 7168), "BF16", id="lm_head"),
    pytest.param("language_model.model.output_attn_res_proj.weight", (1, 7168), "BF16", id="out-attnres-proj"),
    pytest.param(L + "0.mlp.gate_proj.weight", (33792, 7168), "BF16", id="dense-gate"),
    pytest.param(L + "0.mlp.down_proj.weight", (7168, 33792), "BF16", id="dense-down"),
    pytest.param(L + "0.self_attn.q_proj.weight", (12288, 7168), "BF16", id="kda-q"),
    pytest.param(L + "0.self_attn.q_conv1d.weight", (12288, 1, 4), "F32", id="kda-conv"),
    pytest.param(L + "0.self_attn.A_log", (128,), "F32", id="kda-A_log"),
    pytest.param(L + "1.self_attn.f_b_proj.weight", (12288, 128), "BF16", id="kda-f_b"),
    pytest.param(L + "1.self_attn.b_proj.weight", (96, 7168), "BF16", id="kda-b"),
    pytest.param(L + "2.self_attn.o_norm.weight", (128,), "F32", id="kda-o_norm"),
    pytest.param(L + "3.self_attn.q_b_proj.weight", (18432, 1536), "BF16", id="mla-q_b"),
    pytest.param(L + "3.self_attn.kv_a_proj_with_mqa.weight", (576, 7168), "BF16", id="mla-kv_a"),
    pytest.param(L + "92.self_attn.kv_b_proj.weight", (24576, 512), "BF16", id="mla-kv_b-last"),
    pytest.param(L + "91.self_attn.o_proj.weight", (7168, 12288), "BF16", id="mla-o"),
    pytest.param(L + "5.self_attention_res_proj.weight", (1, 7168), "BF16", id="attnres-proj"),
    pytest.param(L + "1.block_sparse_moe.gate.e_score_correction_bias", (896,), "F32", id="router-bias"),
    pytest.param(L + "1.block_sparse_moe.routed_expert_down_proj.weight", (3584, 7168), "BF16", id="latent-down"),
    pytest.param(L + "1.block_sparse_moe.shared_experts.gate_proj.weight", (6144, 7168), "BF16", id="shared-gate"),
    pytest.param(L + "92.block_sparse_moe.experts.895.w1.weight_packed", (3072, 1792), "U8", id="w1-packed"),
    pytest.param(L + "92.block_sparse_moe.experts.895.w3.weight_scale", (3072, 112), "U8", id="w3-scale"),
    pytest.param(L + "1.block_sparse_moe.experts.0.w2.weight_packed", (3584, 1536), "U8", id="w2-packed"),
    pytest.param(L + "1.block_sparse_moe.experts.0.w2.weight_scale", (3584, 96), "U8", id="w2-scale"),
])
def test_k3_inventory_entries(k3_specs, name, shape, dtype):
    assert (k3_specs[name].shape, k3_specs[name].dtype) == (shape, dtype)


@pytest.mark.parametrize("absent", [
    pytest.param(L + "0.block_sparse_moe.gate.weight", id="no-moe-at-layer-0"),
    pytest.param(L + "1.mlp.gate_proj.weight", id="no-dense-at-layer-1"),
    pytest.param(L + "3.self_attn.A_log", id="no-kda-tensors-in-mla"),
    pytest.param(L + "0.self_attn.g_a_proj.weight", id="full-rank-gate-only"),
    pytest.param(L + "0.self_attn.rotary_emb.inv_freq", id="no-rotary"),
])
def test_k3_inventory_absent(k3_specs, absent):
    assert absent not in k3_specs


# ----- synthetic weights -----

def test_synthetic_deterministic(tiny, tiny_weights):
    again = synthetic_weights(tiny, SEED)
    other = synthetic_weights(tiny, SEED + 1)
    assert all(np.array_equal(again[k], v) for k, v in tiny_weights.items())
    assert not np.array_equal(other[L + "0.self_attn.q_proj.weight"], tiny_weights[L + "0.self_attn.q_proj.weight"])


def test_synthetic_storage_exact(tiny, tiny_weights):
    """Each float tensor is exactly representable in its checkpoint dtype; experts are U8."""
    for spec in inventory(tiny):
        w = tiny_weights[spec.name]
        assert w.shape == spec.shape, spec.name
        if spec.dtype == "U8":
            assert w.dtype == np.uint8, spec.name
            continue
        assert w.dtype == np.float64
        stored = w.astype(ml_dtypes.bfloat16 if spec.dtype == "BF16" else np.float32)
        assert np.array_equal(stored.astype(np.float64), w), spec.name


def test_synthetic_scales(tiny, tiny_weights):
    H = tiny.kda_num_heads
    a_log = tiny_weights[L + "0.self_attn.A_log"]
    assert np.all(a_log[H:] == 0) and np.all((a_log[:H] >= 0) & (a_log[:H] <= np.log(16.0)))
    assert np.all(tiny_weights[L + "1.block_sparse_moe.gate.e_score_correction_bias"] != 0)
    proj = tiny_weights[L + "1.mlp_res_proj.weight"]
    assert np.ptp(proj) > 0, "AttnRes projection must not be uniform (uniform mixing hides bugs)"
    norm = tiny_weights[L + "1.input_layernorm.weight"]
    assert abs(norm.mean() - 1.0) < 0.2 and norm.std() > 0
    linear = [w * np.sqrt(w.shape[-1]) for n, w in tiny_weights.items()
              if n.endswith("_proj.weight") and "_res_" not in n and w.dtype == np.float64]
    pooled = np.concatenate([x.ravel() for x in linear])
    assert abs(pooled.std() - 1.0) < STATS_TOL["pooled_std"][0]
    w1 = dequantize(tiny_weights[L + "1.block_sparse_moe.experts.0.w1.weight_packed"],
                    tiny_weights[L + "1.block_sparse_moe.experts.0.w1.weight_scale"])
    assert w1.shape == (tiny.moe_intermediate_size, tiny.routed_expert_hidden_size) and np.all(np.isfinite(w1))


def test_k3_refuses_to_materialise():
    with pytest.raises(ValueError, match="too large"):
        synthetic_weights(K3Config.preset("k3"), 0)


# ----- checkpoint round trip -----

def test_checkpoint_files(ckpt, tiny):
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert not list(ckpt.glob("*.tmp"))
    index = json.loads((ckpt / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == {s.name for s in inventory(tiny)}
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in inventory(tiny))
    for name, fname in list(index["weight_map"].items())[::17]:
        with safe_open(str(ckpt / fname), framework="numpy") as f:   # the reference reader agrees
            assert name in f.keys()
    assert K3Config.from_json(ckpt / "config.json") == tiny


def test_checkpoint_round_trip(ckpt, tiny, tiny_weights):
    reader = CheckpointReader(ckpt)
    assert len(reader) == len(tiny_weights) and set(reader) == set(tiny_weights)
    for spec in inventory(tiny):
        got = reader[spec.name]
        assert reader.dtype_of(spec.name) == spec.dtype and reader.shape_of(spec.name) == spec.shape
        assert got.dtype == (np.uint8 if spec.dtype == "U8" else np.float32), spec.name
        assert np.array_equal(got, tiny_weights[spec.name]), spec.name
    with pytest.raises(KeyError, match="not in the checkpoint"):
        reader["language_model.model.nope"]


# ----- admission -----

def test_admit_good(ckpt, tiny):
    v = admit_checkpoint(ckpt, tiny)
    assert v.ok and v.problems == [] and "ADMITTED" in v.summary()
    assert v.n_found == v.n_expected == len(inventory(tiny))


def test_admit_reports_every_problem_at_once(tmp_path, tiny, tiny_weights):
    """One missing, one unexpected, one misshaped and one mistyped tensor, written by safetensors itself."""
    def stored(name, w):
        return w if w.dtype == np.uint8 else w.astype(ml_dtypes.bfloat16)

    bad = {n: stored(n, w) for n, w in tiny_weights.items()}
    missing = L + "2.self_attn.kv_b_proj.weight"
    misshaped = L + "0.self_attn.q_proj.weight"
    mistyped = L + "0.self_attn.A_log"          # F32 in K3, written as BF16 here
    unexpected = L + "0.self_attn.rotary_emb.inv_freq"
    del bad[missing]
    bad[misshaped] = bad[misshaped][:-1]
    bad[unexpected] = np.ones(4, np.float32)
    bad["vision_tower.patch_embed.weight"] = np.ones(3, np.float32)   # non-text: ignored, counted
    save_file(bad, str(tmp_path / "model.safetensors"))
    v = admit_checkpoint(tmp_path, tiny)
    assert not v.ok
    got = {(p.kind, p.name) for p in v.problems}
    want = {("missing", missing), ("unexpected", unexpected), ("shape", misshaped), ("dtype", mistyped)}
    # every other F32 tensor was also written as BF16 here: each must be reported as a dtype problem too
    f32 = {("dtype", s.name) for s in inventory(tiny) if s.dtype == "F32" and s.name != mistyped}
    assert got == want | f32
    assert v.n_ignored == 1
    text = v.summary(limit=1000)
    assert all(name in text for _, name in want) and "REJECTED" in text


def test_admit_index_points_at_missing_shard(tmp_path, tiny):
    d = synthetic_checkpoint(tiny, SEED, tmp_path, shard_bytes=40_000)
    gone = sorted(d.glob("*.safetensors"))[1]
    lost = [n for n, f in json.loads((d / INDEX_FILE).read_text())["weight_map"].items() if f == gone.name]
    gone.unlink()
    v = admit_checkpoint(d, tiny)
    kinds = {(p.kind, p.name) for p in v.problems}
    assert ("index", gone.name) in kinds
    assert {("missing", n) for n in lost} <= kinds
    assert {k for k, _ in kinds} == {"index", "missing"}


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5])


def _huge_header_length(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", len(data) * 4) + data[8:])


def _bad_json(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:12] = b"#!x{"
    path.write_bytes(bytes(data))


def _tiny_file(path: Path) -> None:
    path.write_bytes(b"\x01\x02")


@pytest.mark.parametrize("corrupt, match", [
    pytest.param(_truncate, "past the end of the file", id="truncated-data"),
    pytest.param(_huge_header_length, "bad header length", id="header-length"),
    pytest.param(_bad_json, "not valid JSON", id="bad-json"),
    pytest.param(_tiny_file, "8-byte header length", id="shorter-than-8-bytes"),
])
def test_corrupt_shard_names_the_file(tmp_path, tiny, corrupt, match):
    d = synthetic_checkpoint(tiny, SEED, tmp_path, shard_bytes=40_000)
    victim = sorted(d.glob("*.safetensors"))[-1]
    corrupt(victim)
    for read in (lambda: admit_checkpoint(d, tiny), lambda: CheckpointReader(d)):
        with pytest.raises(CheckpointError, match=match) as info:
            read()
        assert victim.name in str(info.value)


# ----- k3conf admit -----

def test_cli_admit(ckpt, tmp_path, capsys):
    assert cli_main(["admit", str(ckpt)]) == 0
    assert "ADMITTED" in capsys.readouterr().out
    assert cli_main(["admit", str(ckpt), "--config", "small"]) == 1   # another config's: refused in 4 lines
    out = capsys.readouterr().out
    assert re.match(rf"REJECTED  {re.escape(str(ckpt))}: not a checkpoint of config small: \d+ of \d+ tensors", out)
    assert "it looks like preset 'tiny'" in out
    assert cli_main(["admit", str(tmp_path / "nowhere"), "--config", "tiny"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert cli_main(["admit", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_cli_admit_corrupt_is_usage_error(tmp_path, tiny, capsys):
    d = synthetic_checkpoint(tiny, SEED, tmp_path, shard_bytes=40_000)
    victim = sorted(d.glob("*.safetensors"))[0]
    _truncate(victim)
    assert cli_main(["admit", str(d)]) == 2
    assert victim.name in capsys.readouterr().err


def test_reader_decodes_bf16_in_a_fresh_interpreter(ckpt):
    """BF16 reads must not depend on someone else having imported ml_dtypes (this test module does; the CLI
    does not): safetensors' numpy loader needs numpy's 'bfloat16' dtype registered."""

    name = "language_model.model.norm.weight"
    code = ("import sys; from k3ref.weights import CheckpointReader; "
            f"a = CheckpointReader(sys.argv[1])[{name!r}]; print(a.dtype, a.shape)")
    done = subprocess.run([sys.executable, "-c", code, str(ckpt)], check=False, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["float32", "(36,)"]


def test_admit_index_with_a_non_string_file_name(tmp_path, tiny):
    d = synthetic_checkpoint(tiny, SEED, tmp_path, shard_bytes=40_000)
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"][L + "0.self_attn.A_log"] = 3
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="A_log"):
        admit_checkpoint(d, tiny)
