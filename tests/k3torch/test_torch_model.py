"""The PyTorch K3 model (k3torch) against k3ref's host graph: two independent forms of the
wiring must agree, and each known wrong reading of the wiring, applied to one side only, must break the
agreement at the layer where it sits.

- Agreement: from a synthetic checkpoint on disk, loaded by each side's own loader, the float64 models agree
  on every trace tensor of every layer and step (prefill then decode) within AGREEMENT_RTOL, and on 16 greedy
  tokens exactly.
- Wiring mutants (MUTANTS): each applied to the torch model (its `Wiring`) or to k3ref (monkeypatched);
  the first disagreeing tensor names the expected layer; applied to k3ref, `regenerate` refuses to write.
- Hand-computed layers: one MLA and one KDA decode step written out with numpy matrix products from
  docs/spec.md section 3.7, against both implementations.
"""
from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: pip install 'k3-conformance[torch]'")

import k3ref.kda  # noqa: E402
import k3ref.mla  # noqa: E402
from conformance.backends.torch_model import AGREEMENT_RTOL, first_disagreement, golden_route_forcing  # noqa: E402
from conformance.cases import traces  # noqa: E402
from conformance.cases.catalog import all_cases, select  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.golden.regen import regenerate  # noqa: E402
from conformance.golden.store import read_golden, save_manifest  # noqa: E402
from conformance.judge import gates  # noqa: E402
from conformance.runner import run  # noqa: E402
from k3ref.cache import MlaKv  # noqa: E402
from k3ref.config import K3Config as RefConfig  # noqa: E402
from k3ref.cores import reference_cores  # noqa: E402
from k3ref.cpu_forward import K3CpuModel  # noqa: E402
from k3ref.greedy import greedy_decode  # noqa: E402
from k3ref.kda import KdaConfig, KdaState, kda_decode_token  # noqa: E402
from k3ref.mla import MlaConfig, mla_decode_token  # noqa: E402
from k3ref.weights import TEXT_PREFIX, synthetic_checkpoint, synthetic_weights  # noqa: E402
from k3torch import trace as tm_trace  # noqa: E402
from k3torch.configuration_k3 import K3Config  # noqa: E402
from k3torch.loading import CheckpointMismatch, load_weights  # noqa: E402
from k3torch.modeling_k3 import (  # noqa: E402
    ForcedRoute,
    K3ForCausalLM,
    K3GatedMLA,
    K3KimiDeltaAttention,
    KdaLayerCache,
    MlaLayerCache,
    Wiring,
)
from tests.support.tolerances import rel_rms, tol  # noqa: E402

pytestmark = pytest.mark.torch
SEED = 7
# every config with model traces (the K3-geometry trace config joins when it is added to TraceKind.TABLE)
TRACE_CONFIGS = sorted(traces.TraceKind.TABLE)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The toy models run op by op on tiny tensors: a second intra-op thread only adds synchronisation,
    and on a loaded 2-core machine its spinning made these tests 25x slower (measured on the tiny trace)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------
# fixtures: a synthetic checkpoint per config, each side loading it with its own loader
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(config: str) -> Path:
        if config not in made:
            made[config] = synthetic_checkpoint(RefConfig.preset(config), SEED,
                                                tmp_path_factory.mktemp(f"ckpt-{config}"), shard_bytes=1 << 16)
        return made[config]
    return get


def _reference_trace(model: K3CpuModel) -> dict[str, np.ndarray]:
    """k3ref's trace tensors on PROMPT + its own greedy continuation (as the trace generator makes them)."""
    new = greedy_decode(model, list(traces.PROMPT), traces.DECODE_STEPS).tokens
    tokens = np.array(list(traces.PROMPT) + new, dtype=np.int64)
    return tokens, traces.Stepper(model, reference_cores()).run(tokens)


def _torch_trace(model: K3ForCausalLM, tokens) -> dict[str, np.ndarray]:
    return tm_trace.run_trace(model, tokens, len(traces.PROMPT))


# ---------------------------------------------------------------------------------------------------
# agreement
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", TRACE_CONFIGS)
def test_every_layer_and_the_logits_agree_from_a_checkpoint(config, checkpoint):
    path = checkpoint(config)
    ref_tokens, ref = _reference_trace(K3CpuModel.from_checkpoint(path, dtype=np.float64))
    model = K3ForCausalLM.from_pretrained(path, dtype=torch.float64)
    got = _torch_trace(model, ref_tokens)
    assert sorted(got) == sorted(ref)
    assert first_disagreement(ref, got) is None
    worst = max(rel_rms(got[n], ref[n]) for n in ref)
    assert worst <= AGREEMENT_RTOL


