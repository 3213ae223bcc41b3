"""`k3conf run --tp N --backend B`: each rank calls B's cores on its shard's shapes, judged at B's precision against
the TP 1 goldens; a kernel wrong only on one rank's slice fails naming that rank; ranks serve their routed experts
from the mapped file instead of copying them; `decode --tp N --checkpoint` checks the whole geometry first.

Runs start ranks as processes (seconds of imports each): few runs, shared by the tests that read them.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from conformance.backends.registry import get_backend
from conformance.cli import main as cli_main
from conformance.tp import launch as tp_launch
from conformance.tp.blame import PARTIAL_RTOL
from conformance.tp.measure import measured_shard
from k3ref.config import K3Config
from k3ref.expert_backend import MmapExpertStore
from k3ref.tp import TpPlan
from k3ref.tp_weights import PrefixedCheckpoint, ShardWeights, check_geometry, read_rank_shard
from k3ref.weights import CheckpointReader, read_header, synthetic_checkpoint
from tests.support.strict import require, strict

require("torch")   # fails under K3_STRICT=1: CI must run the ranks
pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "golden" / "trace" / "layerwise-P7-D5.safetensors"
LAYERWISE = ("trace/layerwise-P7-D5", "trace/k3geom/layerwise-P3-D1")
MUTANT = "conformance.tp.mutants:kda_global_head_index"


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _golden_itemsize(name: str) -> int:
    """The golden stores bf16 weights as exact F32, routed experts as U8."""
    return 1 if ".experts." in name else 4


def _outputs(case: str) -> int:
    return sum(k.startswith("outputs.") for k in read_header(ROOT / "golden" / f"{case}.safetensors"))


@pytest.fixture(scope="module", params=["torch-bf16", "cuda-emu"])
def backend_run(request, tmp_path_factory):
    ok, why = get_backend(request.param).available()
    if not ok:
        if strict():   # both run wherever CI does (torch, g++): a missing one there is a failure, not a skip
            pytest.fail(f"K3_STRICT=1: {request.param} cannot run here: {why}", pytrace=False)
        pytest.skip(why)
    out = tmp_path_factory.mktemp(request.param)
    rc = cli_main(["run", "--tp", "2", "--backend", request.param, "--cases", *LAYERWISE, "--report", str(out)])
    return request.param, rc, _report(out)


def test_a_backend_on_ranks_is_judged_on_every_traced_tensor_at_its_precision(backend_run):
    name, rc, rep = backend_run
    assert rc == 0, rep["first_failure"]
    assert {r["case"] for r in rep["results"]} == set(LAYERWISE)
    precision = get_backend(name).precision
    for r in rep["results"]:
        assert r["backend"] == f"{name}-tp2" and r["precision"] == precision and r["status"] == "pass", r["case"]
        assert len(r["tensors"]) == _outputs(r["case"])
        gated = [t for t in r["tensors"] if t["gated"] and t["tensor"].endswith("3_a")]
        assert gated and all(t["gate"]["key"][2] == precision for t in gated)
        if precision != "fp64":   # bounded by the precision's baseline on the same case at TP 1, as in one process
            assert all(t["baseline"] == {"bf16": "torch-bf16", "fp32": "numpy32"}[precision] for t in gated)
            # the baseline ran by itself: its error is not the ranks' own (the mixers' all-reduce sums otherwise)
            assert any(t["comparison"]["rel_rms"] != t["baseline_err"] for t in gated)


def test_the_kernels_run_on_the_shard_shapes(backend_run):
    """k3geom at TP 2 holds one KDA head per rank with K = V = 128: the CUDA kda_decode runs there on every rank
    (no fallback note), while on tiny's 8-wide heads it falls back, said per rank."""
    name, _, rep = backend_run
    if name != "cuda-emu":
        pytest.skip("the fallbacks are cuda-emu's (torch-bf16 runs every shape)")
    notes = {r["case"]: r["notes"] for r in rep["results"]}
    assert not [n for n in notes["trace/k3geom/layerwise-P3-D1"] if "kda_decode: k3ref's reference core ran" in n]
    for rank in (0, 1):
        assert any(n.startswith(f"rank {rank}: kda_decode: k3ref's reference core ran instead")
                   for n in notes["trace/layerwise-P7-D5"])


