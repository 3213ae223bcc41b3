"""Processes and data a run must never leave inconsistent.

Rank processes die with their launcher: a signal to `k3conf decode --tp 2` ends every rank, removes the
work directory and prints one line; a launcher killed outright leaves no rank behind.

Every step waits for an event the processes report (the pids the launcher prints, the `rank<r>.ready` files
the ranks write once they joined the group, a process leaving /proc); HANG_S only bounds each wait, so that a
broken launcher fails the test instead of hanging it.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conformance.cli import main
from conformance.tp.lifetime import PARENT_POLL_S, TpStopped, stop_on_signals
from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel
from k3ref.greedy import NonFiniteLogits, greedy_decode, non_finite_weight
from k3ref.weights import INDEX_FILE, read_header, synthetic_checkpoint

pytest.importorskip("torch.distributed")

REPO = Path(__file__).resolve().parents[2]
HANG_S = 300.0            # a guard against a hang, not a synchronisation
POLL_S = 0.05             # how often a bounded wait looks again for the event it waits for
DECODE = ["decode", "--prompt", "5,17,3", "--max-new", "20000", "--tp", "2", "--dist", "gloo"]


class _Launcher:
    """`k3conf decode --tp 2` as a child process with its own TMPDIR (where its work directory goes)."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path / "tmp"
        self.tmp.mkdir()
        env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(self.tmp))
        self.proc = subprocess.Popen([sys.executable, "-m", "conformance", *DECODE], cwd=REPO, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.pids: list[int] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def rank_pids(self) -> list[int]:
        """The pids the launcher announces ('tp ranks: rank 0 pid N, rank 1 pid M')."""
        while True:
            line = self.lines.get(timeout=HANG_S)
            assert line is not None, f"the launcher ended before announcing its ranks (exit {self.proc.wait()})"
            if line.startswith("tp ranks: "):
                self.pids = [int(part.split(" pid ")[1]) for part in line[len("tp ranks: "):].split(", ")]
                return self.pids

    def work_dirs(self) -> list[Path]:
        return sorted(self.tmp.glob("k3conf-tp-*"))

    def wait_ready(self) -> None:
        """Until both ranks joined the group (each has armed its parent watch before that)."""
        _until(lambda: any(all((d / f"rank{r}.ready").exists() for r in (0, 1)) for d in self.work_dirs()),
               "both ranks to join the group")

    def rest_of_stderr(self) -> list[str]:
        out = []
        while (line := self.lines.get(timeout=HANG_S)) is not None:
            out.append(line)
        return out


def _until(event, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not event():
        assert time.monotonic() < deadline, f"waited {HANG_S:g} s for {what}"
        time.sleep(POLL_S)


def _gone(pid: int) -> bool:
    """True once `pid` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def launcher(tmp_path):
    la = _Launcher(tmp_path)
    yield la
    if la.proc.poll() is None:
        la.proc.kill()
        la.proc.wait()
    for pid in la.pids:   # a failed test leaves no orphan rank running on the machine
        try:
            if b"conformance.tp.rank" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_launcher_ends_every_rank_and_removes_the_work_directory(launcher, sig):
    pids = launcher.rank_pids()
    launcher.wait_ready()
    os.kill(launcher.proc.pid, sig)
    rc = launcher.proc.wait(timeout=HANG_S)
    rest = launcher.rest_of_stderr()
    assert rc == 128 + sig, rest
    assert rest == [f"k3conf decode --tp 2: stopped by {sig.name}: every rank ended, work directory removed"], rest
    assert all(_gone(pid) for pid in pids), "a rank outlived its launcher"
    assert launcher.work_dirs() == []


def test_a_rank_whose_launcher_was_killed_exits_by_itself(launcher):
    """SIGKILL leaves the launcher no chance to clean up: the ranks must notice on their own."""
    pids = launcher.rank_pids()
    launcher.wait_ready()
    os.kill(launcher.proc.pid, signal.SIGKILL)
    launcher.proc.wait(timeout=HANG_S)
    for pid in pids:
        _until(lambda pid=pid: _gone(pid), f"rank pid {pid} to exit after its launcher was killed")


_ORPHAN = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL, text=True)
assert child.stdout.readline() == "armed\\n"
print(child.pid, flush=True)
os._exit(0)   # the parent dies; the child must follow by itself
"""
_WATCHED = """
import os, threading
from conformance.tp.lifetime import die_with_parent
die_with_parent(os.getppid(), pdeathsig=False)
print("armed", flush=True)
threading.Event().wait()   # blocks for as long as the process lives
"""


def test_the_watchdog_alone_ends_a_process_whose_parent_died():
    """Without the kernel's parent-death signal (other systems), the polling watchdog still ends the process."""
    proc = subprocess.run([sys.executable, "-c", _ORPHAN, _WATCHED], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pid = int(proc.stdout.strip())
    _until(lambda: _gone(pid), f"the orphan {pid} to exit (its watchdog polls every {PARENT_POLL_S:g} s)")


def test_stop_on_signals_raises_once_then_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    with pytest.raises(TpStopped) as e, stop_on_signals():
        signal.raise_signal(signal.SIGHUP)   # the handler runs before the next statement
        pytest.fail("SIGHUP did not stop the block")
    assert e.value.signum == signal.SIGHUP and e.value.exit_code == 128 + signal.SIGHUP
    assert {s: signal.getsignal(s) for s in before} == before


# ----- decode refuses non-finite logits and names the weight behind them -----

LM_HEAD = "language_model.lm_head.weight"
O_PROJ = "language_model.model.layers.2.self_attn.o_proj.weight"
SCALE = "language_model.model.layers.1.block_sparse_moe.experts.4.w2.weight_scale"
BF16_NAN, BF16_INF = b"\xc0\x7f", b"\x80\x7f"   # little-endian bf16 quiet NaN and +Inf


@pytest.fixture(scope="module")
def pristine_ckpt(tmp_path_factory) -> Path:
    return synthetic_checkpoint(K3Config.preset("tiny"), 0, tmp_path_factory.mktemp("ckpt"), shard_bytes=40_000)


def _poison(ckpt: Path, name: str, index: tuple[int, ...], value: bytes) -> None:
    """Overwrite one stored element of tensor `name` in its shard with the bytes `value`."""
    path = ckpt / json.loads((ckpt / INDEX_FILE).read_text())["weight_map"][name]
    entry = read_header(path)[name]
    flat = int(np.ravel_multi_index(index, entry.shape))
    with open(path, "r+b") as f:
        f.seek(entry.begin + flat * len(value))
        f.write(value)


@pytest.mark.parametrize("name, index, value, found, named", [
    pytest.param(LM_HEAD, (42, 3), BF16_NAN, "the logits of step 0 hold",
                 f"checkpoint tensor {LM_HEAD} holds 1 non-finite value(s), first at [42, 3]: nan", id="lm_head-nan"),
    pytest.param(O_PROJ, (10, 7), BF16_INF, "expected finite values",
                 f"checkpoint tensor {O_PROJ} (layer 2) holds 1 non-finite value(s), first at [10, 7]: inf",
                 id="layer-inf"),
])
def test_decode_refuses_non_finite_logits_naming_the_checkpoint_tensor(pristine_ckpt, tmp_path, capsys, name,
                                                                       index, value, found, named):
    """Found by the logits check (lm_head) or by the forward's own weight check (o_proj): either way exit 1 and
    the tensor named as the checkpoint names it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine_ckpt, ckpt)
    argv = ["decode", "--checkpoint", str(ckpt), "--prompt", "5,17,3", "--max-new", "4"]
    assert main(argv) == 0, "the pristine checkpoint decodes"
    capsys.readouterr()
    _poison(ckpt, name, index, value)
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "", "no token printed from non-finite logits"
    assert err.startswith("k3conf decode: ") and found in err and named in err, err
    assert "Traceback" not in err


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")   # the overflow is the point
def test_a_finite_model_whose_forward_overflows_is_refused_too():
    """NaN logits from finite weights: refused at the first step, and no weight is blamed."""
    model = K3CpuModel.synthetic(K3Config.preset("tiny"), 0)
    assert non_finite_weight(model) is None
    weights = dict(model.weights)
    weights["language_model.model.norm.weight"] = np.full_like(weights["language_model.model.norm.weight"], 1e308)
    with pytest.raises(NonFiniteLogits, match=r"the logits of step 0 hold \d+ non-finite value\(s\)"):
        greedy_decode(K3CpuModel(model.cfg, weights), [5, 17, 3], 2)


def test_a_nan_mxfp4_scale_is_named_with_its_layer_and_expert():
    """In-memory weights skip checkpoint admission: the scan still names the E8M0 NaN byte (0xFF)."""
    model = K3CpuModel.synthetic(K3Config.preset("tiny"), 0)
    weights = dict(model.weights)
    weights[SCALE] = weights[SCALE].copy()
    weights[SCALE][5, 0] = 0xFF
    assert non_finite_weight(K3CpuModel(model.cfg, weights)) == (
        f"checkpoint tensor {SCALE} (layer 1, expert 4) holds 1 NaN scale byte(s) 0xFF, first at [5, 0]: 255")