@pytest.mark.parametrize("config", TRACE_CONFIGS)
def test_greedy_tokens_agree_for_16_steps(config, checkpoint):
    path = checkpoint(config)
    ref = greedy_decode(K3CpuModel.from_checkpoint(path, dtype=np.float64), list(traces.PROMPT), 16)
    model = K3ForCausalLM.from_pretrained(path, dtype=torch.float64)
    logits = []
    cache = model.new_cache()
    step_logits = model(torch.tensor([traces.PROMPT]), cache)[0, -1]
    for tok in ref.tokens:
        logits.append(step_logits.numpy())
        step_logits = model(torch.tensor([[tok]]), cache)[0, -1]
    assert model.generate(list(traces.PROMPT), 16)[0].tolist() == ref.tokens
    assert rel_rms(np.array(logits), ref.logits) <= AGREEMENT_RTOL


def test_decode_equals_recomputing_the_whole_sequence():
    """The model's own cache path (KDA conv + state, MLA rows) against one prefill of every token."""
    model = _model("tiny")
    tokens = list(traces.PROMPT) + [3, 90, 11]
    cache = model.new_cache()
    model(torch.tensor([tokens[:4]]), cache)
    stepped = [model(torch.tensor([[t]]), cache)[0, -1] for t in tokens[4:]]
    whole = model(torch.tensor([tokens]))[0, 4:]
    assert rel_rms(torch.stack(stepped).numpy(), whole.numpy()) <= tol("fp64_long_recurrence")


def test_float32_model_agrees_with_the_float64_one():
    ids = torch.tensor([traces.PROMPT])
    ref = _model("tiny")(ids).numpy()
    assert rel_rms(_model("tiny", torch.float32)(ids).numpy(), ref) <= tol("fp32_model")


# ---------------------------------------------------------------------------------------------------
# loading: strict names and shapes
# ---------------------------------------------------------------------------------------------------


def _model(config: str, dtype=None, wiring: Wiring | None = None) -> K3ForCausalLM:
    return tm_trace.build_model(RefConfig.preset(config).to_json(), _weights(config),
                                {None: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype], wiring)


_WEIGHTS: dict[str, dict] = {}


def _weights(config: str) -> dict[str, np.ndarray]:
    if config not in _WEIGHTS:
        _WEIGHTS[config] = synthetic_weights(RefConfig.preset(config), SEED)
    return _WEIGHTS[config]


@pytest.mark.parametrize("edit, named", [
    pytest.param(lambda w: w.pop(TEXT_PREFIX + "layers.2.self_attn.kv_b_proj.weight"),
                 r"missing: language_model\.model\.layers\.2\.self_attn\.kv_b_proj\.weight", id="missing"),
    pytest.param(lambda w: w.update({TEXT_PREFIX + "layers.0.self_attn.rotary.inv_freq": np.zeros(4)}),
                 r"unexpected: language_model\.model\.layers\.0\.self_attn\.rotary\.inv_freq", id="extra"),
    pytest.param(lambda w: w.update({TEXT_PREFIX + "norm.weight": np.ones(35)}),
                 r"language_model\.model\.norm\.weight: expected shape \[36\], found \[35\]", id="misshaped"),
    pytest.param(lambda w: w.update({TEXT_PREFIX + "layers.1.block_sparse_moe.experts.3.w2.weight_scale":
                                     np.ones((32, 1))}),
                 r"experts\.3\.w2\.weight_scale: expected torch\.uint8, found torch\.float64", id="mistyped"),
])
def test_loading_is_strict_and_names_the_tensor(edit, named):
    w = dict(_weights("tiny"))
    edit(w)
    model = K3ForCausalLM(K3Config.from_dict(RefConfig.preset("tiny").to_json()), torch.float64)
    with pytest.raises(CheckpointMismatch, match=named):
        load_weights(model, w)


def test_state_dict_names_are_the_checkpoint_names():
    model = K3ForCausalLM(K3Config.from_dict(RefConfig.preset("tiny").to_json()), torch.float64)
    assert set(model.state_dict()) == set(_weights("tiny"))


