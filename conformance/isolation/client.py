"""The run's side of the worker processes: one per isolated backend, started on first use, restarted after a crash.

    pool = WorkerPool(timeout=300.0)
    run = pool.evaluate(case, golden, "root-of-goldens", backend, repeat=True)   # IsolatedEvaluation
    pool.close()

How a worker starts: a backend on the CPU is forked from the run (it sees the backends, mutants and kinds the
run registered, and starts in milliseconds); a backend on a device starts a fresh interpreter
(`python -m conformance.isolation.worker`), because a CUDA context does not survive a fork. Either way the
worker builds the backend by its name and keeps it (and its device context) for every case of the run.

A request that does not end in an answer raises KernelFailure with the error row's message, naming the backend,
the core it was in (the worker reports each core it enters) and the case: the worker died (a crash, a signal,
os._exit), it went silent for longer than the time limit (it is killed), or it sent bytes that are not a
message. The next request starts a new worker. UnsupportedShape and GoldenError come back as themselves.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from conformance.backends.protocol import BackendBase
from conformance.cases.protocol import Case, Evaluation, RunInfo
from conformance.golden.errors import GoldenError
from conformance.isolation import wire
from conformance.isolation.worker import case_doc, serve
from k3ref.cores import UnsupportedShape

DEFAULT_TIMEOUT = 300.0   # seconds a worker may stay silent (inside one core call, or between two)
START_LIMIT = 60.0        # at least this long to start a worker: importing a backend's libraries can be slow


class KernelFailure(RuntimeError):
    """A request to a worker that ended without an answer, or with an error raised in the worker; the message is
    the error row's."""


@dataclasses.dataclass
class IsolatedEvaluation(Evaluation):
    """A worker's Evaluation; `again`: the outputs of the second call (candidate, reference, candidate), when asked."""

    again: dict[str, np.ndarray] | None = None


def golden_where(golden, case: Case, root: Path, entry: dict) -> dict:
    """Where the worker finds the golden: its root folder, its path under it and its manifest entry."""
    return {"root": str(root), "rel": Path(golden.path).relative_to(root).as_posix(), "entry": entry}


