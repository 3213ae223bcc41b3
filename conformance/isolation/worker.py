"""The worker process: one backend, built by its name, running the cases the run sends it.

    python -m conformance.isolation.worker READ_FD WRITE_FD      # or serve(read_fd, write_fd) in a forked child

Requests (conformance.isolation.wire messages) and what the worker answers:
- start {backend}: builds `get_backend(backend)` (by the name the run was given: `file.py:ATTR`, `mutant:...`)
  unless the worker was forked with the backend in hand; it keeps it (and its device context) for the run -> ready;
- evaluate {case, golden, repeat}: reads the golden itself, runs `kind_of(case).evaluate(case, golden, backend)`
  with the backend's cores guarded (conformance.isolation.guard) -> result {notes, info} with the outputs as
  arrays `first.<tensor>`. repeat: the case is run again after a run of k3ref's cores on the same inputs
  (candidate, reference, candidate), the second outputs as `again.<tensor>`;
- time {case, golden}: the kind's timing of the backend -> result {timing: [seconds, bytes] | null};
- copy_bandwidth -> result {value}; check_cores: conformance.backends.checks.check_cores of the backend -> result
  (its BackendError comes back as an error); exit: the worker ends.
Before and after each core call it sends enter / left {core}. Anything raised, BaseException included, is
answered with raised {kind, message, core}: kind "unsupported" (UnsupportedShape: a skip), "golden" (a broken
golden), "written" (a core wrote into its input) or "error".
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import sys
import traceback
from pathlib import Path

from conformance.backends.builtin import NumpyBackend
from conformance.backends.checks import check_cores
from conformance.backends.protocol import BackendBase
from conformance.backends.registry import get_backend
from conformance.cases.catalog import kind_of
from conformance.cases.protocol import Case, Evaluation
from conformance.golden.errors import GoldenError
from conformance.golden.store import read_golden
from conformance.isolation import wire
from conformance.isolation.guard import InputWritten, guarded
from k3ref.cores import UnsupportedShape

PR_SET_PDEATHSIG = 1   # linux/prctl.h: the signal this process gets when its parent ends


def case_of(doc: dict) -> Case:
    """The Case a request names (its params' lists back to the tuples the case tables use)."""
    def tuples(v):
        if isinstance(v, list):
            return tuple(tuples(x) for x in v)
        if isinstance(v, dict):
            return {k: tuples(x) for k, x in v.items()}
        return v
    return Case(doc["name"], doc["kind"], doc["config"], int(doc["seed"]), tuples(doc["params"]))


def case_doc(case: Case) -> dict:
    return {"name": case.name, "kind": case.kind, "config": case.config, "seed": case.seed,
            "params": dict(case.params)}


class Serving:
    """One worker's state: the pipe to the run, the backend, the core it is in."""

    def __init__(self, read_fd: int, write_fd: int, backend: BackendBase | None = None):
        self.read_fd, self.write_fd = read_fd, write_fd
        self.backend = backend   # a forked worker is handed the run's object; a fresh interpreter builds it
        self.core: str | None = None   # the core being called now (None between calls)

    def event(self, what: str, core: str) -> None:
        self.core = core if what == "enter" else None
        wire.send(self.write_fd, {"op": what, "core": core})

    def loop(self) -> None:
        while True:
            try:
                header, _ = wire.receive(self.read_fd)
            except wire.WireClosed:   # the run has ended
                return
            if header["op"] == "exit":
                return
            self.core = None
            try:
                reply, arrays = self.answer(header)
            except BaseException as e:  # noqa: BLE001 - whatever a kernel raises (SystemExit too) is its failure
                reply, arrays = self.raised(e), {}
            try:
                wire.send(self.write_fd, reply, arrays)
            except Exception as e:  # noqa: BLE001 - outputs that cannot be sent (an object array) are the failure
                wire.send(self.write_fd, self.raised(e))

    def answer(self, header: dict) -> tuple[dict, dict]:
        op = header["op"]
        if op == "start":
            if self.backend is None:
                self.backend = get_backend(header["backend"])
            return {"op": "ready"}, {}
        if self.backend is None:
            raise RuntimeError(f"request {op!r} before start: expected start first")
        if op == "copy_bandwidth":
            return {"op": "result", "value": self.backend.copy_bandwidth()}, {}
        if op == "check_cores":   # the start-up check calls the cores too: here, never in the run's process
            # guarded: a crash names its core; a write into an input is left to the run's cells, which name the case
            check_cores(guarded(self.backend, self.event, check_writes=False))
            return {"op": "result"}, {}
        case = case_of(header["case"])
        where = header["golden"]
        golden = read_golden(Path(where["root"]), case.name, {"files": {where["rel"]: where["entry"]}}, case.config)
        if op == "time":
            return {"op": "result", "timing": kind_of(case).timing(case, golden, self.backend)}, {}
        if op == "evaluate":
            return self.evaluate(case, golden, bool(header.get("repeat")))
        raise ValueError(f"unknown request {op!r}: expected start, evaluate, time, copy_bandwidth or exit")

    def evaluate(self, case: Case, golden, repeat: bool) -> tuple[dict, dict]:
        assert self.backend is not None
        kind, backend = kind_of(case), guarded(self.backend, self.event)
        first = kind.evaluate(case, golden, backend)
        arrays = {f"first.{k}": v for k, v in first.outputs.items()}
        if repeat:   # candidate, reference, candidate: a kernel that keeps state between calls shows here
            kind.evaluate(case, golden, NumpyBackend("k3ref", backend.precision))
            arrays.update({f"again.{k}": v for k, v in kind.evaluate(case, golden, backend).outputs.items()})
        return {"op": "result", **evaluation_doc(first)}, arrays

    def raised(self, e: BaseException) -> dict:
        if isinstance(e, UnsupportedShape):
            kind, message = "unsupported", str(e)
        elif isinstance(e, GoldenError):
            kind, message = "golden", str(e)
        elif isinstance(e, InputWritten):
            kind, message = "written", str(e)
        else:
            tb = traceback.extract_tb(e.__traceback__)
            at = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
            kind, message = "error", f"{type(e).__name__}: {e}{at}"
        return {"op": "raised", "kind": kind, "message": message, "core": self.core}


def evaluation_doc(run: Evaluation) -> dict:
    """An Evaluation's notes and info as JSON (its outputs travel as arrays)."""
    return {"notes": [str(n) for n in run.notes], "info": dataclasses.asdict(run.info)}


def detach_from_terminal() -> None:
    """Ctrl-C on the terminal is for the run, which stops the worker itself (a kernel raising KeyboardInterrupt
    still raises); when the run's process dies the worker is killed (Linux), never left running a kernel."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):   # not Linux: the worker still ends when the run closes its pipe
        pass


def serve(read_fd: int, write_fd: int, backend: BackendBase | None = None) -> None:
    """The worker's life: answer requests until the run says exit or closes the pipe. backend: the one to serve
    (a forked worker's), else the one `start` names."""
    detach_from_terminal()
    Serving(read_fd, write_fd, backend).loop()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not all(a.isdigit() for a in argv):
        print(f"usage: python -m conformance.isolation.worker READ_FD WRITE_FD (found {argv})", file=sys.stderr)
        return 2
    os.dup2(2, 1)   # what a kernel prints goes to stderr, never into the run's table
    serve(int(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