@pytest.mark.parametrize("preset", ["tiny", "small", "k3"])
def test_config_reads_the_published_config_json(preset, tmp_path):
    ref = RefConfig.preset(preset)
    ref.save(tmp_path)
    cfg = K3Config.from_json(tmp_path)                                   # a checkpoint directory
    assert cfg == K3Config.from_dict({"text_config": ref.to_json()})     # the multimodal wrapper
    assert [cfg.is_mla(i) for i in range(cfg.num_hidden_layers)] == [ref.is_mla(i)
                                                                      for i in range(ref.num_hidden_layers)]
    common = {f.name for f in dataclasses.fields(K3Config)} & {f.name for f in dataclasses.fields(RefConfig)}
    assert {n: getattr(cfg, n) for n in common} == {n: getattr(ref, n) for n in common}


def test_config_names_a_missing_field():
    raw = RefConfig.preset("tiny").to_json()
    del raw["linear_attn_config"]["head_dim"]
    with pytest.raises(ValueError, match=r"missing field\(s\) \['kda_head_dim'\]"):
        K3Config.from_dict(raw)


# ---------------------------------------------------------------------------------------------------
# wiring mutants: one wrong reading, applied to one side
# ---------------------------------------------------------------------------------------------------


class _Misread(Mapping):
    """k3ref's weights as a misreading host graph sees them: read(name) may fetch another tensor."""

    def __init__(self, inner: Mapping, read):
        self.inner, self.read = inner, read

    def __getitem__(self, name):
        return self.read(self.inner, name)

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


def _misread(monkeypatch, read):
    """Every K3CpuModel built from now on reads its weights through `read(inner, name, cfg)`."""
    init = K3CpuModel.__init__

    def patched(self, cfg, weights, dtype=np.float64):
        init(self, cfg, _Misread(weights, lambda inner, name: read(inner, name, cfg)), dtype)
    monkeypatch.setattr(K3CpuModel, "__init__", patched)


def _renamed(pairs: dict[str, str]):
    def read(inner, name, cfg):
        for a, b in pairs.items():
            if name.endswith(a):
                return inner[name[:-len(a)] + b]
        return inner[name]
    return read


def _kv_b_stacked(inner, name, cfg):
    """kv_b read as [all W_UK; all W_UV]: the per-head reader handed the rows that reading would pick."""
    W = inner[name]
    if not name.endswith("self_attn.kv_b_proj.weight"):
        return W
    H, n, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    return np.concatenate([np.concatenate([W[h * n:(h + 1) * n], W[H * n + h * v:H * n + (h + 1) * v]])
                           for h in range(H)])


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _ref_mla_gate_silu(monkeypatch):
    monkeypatch.setattr(k3ref.mla, "ops", types.SimpleNamespace(**{**vars(k3ref.mla.ops), "sigmoid": _silu}))


def _ref_kda_gate_input_silu(monkeypatch):
    proj = k3ref.kda._proj

    def patched(X, weights, name, shape):
        return proj(_silu(X) if name == "f_b_proj.weight" else X, weights, name, shape)
    monkeypatch.setattr(k3ref.kda, "_proj", patched)


