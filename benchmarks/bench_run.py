"""`k3conf run` (tiny) on a loaded machine against its quiet time, both measured in this run.

Load: os.cpu_count() - 1 processes spinning on a core each (started and stopped here), so one core stays
for the run; before the runner pinned torch to one thread, torch's second OpenMP thread waited on the busy
core and the run took 6.6x its quiet time. Quiet and loaded runs alternate so that the
other users of a shared machine weigh on both alike (best of 3 each). Target: loaded / quiet <= 1.5.
Run: make bench  (or .venv/bin/python -m pytest benchmarks/bench_run.py -q -s)
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

from conformance.judge.speed import short_pass_miss

LOADED_OVER_QUIET_TARGET = 1.5
REPEATS = 3


@contextlib.contextmanager
def busy_cores(n: int):
    """n processes spinning on a core each until the block ends (then terminated and waited for)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)


def _k3conf_run(report_dir) -> float:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "conformance", "run", "--report", str(report_dir)],
                          capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, (f"k3conf run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                                  f"{done.stderr[-3000:]}")
    return seconds


@pytest.mark.xfail(**short_pass_miss(
    "measured 1.7-1.9 on 2026-12-02 (e.g. 33.7 s / 17.3 s) while other users loaded the machine (single runs moved "
    "by 2x), 0.97-1.04 on a quiet one on 2026-12-04; the runner's speed gates (timed cores) are what slows under the "
    "extra load"))
def test_k3conf_run_loaded_vs_quiet(benchmark, speed, tmp_path):
    load = max(1, (os.cpu_count() or 2) - 1)
    best = {"quiet": float("inf"), "loaded": float("inf")}

    def both():
        for _ in range(REPEATS):
            best["quiet"] = min(best["quiet"], _k3conf_run(tmp_path / "quiet"))
            with busy_cores(load):
                best["loaded"] = min(best["loaded"], _k3conf_run(tmp_path / "loaded"))

    benchmark.pedantic(both, rounds=1, iterations=1)
    ratio = best["loaded"] / best["quiet"]
    benchmark.extra_info.update(quiet_s=best["quiet"], loaded_s=best["loaded"], ratio=ratio, busy_processes=load)
    speed.check(f"k3conf run (tiny), {load} busy core(s) / quiet", ratio, LOADED_OVER_QUIET_TARGET,
                f"{best['loaded']:.1f} s / {best['quiet']:.1f} s")
