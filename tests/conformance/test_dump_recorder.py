"""The dump recorders: forward hooks on the PyTorch K3 model (bf16 and float32, TP-1 and a simulated TP-2, an
HF-style wrapper), and k3ref's host graph (float64 / float32, and a real TP-2 run whose ranks each write their
own directory). The dumped tensors must be the model's own: equal to its `records=` output and its layer
wiring, bit for bit."""
from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: pip install 'k3-conformance[torch]'")

from conformance.dumps import Dump, DumpWriter, TorchDumpHooks, merge_ranks, record_torch  # noqa: E402
from conformance.dumps.names import num_blocks, required_keys  # noqa: E402
from conformance.dumps.recorder_ref import record_ref, record_ref_tp  # noqa: E402
from k3ref.config import K3Config  # noqa: E402
from k3ref.cpu_forward import K3CpuModel  # noqa: E402
from k3ref.greedy import greedy_decode  # noqa: E402
from k3ref.safetensors_io import read_header  # noqa: E402
from k3ref.tp_weights import synthetic_rank_shard  # noqa: E402
from k3ref.weights import synthetic_weights  # noqa: E402
from k3torch.modeling_k3 import linear  # noqa: E402
from k3torch.trace import build_model  # noqa: E402
from tests.support.tolerances import rel_rms, tol  # noqa: E402

pytestmark = pytest.mark.torch
CFG = K3Config.preset("tiny")
PROMPT = [5, 17, 3, 9]
NEW = 2
SEED = 7


@pytest.fixture(scope="module")
def weights():
    return synthetic_weights(CFG, SEED)


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def recorded(request, weights, tmp_path_factory):
    """(precision, model, dump) for one precision of the k3torch model."""
    model = build_model(CFG.to_json(), weights, request.param)
    path = record_torch(model, PROMPT, NEW, tmp_path_factory.mktemp(request.param) / "dump", config=CFG.to_json())
    return request.param, model, Dump.open(path)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def test_every_tensor_is_recorded(recorded):
    precision, model, dump = recorded
    assert dump.dtype == {"bf16": "bfloat16", "fp32": "float32"}[precision]
    assert dump.layers == tuple(range(CFG.num_hidden_layers)) and len(dump.steps) == NEW + 1
    # k3torch's bf16 model holds activations in float32: the dump must say so, not round them
    assert (dump.fp32 >= {"prefix", "a", "f", "logits"}) == (precision == "bf16")
    for s in dump.steps:
        T = len(s.tokens)
        for layer in dump.layers:
            for key in required_keys(CFG, layer) + ("h", "x_mixer", "m", "x_mlp"):
                assert dump.has(s.index, f"layers.{layer}.{key}"), (s.index, layer, key)
            assert dump.has(s.index, f"layers.{layer}.router.ids") == (not CFG.mlp_is_dense(layer))
            assert dump.has(s.index, f"layers.{layer}.kda.core_out") == (not CFG.is_mla(layer))
            assert dump.layer_input(s.index, layer)[0].shape == (num_blocks(CFG, layer), T, CFG.hidden_size)
        assert dump.shape(s.index, "logits") == (1, CFG.vocab_size)
    assert dump.nonfinite() == []


def test_steps_follow_greedy_decoding(recorded):
    _, model, dump = recorded
    want = model.generate(torch.tensor(PROMPT), NEW + 1)[0].tolist()
    assert dump.chosen == want
    assert [s.tokens.tolist() for s in dump.steps] == [PROMPT] + [[t] for t in want[:NEW]]
    assert [s.start for s in dump.steps] == [0, len(PROMPT), len(PROMPT) + 1]


def test_hooks_see_what_the_model_records(recorded):
    """The hooks' tensors equal the model's own `records=` output and its logits, bit for bit."""
    _, model, dump = recorded
    cache = model.new_cache(1)
    for s in dump.steps:
        records: dict = {}
        logits = model(torch.tensor(s.tokens)[None], cache, records=records)
        for layer, rec in records.items():
            for key, t in rec.items():
                assert bits(dump.raw(s.index, f"layers.{layer}.{key}")) == bits(t[0].numpy()), (s.index, layer, key)
        assert bits(dump.raw(s.index, "logits")) == bits(logits[0, -1:].numpy())
        head = model.language_model.logits(torch.from_numpy(dump.raw(s.index, "final.hidden")))
        assert bits(dump.raw(s.index, "logits")) == bits(head[-1:].numpy())


