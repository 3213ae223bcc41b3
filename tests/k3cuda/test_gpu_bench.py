"""tools/gpu_bench.py without a GPU: the timer against a fake device clock, the expected-miss bookkeeping and
the exit status. (tools/ is not a package: the script is loaded from its path, as `python tools/...` runs it.)"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from k3cuda.spec import BenchCase, Traffic

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_bench.py"


@pytest.fixture(scope="module")
def gb():
    spec = importlib.util.spec_from_file_location("gpu_bench_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                                      # dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules[spec.name]


class FakeGpu:
    """A device clock: a launch adds `kernel_s`, a flush adds `flush_s`; events read the clock when recorded."""

    def __init__(self, kernel_s=2e-6, flush_s=50e-6):
        self.clock, self.kernel_s, self.flush_s = 0.0, kernel_s, flush_s
        self.flushes = self.syncs = self.launches = 0
        self.launches_at_sync = []

    def launch(self):
        self.launches += 1
        self.clock += self.kernel_s

    def flush(self):
        self.flushes += 1
        self.clock += self.flush_s

    def synchronize(self):
        self.syncs += 1
        self.launches_at_sync.append(self.launches)

    def event(self):
        gpu = self

        class Event:
            def record(self):
                self.t = gpu.clock

            def time_till(self, other):
                return (other.t - self.t) * 1e3

        return Event()


def test_time_fn_times_launches_between_events_with_a_flush_before_each_pair(gb):
    gpu = FakeGpu()
    t = gb.time_fn(gpu.launch, flush=gpu.flush, event=gpu.event, synchronize=gpu.synchronize,
                   launches=5, reps=7, warmup=3)
    assert t == pytest.approx(gpu.kernel_s)                           # per launch; the flushes are not timed
    assert gpu.flushes == 7 and gpu.launches == 3 + 5 * 7
    assert gpu.syncs == 1 and gpu.launches_at_sync == [38]           # one host sync, after everything is queued


def test_one_launch_per_pair_when_the_case_fits_in_twice_the_l2(gb):
    assert gb.launches_for(99 << 20, l2_bytes=50 << 20) == 1
    assert gb.launches_for(100 << 20, l2_bytes=50 << 20) == gb.MANY_LAUNCHES


def test_kernel_version_is_the_headers_latest(gb, tmp_path):
    (tmp_path / "k.cu").write_text("// Versions:\n//   v1: first\n//   v2: second\nint x;\n// v9 in code\n")
    (tmp_path / "none.cu").write_text("// no versions\n")
    assert gb.kernel_version("k", tmp_path) == 2
    assert gb.kernel_version("none", tmp_path) is None and gb.kernel_version("absent", tmp_path) is None
    assert gb.kernel_version("mla_decode") == gb.EXPECTED_MISSES["mla_decode"][0]   # the declaration is current


def test_an_expected_miss_applies_only_to_its_kernel_version(gb):
    version, reason = gb.EXPECTED_MISSES["mla_decode"]
    assert gb.expected_miss("mla_decode", version) == reason
    assert gb.expected_miss("mla_decode", version + 1) is None
    assert gb.expected_miss("rmsnorm", 1) is None


@pytest.mark.parametrize("ratio, target, expected, gate", [
    pytest.param(0.7, 0.6, None, "PASS", id="pass"),
    pytest.param(0.5, 0.6, None, "FAIL", id="fail"),
    pytest.param(0.5, 0.6, "why", "XMISS", id="expected-miss"),
    pytest.param(0.7, 0.6, "why", "XPASS", id="expected-miss-passed"),
    pytest.param(0.1, None, None, "report", id="no-target"),
])
def test_judge(gb, ratio, target, expected, gate):
    assert gb.judge(ratio, target, expected) == gate


@pytest.mark.parametrize("gates, status", [
    pytest.param(["PASS", "report"], 0, id="all-pass"),
    pytest.param(["PASS", "XMISS", "XPASS"], 0, id="only-expected-misses"),
    pytest.param(["PASS", "XMISS", "FAIL"], 1, id="a-failure-beside-an-expected-miss"),
    pytest.param(["PASS", "ERROR"], 1, id="an-error"),
    pytest.param(["ERROR"], 1, id="nothing-timed"),
    pytest.param([], 1, id="nothing-ran"),
])
def test_exit_status(gb, gates, status):
    assert gb.exit_status([{"gate": g} for g in gates]) == status


def _fake_module(gpu, cases, seconds_per_byte):
    class Mod:
        @staticmethod
        def bench_cases():
            return cases

        @staticmethod
        def device_launch(inputs):
            def run():
                gpu.launch()
                gpu.clock += inputs["nbytes"] * seconds_per_byte - gpu.kernel_s
            return run

    return Mod


def _case(label, nbytes, target):
    return BenchCase(label, lambda rng, n=nbytes: {"nbytes": n}, Traffic(bytes=nbytes, flops=0), target)


def test_run_with_only_the_declared_miss_exits_0_and_a_real_miss_exits_1(gb):
    """Copy bandwidth 1 GB/s; kernels at 0.5 GB/s (ratio 0.5) against 0.6: a miss. mla_decode declares it for
    its current version (XMISS), rmsnorm does not (FAIL); a crashing bench_cases is an ERROR row."""
    gpu = FakeGpu()
    dev = gb.Device(flush=gpu.flush, event=gpu.event, synchronize=gpu.synchronize, l2_bytes=1 << 20)
    args = argparse.Namespace(reps=3, warmup=1, no_torch=True)
    slow = _fake_module(gpu, [_case("big", 64 << 20, 0.6), _case("small", 1 << 20, None)], 2e-9)

    def modules(block):
        if block == "broken":
            raise RuntimeError("no bench cases")
        return slow

    rows = gb.run_blocks(["mla_decode"], dev, 1e9, args, modules)
    assert [r["gate"] for r in rows] == ["XMISS", "report"]
    assert rows[0]["bw_ratio"] == pytest.approx(0.5) and rows[0]["launches_per_pair"] == gb.MANY_LAUNCHES
    assert rows[1]["launches_per_pair"] == 1 and "expected_miss" in rows[0]
    assert gb.exit_status(rows) == 0
    rows += gb.run_blocks(["rmsnorm"], dev, 1e9, args, modules)
    assert rows[2]["gate"] == "FAIL" and gb.exit_status(rows) == 1
    broken = gb.run_blocks(["broken"], dev, 1e9, args, modules)
    assert broken[0]["gate"] == "ERROR" and gb.exit_status(broken) == 1


def test_help_and_import_need_no_pycuda():
    """With `import pycuda` made to fail, the script still imports and prints its help."""
    code = ("import runpy, sys; sys.modules['pycuda'] = None; sys.argv = ['gpu_bench.py', '--help']; "
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--reps" in done.stdout, done.stderr
