"""The run's side of the worker processes: one per isolated backend, forked by the fork server on first use and
again after a crash; the backends they serve, as the run sees them (conformance.isolation.remote).

    pool = WorkerPool(timeout=300.0)
    backend = pool.backend("./k3_backend.py:make")   # loaded and described by its worker, never imported here
    pool.case = "rmsnorm/T1-D113"                    # named in the errors of the requests that follow
    ...
    pool.close()                                     # every worker stopped; processes they left are named

A request that does not end in an answer raises KernelFailure with the error row's message, naming the backend,
the core it was in (the worker reports each core it enters) and the case: the worker died (a crash, a signal,
os._exit; noticed from the fork server's report while the answer is awaited, even when a process the kernel
forked still holds the worker's socket), it went silent for longer than the time limit (it is killed), or it
sent bytes that are not a message, or a message out of turn. The next request starts a new worker.
UnsupportedShape comes back as itself.
"""
from __future__ import annotations

import select
import signal
import socket
import time

from conformance.backends.protocol import BackendError
from conformance.isolation import wire
from conformance.isolation.errors import KernelFailure, RaisedInWorker
from conformance.isolation.processes import sweep_orphans
from conformance.isolation.remote import Description, RemoteBackend, read_description, remote_backend
from conformance.isolation.zygote import Zygote, ZygoteError, shared
from k3ref.cores import UnsupportedShape

DEFAULT_TIMEOUT = 300.0   # seconds a worker may stay silent (inside one core call, or between two)
START_LIMIT = 60.0        # at least this long to start a worker: importing a backend's libraries can be slow
DEATH_NOTICE_S = 5.0      # how long a closed socket waits for the fork server's word on how the worker ended
MIN_REPLY = 256 << 20     # a reply may carry this many bytes, or REPLY_FACTOR x the request's, whichever is more
REPLY_FACTOR = 16


def how_it_ended(status: int | None) -> str:
    if status is None:
        return "its process closed its socket and did not exit (it was killed)"
    if status < 0:
        try:
            return f"its process was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"its process was killed by signal {-status}"
    return f"its process exited with status {status} (a kernel ended it: os._exit, or a crash)"


