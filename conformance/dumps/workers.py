"""The layers of one compare spread over worker processes on this machine (`k3conf compare --workers N`).

Each layer's recompute depends only on the dump and the checkpoint, so the layers are independent tasks. Worker
k of N takes the layers [k::N] of the sorted list, opens the dump itself and runs `run_layer(dump, checkpoint,
layer)` for its layers one after the other (the recompute loads one layer's weights at a time, so a worker holds
one layer's weights at a time). Workers are started with multiprocessing's "spawn" method (a fresh interpreter:
no forked copies of the parent's threads or memory maps) and are handed only strings and integers; each result
comes back as the UTF-8 JSON of `LayerResult.to_json()` over the pipe's send_bytes (no pickled object crosses).

A worker that dies (a crash, a signal, os._exit, the kernel's OOM killer) is named with the layers it held and
its exit status; the layers it had not finished run once more in one fresh worker, the layer it died on last (so
a layer that kills every worker it runs in costs only itself), and a layer that does not come back then is
reported missing with both deaths. An exception inside run_layer is not a death: a DumpError is the dump's fault
and stops the compare (exit 2, as in one process), anything else makes that layer missing with the exception.

With one worker the layers run in this process, in the same order, through the same JSON round trip, so that
`--workers 1` and `--workers N` give the same report.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import multiprocessing
import os
import threading
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from conformance.dumps.errors import DumpError
from conformance.dumps.format import Dump

RunLayer = Callable[[Dump, Path, int], Any]   # (dump, checkpoint, layer) -> a result with .to_json() -> dict
POLL_S = 1.0          # how often the collecting thread looks at its workers when no message arrives


@dataclasses.dataclass
class LayerRuns:
    """What the workers brought back. results: layer -> its result's JSON object; missing: layer -> why it has no
    result; failures: one line per worker that died ("worker 1 (layers 3, 7) exited with -9 on layer 3")."""
    results: dict[int, dict] = dataclasses.field(default_factory=dict)
    missing: dict[int, str] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)

    def merge(self, other: LayerRuns) -> None:
        self.results.update(other.results)
        self.missing.update(other.missing)
        self.failures += other.failures


def function_name(fn: Callable) -> str:
    """'module:qualname' of a module-level function, the form a spawned worker imports it by; ValueError for a
    lambda, a nested function or a bound method, which a fresh interpreter cannot find by name."""
    name = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', None)}"
    try:
        found = resolve(name)
    except (ImportError, AttributeError, ValueError):
        found = None
    if found is not fn:
        raise ValueError(f"run_layer: expected a module-level function a worker can import by name, found {fn!r}")
    return name


def resolve(name: str) -> Callable:
    """The function a 'module:qualname' string names."""
    module, _, attr = name.partition(":")
    if not module or not attr or "." in attr or "<" in attr:
        raise ValueError(f"expected 'module:function', found {name!r}")
    return getattr(importlib.import_module(module), attr)


def run_one(dump: Dump, checkpoint: Path, layer: int, run_layer: RunLayer) -> dict:
    """One layer's message: {"layer", "result": JSON} or {"layer", "error", "dump_error"} for an exception."""
    try:
        result = run_layer(dump, checkpoint, layer)
        # the JSON round trip every worker's result makes, so one process and N give the same report
        return {"layer": layer, "result": json.loads(json.dumps(result.to_json(), allow_nan=True))}
    except Exception as e:   # a layer's failure is reported, the other layers still run
        where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
        at = f" ({Path(where.filename).name}:{where.lineno})" if where else ""
        return {"layer": layer, "error": f"{type(e).__name__}: {e}{at}", "dump_error": isinstance(e, DumpError)}


def absorb(runs: LayerRuns, message: dict, who: str) -> None:
    """Put one layer's message into `runs`; a DumpError from a layer stops the compare as it would in one
    process (the dump is at fault, not the worker)."""
    layer = int(message["layer"])
    if "result" in message:
        runs.results[layer] = message["result"]
        runs.missing.pop(layer, None)
    elif message.get("dump_error"):
        raise DumpError(f"layer {layer}: {message['error']}")
    else:
        runs.missing[layer] = f"{message['error']} in {who}"


def run_here(dump: Dump, checkpoint: Path, layers: Sequence[int], run_layer: RunLayer) -> LayerRuns:
    """The layers in this process, in order."""
    runs = LayerRuns()
    for layer in layers:
        absorb(runs, run_one(dump, Path(checkpoint), layer, run_layer), "this process")
    return runs


def _worker_main(conn: Connection, dump_path: str, checkpoint: str, layers: list[int], run_layer: str,
                 threads: int) -> None:
    """A spawned worker: announces each layer before it starts it (so a death names the layer), then sends its
    result; every message is JSON bytes."""
    _limit_threads(threads)
    fn = resolve(run_layer)
    try:
        dump = Dump.open(dump_path, verify=False)   # the parent checked the sha256 of every file
    except DumpError as e:
        for layer in layers:
            conn.send_bytes(json.dumps({"layer": layer, "error": f"{type(e).__name__}: {e}",
                                        "dump_error": True}).encode())
        return
    for layer in layers:
        conn.send_bytes(json.dumps({"layer": layer, "started": True}).encode())
        conn.send_bytes(json.dumps(run_one(dump, Path(checkpoint), layer, fn), allow_nan=True).encode())
    conn.close()


