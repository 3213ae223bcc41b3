"""Untrusted kernels run in a worker process: a write into an input, an exit, a signal, an exception of any kind
or a hang inside a core is an error row naming the backend, the core and the case, the run goes on and exits 1
with its reports written; a core that gives other bits on a second call fails unless the backend declares
itself non-deterministic. The backends are in tests/conformance/untrusted/kernels.py, loaded by file path."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from conformance.cli import main
from conformance.isolation import wire
from conformance.isolation.guard import InputWritten, guard_core

KERNELS = Path(__file__).parent / "untrusted" / "kernels.py"
RMS = "rmsnorm/T1-D113"          # the case the ending and hanging cores end or hang on
OTHER = "situ_glu/T1-I113"       # a case after it: the run goes on, with a new worker


def run_cli(tmp_path: Path, backend: str, cases: list[str], *extra: str) -> tuple[int, dict]:
    """k3conf run of numpy32 and the untrusted backend on `cases`; (exit code, report.json)."""
    rc = main(["run", "--backend", "numpy32", f"{KERNELS}:{backend}", "--cases", *cases, "--no-timing",
               "--report", str(tmp_path), *extra])
    return rc, json.loads((tmp_path / "report.json").read_text())


def cells(report: dict) -> dict[tuple[str, str], dict]:
    return {(r["case"], r["backend"]): r for r in report["results"]}


@pytest.mark.parametrize("backend, case, core, written", [
    ("WRITES_FLOAT", RMS, "rmsnorm", "x"),
    ("WRITES_PACKED", "mxfp4_gemv/N113-K64", "mxfp4_gemv", "packed"),
    ("WRITES_SEQ_LENS", "mla_decode/B2-H3-R32-P16-L65-1", "mla_decode", "seq_lens"),
])
def test_a_core_writing_into_its_input_fails_and_numpy32_is_unaffected(tmp_path, backend, case, core, written):
    rc, report = run_cli(tmp_path, backend, [case])
    got = cells(report)
    name = {"WRITES_FLOAT": "writes-float", "WRITES_PACKED": "writes-packed",
            "WRITES_SEQ_LENS": "writes-seq-lens"}[backend]
    bad = got[(case, name)]
    assert rc == 1 and bad["status"] == "error", bad
    assert f"core {core} wrote into its input {written}" in bad["error"], bad["error"]
    assert got[(case, "numpy32")]["status"] == "pass", got[(case, "numpy32")]


@pytest.mark.parametrize("backend, name, says", [
    ("SYS_EXIT", "sys-exit", "SystemExit: 0"),
    ("OS_EXIT", "os-exit", "exited with status 0"),
    ("SEGFAULT", "segfault", "killed by SIGSEGV"),
    ("INTERRUPT", "interrupt", "KeyboardInterrupt"),
])
def test_a_core_that_ends_its_process_is_an_error_row_and_the_run_goes_on(tmp_path, backend, name, says):
    rc, report = run_cli(tmp_path, backend, [RMS, OTHER])
    got = cells(report)
    bad = got[(RMS, name)]
    assert rc == 1 and report["exit_code"] == 1
    assert bad["status"] == "error" and says in bad["error"], bad["error"]
    assert "core rmsnorm" in bad["error"] and name in bad["error"] and RMS in bad["error"], bad["error"]
    assert got[(OTHER, name)]["status"] == "pass", got[(OTHER, name)]     # a new worker took the next case
    assert got[(RMS, "numpy32")]["status"] == "pass"


def test_a_hung_core_is_stopped_at_the_time_limit(tmp_path):
    rc, report = run_cli(tmp_path, "HANG", [RMS, OTHER], "--timeout", "2")
    got = cells(report)
    bad = got[(RMS, "hang")]
    assert rc == 1 and bad["status"] == "error", bad
    assert "backend hang in core rmsnorm on case rmsnorm/T1-D113: no answer within 2 s" in bad["error"], bad["error"]
    assert got[(OTHER, "hang")]["status"] == "pass"
    assert "time limit 2 s" in {r["backend"]: r for r in report["backends"]}["hang"]["isolation"]


@pytest.mark.parametrize("backend, says", [
    ("EXITS_AT_ONCE", "exited with status 0"),
    ("HANGS_AT_ONCE", "no answer within 2 s"),
])
def test_the_start_up_check_runs_the_cores_in_a_worker_too(tmp_path, backend, says):
    """An external backend's cores are first called by the start-up check, each call in its worker: a core that
    ends its process or hangs there refuses the backend with the reason, the run's own process lives to say so, and
    a wrong kernel is exit 1 with its report (exit 2 is for usage)."""
    rc, report = run_cli(tmp_path, backend, [RMS], "--timeout", "2")
    first = report["first_failure"]
    assert rc == 1 and report["exit_code"] == 1, first
    assert "the start-up check of its cores failed" in first and says in first and "core rmsnorm" in first, first
    assert [r["backend"] for r in report["results"]] == ["numpy32"]   # the refused backend runs no case


def test_a_core_with_other_bits_on_a_second_call_fails(tmp_path):
    rc, report = run_cli(tmp_path, "NOISY", [RMS])
    bad = cells(report)[(RMS, "noisy")]
    assert rc == 1 and bad["status"] == "fail", bad
    assert "not deterministic" in report["first_failure"], report["first_failure"]


def test_a_declared_non_deterministic_core_passes_with_its_spread_noted(tmp_path):
    rc, report = run_cli(tmp_path, "NOISY_DECLARED", [RMS])
    ok = cells(report)[(RMS, "noisy-declared")]
    assert rc == 0 and ok["status"] == "pass", ok
    assert any("spread between the judged call and a second call of rmsnorm" in n for n in ok["notes"]), ok["notes"]


def test_fresh_inputs_are_noted_with_a_seed_that_replays(tmp_path, monkeypatch):
    monkeypatch.setenv("K3CONF_FRESH_SEED", "12345")
    rc, report = run_cli(tmp_path, "NOISY_DECLARED", [RMS])
    notes = cells(report)[(RMS, "noisy-declared")]["notes"]
    replay = f"replay: K3CONF_FRESH_SEED=12345 k3conf run --backend {KERNELS}:NOISY_DECLARED --cases '{RMS}'"
    assert rc == 0 and f"fresh inputs: seed 12345 (pass; {replay})" in notes, notes
    # the person reading the report gets one line for the seed, not one per passing cell
    md = (tmp_path / "report.md").read_text()
    assert md.count("fresh inputs: seed 12345") == 1, md   # numpy32, the baseline, sets the bounds there
    assert "fresh inputs: seed 12345: 1 (case, backend) result(s) passed on them too" in md, md


def test_a_bad_fresh_seed_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("K3CONF_FRESH_SEED", "soon")
    rc = main(["run", "--backend", "numpy32", "--cases", RMS, "--no-timing", "--report", str(tmp_path)])
    assert rc == 2 and "K3CONF_FRESH_SEED: expected a non-negative integer" in capsys.readouterr().err


def test_the_guard_names_the_input_a_core_wrote_into():
    def scribble(x, w, eps):
        w[0] += 1.0
        return x

    events = []
    x, w = np.ones(3), np.ones(3)
    with pytest.raises(InputWritten, match="core rmsnorm wrote into its input w"):
        guard_core("rmsnorm", scribble, lambda what, core: events.append((what, core)))(x, w, eps=1e-5)
    assert events == [("enter", "rmsnorm"), ("left", "rmsnorm")] and w[0] == 1.0   # the caller's array is intact


def test_a_message_round_trips_and_garbage_is_refused():
    r, w = os.pipe()
    try:
        wire.send(w, {"op": "result", "n": np.int64(3)}, {"y": np.arange(4, dtype=np.int32)})
        header, arrays = wire.receive(r, deadline=None)
        assert header == {"op": "result", "n": 3} and arrays["y"].tolist() == [0, 1, 2, 3]
        os.write(w, wire.LENGTH.pack(4) + b"oops" + wire.LENGTH.pack(0))
        with pytest.raises(wire.WireGarbled, match="header is not JSON"):
            wire.receive(r, deadline=None)
    finally:
        os.close(r)
        os.close(w)
