"""Tensor parallelism over torch.distributed (gloo): real processes, real collectives, real faults.

Each test starts ranks as processes (a few seconds of imports each), so they are few and share runs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conformance.cases.catalog import all_cases
from conformance.cli import main as cli_main
from conformance.golden.store import read_golden
from conformance.tp import cli as tp_cli
from conformance.tp import launch as tp_launch
from conformance.tp import tprun
from conformance.tp.blame import blame_ranks
from conformance.tp.launch import TpFailure, spawn
from conformance.tp.measure import MeasuredReader, OverRead, measured_shard
from conformance.tp.mutants import plan_mutant
from conformance.tp.rank import trace_case
from conformance.tp.tprun import run_tp
from k3ref.config import K3Config
from k3ref.tp import LoopbackGroup, TpPlan
from k3ref.tp_weights import SliceReader, read_rank_shard
from k3ref.weights import read_header

pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parents[2]
TRACES = ("trace/layerwise-P7-D5", "trace/free-P7-D5")
FAULT_DEADLINE_S = 60.0   # every rank gone and a non-zero exit within this after a rank is killed


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module", params=[pytest.param(2, id="tp2"), pytest.param(4, id="tp4")])
def tp_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tp{request.param}")
    rc = cli_main(["run", "--tp", str(request.param), "--report", str(out)])
    return request.param, rc, _report(out)


def test_tp_run_passes_the_tp1_goldens(tp_run):
    tp, rc, rep = tp_run
    assert rc == 0, rep["first_failure"]
    assert set(TRACES) <= {r["case"] for r in rep["results"]}
    for r in rep["results"]:
        assert r["backend"] == f"numpy64-tp{tp}"
        if r["case"].startswith("trace/k3geom/") and tp == 4:   # 2 heads: no 4-way split, a skip with the reason
            assert r["status"] == "skip" and "does not split model k3geom" in r["error"], r
            continue
        assert r["status"] == "pass", r["case"]
        assert len(r["tensors"]) == _golden_outputs(r["case"]), "every traced tensor of every layer and step"


def _golden_outputs(case: str) -> int:
    return sum(k.startswith("outputs.") for k in read_header(ROOT / "golden" / f"{case}.safetensors"))


def test_tp_report_lists_every_rank_its_process_and_bytes(tp_run):
    tp, _, rep = tp_run
    for case in TRACES:
        rows = rep["tp_ranks"][case]
        assert [r["rank"] for r in rows] == list(range(tp))
        pids = {r["pid"] for r in rows}
        assert len(pids) == tp and os.getpid() not in pids, "one process per rank, none of them this one"
        notes = next(r["notes"] for r in rep["results"] if r["case"] == case)
        for r in rows:
            assert any(f"rank {r['rank']} (pid {r['pid']})" in n and f"{r['bytes_read']:,}" in n for n in notes)


def test_no_rank_reads_or_holds_more_than_its_shard(tp_run):
    """Held bytes are exactly the plan's dense bytes for that rank (the golden stores weights as F32 / U8), its
    routed experts served from the mapping (none copied); bytes read from the file are those minus the A_log
    zero padding; each is below the whole file's weights."""
    tp, _, rep = tp_run
    plan = TpPlan(K3Config.preset("tiny"), tp)
    whole = TpPlan(K3Config.preset("tiny"), 1).rank_bytes(0, _golden_itemsize)["total"]
    for case in TRACES:
        for r in rep["tp_ranks"][case]:
            want = plan.rank_bytes(r["rank"], _golden_itemsize)
            assert r["plan_bytes"] == want["total"] and r["plan_replicated"] == want["replicated"]
            assert r["resident"] == want["total"] - want["experts"] and r["mapped"] == want["experts"] > 0
            assert r["copied_experts"] == 0
            assert want["replicated"] < r["bytes_read"] <= want["total"] - want["experts"] < whole


def _golden_itemsize(name: str) -> int:
    return 1 if ".experts." in name and name.endswith(("weight_packed", "weight_scale")) else 4