class Worker:
    """One worker process of one backend, forked by `zygote`."""

    def __init__(self, zygote: Zygote, name: str, timeout: float):
        self.zygote, self.name, self.timeout = zygote, name, timeout
        mine, theirs = socket.socketpair()
        self.sock = mine
        self.pid = zygote.fork(theirs)
        self.seq = 0
        self.core: str | None = None
        self.left: list[dict] = []   # processes found running when it was stopped

    def request(self, header: dict, arrays: dict, case: str, limit: float | None = None,
                serve=None) -> tuple[dict, dict]:
        """Send one request; (answer, arrays): the enter/left reports read on the way, and questions the worker
        asks in the middle of a request (a whole model's) answered by `serve(header, arrays) -> (reply, arrays)`."""
        self.seq += 1
        sent = sum(a.nbytes for a in arrays.values())
        try:
            wire.send(self.sock.fileno(), {**header, "seq": self.seq}, arrays)
        except OSError as e:
            raise self.failed(f"could not be sent a request ({e.strerror}); {self._ended()}", case) from None
        limit = self.timeout if limit is None else limit
        deadline = time.monotonic() + limit
        self.core = None
        while True:
            reply, got = self._receive(deadline, limit, case, max(MIN_REPLY, REPLY_FACTOR * sent))
            op = reply.get("op")
            if op in ("enter", "left"):
                self.core = str(reply.get("core"))[:64] if op == "enter" else None
                continue
            if op == "raised":
                raise _raised(reply, self.name, case, self.core)
            if op in ("feed", "route"):
                if serve is None:
                    raise self.failed(f"asked a question ({op}) no request of this kind asks", case)
                try:
                    answer, out = serve(reply, got)
                except Exception as e:  # noqa: BLE001 - a refused question ends the request in the worker
                    answer, out = {"op": "refused", "message": str(e)[:2000]}, {}
                wire.send(self.sock.fileno(), {**answer, "seq": self.seq}, out)
                continue
            return reply, got

    def _receive(self, deadline: float, limit: float, case: str, max_bytes: int) -> tuple[dict, dict]:
        while True:
            wait = deadline - time.monotonic()
            watched = [self.sock.fileno(), self.zygote.fileno()]
            ready = select.select(watched, [], [], max(wait, 0.0))[0] if wait > 0 else []
            if not ready:
                where = "" if self.core else " (outside its cores)"
                raise self.failed(f"no answer within {limit:g} s{where} (k3conf run --timeout); its worker was "
                                  "stopped", case)
            if self.zygote.fileno() in ready:
                try:
                    self.zygote.pump()
                except ZygoteError as e:   # a kernel may kill the server (same user): its workers die with it
                    raise self.failed(f"the worker server died while the worker ran ({e})", case) from None
                if self.pid in self.zygote.dead:
                    raise self.failed(f"the worker died: {how_it_ended(self.zygote.dead[self.pid])}", case)
            if self.sock.fileno() in ready:
                break
        try:
            reply, got = wire.receive(self.sock.fileno(), deadline, max_bytes)
        except wire.WireTimeout:
            raise self.failed(f"no whole answer within {limit:g} s (k3conf run --timeout); its worker was stopped",
                              case) from None
        except wire.WireClosed:
            raise self.failed(f"the worker died: {self._ended()}", case) from None
        except wire.WireGarbled as e:
            raise self.failed(f"the worker sent bytes that are not a message ({e})", case) from None
        if reply.get("seq") != self.seq:
            raise self.failed(f"the worker sent a message out of turn ({str(reply.get('op'))[:40]!r} for request "
                              f"{str(reply.get('seq'))[:20]}, expected {self.seq}): something in its process wrote "
                              "into its socket", case)
        return reply, got

    def _ended(self) -> str:
        """How the worker ended, once its socket closed: the fork server's word, waited for a few seconds."""
        deadline = time.monotonic() + DEATH_NOTICE_S
        while self.pid not in self.zygote.dead and time.monotonic() < deadline:
            if select.select([self.zygote.fileno()], [], [], max(deadline - time.monotonic(), 0.0))[0]:
                try:
                    self.zygote.pump()
                except ZygoteError as e:
                    return f"the worker server died too ({e})"
        return how_it_ended(self.zygote.dead.get(self.pid))

    def failed(self, what: str, case: str) -> KernelFailure:
        """The error of a request that got no answer; the worker is stopped (the next request starts another)."""
        self.stop()
        core = f" in core {self.core}" if self.core else ""
        return KernelFailure(f"backend {self.name}{core} on case {case}: {what}")

    def stop(self) -> None:
        """Kill the process and its process group, close the socket (idempotent); `left` names what was running."""
        if self.sock.fileno() < 0:
            return
        self.sock.close()
        try:
            _, self.left = self.zygote.stop(self.pid)
        except (OSError, ZygoteError):
            self.left = []

    @property
    def alive(self) -> bool:
        return self.sock.fileno() >= 0 and self.pid not in self.zygote.dead


def _raised(reply: dict, backend: str, case: str, core_now: str | None) -> Exception:
    """The exception of a worker's `raised` answer: UnsupportedShape as itself, the rest a KernelFailure naming
    the backend, the core and the case."""
    kind, message = reply.get("kind"), str(reply.get("message"))[:4000]
    core = reply.get("core") or core_now
    if kind == "unsupported":
        return UnsupportedShape(message)
    if kind == "written":
        return KernelFailure(f"{message} (backend {backend}, case {case})")
    where = f"core {str(core)[:64]} of backend {backend}" if core else f"backend {backend}, outside its cores"
    return RaisedInWorker(f"{message}; raised in {where} on case {case}", str(reply.get("type"))[:100],
                          str(reply.get("text"))[:4000])


