"""`k3conf compare` spread over worker processes and torchrun ranks: the same report as one process, and a
worker that dies named, its layers re-run once, then reported missing.

The faulty run_layer functions below are module-level so that a spawned worker imports them by name; what they
do is set by environment variables, which a spawned worker inherits.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.dumps.distributed import merge_payloads, rank_payload
from conformance.dumps.errors import DumpError, DumpShapeError
from conformance.dumps.recompute import recompute_layer
from conformance.dumps.spread import compare_spread
from conformance.dumps.workers import LayerRuns, function_name
from tests.conformance.test_dump_cli import make_checkpoint, record

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
FAULT_LAYER = "K3CONF_TEST_FAULT_LAYER"    # the layer the faulty run_layer fails on
FAULT_ONCE = "K3CONF_TEST_FAULT_ONCE"      # a file: when set, fail only while it does not exist (then create it)
RUN_KEYS = ("run", "metadata")             # what report.json adds to the report: how it ran, on what


def _fault_here(layer: int) -> bool:
    if layer != int(os.environ[FAULT_LAYER]):
        return False
    once = os.environ.get(FAULT_ONCE)
    if once is None:
        return True
    if Path(once).exists():
        return False
    Path(once).touch()
    return True


def killed_on_layer(dump, checkpoint, layer):
    if _fault_here(layer):
        os.kill(os.getpid(), signal.SIGKILL)
    return recompute_layer(dump, checkpoint, layer)


def exits_on_layer(dump, checkpoint, layer):
    if _fault_here(layer):
        os._exit(3)
    return recompute_layer(dump, checkpoint, layer)


def raises_on_layer(dump, checkpoint, layer):
    if _fault_here(layer):
        raise ArithmeticError(f"planted failure in layer {layer}")
    return recompute_layer(dump, checkpoint, layer)


def bad_dump_on_layer(dump, checkpoint, layer):
    if _fault_here(layer):
        raise DumpShapeError(f"planted shape problem in layer {layer}")
    return recompute_layer(dump, checkpoint, layer)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint, planted dump, its one-process report JSON): a dump with a source and carriers, so that
    equal reports are equal in everything the report says."""
    root = tmp_path_factory.mktemp("workers")
    ckpt = make_checkpoint(root)
    dump = record(ckpt, root / "planted",
                  scale={"language_model.model.layers.4.block_sparse_moe.routed_expert_up_proj.weight": 1.05})
    report, run = compare_spread(dump, ckpt)
    assert report.source is not None and report.carriers and run["workers"] == 1
    return ckpt, dump, report.to_json()


def test_two_workers_give_the_report_of_one(tiny):
    ckpt, dump, want = tiny
    report, run = compare_spread(dump, ckpt, workers=2)
    assert run["workers"] == 2 and run["failures"] == []
    assert report.to_json() == want


@pytest.mark.parametrize("fault, status", [(killed_on_layer, -signal.SIGKILL), (exits_on_layer, 3)])
def test_a_worker_that_dies_is_named_rerun_once_then_its_layer_missing(tiny, monkeypatch, fault, status):
    ckpt, dump, want = tiny
    monkeypatch.setenv(FAULT_LAYER, "3")
    report, run = compare_spread(dump, ckpt, workers=2, free=False, run_layer=fault)
    # worker 2 of 2 holds layers 1, 3, 5; the fresh worker 3 gets 5 first and dies on 3 again
    assert run["failures"] == [f"worker 2 (layers 1, 3, 5) exited with {status} on layer 3; layers 5, 3 re-run in "
                               "worker 3",
                               f"worker 3 (layers 5, 3) exited with {status} on layer 3"]
    assert report.missing == [3] and report.exit_code == 1
    assert any(n.startswith("layer 3: no result: worker 2 (layers 1, 3, 5)") for n in report.notes), report.notes
    got = {s.layer: s.to_json() for s in report.layers}
    clean = {s["layer"]: s for s in want["layers"]}
    assert sorted(got) == [0, 1, 2, 4, 5, 6]
    assert all(got[la]["worst"] == clean[la]["worst"] for la in got)