def test_ranks_map_their_experts_instead_of_copying_them(backend_run):
    _, _, rep = backend_run
    plan = TpPlan(K3Config.preset("tiny"), 2)
    for r in rep["tp_ranks"]["trace/layerwise-P7-D5"]:
        want = plan.rank_bytes(r["rank"], _golden_itemsize)
        assert r["copied_experts"] == 0
        assert r["mapped"] == want["experts"] > 0
        assert r["resident"] == want["total"] - want["experts"]


def test_a_kernel_wrong_only_on_one_ranks_slice_fails_naming_that_rank(tmp_path):
    assert cli_main(["run", "--backend", MUTANT, "--cases", LAYERWISE[0], "--no-timing",
                     "--report", str(tmp_path / "tp1")]) == 0, "right on one process: it passes the TP 1 goldens"
    rc = cli_main(["run", "--tp", "2", "--backend", MUTANT, "--cases", LAYERWISE[0], "--report", str(tmp_path)])
    rep = _report(tmp_path)
    assert rc == 1
    assert "tp-mutant-kda-global-head-tp2" in rep["first_failure"] and "step0.layer00.3_a" in rep["first_failure"]
    notes = rep["results"][0]["notes"]
    assert any(n.startswith("rank 1: its mixer partial sum at step 0 layer 0 differs") for n in notes), notes
    assert not any(n.startswith("rank 0: its mixer partial sum") for n in notes)


def test_partial_sum_tolerances_cover_every_precision():
    assert set(PARTIAL_RTOL) == {"fp64", "fp32", "bf16"}
    assert PARTIAL_RTOL["fp64"] < PARTIAL_RTOL["fp32"] < PARTIAL_RTOL["bf16"]


@pytest.mark.parametrize("backend, why", [("torch-model", "runs whole traces by its own wiring"),
                                          ("no-such-backend", "unknown backend")])
def test_a_backend_that_cannot_run_on_ranks_is_refused_before_any_rank(monkeypatch, capsys, tmp_path, backend, why):
    monkeypatch.setattr(tp_launch.subprocess, "Popen", _no_process)
    assert cli_main(["run", "--tp", "2", "--backend", backend, "--report", str(tmp_path)]) == 2
    assert why in capsys.readouterr().err


def _no_process(*a, **k):
    raise AssertionError("a rank was started")


# ----- experts through the mapped store -----

def test_a_ranks_experts_are_views_of_the_mapped_file_and_only_its_own():
    entries = read_header(TINY)
    plan = TpPlan(K3Config.preset("tiny"), 2)
    store = MmapExpertStore(PrefixedCheckpoint(entries, "weights.", TINY))
    shard, cost = measured_shard(plan, 1, entries, prefix="weights.", experts=store, itemsize=_golden_itemsize)
    assert isinstance(shard, ShardWeights)
    held = [n for n in shard if ".experts." in n and n.endswith("weight_packed")]
    lo, hi = plan.expert_range(1)
    assert held and all(lo <= int(n.split(".experts.")[1].split(".")[0]) < hi for n in held)
    assert cost.copied_experts == 0 and not [n for n in shard.dense if ".experts." in n]
    want = plan.rank_bytes(1, _golden_itemsize)
    assert cost.mapped == want["experts"] and cost.read <= want["total"] - want["experts"], "no expert byte read"
    copied, _ = read_rank_shard(plan, 1, entries, prefix="weights.")
    for name in held:
        view = shard[name]
        assert isinstance(view.base, np.memmap) or isinstance(view, np.memmap), "served from the mapping"
        np.testing.assert_array_equal(view, copied[name])
    other = held[0].replace(f".experts.{lo}.", ".experts.0.")
    with pytest.raises(KeyError, match=r"rank 1: .*experts\.0\.w.* is not in its shard \(it holds routed experts"):
        shard[other]


# ----- decode --tp N --checkpoint: the geometry before any rank -----

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return synthetic_checkpoint(K3Config.preset("tiny"), 3, tmp_path_factory.mktemp("tp_ckpt"), shard_bytes=60_000)


