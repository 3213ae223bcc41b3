"""The worker process: one backend, loaded by its name, calling its kernels on the inputs the run sends it.

    serve(fd)   # in a process forked by the fork server (conformance.isolation.zygote); fd: its socket to the run

A worker is given inputs, never answers. Each request carries what one call needs (a core's arguments; for a
whole-model trace the weights, the tokens and, one layer at a time, the golden state a layer-by-layer trace feeds
it); the outputs go back to the run, which alone holds the goldens, the gate tables and the verdicts. The
backend's module is imported here and nowhere else.

Requests (conformance.isolation.wire messages; each carries `seq`, and every message sent back echoes it):
- start {spec}: builds `get_backend(spec)` (a registry name, `mutant:...`, `file.py:ATTR`, an entry point) and
  keeps it for the run -> ready {description}: what the run needs to know of it (describe());
- call {core, args, kwargs}: one call of the backend's core, on its own copies of the arrays, checked for writes
  into them (conformance.isolation.guard) -> result {out, seconds};
- hub {op: new | call | get | set, ...}: the backend's own AttnRes hub (a stateful factory core), kept here by id;
- notes -> result {notes}: backend.run_notes();
- scrub: allocations of the last outputs' sizes filled with NaN and freed, so that a kernel reading memory it
  did not write finds NaN in its next call (the determinism check's second call);
- time {core, sets, repeats}: the judge's own timing of the core (conformance.isolation.timing) on the input
  sets given, every timed call's outputs sent back -> result {seconds, outs};
- copy_bandwidth -> result {value};
- trace {case, config_json, prompt_len, router_budget, kwargs}: a whole-model backend's evaluate_trace on a
  TraceView (conformance.isolation.trace_view), which asks the run for each layer's input and near-tie route
  while the trace runs -> result {out};
- time_trace {...}: the same, timed, on a free-running trace -> result {seconds, outs};
- exit: the worker ends.
Before and after each core call it sends enter / left {core}. Anything raised, BaseException included, is
answered with raised {kind, message, core}: kind "unsupported" (UnsupportedShape: a skip), "written" (a core wrote
into its input) or "error".
"""
from __future__ import annotations

import contextlib
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from conformance.backends.protocol import (
    BackendBase,
    WholeModelBackend,
    checked_availability,
    checked_kernel_cores,
)
from conformance.backends.registry import get_backend
from conformance.cases.core import CORE_SPECS
from conformance.cases.protocol import Case, Evaluation
from conformance.isolation import timing, wire
from conformance.isolation.guard import InputWritten, guard_core
from conformance.isolation.trace_view import TraceView
from k3cuda import force_entry
from k3ref.attnres import AttnResHub
from k3ref.cores import CORE_NAMES, UnsupportedShape
from k3ref.threads import blas_threads

# the blocks a backend may declare a speed target for (speed_target(block)): every block a case belongs to
TARGET_BLOCKS = (*CORE_SPECS, "latent_moe", "trace")
HUB_METHODS = frozenset({"start", "mixer_input", "add_mixer", "mlp_input", "add_mlp", "final_input"})
HUB_FIELDS = frozenset({"blocks", "prefix", "block_size", "eps"})


def describe(backend: BackendBase) -> dict:
    """What the run learns of a backend, as JSON values: its name, precision, device and tensors, whether it can
    run here and why, its kernel cores, whether it is a whole model, whether its AttnRes hub is its own, the
    cores the judge times, its speed targets; `cores_error`: why its cores cannot be had (a whole model's)."""
    ok, why = checked_availability(backend.available)
    doc = {"name": backend.name, "precision": backend.precision, "device": str(backend.device),
           "tensors": backend.tensors, "deterministic": backend.deterministic, "available": ok, "reason": why,
           "kernel_cores": [], "whole_model": isinstance(backend, WholeModelBackend), "own_hub": False,
           "cores_error": "", "timed": [], "speed_targets": {}}
    if not ok:
        return doc
    kernels = checked_kernel_cores(backend.kernel_cores(), f"backend {backend.name}")
    doc["kernel_cores"] = sorted(kernels)
    try:
        cores = backend.cores()
    except UnsupportedShape as e:   # a whole model has no cores: the per-block cases are n/a for it
        doc["cores_error"] = str(e)
    else:
        doc["own_hub"] = "attnres_hub" in kernels and cores.attnres_hub is not AttnResHub
    doc["timed"] = sorted(kernels & backend.timed_cores())
    doc["speed_targets"] = {block: backend.speed_target(block) for block in TARGET_BLOCKS}
    return doc