def test_a_layer_whose_worker_died_once_is_recovered(tiny, monkeypatch, tmp_path):
    ckpt, dump, want = tiny
    monkeypatch.setenv(FAULT_LAYER, "4")
    monkeypatch.setenv(FAULT_ONCE, str(tmp_path / "died"))
    report, run = compare_spread(dump, ckpt, workers=2, run_layer=exits_on_layer)
    assert run["failures"] == ["worker 1 (layers 0, 2, 4, 6) exited with 3 on layer 4; layers 6, 4 re-run in "
                               "worker 3"]
    assert report.notes == run["failures"]
    assert {**report.to_json(), "notes": []} == want    # the same verdict: source at layer 4, carriers 5, 6


def test_an_exception_makes_its_layer_missing_without_a_rerun(tiny, monkeypatch):
    ckpt, dump, _ = tiny
    monkeypatch.setenv(FAULT_LAYER, "2")
    for workers in (1, 2):
        report, run = compare_spread(dump, ckpt, workers=workers, free=False, run_layer=raises_on_layer)
        assert run["failures"] == [] and report.missing == [2] and report.exit_code == 1
        [note] = report.notes
        assert note.startswith("layer 2: no result: ArithmeticError: planted failure in layer 2")


def test_a_dump_error_in_a_worker_stops_the_compare(tiny, monkeypatch):
    ckpt, dump, _ = tiny
    monkeypatch.setenv(FAULT_LAYER, "5")
    with pytest.raises(DumpError, match="layer 5: DumpShapeError: planted shape problem in layer 5"):
        compare_spread(dump, ckpt, workers=2, free=False, run_layer=bad_dump_on_layer)


def test_only_functions_a_worker_can_import_are_taken():
    assert function_name(recompute_layer) == "conformance.dumps.recompute:recompute_layer"
    with pytest.raises(ValueError, match="module-level function"):
        function_name(lambda d, c, la: None)


def test_rank_payloads_are_json_and_carry_a_dump_error():
    runs = LayerRuns(results={1: {"layer": 1, "x": float("nan")}}, missing={3: "ArithmeticError: boom"})
    blobs = [rank_payload(0, [1, 3], runs, None), rank_payload(1, [2], LayerRuns(results={2: {"layer": 2}}), None)]
    merged, ranks = merge_payloads(blobs)
    assert sorted(merged.results) == [1, 2] and np.isnan(merged.results[1]["x"])
    assert merged.missing == {3: "ArithmeticError: boom (rank 0)"}
    assert [r["layers"] for r in ranks] == [[1, 3], [2]]
    with pytest.raises(DumpError, match="rank 1: step 2: truncated"):
        merge_payloads([blobs[0], rank_payload(1, [2], LayerRuns(), "step 2: truncated")])


@pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun next to this interpreter")
def test_two_torchrun_ranks_give_the_report_of_one_worker(tiny, tmp_path):
    ckpt, dump, _ = tiny
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([str(TORCHRUN), "--nproc-per-node", "2", "-m", "conformance", "compare", str(dump),
                           "--checkpoint", str(ckpt), "--distributed", "--report", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, "the planted dump must exit 1 on rank 0"   # torchrun: a rank's non-zero exit
    assert "source: layer 4 mlp" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "report.json").read_text())
    want = compare_spread(dump, ckpt)[0].to_json()    # one process, right after the ranks: the same code
    assert [r["layers"] for r in doc["run"]["ranks"]] == [[0, 2, 4, 6], [1, 3, 5]]
    assert len({r["pid"] for r in doc["run"]["ranks"]}) == 2
    assert {k: v for k, v in doc.items() if k not in RUN_KEYS} == json.loads(json.dumps(want))
