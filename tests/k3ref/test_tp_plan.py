"""TpPlan: split kinds, axes and rank-local shapes; shard() against the algebra it must preserve; sizes."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conformance.cli import main as cli_main
from k3ref.config import K3Config
from k3ref.tp import LoopbackGroup, TpPlan
from k3ref.tp_weights import read_rank_shard, synthetic_rank_shard
from k3ref.weights import CheckpointReader, inventory, num_parameters, synthetic_checkpoint, synthetic_weights

L = "language_model.model.layers."
TPS = [pytest.param(tp, id=f"tp{tp}") for tp in (1, 2, 4, 8)]
# name: (tolerance, reason)
TOL = {"fp64_sum": (1e-12, "a float64 matmul split into partial sums: rounding differs by summation order only")}


@pytest.fixture(scope="module")
def small() -> K3Config:
    return K3Config.preset("small")   # 8 KDA and 8 MLA heads: tp 1, 2, 4, 8 are all legal


@pytest.fixture(scope="module")
def plans(small) -> dict[int, TpPlan]:
    return {tp: TpPlan(small, tp) for tp in (1, 2, 4, 8)}


def _full(plan: TpPlan, name: str, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(plan.entries[name].spec.shape)


# (local name in a KDA layer 0 / MLA layer 3 of `small`, kind, axis)
KINDS = [
    pytest.param(L + "0.self_attn.q_proj.weight", "column", 0, id="kda-q"),
    pytest.param(L + "0.self_attn.v_conv1d.weight", "column", 0, id="kda-conv"),
    pytest.param(L + "0.self_attn.dt_bias", "column", 0, id="kda-dt_bias"),
    pytest.param(L + "0.self_attn.f_a_proj.weight", "replicated", None, id="kda-f_a"),
    pytest.param(L + "0.self_attn.f_b_proj.weight", "column", 0, id="kda-f_b"),
    pytest.param(L + "0.self_attn.b_proj.weight", "column", 0, id="kda-b"),
    pytest.param(L + "0.self_attn.g_proj.weight", "column", 0, id="kda-g"),
    pytest.param(L + "0.self_attn.o_norm.weight", "replicated", None, id="kda-o_norm"),
    pytest.param(L + "0.self_attn.o_proj.weight", "row", 1, id="kda-o"),
    pytest.param(L + "3.self_attn.q_a_proj.weight", "replicated", None, id="mla-q_a"),
    pytest.param(L + "3.self_attn.q_b_proj.weight", "column", 0, id="mla-q_b"),
    pytest.param(L + "3.self_attn.kv_a_proj_with_mqa.weight", "replicated", None, id="mla-kv_a-latent-replicated"),
    pytest.param(L + "3.self_attn.kv_b_proj.weight", "column", 0, id="mla-kv_b"),
    pytest.param(L + "3.self_attn.o_proj.weight", "row", 1, id="mla-o"),
    pytest.param(L + "0.mlp.gate_proj.weight", "replicated", None, id="dense-mlp"),
    pytest.param(L + "1.block_sparse_moe.shared_experts.down_proj.weight", "replicated", None, id="shared"),
    pytest.param(L + "1.block_sparse_moe.gate.weight", "replicated", None, id="router"),
    pytest.param(L + "1.block_sparse_moe.experts.5.w2.weight_packed", "expert", None, id="routed-expert"),
    pytest.param(L + "1.input_layernorm.weight", "replicated", None, id="norm"),
    pytest.param("language_model.model.embed_tokens.weight", "vocab", 0, id="embed"),
    pytest.param("language_model.lm_head.weight", "vocab", 0, id="lm_head"),
]


@pytest.mark.parametrize("name, kind, axis", KINDS)
@pytest.mark.parametrize("tp", TPS)
def test_kind_axis_and_local_shape(plans, name, kind, axis, tp):
    e = plans[tp].entries[name]
    assert (e.kind, e.axis) == (kind, axis)
    want = list(e.spec.shape)
    if axis is not None:
        want[axis] = -(-want[axis] // tp)
    assert e.local_shape == tuple(want)
    placeholder = np.broadcast_to(np.float32(0), e.spec.shape)   # shapes only: no 32M-element draws
    assert plans[tp].shard(name, placeholder, 0).shape == e.local_shape


@pytest.mark.parametrize("tp", TPS)
def test_local_shapes_are_the_local_config(plans, tp):
    """Every non-vocab rank-local shape is the shape of the same tensor for H / tp heads."""
    local = {s.name: s.shape for s in inventory(plans[tp].local_config())}
    for name, e in plans[tp].entries.items():
        if e.kind != "vocab":
            assert e.local_shape == local[name], name


@pytest.mark.parametrize("name, heads", [
    pytest.param(L + "0.self_attn.q_proj.weight", "kda_num_heads", id="kda-q"),
    pytest.param(L + "0.self_attn.g_proj.weight", "kda_num_heads", id="kda-g"),
    pytest.param(L + "3.self_attn.q_b_proj.weight", "num_attention_heads", id="mla-q_b"),
    pytest.param(L + "3.self_attn.kv_b_proj.weight", "num_attention_heads", id="mla-kv_b"),
])
@pytest.mark.parametrize("tp", TPS)
def test_column_shards_are_whole_heads(plans, small, name, heads, tp):
    """Rank r's column shard of x -> W x is the output of heads [r H/tp, (r+1) H/tp), each head whole."""
    plan = plans[tp]
    W = _full(plan, name)
    H = getattr(small, heads)
    per_head = W.shape[0] // H
    x = np.random.default_rng(1).standard_normal(W.shape[1])
    y = W @ x
    for r in range(tp):
        heads = slice(r * H // tp * per_head, (r + 1) * H // tp * per_head)
        np.testing.assert_array_equal(plan.shard(name, W, r) @ x, y[heads])


@pytest.mark.parametrize("name", [
    pytest.param(L + "0.self_attn.o_proj.weight", id="kda-o"),
    pytest.param(L + "3.self_attn.o_proj.weight", id="mla-o"),
])
@pytest.mark.parametrize("tp", TPS)
def test_row_shards_sum_to_the_output(plans, name, tp):
    """sum over ranks of o_proj_r @ (rank r's heads of the mixer output) == o_proj @ all heads."""
    plan = plans[tp]
    W = _full(plan, name)
    o = np.random.default_rng(2).standard_normal(W.shape[1])
    n = W.shape[1] // tp
    partial = sum(plan.shard(name, W, r) @ o[r * n:(r + 1) * n] for r in range(tp))
    assert np.linalg.norm(partial - W @ o) <= TOL["fp64_sum"][0] * np.linalg.norm(W @ o)


@pytest.mark.parametrize("tp", TPS)
def test_a_log_keeps_padding(plans, small, tp):
    name = L + "0.self_attn.A_log"
    a = np.zeros(small.a_log_size)
    a[: small.kda_num_heads] = np.arange(1, small.kda_num_heads + 1)
    h = small.kda_num_heads // tp
    for r in range(tp):
        got = plans[tp].shard(name, a, r)
        assert got.shape == a.shape
        np.testing.assert_array_equal(got[:h], a[r * h:(r + 1) * h])
        assert np.all(got[h:] == 0)


@pytest.mark.parametrize("tp, sizes", [
    pytest.param(1, [97], id="tp1"),
    pytest.param(4, [25, 25, 25, 22], id="tp4-uneven"),
])
def test_vocab_split_uneven(tp, sizes):
    plan = TpPlan(K3Config.preset("tiny"), tp)
    name = "language_model.lm_head.weight"
    W = np.arange(97 * 36, dtype=np.float64).reshape(97, 36)
    parts = [plan.shard(name, W, r) for r in range(tp)]
    assert [p.shape[0] for p in parts] == sizes
    np.testing.assert_array_equal(np.concatenate(parts), W)


@pytest.mark.parametrize("tp", TPS)
def test_replicated_and_expert_are_whole(plans, tp):
    dense = L + "0.mlp.down_proj.weight"
    W = _full(plans[tp], dense)
    assert all(plans[tp].shard(dense, W, r) is W for r in range(tp))
    E = plans[tp].cfg.n_routed_experts
    owners = []
    for e in range(E):
        name = L + f"1.block_sparse_moe.experts.{e}.w1.weight_packed"
        W = _full(plans[tp], name)
        held = [r for r in range(tp) if plans[tp].holds(name, r)]
        assert len(held) == 1, f"expert {e} must live on exactly one rank, found {held}"
        assert plans[tp].shard(name, W, held[0]) is W
        owners.append(held[0])
        for r in set(range(tp)) - set(held):
            with pytest.raises(ValueError, match="does not hold"):
                plans[tp].shard(name, W, r)
    assert owners == sorted(owners) and len(set(owners)) == min(tp, E), "contiguous expert chunks on every rank"


def test_shard_rejects(plans):
    plan = plans[2]
    name = L + "0.self_attn.q_proj.weight"
    W = _full(plan, name)
    with pytest.raises(ValueError, match="full shape"):
        plan.shard(name, W[:-1], 0)
    with pytest.raises(ValueError, match="rank"):
        plan.shard(name, W, 2)
    with pytest.raises(ValueError, match="not a tensor"):
        plan.shard("language_model.model.layers.0.self_attn.rotary.weight", W, 0)


@pytest.mark.parametrize("name, tp", [
    pytest.param("small", 3, id="small-tp3"),
    pytest.param("tiny", 3, id="tiny-tp3"),
    pytest.param("small", 16, id="small-tp16"),
])
def test_tp_not_dividing_heads_raises(name, tp):
    with pytest.raises(ValueError, match="does not divide"):
        TpPlan(K3Config.preset(name), tp)


@pytest.fixture(scope="module")
def k3_tp8() -> TpPlan:
    return TpPlan(K3Config.preset("k3"), 8)


def test_k3_tp8_sizes(k3_tp8):
    """Per-rank bytes re-derived by hand from docs/spec.md sections 2 and 7 (bf16 2 B, F32 4 B, U8 1 B)."""
    D, V, H, K, tp = 7168, 163840, 96, 128, 8
    h = H // tp
    kda = (2 * (3 * h * K * D + K * D + h * K * K + h * D + h * K * D + D * h * K)
           + 4 * (3 * h * K * 4 + 128 + h * K + K))
    mla = 2 * (1536 * D + 1536 + h * 192 * 1536 + 576 * D + 512 + h * 256 * 512 + h * 128 * D + D * h * 128)
    mlp = 2 * 3 * 33792 * D + 92 * (2 * (896 * D + 3584 * D + 3584 + D * 3584 + 3 * 6144 * D) + 4 * 896)
    expert = 2 * (3072 * 1792 + 3072 * 112) + 3584 * 1536 + 3584 * 96
    per = k3_tp8.weight_bytes_per_rank()
    assert per["attention"] == 69 * kda + 24 * mla
    assert per["mlp"] == mlp
    assert per["experts"] == 92 * (896 // tp) * expert  # expert-parallel: 112 whole experts per rank
    assert per["embeddings"] == 2 * 2 * (V // tp) * D
    assert per["norms"] == 2 * (93 * 6 * D + 3 * D)
    assert per["total"] == sum(per[g] for g in ("attention", "mlp", "experts", "embeddings", "norms"))
    assert k3_tp8.kv_bytes_per_token() == 24 * 576 * 2
    assert k3_tp8.kv_bytes_per_token(dtype_bytes=1) == 24 * 576
    assert k3_tp8.kda_state_bytes_per_sequence() == 69 * (h * K * K * 4 + 3 * h * K * 3 * 4)


def test_cli_model_info(capsys):
    assert cli_main(["model", "info", "--config", "small", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    plan = TpPlan(K3Config.preset("small"), 4)
    assert f"{plan.kv_bytes_per_token():,}" in out and f"{plan.kda_state_bytes_per_sequence():,}" in out
    assert f"{num_parameters(K3Config.preset('small')):,}" in out
    for group, n in plan.weight_bytes_per_rank().items():
        assert f"{group}" in out and f"{n:,}" in out
    assert cli_main(["model", "info", "--config", "small", "--tp", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_a_rank_without_experts_is_refused():
    cfg = dataclasses.replace(K3Config.preset("tiny"), n_routed_experts=3, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="leave rank 3 without an expert"):
        TpPlan(cfg, 4)          # chunks of 1: experts 0, 1, 2 and nothing for rank 3
    assert TpPlan(cfg, 2).expert_range(1) == (2, 3)


@pytest.mark.parametrize("tp", [pytest.param(t, id=f"tp{t}") for t in (2, 4)])
def test_synthetic_shard_is_the_slice_of_the_full_weights(tp):
    cfg = K3Config.preset("tiny")
    plan, full = TpPlan(cfg, tp), synthetic_weights(cfg, seed=5)
    for r in range(tp):
        shard, cost = synthetic_rank_shard(plan, r, seed=5)
        assert set(shard) == {n for n in full if plan.holds(n, r)}
        for n, a in shard.items():
            np.testing.assert_array_equal(np.asarray(a, np.float64) if a.dtype != np.uint8 else a,
                                          plan.shard(n, full[n], r), err_msg=n)
        assert cost.resident == plan.rank_bytes(r)["total"]


@pytest.mark.parametrize("tp", [pytest.param(t, id=f"tp{t}") for t in (2, 4)])
def test_read_shard_reads_only_the_slices(tmp_path, tp):
    """From a checkpoint directory a rank copies exactly its slices: the bytes counted are the plan's for that
    rank (less the A_log padding it fills with zeros), and every array equals the slice of the full tensor."""

    cfg = K3Config.preset("tiny")
    synthetic_checkpoint(cfg, 2, tmp_path, shard_bytes=1 << 16)
    entries = CheckpointReader(tmp_path).entries
    plan, full = TpPlan(cfg, tp), synthetic_weights(cfg, seed=2)
    pad = (cfg.a_log_size - cfg.kda_num_heads // tp) * 4 * len(cfg.kda_layers)   # F32 zeros, not read
    for r in range(tp):
        shard, cost = read_rank_shard(plan, r, entries)
        assert cost.read == plan.rank_bytes(r)["total"] - pad
        assert cost.resident == plan.rank_bytes(r)["total"]
        for n, a in shard.items():
            np.testing.assert_array_equal(np.asarray(a, np.float64) if a.dtype != np.uint8 else a,
                                          plan.shard(n, full[n], r), err_msg=n)
    del entries[L + "1.block_sparse_moe.experts.6.w1.weight_scale"]
    with pytest.raises(ValueError,
                       match=rf"rank {tp - 1}: tensor .*experts\.6\.w1\.weight_scale of its shard is missing"):
        read_rank_shard(plan, tp - 1, entries)


def test_loopback_rank_that_raises_is_named_and_releases_the_others():
    def work(rank, comm):
        if rank == 1:
            raise ValueError("bad tensor")
        return comm.all_reduce(np.ones(3))     # would wait forever for rank 1 without the abort

    with pytest.raises(RuntimeError, match="rank 1: ValueError: bad tensor"):
        LoopbackGroup(3, timeout=30).run(work)


def test_gather_vocab_uneven():
    plan = TpPlan(K3Config.preset("tiny"), 4)     # vocab 97 in rows of 25, 25, 25, 22
    full = np.arange(2 * 97, dtype=np.float64).reshape(2, 97)

    def work(rank, comm):
        tp = plan.rank(rank, comm)
        return tp.gather_vocab(full[:, tp.vocab.start:tp.vocab.stop])

    for got in LoopbackGroup(4).run(work):
        np.testing.assert_array_equal(got, full)