def test_layer_inputs_follow_the_attnres_wiring(recorded):
    """prefix(l+1) = prefix(l) + a + f, or a + f when layer l opens a block (then blocks(l+1) = blocks(l) +
    [prefix(l)]); layer 0's prefix is the embedding."""
    _, model, dump = recorded
    B = CFG.attn_res_block_size
    for s in dump.steps:
        emb = model.language_model.model.embed(torch.tensor(s.tokens)[None]).prefix[0].numpy()
        assert bits(dump.raw(s.index, "layers.0.prefix")) == bits(emb)
        for layer in dump.layers[:-1]:
            prefix, a, f = (dump.raw(s.index, f"layers.{layer}.{k}") for k in ("prefix", "a", "f"))
            nxt = f"layers.{layer + 1}."
            if layer % B == 0:
                assert bits(dump.raw(s.index, nxt + "prefix")) == bits(a + f)
                assert bits(dump.raw(s.index, nxt + "blocks")[-1]) == bits(prefix)
            else:
                assert bits(dump.raw(s.index, nxt + "prefix")) == bits(prefix + a + f)
                assert bits(dump.raw(s.index, nxt + "blocks")) == bits(dump.raw(s.index, f"layers.{layer}.blocks"))


def test_router_hook_records_the_routers_choice(recorded):
    _, model, dump = recorded
    layers = model.language_model.model.decoder_layers()
    for s in dump.steps:
        for layer in dump.layers:
            if CFG.mlp_is_dense(layer):
                continue
            w, idx = layers[layer].block_sparse_moe.gate(torch.from_numpy(dump.raw(s.index, f"layers.{layer}.x_mlp")))
            np.testing.assert_array_equal(dump.get(s.index, f"layers.{layer}.router.ids"), idx.numpy())
            assert bits(dump.raw(s.index, f"layers.{layer}.router.weights")) == bits(w.numpy())


def test_expert_hooks_record_every_slot(recorded):
    """experts.in is the routed experts' input in the model's dtype (what their matmuls take) and slot j of
    token t in experts.out is expert router.ids[t, j]'s output, bit for bit as the model computes it."""
    precision, model, dump = recorded
    layers = model.language_model.model.decoder_layers()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    assert ("experts.out" in dump.fp32, "experts.in" in dump.fp32) == (precision == "bf16", False)
    for s in dump.steps:
        for layer in dump.layers:
            key = f"layers.{layer}."
            assert dump.has(s.index, key + "experts.in") == dump.has(s.index, key + "experts.out") == (
                not CFG.mlp_is_dense(layer))
            if CFG.mlp_is_dense(layer):
                continue
            moe = layers[layer].block_sparse_moe
            z = linear(torch.from_numpy(dump.raw(s.index, key + "x_mlp")), moe.routed_expert_down_proj.weight)
            np.testing.assert_array_equal(dump.get(s.index, key + "experts.in"), z.to(dtype).double().numpy())
            ids, out = dump.get(s.index, key + "router.ids"), dump.raw(s.index, key + "experts.out")
            for e in np.unique(ids):
                rows, slot = np.nonzero(ids == e)
                want = moe.experts[int(e)](z[torch.from_numpy(rows)]).numpy()
                assert bits(out[rows, slot]) == bits(want), (s.index, layer, int(e))


def test_experts_can_be_left_out(weights, tmp_path):
    model = build_model(CFG.to_json(), weights, "fp32")
    dump = Dump.open(record_torch(model, PROMPT, 0, tmp_path / "d", config=CFG.to_json(), experts=False))
    names = dump.names(0)
    assert "layers.1.router.ids" in names and not any(".experts." in n for n in names)


