"""The fork server of the worker processes: a fresh interpreter that has never held a golden, a gate table's
verdict or anything else of a run, from which every worker is forked.

Why a fork server: a worker forked from the run itself would start with a copy of the run's memory, the goldens
already read among it (a kernel finds them with `gc.get_objects()`); a fresh interpreter per worker costs a
second or two of imports each. The server is started once per process that runs kernels (`shared()`), imports
what workers need (NumPy, k3ref, the case kinds, torch when installed) and then forks a worker in milliseconds
whenever the run asks for one; it is given nothing else.

    python -m conformance.isolation.zygote CTRL_FD          # started by Zygote(); CTRL_FD a SOCK_SEQPACKET socket

The control socket carries one JSON message per packet, a worker's socket attached to a fork request:
- fork {env, cwd, path} + one fd -> forked {pid}: the child starts a session of its own (its process group is
  its pid; it is detached from the terminal), asks to be killed when the server dies, takes the run's
  environment, working directory and sys.path, and serves the worker protocol on the fd
  (conformance.isolation.worker);
- stop {pid} -> stopped {pid, status, left}: the processes of the worker's group other than itself are named,
  the group is killed, then every process that escaped it (a kernel's daemon in a session of its own) is killed
  as it is found: the server is a child subreaper (Linux), so such a process is re-parented to the server, not
  to init, once the process that started it is gone. `left` names them all (pid and command line);
- sweep {} -> swept {left}: the same search for escaped processes, any time;
- exit {} -> every worker's group and every escaped process killed, then the server exits.
Unasked, the server reports died {pid, status} when a worker ends on its own, so a run waiting for a worker's
reply notices its death at once even when a process the kernel forked keeps the worker's socket open.

The run's side is `Zygote`: one per process (`shared()`), used from one thread at a time. The server's output
(and every worker's, where kernels print) goes to a pipe the run copies to its own stderr, so a process a kernel
leaves behind never holds the run's own output streams open.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from conformance.isolation import worker
from conformance.isolation.processes import (
    PR_SET_CHILD_SUBREAPER,
    PR_SET_PDEATHSIG,
    SWEEP_PAUSE,
    SWEEP_ROUNDS,
    WORKER_MARK,
    children_of,
    command_line,
    group_members,
    kill,
    prctl,
)

START_LIMIT = 120.0   # seconds for the server to answer its first request: it imports NumPy, k3ref and torch
PACKET = 1 << 20      # the largest control message (a fork request carries the run's environment)


class ZygoteError(RuntimeError):
    """The fork server could not be started or stopped answering; the message says what it printed."""


# --------------------------------------------------------------------------------------------------------------
# the server


class _Server:
    def __init__(self, ctrl: socket.socket):
        self.ctrl = ctrl
        self.workers: dict[int, int | None] = {}   # pid -> exit status once reaped (None while it runs)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)   # a handler, so SIGCHLD reaches the wakeup fd

    def send(self, message: dict) -> None:
        self.ctrl.send(json.dumps(message).encode())

    def loop(self) -> None:
        while True:
            ready = select.select([self.ctrl.fileno(), self.wake_r], [], [])[0]
            if self.wake_r in ready:
                os.read(self.wake_r, 4096)
                self.reap()
            if self.ctrl.fileno() in ready:
                try:
                    data, fds, _, _ = socket.recv_fds(self.ctrl, PACKET, 4)
                except OSError:
                    data, fds = b"", []
                if not data:   # the run has gone: nothing may outlive it
                    self.kill_everything()
                    return
                message = json.loads(data)
                if message["op"] == "exit":
                    self.kill_everything()
                    self.send({"op": "exited"})
                    return
                self.answer(message, fds)

    def answer(self, message: dict, fds: list[int]) -> None:
        op = message["op"]
        if op == "fork":
            pid = os.fork()
            if pid == 0:
                self.become_worker(message, fds[0])   # never returns
            for fd in fds:
                os.close(fd)
            self.workers[pid] = None
            self.send({"op": "forked", "pid": pid})
        elif op == "stop":
            pid = int(message["pid"])
            members = [(p, command_line(p)) for p in group_members(pid, exclude=pid)]
            kill(pid, group=True)
            kill(pid)
            status = self.wait_for(pid)
            left = [{"pid": p, "command": c, "how": "in its process group"} for p, c in members]
            left += [dict(e, how="escaped its process group") for e in self.sweep()]
            self.send({"op": "stopped", "pid": pid, "status": status, "left": left})
        elif op == "sweep":
            self.send({"op": "swept", "left": [dict(e, how="escaped its process group") for e in self.sweep()]})
        else:
            self.send({"op": "error", "message": f"unknown request {op!r}"})

    def become_worker(self, message: dict, fd: int) -> None:
        code = 0
        try:
            parent = os.getppid()
            os.setsid()
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:   # the server died between the fork and the request
                os._exit(1)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            for own in (self.ctrl.fileno(), self.wake_r, self.wake_w):
                os.close(own)
            os.environ.clear()
            os.environ.update(message["env"])
            os.chdir(message["cwd"])
            sys.path[:] = message["path"]
            worker.serve(fd)
        except BaseException:  # noqa: BLE001 - the worker ends here whatever happened; the run reads the status
            code = 1
        finally:
            os._exit(code)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.workers and self.workers[pid] is None:
                code = os.waitstatus_to_exitcode(status)
                self.workers[pid] = code
                self.send({"op": "died", "pid": pid, "status": code})

    def wait_for(self, pid: int) -> int | None:
        """The exit status of worker `pid` once it has ended (it was just killed)."""
        if self.workers.get(pid) is not None:
            return self.workers.pop(pid)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:   # reaped by reap() in the meantime: its status was sent as `died`
            return self.workers.pop(pid, None)
        self.workers.pop(pid, None)
        return os.waitstatus_to_exitcode(status)

    def sweep(self) -> list[dict]:
        """Kill every child of the server that is not a running worker (processes that escaped a worker's group
        and were re-parented here), until none is left; their pids and command lines."""
        left: list[dict] = []
        seen: set[int] = set()
        for _ in range(SWEEP_ROUNDS):
            self.reap()
            strays = [p for p in children_of(os.getpid()) if p not in self.workers and p not in seen]
            if not strays:
                if not left or not any(children_of(p) for p in seen):
                    break
            for p in strays:
                left.append({"pid": p, "command": command_line(p)})
                seen.add(p)
                kill(p, group=True)
                kill(p)
            time.sleep(SWEEP_PAUSE)
        self.reap_all_strays()
        return left

    def reap_all_strays(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.workers and self.workers[pid] is None:   # a worker that died meanwhile
                self.workers.pop(pid)

    def kill_everything(self) -> None:
        for pid in list(self.workers):
            kill(pid, group=True)
            kill(pid)
        self.sweep()


def _preload() -> None:
    """torch, imported once here (when installed) so that a torch backend's worker starts ready."""
    try:
        import torch  # noqa: F401, PLC0415 -- optional: the torch baselines' workers start without the import
    except ImportError:
        pass


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print(f"usage: python -m conformance.isolation.zygote CTRL_FD (found {argv})", file=sys.stderr)
        return 2
    ctrl = socket.socket(fileno=int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is for the run, which stops the server itself
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)   # the run died without a word: kill the workers, then go

    def stop(_signum, _frame) -> None:
        server.kill_everything()
        os._exit(0)

    server = _Server(ctrl)
    signal.signal(signal.SIGTERM, stop)
    os.dup2(2, 1)   # anything printed goes to stderr, which the run copies to its own
    _preload()
    server.send({"op": "ready", "pid": os.getpid()})
    server.loop()
    return 0


