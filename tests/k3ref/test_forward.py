"""The host graph: prefill/decode forms agree, caches advance by one token a step, cores are injectable."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conformance.cli import main as cli_main
from k3ref.cache import HybridCache
from k3ref.config import K3Config
from k3ref.cores import reference_cores
from k3ref.cpu_forward import Ablation, K3CpuModel, forward_prefill, forward_token
from k3ref.cpu_weights import CheckpointWeights
from k3ref.expert_backend import MmapExpertStore, ReaderExpertStore
from k3ref.greedy import greedy_decode, greedy_recompute
from k3ref.tp import LoopbackGroup, TpPlan
from k3ref.tp_weights import synthetic_rank_shard
from k3ref.weights import inventory, synthetic_checkpoint
from tests.support.tolerances import effect, rel_rms, tol

PROMPT = [5, 17, 3, 42, 8, 1, 60]


@pytest.fixture(scope="module")
def tiny() -> K3CpuModel:
    return K3CpuModel.synthetic(K3Config.preset("tiny"), seed=7)


def test_greedy_equals_recompute_16_tokens(tiny):
    cached = greedy_decode(tiny, PROMPT, 16)
    again = greedy_recompute(tiny, PROMPT, 16)
    assert cached.tokens == again.tokens
    assert rel_rms(cached.logits, again.logits) < tol("fp64_long_recurrence")
    assert len(set(cached.tokens)) > 1, "degenerate model: greedy repeats one token"


def test_prefill_then_decode_equals_one_prefill(tiny):
    """Cached decode of the last 3 tokens == prefilling all 10 at once (chunked KDA + expanded MLA)."""
    tokens = PROMPT + [11, 2, 90]
    cache = tiny.new_cache()
    seq = cache.add_sequence()
    forward_prefill(tiny, PROMPT, cache, seq=seq)
    stepped = [forward_token(tiny, t, len(PROMPT) + i, cache, seq=seq) for i, t in enumerate(tokens[len(PROMPT):])]
    full_cache = tiny.new_cache()
    whole = forward_prefill(tiny, tokens, full_cache, seq=full_cache.add_sequence())
    assert rel_rms(np.array(stepped), whole[len(PROMPT):]) < tol("fp64_long_recurrence")


def test_cache_advances_one_token_per_step(tiny):
    cache = tiny.new_cache()
    seq = cache.add_sequence()
    forward_prefill(tiny, PROMPT, cache, seq=seq)
    assert cache.seq_len(seq) == len(PROMPT)
    assert all(int(kv.seq_lens([seq])[0]) == len(PROMPT) for kv in cache.mla.values())
    forward_token(tiny, 4, len(PROMPT), cache, seq=seq)
    assert all(int(kv.seq_lens([seq])[0]) == len(PROMPT) + 1 for kv in cache.mla.values())
    assert all(np.any(st.recurrent != 0) for st in cache.kda.values())


@pytest.mark.parametrize("pos", [pytest.param(6, id="one-early"), pytest.param(8, id="one-late")])
def test_decode_position_off_by_one_is_rejected(tiny, pos):
    cache = tiny.new_cache()
    seq = cache.add_sequence()
    forward_prefill(tiny, PROMPT, cache, seq=seq)
    with pytest.raises(ValueError, match="pos: expected 7"):
        forward_token(tiny, 1, pos, cache, seq=seq)


def test_two_sequences_share_the_cache_independently(tiny):
    """Interleaved sequences in one HybridCache give the same logits as each alone."""
    cache = tiny.new_cache()
    a, b = cache.add_sequence(), cache.add_sequence()
    forward_prefill(tiny, PROMPT, cache, seq=a)
    forward_prefill(tiny, PROMPT[:3], cache, seq=b)
    la = forward_token(tiny, 9, len(PROMPT), cache, seq=a)
    lb = forward_token(tiny, 9, 3, cache, seq=b)
    alone = tiny.new_cache()
    s = alone.add_sequence()
    forward_prefill(tiny, PROMPT[:3], alone, seq=s)
    assert rel_rms(lb, forward_token(tiny, 9, 3, alone, seq=s)) < tol("fp64_same_math")
    assert not np.allclose(la, lb)


def test_cores_are_injected_into_every_layer(tiny):
    calls = []

    def spy_rmsnorm(x, w, eps):
        calls.append(id(w))
        return reference_cores().rmsnorm(x, w, eps)

    cache = tiny.new_cache()
    forward_prefill(tiny, PROMPT[:2], cache, seq=cache.add_sequence(),
                    cores=reference_cores().replace(rmsnorm=spy_rmsnorm))
    # every layer's input and post norm and the final norm went through the core (the weights are the cached
    # cast arrays, so identity names the norm); the KDA o_norm, the MoE latent norm and the MLA q_a / kv_a norms
    # of the prefill (expanded form + cache rows) do too.
    want = [id(tiny.layer(i)[n]) for i in range(tiny.cfg.num_hidden_layers)
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight")]
    want += [id(tiny.globals()["norm.weight"])]
    want += [id(tiny.layer(i)["block_sparse_moe.routed_expert_norm.weight"])
             for i in range(tiny.cfg.first_k_dense_replace, tiny.cfg.num_hidden_layers)]
    want += [id(tiny.layer(i)["self_attn.o_norm.weight"]) for i in tiny.cfg.kda_layers]
    want += [id(tiny.layer(i)[f"self_attn.{n}_layernorm.weight"]) for i in tiny.cfg.mla_layers for n in ("q_a", "kv_a")]
    assert set(want) <= set(calls)


def test_attnres_ablation_changes_the_model(tiny):
    cache0, cache1 = tiny.new_cache(), tiny.new_cache()
    plain = forward_prefill(tiny, PROMPT, cache0, seq=cache0.add_sequence(), ablation=Ablation(attnres_mix=0.0))
    prod = forward_prefill(tiny, PROMPT, cache1, seq=cache1.add_sequence())
    assert rel_rms(plain, prod) > effect("attnres_ablation")


class RecordingWeights(dict):
    """A weight dict that remembers which names were read."""

    def __init__(self, *a):
        super().__init__(*a)
        self.read: set[str] = set()

    def __getitem__(self, k):
        self.read.add(k)
        return super().__getitem__(k)


def test_routed_experts_are_read_only_when_selected(tiny):
    weights = RecordingWeights(tiny.weights)
    model = K3CpuModel(tiny.cfg, weights, tiny.dtype)
    cache = model.new_cache()
    forward_prefill(model, PROMPT[:1], cache, seq=cache.add_sequence())
    experts_read = {k.split(".experts.")[1].split(".")[0] + "@" + k.split(".layers.")[1].split(".")[0]
                    for k in weights.read if ".experts." in k}
    moe_layers = tiny.cfg.num_hidden_layers - tiny.cfg.first_k_dense_replace
    # one token: at most top_k experts per MoE layer, never all of them
    assert len(experts_read) <= tiny.cfg.num_experts_per_tok * moe_layers
    assert tiny.cfg.num_experts_per_tok < tiny.cfg.n_routed_experts


def test_checkpoint_forward_equals_in_memory(tiny, tmp_path):
    synthetic_checkpoint(tiny.cfg, 7, tmp_path)
    loaded = K3CpuModel.from_checkpoint(tmp_path, dtype=np.float64)
    c1, c2 = tiny.new_cache(), loaded.new_cache()
    a = forward_prefill(tiny, PROMPT, c1, seq=c1.add_sequence())
    b = forward_prefill(loaded, PROMPT, c2, seq=c2.add_sequence())
    assert rel_rms(b, a) < tol("fp64_same_math")


def test_k3_cache_memory_accounting():
    cfg = K3Config.preset("k3")
    cache = HybridCache.__new__(HybridCache)  # accounting needs no allocation of 93 layers of state
    cache.cfg = cfg                           # the counts come from the config (k3ref.cache owns the formulas)
    assert cache.mla_bytes_per_token(2) == 24 * 1152
    recurrent, conv = 96 * 128 * 128 * 4, 3 * 96 * 128 * 3 * 4
    assert cache.kda_bytes_per_sequence(4) == 69 * (recurrent + conv)


def test_float32_model_tracks_float64(tiny):
    m32 = K3CpuModel(tiny.cfg, tiny.weights, np.float32)
    c1, c2 = tiny.new_cache(), m32.new_cache()
    a = forward_prefill(tiny, PROMPT, c1, seq=c1.add_sequence())
    b = forward_prefill(m32, PROMPT, c2, seq=c2.add_sequence())
    assert b.dtype == np.float32
    assert rel_rms(b, a) < tol("fp32_model")


@pytest.mark.parametrize("tp", [pytest.param(t, id=f"tp{t}") for t in (1, 2, 4)])
def test_tensor_parallel_ranks_equal_tp1(tiny, tp):
    """Each rank runs the same host graph on its shard with real collectives (threads): same tokens, logits."""

    cfg = tiny.cfg
    if cfg.kda_num_heads % 4 or cfg.num_attention_heads % 4:
        cfg = dataclasses.replace(cfg, kda_num_heads=4, num_attention_heads=4)
    ref = greedy_decode(K3CpuModel.synthetic(cfg, seed=3), PROMPT, 3)
    plan = TpPlan(cfg, tp)

    def rank(r, comm):
        shard, _ = synthetic_rank_shard(plan, r, seed=3)
        return greedy_decode(K3CpuModel(plan.local_config(), shard, tp=plan.rank(r, comm)), PROMPT, 3)

    for got in LoopbackGroup(tp).run(rank):
        assert got.tokens == ref.tokens
        assert rel_rms(got.logits, ref.logits) < tol("fp64_same_math")


@pytest.mark.parametrize("decode", [pytest.param(greedy_decode, id="cached"),
                                    pytest.param(greedy_recompute, id="recompute")])
def test_greedy_zero_new_tokens(tiny, decode):
    out = decode(tiny, PROMPT, 0)
    assert out.tokens == [] and out.logits.shape == (0, tiny.cfg.vocab_size)


def test_tied_embeddings_use_the_embedding_table():
    cfg = dataclasses.replace(K3Config.preset("tiny"), tie_word_embeddings=True)
    model = K3CpuModel.synthetic(cfg, seed=2)
    assert "language_model.lm_head.weight" not in model.weights
    cache = model.new_cache()
    logits = forward_prefill(model, PROMPT, cache, seq=cache.add_sequence())
    assert logits.shape == (len(PROMPT), cfg.vocab_size)
    np.testing.assert_array_equal(model.lm_head(), model.weights["language_model.model.embed_tokens.weight"])


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    """A checkpoint whose config is NOT the tiny preset (another vocab and block size)."""

    cfg = dataclasses.replace(K3Config.preset("tiny"), vocab_size=131, attn_res_block_size=2)
    return cfg, synthetic_checkpoint(cfg, 1, tmp_path_factory.mktemp("other"))


def test_cli_decode_checkpoint_reads_its_config(other_ckpt, capsys):
    cfg, d = other_ckpt
    assert cli_main(["decode", "--checkpoint", str(d), "--prompt", "1,2,120", "--max-new", "3", "--ids-only"]) == 0
    got = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    model = K3CpuModel.from_checkpoint(d, dtype=np.float64)
    assert model.cfg == cfg and got == greedy_decode(model, [1, 2, 120], 3).tokens


def test_checkpoint_with_a_foreign_config_is_refused(other_ckpt, capsys):
    _, d = other_ckpt
    with pytest.raises(ValueError, match=r"embed_tokens.weight: expected shape \[97, 36\].*found \[131, 36\]"):
        K3CpuModel.from_checkpoint(d, K3Config.preset("tiny"))
    assert cli_main(["decode", "--checkpoint", str(d), "--config", "tiny", "--prompt", "1"]) == 2
    assert "k3conf admit" in capsys.readouterr().err


# ----- routed experts served by the expert store (k3ref.expert_backend) -----

@pytest.fixture(scope="module")
def tiny_ckpt(tiny, tmp_path_factory):
    """The tiny model's weights (seed 7) as a checkpoint, several shards so experts span files."""

    return synthetic_checkpoint(tiny.cfg, 7, tmp_path_factory.mktemp("tiny_ckpt"), shard_bytes=50_000)