class Serving:
    """One worker's state: its socket, the backend, the hubs it keeps, the request being answered."""

    def __init__(self, fd: int):
        self.fd = fd
        self.backend: BackendBase | None = None
        self.core: str | None = None       # the core being called now (None between calls)
        self.seq = 0                       # the request being answered
        self.hubs: dict[int, object] = {}
        self.last_sizes: list[int] = []    # bytes of the last outputs sent, for scrub

    def send(self, header: dict, arrays: dict | None = None) -> None:
        wire.send(self.fd, {**header, "seq": self.seq}, arrays)

    def event(self, what: str, core: str) -> None:
        self.core = core if what == "enter" else None
        self.send({"op": what, "core": core})

    def ask(self, header: dict, arrays: dict | None = None) -> tuple[dict, dict]:
        """A question to the run in the middle of a request (a whole model's next layer input); its answer."""
        self.send(header, arrays)
        reply, got = wire.receive(self.fd)
        if reply.get("op") == "refused":
            raise RuntimeError(str(reply.get("message"))[:2000])
        return reply, got

    def loop(self) -> None:
        while True:
            try:
                header, arrays = wire.receive(self.fd)
            except wire.WireClosed:   # the run has ended
                return
            self.seq = int(header.get("seq", 0))
            if header["op"] == "exit":
                return
            self.core = None
            try:
                reply, out = self.answer(header, arrays)
            except BaseException as e:  # noqa: BLE001 - whatever a kernel raises (SystemExit too) is its failure
                reply, out = self.raised(e), {}
            try:
                self.send(reply, out)
            except Exception as e:  # noqa: BLE001 - outputs that cannot be sent (an object array) are the failure
                self.send(self.raised(e))

    def answer(self, header: dict, arrays: dict) -> tuple[dict, dict]:
        op = header["op"]
        if op == "start":
            if self.backend is None:
                self.backend = get_backend(str(header["spec"]))
            return {"op": "ready", "description": describe(self.backend)}, {}
        if self.backend is None:
            raise RuntimeError(f"request {op!r} before start: expected start first")
        args = wire.unpack(header.get("args", []), arrays)
        kwargs = wire.unpack(header.get("kwargs", {"$d": {}}), arrays)
        if op == "call":
            with entries_forced(header.get("forced") or {}):
                return self.call(str(header["core"]), args, kwargs, header.get("check_writes") is not False)
        if op == "hub":
            return self.hub(header, args, kwargs)
        if op == "notes":
            notes = self.backend.run_notes()
            return {"op": "result", "notes": [str(n) for n in notes]}, {}
        if op == "scrub":
            scrub(self.last_sizes)
            return {"op": "result"}, {}
        if op == "copy_bandwidth":
            return {"op": "result", "value": self.backend.copy_bandwidth()}, {}
        if op == "time":
            with entries_forced(header.get("forced") or {}):
                return self.time(str(header["core"]), args, int(header["repeats"]))
        if op in ("trace", "time_trace"):
            return self.trace(header, arrays, timed=op == "time_trace")
        raise ValueError(f"unknown request {op!r}")

    def cores(self):
        assert self.backend is not None
        return self.backend.cores()

    def call(self, core: str, args: list, kwargs: dict, check_writes: bool = True) -> tuple[dict, dict]:
        if core not in CORE_NAMES or core == "attnres_hub":
            raise ValueError(f"call of {core!r}: expected a core of {CORE_NAMES} other than attnres_hub")
        fn = guard_core(core, getattr(self.cores(), core), self.event, check_writes)
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        seconds = time.perf_counter() - t0
        return self.result({"seconds": seconds}, outputs(result))

    def result(self, header: dict, value) -> tuple[dict, dict]:
        arrays: dict[str, np.ndarray] = {}
        tree = wire.pack(value, arrays)
        self.last_sizes = [a.nbytes for a in arrays.values()]
        return {"op": "result", "out": tree, **header}, arrays

    def hub(self, header: dict, args: list, kwargs: dict) -> tuple[dict, dict]:
        what = header["what"]
        if what == "new":
            hub = self.cores().attnres_hub(*args, **kwargs)
            self.hubs[len(self.hubs) + 1] = hub
            return {"op": "result", "id": len(self.hubs)}, {}
        hub = self.hubs[int(header["id"])]
        name = str(header["name"])
        if what == "call" and name in HUB_METHODS:
            self.core = "attnres_hub"
            kwargs = dict(kwargs)
            if name in ("mixer_input", "mlp_input", "final_input"):   # its mixes: the backend's own core
                kwargs["cores"] = self.cores()
            return self.result({}, outputs(getattr(hub, name)(*args, **kwargs)))
        if what == "get" and name in HUB_FIELDS:
            return self.result({}, outputs(getattr(hub, name)))
        if what == "set" and name in ("blocks", "prefix"):
            setattr(hub, name, args[0])
            return {"op": "result"}, {}
        raise ValueError(f"hub request {what} {name!r}: not a method or field of an AttnRes hub")

    def time(self, core: str, sets: list, repeats: int) -> tuple[dict, dict]:
        assert self.backend is not None
        seconds, outs = timing.timed_calls(self.backend, core, [(s[0], s[1]) for s in sets], repeats, self.event)
        return self.result({"seconds": seconds}, [outputs(o) for o in outs])

    def trace(self, header: dict, arrays: dict, timed: bool) -> tuple[dict, dict]:
        backend = self.backend
        if not isinstance(backend, WholeModelBackend):
            raise ValueError(f"backend {getattr(backend, 'name', '?')} is not a whole-model backend: its traces run "
                             "on its cores")
        weights = {k[len("w."):]: v for k, v in arrays.items() if k.startswith("w.")}
        routes = wire.unpack(header.get("routes"), arrays) if header.get("routes") is not None else None
        view = TraceView(self.ask, header["golden_kwargs"], weights, arrays["tokens"], routes)
        case = Case(**wire.unpack(header["case"], {}))

        def once() -> Evaluation:
            return backend.evaluate_trace(case, view, header["config_json"], int(header["prompt_len"]),
                                          router_budget=float(header["router_budget"]))
        if not timed:
            return self.result({}, {k: np.asarray(v) for k, v in once().outputs.items()})
        seconds, outs = timing.timed_runs(once, int(header["repeats"]))
        return self.result({"seconds": seconds}, [{k: np.asarray(v) for k, v in o.outputs.items()} for o in outs])

    def raised(self, e: BaseException) -> dict:
        if isinstance(e, UnsupportedShape):
            kind, message = "unsupported", str(e)
        elif isinstance(e, InputWritten):
            kind, message = "written", str(e)
        else:
            tb = traceback.extract_tb(e.__traceback__)
            at = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
            kind, message = "error", f"{type(e).__name__}: {e}{at}"
        return {"op": "raised", "kind": kind, "message": message[:4000], "core": self.core,
                "type": type(e).__name__[:100], "text": str(e)[:4000]}


