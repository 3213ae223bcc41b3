"""Starting N ranks and ending them cleanly.

Two ways in, one rank code (conformance.tp.rank):
- spawned: `k3conf run --tp N` starts N children `python -m conformance.tp.rank JOB` with the env://
  variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT=a free port) and watches them;
- torchrun: the variables are already set (`under_torchrun()`), every process is a rank and runs in place.

A fault ends every rank within a bounded time: each collective has the group's timeout, a rank that raises
writes `rank<r>.error.json` (what, where) before it exits non-zero, and the parent, as soon as one child
exits non-zero or dies, gives the others `grace` seconds to fail on their own and then kills them. The
error names the rank that went first and why (a signal, or its exception), then what the others saw.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conformance.tp.lifetime import PARENT_ENV

DIST_BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 60.0     # a collective that waits longer raises: a peer hangs or took another path
RENDEZVOUS_S = 300.0        # how long the ranks wait for each other to start
GRACE_S = 10.0               # after the first failed rank, how long the others get to fail on their own


class TpFailure(Exception):
    """A tensor-parallel run that did not complete: the message names the rank and the cause."""


def under_torchrun() -> bool:
    """True when this process is a rank started by torchrun (or any env:// launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the env:// variables."""
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError) as e:
        raise TpFailure(f"env:// variables: expected integer RANK and WORLD_SIZE, found "
                        f"RANK={os.environ.get('RANK')!r} WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}") from e
    return rank, size, local


def default_dist(tp: int) -> str:
    """nccl when every rank of this machine can have its own GPU, else gloo."""
    try:
        import torch  # noqa: PLC0415 -- optional: the package imports without torch

        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= tp else "gloo"
    except ImportError:
        return "gloo"


def check_dist(dist: str, tp: int) -> None:
    """Refuse a transport that cannot run here, before any process starts."""
    if dist not in DIST_BACKENDS:
        raise TpFailure(f"--dist: expected one of {DIST_BACKENDS}, found {dist!r}")
    try:
        import torch  # noqa: PLC0415 -- optional: the package imports without torch
        import torch.distributed as tdist  # noqa: PLC0415 -- optional: the package imports without torch
    except ImportError as e:
        raise TpFailure(f"--tp needs torch (pip install 'k3-conformance[torch]'): {e}") from None
    if not tdist.is_available():
        raise TpFailure("--tp: this torch build has no torch.distributed")
    if dist == "nccl":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < tp and not under_torchrun():
            raise TpFailure(f"--dist nccl: expected a GPU per rank ({tp}), found {n}; use --dist gloo")


def init_group(dist: str, timeout_s: float):
    """Join the process group (env://); returns (rank, size, device, group).

    The rendezvous waits up to RENDEZVOUS_S for the slowest rank to start (imports on a busy machine); the
    collectives of the returned group wait `timeout_s`, so a hang is found sooner than a slow start.
    """
    import torch.distributed as tdist  # noqa: PLC0415 -- optional: the package imports without torch

    rank, size, local = env_rank()
    device = "cpu"
    if dist == "nccl":
        import torch  # noqa: PLC0415 -- optional: the package imports without torch

        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    tdist.init_process_group(dist, timeout=datetime.timedelta(seconds=max(timeout_s, RENDEZVOUS_S)), rank=rank,
                             world_size=size)
    group = tdist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s), backend=dist)
    return rank, size, device, group


def free_port() -> int:
    """A TCP port nobody listens on now (the rendezvous of one spawned run on 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def error_path(workdir: Path, rank: int) -> Path:
    return Path(workdir) / f"rank{rank}.error.json"


def spawn(job: dict, workdir: Path, *, grace: float = GRACE_S, on_start=None) -> list[int]:
    """Run `job` on job["tp"] child processes; returns their pids once all exited 0, else raises TpFailure.

    on_start(pids) is called once every child has started (the CLI prints the pids). Any exception on the
    way (TpStopped from a signal included) kills every child started so far before it propagates; a child
    ends by itself when this thread's process dies (conformance.tp.lifetime), so keep the calling thread alive
    for as long as the children run (this function returns only once they all exited).
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    job_path = workdir / "job.json"
    job_path.write_text(json.dumps(job))
    tp, port = int(job["tp"]), free_port()
    procs = []
    try:
        for r in range(tp):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(tp), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(tp),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{PARENT_ENV: str(os.getpid())})
            env.setdefault("OMP_NUM_THREADS", "1")   # N ranks share the cores: no nested BLAS threads
            log = open(workdir / f"rank{r}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, "-m", "conformance.tp.rank", str(job_path)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        if on_start:
            on_start([p.pid for p in procs])
        stopped = _watch(procs, grace)
    except BaseException:
        _kill(procs)
        raise
    if any(p.returncode != 0 for p in procs):
        raise TpFailure(_explain(procs, workdir, stopped, grace))
    return [p.pid for p in procs]


def _watch(procs: list, grace: float) -> set[int]:
    """Wait for every child; once one failed, kill the survivors after `grace` seconds (returns those)."""
    first_fail, stopped = None, set[int]()
    while True:
        rcs = [p.poll() for p in procs]
        if all(rc is not None for rc in rcs):
            return stopped
        if first_fail is None and any(rc not in (None, 0) for rc in rcs):
            first_fail = time.monotonic()
        if first_fail is not None and time.monotonic() - first_fail > grace:
            stopped = _kill(procs)
        time.sleep(0.05)


def _kill(procs: list) -> set[int]:
    killed = set()
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
            killed.add(r)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    return killed


def _cause(rank: int, proc, workdir: Path, stopped: set[int], grace: float) -> tuple[float, str]:
    """(order, text) of one failed rank: killed by a signal first, then its own error, then hung, then a
    collective's failure (the consequence of one of the others)."""
    if rank in stopped:   # alive while its peers' collectives failed or timed out: it hung, or wedged them
        return 1.5, (f"rank {rank} (pid {proc.pid}) hung: still running {grace:g} s after a peer failed, "
                     "killed by the launcher")
    err = error_path(workdir, rank)
    if err.exists():
        try:
            rec = json.loads(err.read_text())
            return (2 if rec.get("kind") == "collective" else 1), f"rank {rank} (pid {proc.pid}): {rec['message']}"
        except (ValueError, KeyError):
            pass
    rc = proc.returncode
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        return 0, f"rank {rank} (pid {proc.pid}) died: killed by signal {name}"
    return 0, (f"rank {rank} (pid {proc.pid}) exited with status {rc} without an error report "
               f"(see {workdir}/rank{rank}.log)")


def _explain(procs: list, workdir: Path, stopped: set[int], grace: float) -> str:
    causes = sorted(_cause(r, p, workdir, stopped, grace) + (r,) for r, p in enumerate(procs) if p.returncode != 0)
    head, rest = causes[0][1], [c[1] for c in causes[1:]]
    return head + ("".join(f"; then {c}" for c in rest) if rest else "")