def test_decode_tp_holds_the_plan_of_model_info(capfd):
    """Synthesised shards: per rank held bytes (storage dtypes) == `k3conf model info --tp 2`, and the tokens
    equal the TP 1 greedy decode."""
    assert cli_main(["decode", "--prompt", "5,17,3", "--max-new", "4"]) == 0
    ref = capfd.readouterr().out.strip()
    assert cli_main(["decode", "--prompt", "5,17,3", "--max-new", "4", "--tp", "2"]) == 0
    out, err = capfd.readouterr()
    assert out.strip() == ref
    assert cli_main(["model", "info", "--config", "tiny", "--tp", "2"]) == 0
    info = capfd.readouterr().out
    plan = TpPlan(K3Config.preset("tiny"), 2)
    for r in range(2):
        held = plan.rank_bytes(r)["total"]
        assert f"holds {held:,} B" in err and f"rank {r}" in info and f"total {held:>18,} B" in info


@pytest.mark.parametrize("rank", [pytest.param(r, id=f"rank{r}") for r in (0, 1)])
def test_wrong_split_axis_is_refused_naming_the_layer_and_rank(rank):
    """The ranks build their shard with this very call (conformance.tp.rank); a refusal there ends the run
    with the message below as the rank's cause."""
    plan = plan_mutant("g_proj-row-split")(K3Config.preset("tiny"), 2)
    entries = read_header(ROOT / "golden" / "trace" / "layerwise-P7-D5.safetensors")
    with pytest.raises(ValueError, match=rf"rank {rank}: language_model\.model\.layers\.0\.self_attn\.g_proj\.weight: "
                                         r"the plan's shard has shape \[32, 18\], the rank's model needs \[16, 36\]"):
        read_rank_shard(plan, rank, entries, prefix="weights.")


def test_a_rank_reading_another_ranks_heads_fails_naming_layer_and_rank(tmp_path):
    rc = cli_main(["run", "--tp", "2", "--cases", "trace/layerwise*", "--tp-mutant", "q_proj-neighbour-heads",
                   "--report", str(tmp_path)])
    rep = _report(tmp_path)
    assert rc == 1
    assert "step0.layer00.3_a" in rep["first_failure"]
    notes = rep["results"][0]["notes"]
    assert any("rank 0: its mixer partial sum at step 0 layer 0 differs" in n for n in notes)
    assert any("rank 1: its mixer partial sum at step 0 layer 0 differs" in n for n in notes)


def test_a_rank_missing_its_shard_ends_every_rank_naming_it(tmp_path):
    """Rank 1 holds experts 4..6 at tp 2: without one of them it raises, rank 0's collective fails, both end."""
    gold = tmp_path / "golden"
    (gold / "trace").mkdir(parents=True)
    (gold / "MANIFEST.json").write_text((ROOT / "golden" / "MANIFEST.json").read_text())
    name = "trace/layerwise-P7-D5"
    tensors = load_file(str(ROOT / "golden" / f"{name}.safetensors"))
    gone = "weights.language_model.model.layers.1.block_sparse_moe.experts.5.w2.weight_packed"
    del tensors[gone]
    save_file(tensors, str(gold / f"{name}.safetensors"))
    case = next(c for c in all_cases("tiny") if c.name == name)
    t0 = time.monotonic()
    with pytest.raises(TpFailure) as e:
        run_tp([case], gold, config="tiny", tp=2, dist="gloo", timeout=30.0)
    assert time.monotonic() - t0 < FAULT_DEADLINE_S
    msg = str(e.value)
    assert msg.startswith("rank 1 (pid ") and gone in msg and "missing" in msg
    assert "rank 0 (pid" in msg, "what the other rank saw is reported too"


FAULT_GRACE_S = 3.0   # the launcher's wait for the other ranks to fail on their own (the CLI's is 10 s)


def _start_decode(workdir: Path, timeout: float = 30.0):
    """A long greedy decode on 2 spawned ranks, in a thread; returns (pids, outcome, thread) once both ranks
    have joined the group and are decoding. outcome["error"] is the TpFailure message (None on success)."""
    cfg = K3Config.preset("tiny")
    job = {"kind": "decode", "tp": 2, "dist": "gloo", "timeout": timeout, "workdir": str(workdir),
           "config_json": json.loads(json.dumps(dataclasses.asdict(cfg))), "checkpoint": None, "seed": 0,
           "prompt": [5, 17, 3], "max_new": 20000, "dtype": "float64"}
    pids, outcome = [], {}

    def launch():
        try:
            spawn(job, workdir, grace=FAULT_GRACE_S, on_start=pids.extend)
            outcome["error"] = None
        except TpFailure as e:
            outcome["error"] = str(e)

    t = threading.Thread(target=launch, daemon=True)
    t.start()
    deadline = time.monotonic() + FAULT_DEADLINE_S
    while not all((workdir / f"rank{r}.ready").exists() for r in range(2)):
        assert time.monotonic() < deadline and t.is_alive(), f"the ranks never joined: {outcome}"
        time.sleep(0.1)
    return pids, outcome, t