def _spy_cores(routes: list, gemv_args: list):
    """Reference cores that record every moe_route result (indices) and every mxfp4_gemv weight pair."""
    ref = reference_cores()

    def moe_route(*a, **kw):
        w, idx = ref.moe_route(*a, **kw)
        routes.append(np.array(idx))
        return w, idx

    def mxfp4_gemv(packed, scale, x):
        gemv_args.append((packed, scale))
        return ref.mxfp4_gemv(packed, scale, x)

    return ref.replace(moe_route=moe_route, mxfp4_gemv=mxfp4_gemv)


def _expert_nbytes(cfg) -> dict[tuple[int, int], int]:
    """(layer, expert) -> stored bytes of its six MXFP4 tensors, from the inventory (not from any store)."""

    out: dict[tuple[int, int], int] = {}
    for spec in inventory(cfg):
        if ".block_sparse_moe.experts." in spec.name:
            layer = int(spec.name.split(".layers.")[1].split(".")[0])
            expert = int(spec.name.split(".experts.")[1].split(".")[0])
            out[(layer, expert)] = out.get((layer, expert), 0) + spec.nbytes
    return out


def _selected(cfg, routes: list) -> set[tuple[int, int]]:
    """The (layer, expert) pairs in the router's choices: one moe_route call per MoE layer, in layer order."""
    moe_layers = list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    assert len(routes) == len(moe_layers), f"expected one moe_route call per MoE layer, found {len(routes)}"
    return {(layer, int(e)) for layer, idx in zip(moe_layers, routes, strict=True) for e in idx.reshape(-1)}


