"""`compare_dump` on recorded dumps: clean engines pass, each planted single-layer bug is named as the source at
its layer and sublayer with the later layers as carriers, and a TP-2 dump gives the TP-1 report.

Dumps come from the recorder on the PyTorch model (k3torch, bf16 unless said) over synthetic checkpoints, and
from k3ref itself at float64 (an engine that is the reference: it must add nothing)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conformance.dumps import Dump, DumpWriter
from conformance.dumps.budgets import EXPERTS_GAIN, budget_for
from conformance.dumps.errors import DumpShapeError
from conformance.dumps.planted import EXPECTED_SUBLAYER, plant
from conformance.dumps.recompute import LayerResult, recompute_layer
from conformance.dumps.verdict import DumpReport, compare_dump
from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel, forward_tokens
from k3ref.weights import synthetic_checkpoint

torch = pytest.importorskip("torch", reason="PyTorch is not installed: pip install 'k3-conformance[torch]'")

from conformance.dumps.recorder import record_torch  # noqa: E402
from k3torch.modeling_k3 import K3ForCausalLM  # noqa: E402

SEED = 7
NEW_TOKENS = 3
# (config, bug, layer, kwargs): every planted layer has later layers to carry it
PLANTED: list[tuple[str, str, int, dict]] = [
    ("tiny", "kda_lower_bound", 1, {}),
    ("tiny", "mla_softmax_scale", 2, {}),
    ("tiny", "router_bias_dropped", 3, {}),
    ("tiny", "attnres_swapped", 4, {}),
    ("k3geom", "kda_lower_bound", 1, {}),
    ("k3geom", "mla_softmax_scale", 3, {}),
    ("k3geom", "router_bias_dropped", 2, {}),
    ("k3geom", "attnres_swapped", 2, {}),
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Toy models run op by op: a second intra-op thread only adds synchronisation on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(config: str):
        if config not in made:
            made[config] = synthetic_checkpoint(K3Config.preset(config), SEED, tmp_path_factory.mktemp(config))
        return made[config]
    return get


def _prompt(config: str, n: int = 8):
    return np.random.default_rng(0).integers(0, K3Config.preset(config).vocab_size, n)


def _record(ckpt, config, out, *, dtype=torch.bfloat16, bug=None, tp_size=1, **kwargs):
    model = K3ForCausalLM.from_pretrained(ckpt, dtype=dtype)
    if bug is not None:
        plant(model, bug[0], bug[1], **kwargs)
    return record_torch(model, _prompt(config), NEW_TOKENS, out, tp_size=tp_size)


def _reference_dump(ckpt, out, *, poison=None, keys=("h", "x_mixer", "a", "m", "x_mlp", "f")):
    """A dump written by k3ref at float64 (prefill + NEW_TOKENS greedy steps) holding the layer records `keys`;
    poison(step, layer, rec) may change a record before it is written."""
    model = K3CpuModel.from_checkpoint(ckpt, dtype=np.float64)
    cache = model.new_cache()
    seq = cache.add_sequence()
    w = DumpWriter(out, engine="k3ref float64", dtype="float64", config=model.cfg.to_json())
    tokens, start = _prompt("tiny"), 0
    for step in range(NEW_TOKENS + 1):
        w.begin_step("prefill" if step == 0 else "decode", tokens, start)

        def rec(layer, hub, r, step=step):
            if poison:
                poison(step, layer, r)
            if hub.blocks:
                w.put(f"layers.{layer}.blocks", np.stack(hub.blocks))
            w.put(f"layers.{layer}.prefix", hub.prefix)
            for k in keys:
                w.put(f"layers.{layer}.{k}", r[k])
        logits = forward_tokens(model, tokens, cache, seq=seq, prefill=step == 0, recorder=rec)
        chosen = int(np.argmax(logits[-1]))
        w.end_step(chosen)
        start, tokens = start + len(tokens), np.array([chosen])
    w.close()
    return out


def _all_rows(report: DumpReport):
    return [r for s in report.layers for r in s.worst.values()]


def test_a_float64_reference_engine_adds_nothing(checkpoint, tmp_path):
    ckpt = checkpoint("tiny")
    report = compare_dump(_reference_dump(ckpt, tmp_path / "dump"), ckpt)
    assert report.exit_code == 0 and report.source is None and not report.missing
    assert max(r.added.rel_rms for r in _all_rows(report)) <= 1e-12
    assert report.free is not None and all(t.agree and t.gap == 0.0 for t in report.free.tokens)
    assert max(d.rel_rms for d in report.free.carried.values()) <= 1e-12


def test_a_dump_of_the_required_tensors_only_is_judged_per_mixer_and_mlp(checkpoint, tmp_path):
    """Without h / m the AttnRes rows cannot be judged: the mixer and MLP rows then start from the recomputed
    AttnRes of the dumped layer input (and cover it)."""
    ckpt = checkpoint("tiny")
    report = compare_dump(_reference_dump(ckpt, tmp_path / "dump", keys=("a", "f")), ckpt, free=False)
    assert report.exit_code == 0 and report.free is None
    assert {r.sublayer for r in _all_rows(report)} == {"mixer", "mlp", "layer"}
    assert max(r.added.rel_rms for r in _all_rows(report)) <= 1e-12


@pytest.mark.parametrize("config", ["tiny", "k3geom"])
def test_clean_bf16_dump_is_within_every_budget(config, checkpoint, tmp_path):
    ckpt = checkpoint(config)
    report = compare_dump(_record(ckpt, config, tmp_path / "dump"), ckpt)
    assert report.exit_code == 0, report.to_json()
    assert report.source is None and report.carriers == [] and report.findings == []
    assert [s.layer for s in report.layers] == list(range(K3Config.preset(config).num_hidden_layers))
    assert all(r.added.rel_rms <= r.budget and r.over_by == [] for r in _all_rows(report))
    assert {r.sublayer for r in _all_rows(report)} == {"attnres_mixer", "mixer", "attnres_mlp", "mlp", "layer"}
    cfg = K3Config.preset(config)            # the recorder dumps the routed experts: each MoE mlp row checks them
    assert [s.worst["mlp"].experts is not None for s in report.layers] == [not cfg.mlp_is_dense(la)
                                                                           for la in range(cfg.num_hidden_layers)]
    back = DumpReport.from_json(json.loads(report.dumps()))
    assert back.to_json() == report.to_json()


@pytest.mark.parametrize(("config", "bug", "layer", "kwargs"), PLANTED, ids=[f"{c}-{b}" for c, b, _, _ in PLANTED])
def test_a_planted_bug_is_named_at_its_layer_and_sublayer(config, bug, layer, kwargs, checkpoint, tmp_path):
    ckpt = checkpoint(config)
    report = compare_dump(_record(ckpt, config, tmp_path / "dump", bug=(bug, layer), **kwargs), ckpt)
    assert report.exit_code == 1
    assert report.source is not None and report.source[:2] == (layer, EXPECTED_SUBLAYER[bug]), report.source
    assert [s.verdict for s in report.layers[:layer]] == ["ok"] * layer
    later = list(range(layer + 1, K3Config.preset(config).num_hidden_layers))
    assert report.carriers and set(report.carriers) <= set(later)


@pytest.mark.parametrize(("config", "dtype"), [("tiny", "bfloat16"), ("k3geom", "bfloat16"), ("tiny", "float32")])
def test_one_expert_scale_error_is_named(config, dtype, checkpoint, tmp_path):
    """One routed expert's w2 scales 1% too large, the expert the clean run routes most slots of layer 1 to.
    At bf16 the MoE output f hides it (its rel RMS and gain stay within the bf16 rounding of a correct MLP);
    the routed experts' check finds it: that expert's outputs, pooled over its slots, are ~1% too large."""
    ckpt, tdtype = checkpoint(config), getattr(torch, dtype)
    clean = Dump.open(_record(ckpt, config, tmp_path / "clean", dtype=tdtype))
    ids = np.concatenate([clean.get(s.index, "layers.1.router.ids").ravel() for s in clean.steps])
    expert = int(np.argmax(np.bincount(ids)))
    report = compare_dump(_record(ckpt, config, tmp_path / "dump", dtype=tdtype, bug=("expert_scale", 1),
                                  expert=expert), ckpt)
    assert report.source is not None and report.source[:2] == (1, "mlp"), report.source
    row = report.layers[1].worst["mlp"]
    assert row.experts is not None and row.experts.worst is not None and row.experts.worst.expert == expert
    assert row.experts.worst.score > 2 * budget_for(dtype, EXPERTS_GAIN)
    assert any(why.startswith(f"routed expert {expert} gain +") for why in row.over_by), row.over_by
    if dtype == "bfloat16":            # what the experts' check is for: f alone does not show it
        assert row.added.rel_rms <= row.budget and row.gain_budget is not None
        assert abs(row.added.gain) <= row.gain_budget
    assert set(report.carriers) == set(range(2, K3Config.preset(config).num_hidden_layers))


def test_a_tp2_dump_merged_gives_the_tp1_report(checkpoint, tmp_path):
    ckpt, config = checkpoint("tiny"), "tiny"
    one = compare_dump(_record(ckpt, config, tmp_path / "tp1", bug=("mla_softmax_scale", 2)), ckpt).to_json()
    two = compare_dump(_record(ckpt, config, tmp_path / "tp2", bug=("mla_softmax_scale", 2), tp_size=2), ckpt).to_json()
    assert (one.pop("tp_size"), two.pop("tp_size")) == (1, 2)
    assert two == one


def test_nan_in_an_engine_output_is_a_finding_and_the_source(checkpoint, tmp_path):
    def poison(step, layer, rec):
        if (step, layer) == (1, 3):
            rec["f"] = rec["f"].copy()
            rec["f"][0, 5] = np.nan
    ckpt = checkpoint("tiny")
    report = compare_dump(_reference_dump(ckpt, tmp_path / "dump", poison=poison), ckpt, free=False)
    assert report.source == (3, "mlp", 1)
    assert any("layer 3 f" in f for f in report.findings)
    assert report.layers[3].worst["mlp"].added.nonfinite == 1
    assert report.exit_code == 1
    back = json.loads(report.dumps())          # dumps() refuses NaN floats: strict JSON throughout
    assert DumpReport.from_json(back).source == (3, "mlp", 1)


def test_missing_layers_and_a_foreign_checkpoint(checkpoint, tmp_path):
    ckpt = checkpoint("tiny")
    dump = _reference_dump(ckpt, tmp_path / "dump")

    def some(run_layer, path, ck, layers):
        return [run_layer(path, ck, la) for la in layers if la != 4]
    report = compare_dump(dump, ckpt, map_layers=some, free=False)
    assert report.missing == [4] and report.exit_code == 1 and report.source is None
    with pytest.raises(DumpShapeError, match="differing fields"):
        compare_dump(dump, checkpoint("k3geom"))


def test_a_layer_result_travels_as_json_from_a_path(checkpoint, tmp_path):
    ckpt = checkpoint("tiny")
    dump = _reference_dump(ckpt, tmp_path / "dump")
    res = recompute_layer(str(dump), str(ckpt), 2)
    assert (res.layer, res.mixer, res.mlp) == (2, "MLA", "MoE")
    assert len(res.rows) == 5 * (NEW_TOKENS + 1)
    assert LayerResult.from_json(json.loads(json.dumps(res.to_json()))) == res
    with pytest.raises(ValueError, match="dumped layers"):
        recompute_layer(dump, ckpt, 9)


def test_a_real_tp2_run_of_k3ref_gives_the_tp1_verdicts(checkpoint, tmp_path):
    """k3ref's host graph at float32 on 2 ranks (each rank writes its own directory, logits split by vocab)
    against the same graph on 1 rank: the same verdict for every layer and the same tokens; the numbers differ
    only by the ranks' summation order."""
    from conformance.dumps.recorder_ref import record_ref, record_ref_tp  # noqa: PLC0415 -- k3ref-only test
    from k3ref.tp_weights import synthetic_rank_shard  # noqa: PLC0415 -- k3ref-only test

    ckpt, cfg = checkpoint("tiny"), K3Config.preset("tiny")
    one = record_ref(K3CpuModel.from_checkpoint(ckpt, dtype=np.float32), _prompt("tiny"), NEW_TOKENS,
                     tmp_path / "tp1")
    two = record_ref_tp(cfg.to_json(), lambda plan, r: synthetic_rank_shard(plan, r, SEED)[0], 2, _prompt("tiny"),
                        NEW_TOKENS, tmp_path / "tp2", dtype=np.float32)
    a, b = compare_dump(one, ckpt), compare_dump(two, ckpt)
    assert (a.tp_size, b.tp_size) == (1, 2)
    assert a.exit_code == b.exit_code == 0 and a.source is None and b.source is None
    assert [s.verdict for s in a.layers] == [s.verdict for s in b.layers]
    assert a.free is not None and b.free is not None
    assert [t.engine for t in a.free.tokens] == [t.engine for t in b.free.tokens]
    for x, y in zip(_all_rows(a), _all_rows(b), strict=True):
        assert abs(x.added.rel_rms - y.added.rel_rms) <= x.budget