def _ref_kpe_normalised(monkeypatch):
    project = k3ref.mla.mla_project

    def patched(*args, **kwargs):
        q_nope, q_pe, c, k_pe, gate = project(*args, **kwargs)
        return q_nope, q_pe, c, k_pe / np.sqrt(np.mean(k_pe * k_pe, axis=-1, keepdims=True) + 1e-6), gate
    monkeypatch.setattr(k3ref.mla, "mla_project", patched)


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A wrong reading of the wiring: as a torch-model `Wiring`, and as a monkeypatch of k3ref."""

    torch_wiring: Wiring                  # the torch model reading it
    patch_k3ref: Callable[[pytest.MonkeyPatch], None]   # k3ref reading it (monkeypatched)
    first: str                            # the step and layer (tensor-name prefix) that must disagree first


MUTANTS = {
    "mla-gate-silu": Mutant(Wiring(mla_gate="silu"), _ref_mla_gate_silu, "step0.layer02."),
    "kda-gate-input-silu": Mutant(Wiring(kda_gate_input_silu=True), _ref_kda_gate_input_silu, "step0.layer00."),
    "attnres-queries-swapped": Mutant(
        Wiring(attnres_queries_swapped=True),
        lambda mp: _misread(mp, _renamed({"self_attention_res_proj.weight": "mlp_res_proj.weight",
                                          "mlp_res_proj.weight": "self_attention_res_proj.weight",
                                          "self_attention_res_norm.weight": "mlp_res_norm.weight",
                                          "mlp_res_norm.weight": "self_attention_res_norm.weight"})),
        "step0.layer00."),
    "kv-b-stacked": Mutant(Wiring(kv_b_layout="stacked"), lambda mp: _misread(mp, _kv_b_stacked), "step0.layer02."),
    "final-norms-swapped": Mutant(
        Wiring(final_norms_swapped=True),
        lambda mp: _misread(mp, _renamed({"model.norm.weight": "model.output_attn_res_norm.weight",
                                          "output_attn_res_norm.weight": "norm.weight"})),
        "step0.logits"),
    "post-norm-is-input-norm": Mutant(
        Wiring(post_norm_is_input_norm=True),
        lambda mp: _misread(mp, _renamed({"post_attention_layernorm.weight": "input_layernorm.weight"})),
        "step0.layer00."),
    "mla-cache-kpe-normalised": Mutant(Wiring(mla_cache_kpe_normalised=True), _ref_kpe_normalised,
                                       "step0.layer02."),
}


def _reference_tiny():
    return _reference_trace(K3CpuModel(RefConfig.preset("tiny"), _weights("tiny"), np.float64))


@pytest.fixture(scope="module")
def reference_tiny():
    return _reference_tiny()


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_wrong_reading_in_the_torch_model_breaks_the_agreement_at_its_layer(name, reference_tiny):
    tokens, ref = reference_tiny
    found = first_disagreement(ref, _torch_trace(_model("tiny", wiring=MUTANTS[name].torch_wiring), tokens))
    assert found is not None and found[0].startswith(MUTANTS[name].first), found
    assert found[1] > 1e3 * AGREEMENT_RTOL


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_wrong_reading_in_k3ref_breaks_the_agreement_at_its_layer(name, monkeypatch):
    MUTANTS[name].patch_k3ref(monkeypatch)
    tokens, ref = _reference_tiny()
    found = first_disagreement(ref, _torch_trace(_model("tiny"), tokens))
    assert found is not None and found[0].startswith(MUTANTS[name].first), found


@pytest.mark.parametrize("name", list(MUTANTS))
def test_regen_refuses_a_trace_golden_that_k3ref_computes_with_a_wrong_reading(name, monkeypatch, tmp_path, capsys):
    MUTANTS[name].patch_k3ref(monkeypatch)
    layer = re.search(r"layer(\d+)", MUTANTS[name].first)
    where = f"layer {int(layer.group(1))} " if layer else "tensor step0.logits"
    assert main(["regen", "--accept", "--cases", "trace/free-P7-D5", "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "refusing to write" in err and where in err, err
    assert not list(tmp_path.glob("trace/*"))


def test_regen_writes_the_trace_golden_when_both_agree(tmp_path):
    save_manifest(tmp_path, {"schema_version": 1, "files": {}})
    [outcome] = regenerate(select(all_cases("tiny"), ["trace/free-P7-D5"]), tmp_path)
    assert outcome.status == "new" and outcome.path.is_file()


# ---------------------------------------------------------------------------------------------------
# the torch-model backend on the committed goldens
# ---------------------------------------------------------------------------------------------------


def test_torch_model_backend_passes_the_committed_traces_and_skips_block_cases():
    cases = select(all_cases("tiny"), ["trace/*", "rmsnorm/*"])
    report = run(cases, ["torch-model"], ROOT / "golden", timing=True)
    status = {r.case: r.status for r in report.results}
    assert all(status[c.name] == "pass" for c in cases if c.kind == "trace"), report.first_failure_line()
    assert all(status[c.name] == "skip" for c in cases if c.kind != "trace")
    assert report.exit_code == 0
    # a whole model is timed on its free-running traces: a layer-by-layer one asks for each layer's golden input,
    # which a timed run could not be given without handing it every layer's state at once
    timed = {r.case: r.speed for r in report.results if r.status == "pass"}
    assert all(s is not None and s.seconds > 0 for c, s in timed.items() if "/free-" in c or c.startswith("trace/free"))
    assert all(s is None for c, s in timed.items() if "layerwise" in c)


# the traces torch-model-bf16 passes with its near-tie router choices teacher-forced: all four, each mode with its
# own budgets (a free run's with the larger ones its compounded error needs)
BF16_PASSING = ["trace/layerwise-P7-D5", "trace/k3geom/layerwise-P3-D1", "trace/k3geom/free-P3-D1",
                "trace/free-P7-D5"]
TABLE_OF = {"layerwise": "MARGIN_BUDGETS", "free": "FREE_MARGIN_BUDGETS"}


def _mode(case: str) -> str:
    return "free" if "/free-" in case else "layerwise"


def _bf16_router_budget(mode: str) -> float:
    return getattr(gates, TABLE_OF[mode])["bf16"]["router"][0]


def _set_bf16_budgets(monkeypatch, mode: str, why: str, **budgets: float) -> None:
    """The verdicts read a copy of `mode`'s (read-only) budget table with the named bf16 budgets replaced."""
    table = {p: dict(rows) for p, rows in getattr(gates, TABLE_OF[mode]).items()}
    table["bf16"].update({choice: (budget, why) for choice, budget in budgets.items()})
    monkeypatch.setattr(gates, TABLE_OF[mode], table)