# --------------------------------------------------------------------------------------------------------------
# the run's side


class Zygote:
    """The run's handle on its fork server (see the module docstring). `dead` maps the pid of every worker that
    ended on its own to its exit status (a negative number: killed by that signal)."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out_r, out_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "conformance.isolation.zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w,
                start_new_session=True, cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": _python_path()})
        finally:
            theirs.close()
            os.close(out_w)
        self.ctrl = mine
        self.owner = os.getpid()   # a child forked from this process must not use (or stop) this server
        self.dead: dict[int, int | None] = {}
        self.lost = ""             # why the server stopped before it was closed ('' while it serves)
        self._out = out_r
        self._tail = bytearray()   # the last bytes it printed, for an error when it fails to start
        threading.Thread(target=self._copy_output, name="k3conf-zygote-output", daemon=True).start()
        self.ready = False

    def _copy_output(self) -> None:
        """What the server and the workers print, onto this process's stderr as it comes."""
        while True:
            try:
                chunk = os.read(self._out, 65536)
            except OSError:
                return
            if not chunk:
                os.close(self._out)
                return
            self._tail = (self._tail + chunk)[-4000:]
            try:
                sys.stderr.write(chunk.decode("utf-8", "replace"))
                sys.stderr.flush()
            except (OSError, ValueError):   # a closed stderr (the interpreter shutting down): drop the text
                pass

    def fileno(self) -> int:
        return self.ctrl.fileno()

    def owned(self) -> bool:
        """False in a child forked from the process that started the server: that server is its parent's."""
        return self.owner == os.getpid()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and self.ctrl.fileno() >= 0

    def _receive(self, timeout: float | None) -> dict | None:
        """One message from the server (None when none came within `timeout`); ZygoteError when it is gone."""
        if timeout is not None and not select.select([self.ctrl], [], [], max(timeout, 0.0))[0]:
            return None
        try:
            data = self.ctrl.recv(PACKET)
        except OSError as e:
            raise self._gone(f"its socket failed ({e})") from None
        if not data:
            raise self._gone("it closed its socket")
        message = json.loads(data)
        if message.get("op") == "died":
            self.dead[int(message["pid"])] = message.get("status")
        return message

    def _gone(self, what: str) -> ZygoteError:
        self.lost = self.lost or what
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        said = bytes(self._tail).decode("utf-8", "replace").strip()[-1500:]
        return ZygoteError(f"the worker server (python -m conformance.isolation.zygote, pid {self.proc.pid}) "
                           f"stopped: {what}; exit status {self.proc.returncode}" + (f"; it printed: {said}" if said
                                                                                     else ""))

    def _reply(self, op: str, limit: float) -> dict:
        deadline = time.monotonic() + limit
        while True:
            message = self._receive(deadline - time.monotonic())
            if message is None:
                raise ZygoteError(f"the worker server (pid {self.proc.pid}) gave no {op!r} answer within {limit:g} s")
            if message.get("op") == op:
                return message
            if message.get("op") == "error":
                raise ZygoteError(f"the worker server refused a request: {message.get('message')}")

    def _ready(self) -> None:
        if not self.ready:
            self._reply("ready", START_LIMIT)
            self.ready = True

    def pump(self) -> None:
        """Read the messages the server sent unasked (deaths) without waiting."""
        while self._receive(0.0) is not None:
            pass

    def fork(self, sock: socket.socket) -> int:
        """A new worker serving on `sock` (given away: closed here); its pid."""
        self._ready()
        env = {**os.environ, WORKER_MARK: str(os.getpid())}
        message = {"op": "fork", "env": env, "cwd": os.getcwd(), "path": list(sys.path)}
        try:
            socket.send_fds(self.ctrl, [json.dumps(message).encode()], [sock.fileno()])
        finally:
            sock.close()
        return int(self._reply("forked", START_LIMIT)["pid"])

    def stop(self, pid: int) -> tuple[int | None, list[dict]]:
        """Kill worker `pid` and its process group; (its exit status, the processes that were left running)."""
        self.ctrl.send(json.dumps({"op": "stop", "pid": pid}).encode())
        reply = self._reply("stopped", START_LIMIT)
        self.dead.pop(pid, None)
        return reply.get("status"), list(reply.get("left") or [])

    def sweep(self) -> list[dict]:
        self.ctrl.send(json.dumps({"op": "sweep"}).encode())
        return list(self._reply("swept", START_LIMIT).get("left") or [])

    def close(self) -> None:
        """Kill every worker and escaped process, then end the server (idempotent)."""
        if self.proc.poll() is None:
            try:
                self.ctrl.send(json.dumps({"op": "exit"}).encode())
                self._reply("exited", 10.0)
            except (OSError, ZygoteError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.ctrl.close()


def _python_path() -> str:
    """PYTHONPATH for the server: the folder this package is imported from first, so that a checkout run
    without installing (`python -m conformance` in the repository) starts the same code."""
    here = str(Path(__file__).resolve().parents[2])
    rest = os.environ.get("PYTHONPATH", "")
    return here + (os.pathsep + rest if rest else "")


_SHARED: list[Zygote] = []
_LOCK = threading.Lock()


def shared() -> Zygote:
    """This process's fork server, started on first use (and again if it died); stopped when the process exits."""
    with _LOCK:
        if _SHARED and _SHARED[0].owned() and _SHARED[0].alive:
            return _SHARED[0]
        if _SHARED:
            old = _SHARED.pop()
            if old.owned():
                old.close()
        _SHARED.append(Zygote())
        return _SHARED[0]


def _close_shared() -> None:
    while _SHARED:
        z = _SHARED.pop()
        if z.owned():
            z.close()


atexit.register(_close_shared)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