class _Forked:
    """A forked child, with Popen's kill / poll."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


def _how_it_ended(proc: _Forked | subprocess.Popen) -> str:
    rc = proc.poll()
    if rc is None:
        return "its process closed the pipe and did not exit (it was killed)"
    if rc < 0:
        try:
            return f"its process was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"its process was killed by signal {-rc}"
    return f"its process exited with status {rc} (a kernel ended it: os._exit, or a crash)"


class Worker:
    """One worker process of one backend."""

    def __init__(self, backend: BackendBase, timeout: float, inherited: list[int]):
        self.name, self.timeout = backend.name, timeout
        to_worker, from_worker = os.pipe(), os.pipe()
        child_fds = (to_worker[0], from_worker[1])
        self.proc: _Forked | subprocess.Popen
        if backend.device == "cpu":
            self.proc = self._fork(backend, child_fds, inherited + [to_worker[1], from_worker[0]])
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "conformance.isolation.worker", *map(str, child_fds)],
                pass_fds=child_fds, stdin=subprocess.DEVNULL)
        os.close(to_worker[0])
        os.close(from_worker[1])
        self.write_fd, self.read_fd = to_worker[1], from_worker[0]
        self.core: str | None = None

    @staticmethod
    def _fork(backend: BackendBase, child_fds: tuple[int, int], close: list[int]) -> _Forked:
        pid = os.fork()
        if pid:
            return _Forked(pid)
        code = 0
        try:   # the child: never returns into the run's code
            for fd in close:   # other workers' pipes: each worker must see its own pipe close
                os.close(fd)
            sys.stdout = sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)   # fresh locks, stdout to stderr
            os.dup2(2, 1)
            serve(*child_fds, backend)
        except BaseException:  # noqa: BLE001 - the child ends here whatever happened
            code = 1
        finally:
            os._exit(code)

    @property
    def fds(self) -> list[int]:
        return [self.write_fd, self.read_fd]

    def request(self, header: dict, case: str) -> tuple[dict, dict]:
        """Send one request; (answer, arrays), the worker's enter/left reports read on the way."""
        try:
            wire.send(self.write_fd, header)
        except OSError as e:
            raise self.failed(f"could not be sent a request ({e.strerror}); {_how_it_ended(self.proc)}", case) from None
        limit = max(self.timeout, START_LIMIT) if header["op"] == "start" else self.timeout
        self.core = None
        while True:
            try:
                reply, arrays = wire.receive(self.read_fd, time.monotonic() + limit)
            except wire.WireTimeout:
                where = "" if self.core else " (outside its cores)"
                raise self.failed(f"no answer within {limit:g} s{where} (k3conf run --timeout); its worker was "
                                  "stopped", case) from None
            except wire.WireClosed:
                raise self.failed(f"the worker died: {self.ended(limit)}", case) from None
            except wire.WireGarbled as e:
                raise self.failed(f"the worker sent bytes that are not a message ({e})", case) from None
            if reply["op"] in ("enter", "left"):
                self.core = reply.get("core") if reply["op"] == "enter" else None
                continue
            if reply["op"] == "raised":
                raise _raised(reply, self.name, case)
            return reply, arrays

    def ended(self, limit: float) -> str:
        """How the process ended, once it has (it closed its pipe, so it is exiting: waited for up to `limit`)."""
        deadline = time.monotonic() + limit
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return _how_it_ended(self.proc)

    def failed(self, what: str, case: str) -> KernelFailure:
        """The error of a request that got no answer; the worker is stopped (the next request starts another)."""
        self.stop()
        core = f" in core {self.core}" if self.core else ""
        return KernelFailure(f"backend {self.name}{core} on case {case}: {what}")

    def stop(self) -> None:
        """Kill the process and close the pipes (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            _reap(self.proc)
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.write_fd = self.read_fd = -1

    @property
    def alive(self) -> bool:
        return self.write_fd >= 0


def _reap(proc: _Forked | subprocess.Popen) -> None:
    if isinstance(proc, subprocess.Popen):
        proc.wait()
    else:
        pid, status = os.waitpid(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)


def _raised(reply: dict, backend: str, case: str) -> Exception:
    """The exception of a worker's `raised` answer: UnsupportedShape and GoldenError as themselves, the rest a
    KernelFailure naming the backend, the core and the case."""
    kind, message, core = reply.get("kind"), str(reply.get("message")), reply.get("core")
    if kind == "unsupported":
        return UnsupportedShape(message)
    if kind == "golden":
        return GoldenError(message)
    if kind == "written":
        return KernelFailure(f"{message} (backend {backend}, case {case})")
    where = f"core {core} of backend {backend}" if core else f"backend {backend}, outside its cores"
    return KernelFailure(f"{message}; raised in {where} on case {case}")


class WorkerPool:
    """The run's workers, one per isolated backend name."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        self.timeout = timeout
        self.workers: dict[str, Worker] = {}
        self.specs: dict[str, str] = {}   # backend name -> the name it was loaded by (file.py:ATTR), when they differ

    def worker(self, backend: BackendBase, case: str) -> Worker:
        w = self.workers.get(backend.name)
        if w is None or not w.alive or w.proc.poll() is not None:   # none yet, or it died after its last answer
            if w is not None:
                w.stop()
            inherited = [fd for other in self.workers.values() if other.alive for fd in other.fds]
            w = self.workers[backend.name] = Worker(backend, self.timeout, inherited)
            try:
                w.request({"op": "start", "backend": self.specs.get(backend.name, backend.name)}, case)
            except BaseException:
                w.stop()   # a worker without its backend serves nothing: the next case starts another
                raise
        return w

    def call(self, backend: BackendBase, header: dict, label: str) -> tuple[dict, dict]:
        return self.worker(backend, label).request(header, label)

    def evaluate(self, case: Case, where: dict, backend: BackendBase, repeat: bool = False) -> IsolatedEvaluation:
        """The backend's run of `case` in its worker; `where`: golden_where(...)."""
        reply, arrays = self.call(backend, {"op": "evaluate", "case": case_doc(case), "golden": where,
                                            "repeat": repeat}, case.name)
        first = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("first.")}
        again = {k.split(".", 1)[1]: v for k, v in arrays.items() if k.startswith("again.")}
        info = reply.get("info") or {}
        return IsolatedEvaluation(first, [str(n) for n in reply.get("notes", [])],
                                  RunInfo(**{f.name: info[f.name] for f in dataclasses.fields(RunInfo)
                                             if f.name in info}),
                                  again if repeat else None)

    def timing(self, case: Case, where: dict, backend: BackendBase) -> tuple[float, int] | None:
        reply, _ = self.call(backend, {"op": "time", "case": case_doc(case), "golden": where}, case.name)
        t = reply.get("timing")
        return None if t is None else (float(t[0]), int(t[1]))

    def copy_bandwidth(self, backend: BackendBase) -> float | None:
        reply, _ = self.call(backend, {"op": "copy_bandwidth"}, "(copy bandwidth)")
        value = reply.get("value")
        return None if value is None else float(value)

    def check_cores(self, backend: BackendBase) -> None:
        """conformance.backends.checks.check_cores of `backend`, run in its worker; KernelFailure with the check's
        message (or the crash's) when it fails."""
        self.call(backend, {"op": "check_cores"}, "(start-up check of the cores)")

    def close(self) -> None:
        for w in self.workers.values():
            w.stop()
        self.workers.clear()