def test_killing_a_rank_mid_run_ends_all_within_bounded_time(tmp_path):
    pids, outcome, t = _start_decode(tmp_path)
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    t.join(FAULT_DEADLINE_S)
    assert not t.is_alive(), f"the launcher still waits {FAULT_DEADLINE_S} s after rank 1 was killed"
    assert time.monotonic() - killed < FAULT_DEADLINE_S
    assert outcome["error"].startswith(f"rank 1 (pid {pids[1]}) died: killed by signal SIGKILL"), outcome
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"rank process {pid} is still running"


def test_a_hung_rank_is_named_after_the_collective_timeout(tmp_path):
    """Rank 1 stops (SIGSTOP): rank 0's collective times out, and the launcher names rank 1 as hung."""
    pids, outcome, t = _start_decode(tmp_path, timeout=5.0)
    os.kill(pids[1], signal.SIGSTOP)
    t.join(FAULT_DEADLINE_S)
    assert not t.is_alive(), "the launcher waits on a hung rank"
    msg = outcome["error"]
    assert msg.startswith(f"rank 1 (pid {pids[1]}) hung: still running {FAULT_GRACE_S:g} s after a peer failed"), msg
    assert f"rank 0 (pid {pids[0]}): collective" in msg


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_impossible_plans_are_refused_before_any_process(monkeypatch, capsys):
    monkeypatch.setattr(tp_launch, "spawn", lambda *a, **k: pytest.fail("a process was started"))
    assert cli_main(["run", "--tp", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err
    assert cli_main(["decode", "--prompt", "1,2", "--tp", "8"]) == 2
    assert "does not divide" in capsys.readouterr().err
    import torch  # noqa: PLC0415 -- optional: a top-level import would fail collection before importorskip

    if not torch.cuda.is_available():
        assert cli_main(["run", "--tp", "2", "--dist", "nccl"]) == 2
        assert "expected a GPU per rank (2), found 0" in capsys.readouterr().err


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun next to this interpreter")
def test_torchrun_gives_the_same_result(tp_run, tmp_path):
    """The ranks started by torchrun (env:// already set) gate exactly as the spawned `--tp 2` ranks did."""
    tp, _, spawned = tp_run
    if tp != 2:
        pytest.skip("torchrun is compared with the spawned --tp 2 run")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([str(TORCHRUN), "--nproc-per-node", "2", "-m", "conformance", "run", "--tp", "2",
                           "--cases", "trace/layerwise*", "--report", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = _report(tmp_path)
    rows = rep["tp_ranks"]["trace/layerwise-P7-D5"]
    assert [r["rank"] for r in rows] == [0, 1] and len({r["pid"] for r in rows}) == 2
    [got] = rep["results"]
    want = next(r for r in spawned["results"] if r["case"] == got["case"])
    assert got["status"] == want["status"] == "pass"
    assert [(t["tensor"], t["comparison"]) for t in got["tensors"]] == \
        [(t["tensor"], t["comparison"]) for t in want["tensors"]]


class _RecordingComm:
    """A loopback comm that, like TorchComm, records every all_reduce input while `record` is a list."""

    def __init__(self, inner):
        self.inner, self.record = inner, None

    def all_reduce(self, a):
        if self.record is not None:
            self.record.append(np.array(a, copy=True))
        return self.inner.all_reduce(a)

    def all_gather(self, a):
        return self.inner.all_gather(a)


@pytest.mark.parametrize("mutant, want", [
    pytest.param(None, ["every rank's partial sums match their shares of the golden"], id="correct-plan"),
    pytest.param("q_proj-neighbour-heads", ["rank 0: its mixer partial sum at step 0 layer 0 differs",
                                            "rank 1: its mixer partial sum at step 0 layer 0 differs"], id="mutant"),
])
def test_blame_checks_every_partial_sum_of_every_rank(mutant, want):
    """The rank code on threads: with the right plan every recorded partial sum (mixers and routed latents of
    every layer and step) equals that rank's share recomputed from the golden; with a mutant the ranks at
    fault are named."""
    case = next(c for c in all_cases("tiny") if c.name == TRACES[0])
    job = {"tp": 2, "config": "tiny", "golden_root": str(ROOT / "golden"), "mode": {case.name: "layerwise"},
           "model": {case.name: "tiny"}, "prompt": {case.name: 7}, "mutant": mutant}
    outs, _ = LoopbackGroup(2).run(lambda r, comm: trace_case(job, case.name, r, _RecordingComm(comm)))[0]
    schedule_len = 6 * (1 + 7 + 6)      # steps x (embedding + 7 mixers + 6 MoE layers) of tiny
    assert sum(k.startswith("tp.partial.") for k in outs) == schedule_len
    got = blame_ranks(case, read_golden(ROOT / "golden", case.name), outs, 2)
    assert len(got) == len(want) and all(line.startswith(w) for line, w in zip(got, want, strict=True)), got


# ----- bytes read are measured by the kernel, not reported by the reader -----

class _WholeTensorReader(SliceReader):
    """A dishonest reader: copies every tensor whole out of the mapping, then reports only the slice."""

    def view(self, name, h):
        return np.array(super().view(name, h))


class _WholeTensorPreader(MeasuredReader):
    """Another: reads every tensor whole with read calls, and takes those bytes off its own count."""

    def view(self, name, h):
        v = super().view(name, h)
        if not name.endswith("A_log"):
            self.copy(v)
            self.bytes_read -= v.nbytes
        return v


@pytest.mark.parametrize("tp", [2, 4])
def test_an_honest_rank_is_measured_reading_exactly_its_shard(tp):
    entries = read_header(ROOT / "golden" / "trace" / "layerwise-P7-D5.safetensors")
    plan = TpPlan(K3Config.preset("tiny"), tp)
    for rank in range(tp):
        shard, cost = measured_shard(plan, rank, entries, prefix="weights.", itemsize=_golden_itemsize)
        want, _ = read_rank_shard(plan, rank, entries, prefix="weights.")
        assert sorted(shard) == sorted(want)
        assert all(np.array_equal(shard[k].view(np.uint8), want[k].view(np.uint8)) for k in want)
        assert cost.read == plan.rank_bytes(rank, _golden_itemsize)["total"]


@pytest.mark.parametrize("reader, counted", [
    pytest.param(_WholeTensorReader, "B of mapped pages", id="through-the-mapping"),
    pytest.param(_WholeTensorPreader, "B by read calls", id="through-read-calls"),
])
def test_a_rank_reading_whole_tensors_fails_whatever_its_reader_reports(reader, counted):
    entries = read_header(ROOT / "golden" / "trace" / "layerwise-P7-D5.safetensors")
    plan = TpPlan(K3Config.preset("tiny"), 2)
    shard_bytes = plan.rank_bytes(1, _golden_itemsize)["total"]
    with pytest.raises(OverRead, match=rf"rank 1: read [\d,]+ B of the weight files .*more than the "
                                       rf"{shard_bytes:,} B of its shard") as e:
        measured_shard(plan, 1, entries, prefix="weights.", itemsize=_golden_itemsize, reader=reader())
    assert counted in str(e.value)


# ----- run --tp: the report folder first, exit 1 on a failed gate -----

def test_run_tp_checks_the_report_folder_before_any_rank_starts(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tprun, "spawn", lambda *a, **k: pytest.fail("a rank was started"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cli_main(["run", "--tp", "2", "--report", str(blocker / "sub")]) == 2
    assert f"--report {blocker / 'sub'}: cannot write reports there" in capsys.readouterr().err


def test_run_tp_exits_1_on_a_failed_gate_even_when_the_reports_cannot_be_written(monkeypatch, tmp_path, capsys):
    def disk_full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tp_cli.rep, "write_reports", disk_full)
    rc = cli_main(["run", "--tp", "2", "--cases", "trace/layerwise*", "--tp-mutant", "q_proj-neighbour-heads",
                   "--report", str(tmp_path)])
    assert rc == 1
    assert f"cannot write the reports to {tmp_path} (No space left on device)" in capsys.readouterr().err
