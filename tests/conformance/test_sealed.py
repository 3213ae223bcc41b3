"""Sealed judging: a kernel shares a process with neither the expected answer nor the judge.

Each kernel of tests/conformance/untrusted/hostile.py (and judge_rewriter.py) is written to cheat: it looks for the
answer on its stack or among the garbage collector's objects, rewrites the judge when its module is imported,
forges the worker's reply, does no work when timed, leaves processes running or ends its worker from a fork that
keeps the socket. Run through `k3conf run` as a user runs it (a child process, its output read to the end), through
the pytest plugin and through `run --tp 2`, none of them may pass, and none may leave a process behind: every
process the run started carries a tag in its environment, and none may carry it once the run has returned.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from conformance.isolation import wire
from conformance.isolation.remote import read_description
from conformance.isolation.trace_view import TraceRefused, TraceServer
from conformance.judge import gate_table, gates

REPO = Path(__file__).resolve().parents[2]
HOSTILE = Path(__file__).parent / "untrusted" / "hostile.py"
REWRITER = Path(__file__).parent / "untrusted" / "judge_rewriter.py"
RMS = "rmsnorm/T1-D113"
RUN_LIMIT_S = 240.0   # a guard against a hang: each run here takes seconds


def _tagged_processes(tag: str) -> list[str]:
    """'pid: command line' of every process whose environment carries K3CONF_PROBE_TAG=tag."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"K3CONF_PROBE_TAG={tag}".encode() in environ.split(b"\0"):
            found.append(f"{pid}: {cmd.strip()}")
    return found