def _limit_threads(threads: int) -> None:
    """N workers share the cores: each BLAS gets its share (the results do not depend on it, only the time)."""
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415 -- optional: only a thread cap
    except ImportError:
        return
    threadpool_limits(limits=max(1, threads))


@dataclasses.dataclass
class _Worker:
    number: int
    layers: list[int]
    process: Any
    conn: Connection
    done: set[int] = dataclasses.field(default_factory=set)
    current: int | None = None
    retry: bool = False


class WorkerPool:
    """N spawned workers over the layers, collected by a thread of this process so that the caller can do other
    work meanwhile (the free run): `pool.start()`, then `pool.join() -> LayerRuns`."""

    def __init__(self, dump_path: Path, checkpoint: Path, layers: Sequence[int], workers: int, run_layer: RunLayer):
        if workers < 1:
            raise ValueError(f"workers: expected at least 1, found {workers}")
        self.dump_path, self.checkpoint = str(dump_path), str(checkpoint)
        self.layers = sorted(int(x) for x in layers)
        self.n = min(workers, max(1, len(self.layers)))
        self.run_layer = function_name(run_layer)
        self.threads = max(1, (os.cpu_count() or 1) // self.n)
        self.runs = LayerRuns()
        self._ctx = multiprocessing.get_context("spawn")
        self._count = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._live: list[_Worker] = []
        self._stopping = False

    def start(self) -> WorkerPool:
        for k in range(self.n):
            self._spawn(self.layers[k::self.n], retry=False)
        self._thread = threading.Thread(target=self._collect_safely, name="k3conf-compare-workers", daemon=True)
        self._thread.start()
        return self

    def join(self) -> LayerRuns:
        """Wait for every worker; re-raises a DumpError a worker met (every worker ended first)."""
        if self._thread is None:
            self.start()
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.runs

    def stop(self) -> None:
        """End every worker now (the caller failed meanwhile); what they brought back is dropped."""
        self._stopping = True
        for w in list(self._live):
            w.process.kill()
        if self._thread is not None:
            self._thread.join()

    def _spawn(self, layers: list[int], *, retry: bool) -> None:
        self._count += 1
        parent, child = self._ctx.Pipe(duplex=False)
        p = self._ctx.Process(target=_worker_main, name=f"k3conf-compare-worker-{self._count}",
                              args=(child, self.dump_path, self.checkpoint, layers, self.run_layer, self.threads),
                              daemon=True)
        p.start()
        child.close()   # the worker holds the only writing end: its death ends our reads with EOFError
        self._live.append(_Worker(self._count, list(layers), p, parent, retry=retry))

    def _collect_safely(self) -> None:
        try:
            self._collect()
        except BaseException as e:  # handed to join(): the caller's thread raises it
            self._error = e
            for w in self._live:
                w.process.kill()
            for w in self._live:
                w.process.join()

    def _collect(self) -> None:
        while self._live:
            ready = wait([w.conn for w in self._live], timeout=POLL_S)
            for w in list(self._live):
                if w.conn in ready:
                    self._read(w)

    def _read(self, w: _Worker) -> None:
        try:
            message = json.loads(w.conn.recv_bytes().decode())
        except (EOFError, OSError):
            self._ended(w)
            return
        if message.get("started"):
            w.current = int(message["layer"])
            return
        w.done.add(int(message["layer"]))
        w.current = None
        absorb(self.runs, message, f"worker {w.number}")

    def _ended(self, w: _Worker) -> None:
        """The worker's pipe closed: it finished, or it died and its unfinished layers go to a fresh worker."""
        self._live.remove(w)
        w.process.join()
        w.conn.close()
        left = [layer for layer in w.layers if layer not in w.done]
        if self._stopping or (not left and w.process.exitcode == 0):
            return
        on = f" on layer {w.current}" if w.current is not None else ""
        line = f"worker {w.number} (layers {', '.join(map(str, w.layers))}) exited with {w.process.exitcode}{on}"
        if w.retry or not left:
            self.runs.failures.append(line + ("" if left else "; every layer had finished"))
            for layer in left:
                first = self.runs.missing.get(layer, "")
                self.runs.missing[layer] = (f"{first}; then " if first else "") + line
            return
        # the layer it died on last: a layer that kills its worker every time then costs only itself
        left.sort(key=lambda layer: layer == w.current)
        self.runs.failures.append(f"{line}; layers {', '.join(map(str, left))} re-run in worker {self._count + 1}")
        for layer in left:
            self.runs.missing[layer] = line
        self._spawn(left, retry=True)


def run_layers(dump: Dump, checkpoint: Path, layers: Sequence[int], *, workers: int = 1,
               run_layer: RunLayer, meanwhile: Callable[[], Any] | None = None) -> tuple[LayerRuns, Any]:
    """Every layer's result, in this process (workers == 1) or over `workers` spawned workers; `meanwhile()`
    runs in this process while the workers work (after the layers with one worker), and its value is returned
    second."""
    if workers <= 1:
        runs = run_here(dump, checkpoint, layers, run_layer)
        return runs, (meanwhile() if meanwhile else None)
    pool = WorkerPool(dump.path, checkpoint, layers, workers, run_layer).start()
    try:
        other = meanwhile() if meanwhile else None
    except BaseException:
        pool.stop()
        raise
    return pool.join(), other