def test_checkpoint_model_serves_experts_from_the_mmap_store(tiny_ckpt, monkeypatch):
    monkeypatch.delenv("K3_EXPERT_BACKEND", raising=False)
    loaded = K3CpuModel.from_checkpoint(tiny_ckpt, dtype=np.float64)
    assert isinstance(loaded.weights, CheckpointWeights)
    assert type(loaded.expert_store) is MmapExpertStore and loaded.expert_store is loaded.weights.store
    assert loaded.expert_store.bytes_touched == 0, "loading reads headers only"


@pytest.mark.parametrize("fast", ["numpy", "jit"])
def test_checkpoint_forward_equals_in_memory_exactly(tiny, tiny_ckpt, monkeypatch, fast):
    """Experts from memmaps, the rest from the reader: the same bits as the in-memory weights, prefill and decode,
    with the NumPy forms. The compiled default multiplies the checkpoint's bf16 lm_head by the bf16 GEMV, whose
    fixed-order sums differ from BLAS's over the in-memory float table in the last bits only."""
    monkeypatch.delenv("K3_EXPERT_BACKEND", raising=False)
    monkeypatch.setenv("K3_FAST", fast)
    loaded = K3CpuModel.from_checkpoint(tiny_ckpt, dtype=np.float64)
    c1, c2 = tiny.new_cache(), loaded.new_cache()
    s1, s2 = c1.add_sequence(), c2.add_sequence()
    pairs = [(forward_prefill(loaded, PROMPT, c2, seq=s2), forward_prefill(tiny, PROMPT, c1, seq=s1))]
    for i, t in enumerate([11, 2]):
        pos = len(PROMPT) + i
        pairs.append((forward_token(loaded, t, pos, c2, seq=s2), forward_token(tiny, t, pos, c1, seq=s1)))
    for got, want in pairs:
        if fast == "numpy":
            np.testing.assert_array_equal(got, want)
        else:
            assert rel_rms(got, want) <= tol("fp64_same_math")