def test_simulated_tp2_merges_to_the_tp1_dump(recorded, tmp_path):
    _, model, dump = recorded
    tp2 = record_torch(model, PROMPT, NEW, tmp_path / "tp2", config=CFG.to_json(), tp_size=2)
    core = read_header(tp2 / "rank1" / "step0000.safetensors").entries["layers.0.kda.core_out"]
    assert core.shape == (len(PROMPT), CFG.kda_num_heads // 2, CFG.kda_head_dim)      # rank 1 holds its heads
    assert read_header(tp2 / "rank1" / "step0000.safetensors").entries["logits"].shape == (1, 48)  # 97 = 49 + 48
    merged = Dump.open(merge_ranks(tp2, tmp_path / "merged"))
    assert merged.chosen == dump.chosen
    for s in dump.steps:
        assert merged.names(s.index) == dump.names(s.index)
        for name in dump.names(s.index):
            assert bits(merged.raw(s.index, name)) == bits(dump.raw(s.index, name)), name


def test_hooks_work_on_an_hf_style_model(weights, tmp_path):
    """Hooks match module names by suffix: a wrapper called as model(input_ids=, past_key_values=, use_cache=)
    returning .logits gives the same dump."""
    k3 = build_model(CFG.to_json(), weights, "fp32")

    class HfStyle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config, self.dtype = k3, k3.config, k3.dtype

        def forward(self, input_ids, past_key_values=None, use_cache=True):
            cache = past_key_values if past_key_values is not None else self.inner.new_cache(1)
            return types.SimpleNamespace(logits=self.inner(input_ids, cache), past_key_values=cache)

    a = Dump.open(record_torch(HfStyle(), PROMPT, NEW, tmp_path / "hf", config=CFG.to_json()))
    b = Dump.open(record_torch(k3, PROMPT, NEW, tmp_path / "k3", config=CFG.to_json()))
    assert a.chosen == b.chosen
    for s in b.steps:
        assert a.names(s.index) == b.names(s.index)
        assert all(bits(a.raw(s.index, n)) == bits(b.raw(s.index, n)) for n in b.names(s.index))


def test_hooks_need_checkpoint_names():
    with pytest.raises(ValueError, match="expected modules named like '...layers.<i>'"):
        TorchDumpHooks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_bf16_torch_tensors_are_stored_as_bf16_bits(tmp_path):
    t = torch.randn(1, CFG.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w = DumpWriter(tmp_path / "d", engine="x", dtype="bfloat16", config=CFG.to_json())
    w.begin_step("prefill", [1], 0)
    for key in ("prefix", "a", "f"):
        w.put(f"layers.0.{key}", t)
    w.end_step()
    w.close()
    raw = Dump.open(tmp_path / "d").raw(0, "layers.0.a")
    assert raw.dtype == ml_dtypes.bfloat16 and bits(raw) == bits(t.view(torch.int16).numpy())


# ----- k3ref's host graph -----

@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["fp64", "fp32"])
def test_ref_recorder(tmp_path, dtype):
    model = K3CpuModel.synthetic(CFG, seed=3, dtype=dtype)
    dump = Dump.open(record_ref(model, PROMPT, NEW, tmp_path / "ref"))
    assert dump.dtype == np.dtype(dtype).name and dump.fp32 == frozenset()
    assert dump.chosen == greedy_decode(model, PROMPT, NEW + 1).tokens
    for s in dump.steps:
        for layer in dump.layers[:-1]:
            blocks, prefix = dump.layer_input(s.index, layer)
            a, f = dump.raw(s.index, f"layers.{layer}.a"), dump.raw(s.index, f"layers.{layer}.f")
            want = a + f if layer % CFG.attn_res_block_size == 0 else prefix.astype(dtype) + a + f
            assert bits(dump.raw(s.index, f"layers.{layer + 1}.prefix")) == bits(want)


def test_ref_tp2_ranks_merge_to_tp1(tmp_path):
    """A real TP-2 run of the host graph (threads, real collectives): each rank writes its own directory, and
    the merged dump equals the TP-1 dump up to the all-reduce's summation order."""
    one = Dump.open(record_ref(K3CpuModel.synthetic(CFG, seed=3), PROMPT, NEW, tmp_path / "tp1"))
    path = record_ref_tp(CFG.to_json(), lambda plan, r: synthetic_rank_shard(plan, r, seed=3)[0], 2, PROMPT, NEW,
                         tmp_path / "tp2")
    assert read_header(path / "rank1" / "step0000.safetensors").entries["logits"].shape == (1, 48)
    two = Dump.open(merge_ranks(path, tmp_path / "merged"))
    assert two.chosen == one.chosen
    for s in one.steps:
        assert two.names(s.index) == one.names(s.index)
        for name in one.names(s.index):
            assert rel_rms(two.get(s.index, name), one.get(s.index, name)) < tol("fp64_same_math"), name