def outputs(value):
    """A core's result as the wire carries it: a tuple or list of arrays stays one, anything array-like becomes a
    NumPy array (a list of numbers, a NumPy scalar); None stays None."""
    if value is None or isinstance(value, np.ndarray):
        return value
    if isinstance(value, tuple):
        return tuple(outputs(v) for v in value)
    if isinstance(value, list) and any(isinstance(v, np.ndarray) for v in value):
        return [outputs(v) for v in value]
    if isinstance(value, dict):
        return {str(k): outputs(v) for k, v in value.items()}
    if isinstance(value, bool | int | float | str):
        return value
    return np.asarray(value)


def entries_forced(forced: dict) -> contextlib.ExitStack:
    """The k3cuda kernel entries the run's case forces (k3cuda.force_entry), forced here around the call."""
    stack = contextlib.ExitStack()
    for block, entry in forced.items():
        stack.enter_context(force_entry(str(block), str(entry)))
    return stack


def scrub(sizes: list[int]) -> None:
    """Fill freed memory of the sizes just returned with NaN: the allocators (malloc's bins, torch's caching
    allocator on a GPU) hand such blocks out again, so an output a kernel forgot to write reads NaN, not the last
    call's data."""
    poisoned = [np.full(max(n // 8, 1), np.nan) for n in sizes]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        poisoned += [torch.full((max(n // 4, 1),), float("nan"), device="cuda") for n in sizes]
    del poisoned


def serve(fd: int) -> None:
    """The worker's life: answer requests until the run says exit or closes the socket. Ctrl-C on the terminal is
    the run's (the fork server started this process in a session of its own; SIGINT is ignored all the same)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with blas_threads(1):   # as the run: one BLAS thread per process, so the bits do not depend on the machine
        Serving(fd).loop()


__all__ = ["describe", "outputs", "scrub", "serve", "Serving"]