def test_bytes_touched_are_exactly_the_selected_experts(tiny_ckpt, monkeypatch):
    monkeypatch.delenv("K3_EXPERT_BACKEND", raising=False)
    model = K3CpuModel.from_checkpoint(tiny_ckpt, dtype=np.float64)
    store, sizes = model.expert_store, _expert_nbytes(model.cfg)
    cache = model.new_cache()
    seq = cache.add_sequence()

    routes: list = []
    forward_prefill(model, PROMPT, cache, seq=seq, cores=_spy_cores(routes, []))
    picked = _selected(model.cfg, routes)
    # a prefill reads each expert that any of its tokens picked once per layer
    assert store.bytes_touched == sum(sizes[le] for le in picked)

    before, routes = store.bytes_touched, []
    forward_token(model, 4, len(PROMPT), cache, seq=seq, cores=_spy_cores(routes, []))
    picked = _selected(model.cfg, routes)
    moe_layers = model.cfg.num_hidden_layers - model.cfg.first_k_dense_replace
    assert len(picked) == model.cfg.num_experts_per_tok * moe_layers, "one token: top_k distinct experts a layer"
    assert store.bytes_touched - before == sum(sizes[le] for le in picked)
    assert store.bytes_touched - before < sum(sizes.values()), "a decode step must not read every expert"