class WorkerPool:
    """The run's workers, one per isolated backend (by the name it was loaded by), and the backends they serve."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        self.timeout = timeout
        self.case = ""                                  # the case the next requests are for (their errors name it)
        self.workers: dict[str, Worker] = {}
        self.descriptions: dict[str, Description] = {}
        self.backends: dict[str, RemoteBackend] = {}
        self.left: dict[str, list[dict]] = {}           # backend name -> processes its workers left running
        self.servers: list[Zygote] = []                 # the fork servers its workers came from
        self.stopped_pids: list[int] = []               # workers stopped before close

    def backend(self, spec: str) -> RemoteBackend:
        """The backend `spec` names, loaded and described by its worker; BackendError when it cannot be loaded."""
        if spec not in self.backends:
            self.worker(spec, "(loading the backend)")
            self.backends[spec] = remote_backend(self, self.descriptions[spec])
        return self.backends[spec]

    def worker(self, spec: str, case: str) -> Worker:
        w = self.workers.get(spec)
        if w is not None and w.alive:
            return w
        if w is not None:
            self._stopped(spec, w)
        name = self.descriptions[spec].name if spec in self.descriptions else spec
        try:
            server = shared()
            if server not in self.servers:
                self.servers.append(server)
            w = self.workers[spec] = Worker(server, name, self.timeout)
        except ZygoteError as e:
            raise BackendError(f"backend {spec}: no worker process could be started: {e}") from None
        try:
            reply, _ = w.request({"op": "start", "spec": spec}, {}, case, max(self.timeout, START_LIMIT))
            found = read_description(reply.get("description"), spec)
        except KernelFailure as e:
            self._stopped(spec, w)
            if spec in self.descriptions:
                raise
            raise BackendError(f"backend {spec}: its worker could not load it: {e}") from None
        known = self.descriptions.setdefault(spec, found)
        w.name = known.name
        if found != known:
            self._stopped(spec, w)
            raise KernelFailure(f"backend {known.name} on case {case}: its worker, started again, described the "
                                "backend otherwise than the first one did")
        return w

    def _stopped(self, spec: str, w: Worker) -> None:
        self.stopped_pids.append(w.pid)
        w.stop()
        if w.left:
            self.left.setdefault(w.name, []).extend(w.left)
        self.workers.pop(spec, None)

    def request(self, spec: str, header: dict, arrays: dict | None = None, serve=None,
                limit: float | None = None) -> tuple[dict, dict]:
        return self.worker(spec, self.case).request(header, arrays or {}, self.case, limit, serve)

    def close(self) -> None:
        """Stop every worker; the processes they (or a kernel's daemons) left running are killed and in `left`.
        Where a fork server died during the run, the processes it orphaned that were re-parented to this process
        (processes.guard_this_process) are killed and named too."""
        pids = [w.pid for w in self.workers.values()] + self.stopped_pids
        for spec, w in list(self.workers.items()):
            self._stopped(spec, w)
        self.workers.clear()
        if any(z.lost for z in self.servers):
            orphans = sweep_orphans(pids)
            if orphans:
                self.left.setdefault("(orphaned by the worker server)", []).extend(orphans)

    def left_lines(self) -> list[str]:
        """One line per backend whose kernels left processes running after its worker was stopped, and per fork
        server that died during the run (a process that escaped a worker's group then outlives the run unseen)."""
        lines = [f"the worker server (pid {z.proc.pid}) died during the run ({z.lost}): a kernel can kill it, and "
                 "a process that escaped a worker's process group is then neither found nor killed"
                 for z in self.servers if z.lost]
        for name, procs in self.left.items():
            shown = "; ".join(f"pid {p.get('pid')} ({str(p.get('how'))[:40]}): {str(p.get('command'))[:120]}"
                              for p in procs[:5])
            more = f"; and {len(procs) - 5} more" if len(procs) > 5 else ""
            lines.append(f"backend {name} left {len(procs)} process(es) running after its calls, killed when its "
                         f"worker was stopped: {shown}{more}")
        return lines