def test_the_whole_geometry_of_a_good_checkpoint_passes(tiny_ckpt):
    for tp in (1, 2, 4):
        check_geometry(TpPlan(K3Config.preset("tiny"), tp), CheckpointReader(tiny_ckpt).entries)


def test_every_misfit_is_named_with_expected_and_found(tiny_ckpt):
    entries = dict(CheckpointReader(tiny_ckpt).entries)
    g = "language_model.model.layers.1.self_attn.g_proj.weight"
    a = "language_model.model.layers.0.self_attn.A_log"
    e = "language_model.model.layers.3.block_sparse_moe.experts.5.w2.weight_scale"
    entries[g] = dataclasses.replace(entries[g], shape=(entries[g].shape[0] + 1, entries[g].shape[1]))
    entries[a] = dataclasses.replace(entries[a], dtype="BF16")
    del entries[e]
    with pytest.raises(ValueError) as err:
        check_geometry(TpPlan(K3Config.preset("tiny"), 2), entries)
    msg = str(err.value)
    assert msg.startswith("--tp 2: 3 tensor(s) do not fit the plan: ")
    assert f"{g}: expected BF16 [32, 36], found BF16 [33, 36]" in msg
    assert f"{a}: expected F32 [" in msg and "found BF16" in msg
    assert f"{e}: expected U8 [" in msg and "found no such tensor" in msg


def test_decode_tp_refuses_a_misfit_checkpoint_before_any_rank(tiny_ckpt, monkeypatch, capsys):
    """tiny's checkpoint read as k3geom (K3's head geometry): refused from the headers, naming the tensors, and
    no rank started."""
    monkeypatch.setattr(tp_launch.subprocess, "Popen", _no_process)
    rc = cli_main(["decode", "--tp", "2", "--checkpoint", str(tiny_ckpt), "--config", "k3geom", "--prompt", "1,2",
                   "--max-new", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--checkpoint {tiny_ckpt}: --tp 2: " in err and "tensor(s) do not fit the plan" in err
    assert "language_model.model.embed_tokens.weight: expected BF16 [" in err and ", found BF16 [97, 36]" in err


def test_decode_tp_from_a_checkpoint_maps_the_experts_and_equals_tp1(tiny_ckpt, capfd):
    argv = ["decode", "--checkpoint", str(tiny_ckpt), "--prompt", "5,17,3", "--max-new", "3"]
    assert cli_main(argv) == 0
    ref = capfd.readouterr().out.strip()
    assert cli_main([*argv, "--tp", "2"]) == 0
    out, err = capfd.readouterr()
    assert out.strip() == ref
    plan = TpPlan(K3Config.preset("tiny"), 2)
    for r in range(2):
        want = plan.rank_bytes(r)
        line = next(x for x in err.splitlines() if x.startswith(f"rank {r} (pid "))
        assert f"holds {want['total'] - want['experts']:,} B of weights" in line
        assert f"its routed experts ({want['experts']:,} B) served from the mapping (0 expert tensors copied)" in line


WRITER = '''
import os
from conformance import Backend


def make():
    def make_cores(base):
        def rmsnorm(x, w, eps):
            if os.environ.get("RANK") == "1":
                x[...] = 0.0            # writes into its input, on rank 1 only
            return base.rmsnorm(x, w, eps)
        return base.replace(rmsnorm=rmsnorm)
    return Backend.from_cores("writes-on-rank-1", "fp64", make_cores)
'''


def test_a_core_writing_into_its_input_on_a_rank_fails_naming_the_rank_and_core(tmp_path, capsys):
    """The isolation guard holds inside ranks: each core call on its own copies, a write is caught."""
    path = tmp_path / "writer.py"
    path.write_text(WRITER)
    rc = cli_main(["run", "--tp", "2", "--backend", f"{path}:make", "--cases", LAYERWISE[0],
                   "--report", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "k3conf run --tp 2: rank 1 (pid " in err
    assert "trace/layerwise-P7-D5: KernelFailure: core rmsnorm wrote into its input x" in err