def test_expert_arrays_reaching_the_core_are_memory_mapped(tiny_ckpt, monkeypatch):
    monkeypatch.delenv("K3_EXPERT_BACKEND", raising=False)
    model = K3CpuModel.from_checkpoint(tiny_ckpt, dtype=np.float64)
    cache = model.new_cache()
    routes, gemv_args = [], []
    forward_token(model, 4, 0, cache, seq=cache.add_sequence(), cores=_spy_cores(routes, gemv_args))
    maps = list(model.expert_store._maps.values())
    assert maps and all(isinstance(m, np.memmap) for m in maps)
    # three gemvs (w1, w3, w2) per selected expert, each handed a packed and a scale array
    assert len(gemv_args) == 3 * len(_selected(model.cfg, routes))

    def mapped(a):
        base = a
        while base is not None and not any(base is m for m in maps):
            base = base.base
        return base is not None and np.shares_memory(a, base)

    for packed, scale in gemv_args:
        assert packed.dtype == np.uint8 and scale.dtype == np.uint8
        assert mapped(packed) and mapped(scale), "an expert tensor was copied on its way to the core"
        assert not packed.flags.writeable and not scale.flags.writeable


def test_reader_expert_backend_copies_and_agrees(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("K3_EXPERT_BACKEND", "reader")
    by_reader = K3CpuModel.from_checkpoint(tiny_ckpt, dtype=np.float64)
    monkeypatch.delenv("K3_EXPERT_BACKEND")
    by_mmap = K3CpuModel.from_checkpoint(tiny_ckpt, dtype=np.float64)
    assert type(by_reader.expert_store) is ReaderExpertStore
    c1, c2 = by_reader.new_cache(), by_mmap.new_cache()
    a = forward_prefill(by_reader, PROMPT, c1, seq=c1.add_sequence())
    b = forward_prefill(by_mmap, PROMPT, c2, seq=c2.add_sequence())
    np.testing.assert_array_equal(a, b)
    assert by_reader.expert_store.bytes_touched == by_mmap.expert_store.bytes_touched > 0
    assert by_reader.expert_store._maps == {}, "the reader backend maps no shard"


def test_unknown_expert_backend_is_refused(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("K3_EXPERT_BACKEND", "nvme")
    with pytest.raises(ValueError,
                       match=r"K3_EXPERT_BACKEND='nvme': unknown expert backend; known: \['mmap', 'reader'\]"):
        K3CpuModel.from_checkpoint(tiny_ckpt, dtype=np.float64)


def test_in_memory_model_has_no_expert_store(tiny):
    assert tiny.expert_store is None