def _near_route_ties(case: str, budget: float) -> int:
    """Tokens whose golden router margin is below `budget`, over every MoE layer and step of `case`."""
    inter = read_golden(ROOT / "golden", case).group("inter")
    return sum(int(np.sum(np.asarray(v) < budget)) for k, v in inter.items()
               if k.startswith("route.") and k.endswith(".margin"))


def _run_bf16(cases: list[str]):
    return run(select(all_cases("tiny"), cases), ["torch-model-bf16"], ROOT / "golden", timing=False)


def test_bf16_model_passes_the_traces_with_router_near_ties_teacher_forced():
    report = _run_bf16(BF16_PASSING)
    assert report.exit_code == 0, report.first_failure_line()
    assert sorted(r.case for r in report.results) == sorted(BF16_PASSING)
    for r in report.results:
        assert r.status == "pass" and not r.flips
        forced = _near_route_ties(r.case, _bf16_router_budget(_mode(r.case)))
        assert forced > 0 and r.teacher_forced["router"] == forced, r.case
        assert any(n.startswith(f"teacher-forced near-ties (margin below the bf16 budget, the golden's choice "
                                f"given): {forced} router choice(s)") for n in r.notes), r.notes


def test_without_forcing_the_bf16_model_flips_k3geoms_first_token(monkeypatch):
    """The hook is what makes k3geom's free trace pass: a layer-1 route at margin 4.6e-3 flips at bf16, and
    the prompt's greedy token with it (the free run's token budget, which would force that token, set to 0 too)."""
    _set_bf16_budgets(monkeypatch, "free", "no forcing", router=0.0, argmax=0.0)
    [r] = _run_bf16(["trace/k3geom/free-P3-D1"]).results
    assert r.status == "fail" and r.teacher_forced["router"] == 0
    assert [f["step"] for f in r.flips] == [0], r.flips
    assert not any(n.startswith("teacher-forced") for n in r.notes)


def test_a_forced_route_replaces_only_the_flagged_tokens_and_keeps_the_own_scores():
    model = _model("tiny", torch.float32)
    gate = model.language_model.model.layers[1].block_sparse_moe.gate
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(SEED))
    w, idx = gate(x)
    s = torch.sigmoid(torch.nn.functional.linear(x, gate.weight))
    other = (idx + 1) % model.config.n_routed_experts
    gate.forced = ForcedRoute(other, torch.tensor([False, True, False]))
    fw, fidx = gate(x)
    assert torch.equal(fidx[[0, 2]], idx[[0, 2]]) and torch.equal(fidx[1], other[1])
    expected = torch.gather(s, 1, other)[1]
    assert torch.allclose(fw[1], expected / expected.sum() * model.config.routed_scaling_factor)
    gate.forced = ForcedRoute(other[:2], torch.tensor([False, True]))
    with pytest.raises(ValueError, match=r"expected experts \[3, 2\] and rows \[3\].*found \[2, 2\] and \[2\]"):
        gate(x)


def test_run_trace_leaves_the_routers_unforced(reference_tiny):
    tokens, _ = reference_tiny
    model = _model("tiny", torch.bfloat16)
    inter = read_golden(ROOT / "golden", "trace/free-P7-D5").group("inter")
    routes = golden_route_forcing(inter, _bf16_router_budget("free"))
    tm_trace.run_trace(model, tokens, len(traces.PROMPT), routes=routes)
    assert routes.forced == _near_route_ties("trace/free-P7-D5", _bf16_router_budget("free"))
    moes = [moe for layer in model.language_model.model.decoder_layers() if (moe := layer.moe()) is not None]
    assert moes and all(moe.gate.forced is None for moe in moes)