def _run(args: list[str], cwd: Path = REPO, **env: str) -> tuple[subprocess.CompletedProcess, float, list[str]]:
    """A k3conf command as a user runs it, its output read to the end; (result, seconds, processes left behind)."""
    tag = uuid.uuid4().hex
    full_env = {**os.environ, "K3CONF_PROBE_TAG": tag, "K3_STRICT": "", "PYTHONPATH": str(REPO), **env}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)
    seconds = time.monotonic() - t0
    deadline = time.monotonic() + 5.0   # a killed process leaves /proc as its parent reaps it
    while (left := _tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return done, seconds, left


def _k3conf(tmp_path: Path, backend: str, *extra: str, cases: str = RMS, cwd: Path = REPO,
            **env: str) -> tuple[int, dict, str, float, list[str]]:
    done, seconds, left = _run(["conformance", "run", "--backend", backend, "--cases", cases,
                                "--report", str(tmp_path), *extra], cwd, **env)
    report = json.loads((tmp_path / "report.json").read_text()) if (tmp_path / "report.json").exists() else {}
    return done.returncode, report, done.stdout + done.stderr, seconds, left


def _cell(report: dict, backend: str) -> dict:
    return next(r for r in report["results"] if r["backend"] == backend)


@pytest.mark.parametrize("name, backend", [
    ("stack-walker", f"{HOSTILE}:STACK_WALKER"),
    ("gc-memoriser", f"{HOSTILE}:GC_MEMORISER"),
    ("fresh-reader", f"{HOSTILE}:FRESH_READER"),
    ("judge-rewriter", f"{REWRITER}:BACKEND"),
    ("forger", f"{HOSTILE}:FORGER"),
])
def test_a_kernel_one_percent_off_cannot_find_or_change_the_verdict(tmp_path, name, backend):
    """The answer is not in the kernel's process (goldens and fresh inputs alike) and the judge is not either: a
    kernel one percent off fails whatever it searches or rewrites there, and the reports are written."""
    rc, report, out, _, left = _k3conf(tmp_path, backend, "--no-timing")
    assert rc == 1, out
    cells = [r for r in report["results"] if r["backend"] == name]
    # a failed or errored cell, or (the forger, whose extra frame the start-up check meets first) a refused backend
    assert all(c["status"] in ("fail", "error") for c in cells) and (cells or report["refused"]), report
    assert report["judge_problem"] == "" and (tmp_path / "report.html").exists() and not left, (report, left)
    if name == "forger":   # the reply it forged is data: its markup is never markup in a report
        assert "<script>alert" not in (tmp_path / "report.md").read_text() + (tmp_path / "report.html").read_text()


def test_loading_a_backend_never_touches_the_runs_judge():
    """The rewriting module runs in a worker: this process's tables and verdict functions are as built."""
    from conformance.isolation.client import WorkerPool  # noqa: PLC0415 -- the pool starts the fork server

    pool = WorkerPool(60)
    try:
        backend = pool.backend(f"{REWRITER}:BACKEND")
        assert backend.name == "judge-rewriter"
    finally:
        pool.close()
    assert gates.tables_changed() == "" and "judge_rewriter" not in " ".join(sys.modules)


def test_the_digest_notices_a_row_edited_in_place():
    gate = next(iter(gate_table.GATES.values()))
    cap = gate.cap
    object.__setattr__(gate, "cap", cap * 2)
    try:
        assert "edited in place" in gates.tables_changed()
    finally:
        object.__setattr__(gate, "cap", cap)
    assert gates.tables_changed() == ""


def test_a_kernel_that_is_lazy_when_timed_fails(tmp_path):
    """Every timed call's outputs are held to the judged ones: a kernel returning np.empty_like when a timer's
    frame is on its stack fails its cell instead of earning a speed."""
    rc, report, out, _, left = _k3conf(tmp_path, f"{HOSTILE}:TIMING_ONLY")
    cell = _cell(report, "timing-only")
    assert rc == 1 and cell["status"] == "fail", out
    assert any("timed call" in t["rule"] for t in cell["tensors"] if not t["passed"]), cell
    assert cell["speed"] is None and not left


@pytest.mark.parametrize("name, where", [("helper-process", "in its process group"),
                                         ("escaped-daemon", "escaped its process group")])
def test_processes_a_kernel_starts_end_with_the_run_and_fail_it(tmp_path, name, where):
    """A helper holding the worker's output streams, or a daemon in a session of its own: the run returns at once
    (the caller reading its output to the end does not wait for them), names them, fails, and leaves none."""
    backend = f"{HOSTILE}:{'HELPER' if name == 'helper-process' else 'DAEMON'}"
    rc, report, out, seconds, left = _k3conf(tmp_path, backend, "--no-timing")
    assert rc == 1 and not left, (out, left)
    assert seconds < 40, f"the run took {seconds:.0f} s: something held its output open"
    line = report["left_running"][0]
    assert f"backend {name} left" in line and where in line and "sleep" in line, line


def test_a_worker_that_dies_while_its_fork_holds_the_socket_is_reported_at_once(tmp_path):
    rc, report, out, seconds, left = _k3conf(tmp_path, f"{HOSTILE}:FORK_EXIT", "--no-timing")
    cell = _cell(report, "fork-then-exit")
    assert rc == 1 and cell["status"] == "error", out
    assert "exited with status 3" in cell["error"] and "core rmsnorm" in cell["error"], cell["error"]
    assert seconds < 60 and not left, (seconds, left)


def test_a_kernel_that_kills_the_worker_server_fails_and_its_daemon_is_found(tmp_path):
    """The fork server is the kernel's parent, and the same user may kill it: the worker dies with it (an error
    cell at once), `k3conf run` adopts what it orphaned (a child subreaper) and kills it, and the run fails."""
    rc, report, out, seconds, left = _k3conf(tmp_path, f"{HOSTILE}:SERVER_KILLER", "--no-timing")
    cell = _cell(report, "server-killer")
    assert rc == 1 and cell["status"] == "error" and "worker server died" in cell["error"], out
    assert any("died during the run" in line for line in report["left_running"]), report["left_running"]
    assert seconds < 60 and not left, (seconds, left)


def test_a_kernel_that_changes_directory_cannot_move_the_goldens(tmp_path):
    """A relative --golden is made absolute before any worker starts; the kernel's os.chdir is its own."""
    rc, report, out, _, left = _k3conf(tmp_path, f"{HOSTILE}:CHDIR", "--no-timing", "--golden", "golden")
    assert rc == 0 and _cell(report, "changes-directory")["status"] == "pass" and not left, out


def test_a_backends_text_is_never_markup(tmp_path):
    """A reason with <script> and rich markup: escaped in the Markdown and the HTML, printed as it is."""
    rc, report, out, _, left = _k3conf(tmp_path, "numpy64", "--no-timing", "--backend", f"{HOSTILE}:SCRIPT_REASON")
    md, html = (tmp_path / "report.md").read_text(), (tmp_path / "report.html").read_text()
    assert "<script>" not in md and "<script>alert" not in html and "\\<script\\>alert" in md, md
    assert "[bold]not here[/bold]" in out, out


def test_a_kernel_refused_at_start_up_fails_the_run_with_its_report(tmp_path):
    """No answer to its inputs at the start-up check is a wrong kernel: exit 1 and a report that says why (exit 2
    is for usage)."""
    rc, report, out, _, _ = _k3conf(tmp_path, f"{Path(__file__).parent / 'untrusted' / 'kernels.py'}:EXITS_AT_ONCE",
                                    "--no-timing", "--timeout", "5")
    assert rc == 1, out
    assert "start-up check" in report["first_failure"] and "exited with status 0" in report["first_failure"]


def test_the_pytest_plugin_is_sealed_too(tmp_path):
    (tmp_path / "test_mine.py").write_text("def test_mine():\n    assert True\n")
    done, _, left = _run(["pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
                          f"--k3conf-backend={HOSTILE}:GC_MEMORISER", f"--k3conf-cases={RMS}"], tmp_path)
    assert done.returncode == 1 and "1 failed" in done.stdout and not left, done.stdout[-3000:]
    done, _, left = _run(["pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
                          f"--k3conf-backend={HOSTILE}:HELPER", f"--k3conf-cases={RMS}"], tmp_path)
    assert done.returncode == 1 and re.search(r"left \d+ process\(es\) running", done.stdout) and not left, (
        done.stdout[-3000:])


@pytest.mark.torch
def test_tp_ranks_run_a_kernel_in_workers_of_their_own(tmp_path):
    """`run --tp 2`: each rank calls the kernel in a worker process of its own, never beside the golden it reads."""
    rc, _, out, _, left = _k3conf(tmp_path, f"{HOSTILE}:GC_MEMORISER", "--tp", "2", "--dist", "gloo",
                                  cases="trace/layerwise-P7-D5")
    assert rc == 1 and "FAIL" in out and not left, out[-3000:]
    rc, _, out, seconds, left = _k3conf(tmp_path, f"{HOSTILE}:HELPER", "--tp", "2", "--dist", "gloo",
                                        cases="trace/layerwise-P7-D5")
    assert rc == 1 and "left" in out and not left and seconds < 120, (out[-3000:], left)


# ---------------------------------------------------------------------------------- the boundary's data, unit-sized


def test_packed_values_round_trip_and_anything_else_is_refused():
    arrays: dict = {}
    value = (np.arange(3.0), [1, None, "x"], {"k": np.ones(2, np.int64)})
    tree = wire.pack(value, arrays)
    back = wire.unpack(json.loads(json.dumps(tree)), arrays)
    assert isinstance(back, tuple) and back[1] == [1, None, "x"] and back[2]["k"].dtype == np.int64
    with pytest.raises(wire.Unpackable, match="does not carry"):
        wire.unpack({"$a": "p9"}, arrays)
    deep: object = 1
    for _ in range(wire.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(wire.Unpackable, match="deeper"):
        wire.unpack(deep, {})
    with pytest.raises(TypeError, match="cannot send"):
        wire.pack(object(), {})


@pytest.mark.parametrize("field, value, says", [
    ("name", "a b", "no spaces"),
    ("name", "[bold]x", "no markup"),
    ("precision", "fp16", "precision expected"),
    ("kernel_cores", ["rmsnorm", "not_a_core"], "core names"),
    ("speed_targets", {"rmsnorm": -1}, "positive finite"),
    ("available", "yes", "True or False"),
])
def test_a_workers_description_is_checked_field_by_field(field, value, says):
    doc = {"name": "b", "precision": "fp32", "device": "cpu", "tensors": "numpy", "deterministic": True,
           "available": True, "reason": "r" * 10_000, "kernel_cores": ["rmsnorm"], "whole_model": False,
           "own_hub": False, "cores_error": "", "timed": [], "speed_targets": {}}
    assert len(read_description(doc, "spec").reason) < 2100   # texts are cut to a bound
    with pytest.raises(ValueError, match=says):
        read_description({**doc, field: value}, "spec")


class _Golden:
    def __init__(self, outputs: dict, inter: dict):
        self._groups = {"outputs": outputs, "inter": inter}

    def group(self, name: str) -> dict:
        return self._groups[name]


def test_a_whole_model_gets_a_layers_golden_input_only_after_recording_what_came_before():
    outputs = {"step0.layer00.3_a": np.zeros(2), "step0.layer01.3_a": np.zeros(2), "step0.logits": np.zeros(3)}
    inter = {"step0.layer01.prefix": np.ones(2), "step0.final.prefix": np.ones(2)}
    server = TraceServer(_Golden(outputs, inter), router_budget=0.0)
    with pytest.raises(TraceRefused, match="before recording step0.layer00.3_a"):
        server.answer({"op": "feed", "key": "step0.layer01"}, {})
    _, fed = server.answer({"op": "feed", "key": "step0.layer01"}, {"c.step0.layer00.3_a": np.zeros(2)})
    assert list(fed) == ["f.prefix"]
    with pytest.raises(TraceRefused, match="differs"):
        server.check_final({"step0.layer00.3_a": np.ones(2)})