# ---------------------------------------------------------------------------------------------------
# hand-computed layers: docs/spec.md section 3.7 as explicit numpy matrix products
# ---------------------------------------------------------------------------------------------------


def _small_config(**kw) -> K3Config:
    base = dict(vocab_size=11, hidden_size=7, num_hidden_layers=2, full_attn_layers=(2,), intermediate_size=5,
                num_attention_heads=2, q_lora_rank=6, kv_lora_rank=5, qk_nope_head_dim=4, qk_rope_head_dim=2,
                v_head_dim=3, kda_num_heads=2, kda_head_dim=4, a_log_size=3, n_routed_experts=2,
                num_experts_per_tok=1, n_shared_experts=0, moe_intermediate_size=32, routed_expert_hidden_size=32)
    return K3Config(**{**base, **kw})


def _rmsnorm(z, w, eps):
    return w * z / np.sqrt(np.mean(z * z) + eps)


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _torch_module(cls, cfg, weights):
    m = cls(cfg, torch.float64)
    m.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    return m


def test_mla_decode_step_by_hand(rng):
    cfg = _small_config()
    D, H, n, r, v, R, Q = 7, 2, 4, 2, 3, 5, 6
    lin = lambda o, i: rng.standard_normal((o, i)) / np.sqrt(i)  # noqa: E731
    w = {"q_a_proj.weight": lin(Q, D), "q_a_layernorm.weight": 1 + 0.1 * rng.standard_normal(Q),
         "q_b_proj.weight": lin(H * (n + r), Q), "kv_a_proj_with_mqa.weight": lin(R + r, D),
         "kv_a_layernorm.weight": 1 + 0.1 * rng.standard_normal(R), "kv_b_proj.weight": lin(H * (n + v), R),
         "g_proj.weight": lin(H * v, D), "o_proj.weight": lin(D, H * v)}
    prev = rng.standard_normal((2, R + r))                         # two cached rows [c | k_pe]
    x = rng.standard_normal(D)

    # by hand
    q = w["q_b_proj.weight"] @ _rmsnorm(w["q_a_proj.weight"] @ x, w["q_a_layernorm.weight"], 1e-6)
    kv = w["kv_a_proj_with_mqa.weight"] @ x
    row = np.concatenate([_rmsnorm(kv[:R], w["kv_a_layernorm.weight"], 1e-6), kv[R:]])   # k_pe not normalised
    rows = np.vstack([prev, row])
    o = []
    for h in range(H):
        W_UK = w["kv_b_proj.weight"][h * (n + v):h * (n + v) + n]          # per head: rows 0..n-1 ...
        W_UV = w["kv_b_proj.weight"][h * (n + v) + n:(h + 1) * (n + v)]    # ... then rows n..n+v-1
        q_nope, q_pe = q[h * (n + r):h * (n + r) + n], q[h * (n + r) + n:(h + 1) * (n + r)]
        s = np.array([(q_nope @ (W_UK @ rj[:R]) + q_pe @ rj[R:]) / np.sqrt(n + r) for rj in rows])
        p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        o.append(W_UV @ (p @ rows[:, :R]))
    y = w["o_proj.weight"] @ (np.concatenate(o) * _sigmoid(w["g_proj.weight"] @ x))

    # k3ref
    kv_cache = MlaKv(2, 64, R + r, np.float64)
    seq = kv_cache.add_sequence()
    for row_prev in prev:
        kv_cache.append([seq], row_prev[None])
    y_ref = mla_decode_token(w, x[None], kv_cache, [seq], MlaConfig(H, Q, R, n, r, v))[0]
    # torch model
    cache = MlaLayerCache(torch.from_numpy(prev)[None])
    y_torch = _torch_module(K3GatedMLA, cfg, w)(torch.from_numpy(x)[None, None], cache)[0, 0].numpy()

    assert rel_rms(y_ref, y) <= tol("fp64_same_math")
    assert rel_rms(y_torch, y) <= tol("fp64_same_math")
    assert rel_rms(kv_cache.gather(seq), rows) <= tol("fp64_same_math")
    assert rel_rms(cache.rows[0].numpy(), rows) <= tol("fp64_same_math")


def test_kda_decode_step_from_a_nonzero_state_by_hand(rng):
    cfg = _small_config()
    D, H, K, W = 7, 2, 4, 4
    lin = lambda o, i: rng.standard_normal((o, i)) / np.sqrt(i)  # noqa: E731
    w = {f"{c}_proj.weight": lin(H * K, D) for c in "qkv"}
    w.update({f"{c}_conv1d.weight": 0.5 * rng.standard_normal((H * K, 1, W)) for c in "qkv"})
    w.update({"A_log": np.concatenate([np.log(rng.uniform(1, 16, H)), [0.0]]),
              "dt_bias": 0.5 * rng.standard_normal(H * K), "f_a_proj.weight": lin(K, D),
              "f_b_proj.weight": lin(H * K, K), "b_proj.weight": lin(H, D), "g_proj.weight": lin(H * K, D),
              "o_norm.weight": 1 + 0.1 * rng.standard_normal(K), "o_proj.weight": lin(D, H * K)})
    conv = {c: rng.standard_normal((H * K, W - 1)) for c in "qkv"}      # the last 3 projections, oldest first
    S0 = 0.3 * rng.standard_normal((H, K, K))
    x = rng.standard_normal(D)

    # by hand
    def stream(c):
        p = w[f"{c}_proj.weight"] @ x
        hist = np.hstack([conv[c], p[:, None]])                          # [C, W]: x_{t-3} .. x_t
        y = np.array([w[f"{c}_conv1d.weight"][i, 0] @ hist[i] for i in range(H * K)])
        return _silu(y).reshape(H, K)
    q, k, v = stream("q"), stream("k"), stream("v")
    g_in = (w["f_b_proj.weight"] @ (w["f_a_proj.weight"] @ x) + w["dt_bias"]).reshape(H, K)
    beta = _sigmoid(w["b_proj.weight"] @ x)
    G = (w["g_proj.weight"] @ x).reshape(H, K)
    out, S_new = [], np.empty_like(S0)
    for h in range(H):
        g = -5.0 * _sigmoid(np.exp(w["A_log"][h]) * g_in[h])
        qh = q[h] / np.sqrt(q[h] @ q[h] + 1e-6) / np.sqrt(K)
        kh = k[h] / np.sqrt(k[h] @ k[h] + 1e-6)
        S = np.diag(np.exp(g)) @ S0[h]
        S = S + beta[h] * np.outer(kh, v[h] - S.T @ kh)
        S_new[h] = S
        out.append(_rmsnorm(S.T @ qh, w["o_norm.weight"], 1e-5) * _sigmoid(G[h]))
    y = w["o_proj.weight"] @ np.concatenate(out)

    # k3ref
    state = KdaState(conv["q"][None], conv["k"][None], conv["v"][None], S0[None])
    y_ref, st = kda_decode_token(w, x[None], state, KdaConfig(H, K))
    # torch model
    cache = KdaLayerCache(*(torch.from_numpy(conv[c])[None] for c in "qkv"), torch.from_numpy(S0)[None])
    y_torch = _torch_module(K3KimiDeltaAttention, cfg, w)(torch.from_numpy(x)[None, None], cache)[0, 0].numpy()

    assert rel_rms(y_ref[0], y) <= tol("fp64_same_math")
    assert rel_rms(y_torch, y) <= tol("fp64_same_math")
    assert rel_rms(st.recurrent[0], S_new) <= tol("fp64_same_math")
    assert rel_rms(cache.recurrent[0].numpy(), S_new) <= tol("fp64_same_math")


# ---------------------------------------------------------------------------------------------------
# a `small` checkpoint: strict load and the same greedy tokens as `k3conf decode --checkpoint`
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_small_checkpoint_generates_what_k3conf_decode_does(tmp_path, request, capsys):
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("writes and decodes a 0.4B-parameter checkpoint (about a minute): run with -m slow")
    path = synthetic_checkpoint(RefConfig.preset("small"), 0, tmp_path / "small")
    prompt = [5, 17, 3, 42, 8]
    assert main(["decode", "--checkpoint", str(path), "--prompt", ",".join(map(str, prompt)), "--max-new", "8",
                 "--dtype", "float32", "--ids-only"]) == 0
    expected = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    model = K3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    got = model.generate(prompt, 8)[0].tolist()
    assert got == expected, f"torch model {got}, k3conf decode {expected}"
