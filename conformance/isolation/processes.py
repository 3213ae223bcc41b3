"""The processes around a worker, as /proc shows them (Linux; elsewhere nothing is found): a group's members, a
process's children, command lines; and what a process that holds answers does to keep the others out of it.

The fork server (conformance.isolation.zygote) uses these to name and kill what a worker left running; `k3conf run`
calls guard_this_process, and sweep_orphans when a kernel killed the fork server.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

# linux/prctl.h
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
SWEEP_ROUNDS = 50     # escaped processes re-parent one generation at a time: look again this many times
SWEEP_PAUSE = 0.02
WORKER_MARK = "K3CONF_WORKER_OF"   # in every worker's environment: the pid of the run it serves


def prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (AttributeError, OSError):   # not Linux
        return False


def stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, process group) of `pid` from /proc, None when it is gone, a zombie or unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()   # after the command name, which may hold spaces and ')'
    if fields[0] == "Z":   # a zombie has ended; only its parent's wait is missing
        return None
    return int(fields[1]), int(fields[2])


def _pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def command_line(pid: int) -> str:
    """The command line of `pid` as `ps` shows it (bounded), or '?' when it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    return (text[:200] + "...") if len(text) > 200 else (text or "?")


def group_members(pgid: int, exclude: int) -> list[int]:
    """Live processes of process group `pgid` other than `exclude`."""
    found = []
    for pid in _pids():
        st = stat(pid)
        if st is not None and st[1] == pgid and pid != exclude:
            found.append(pid)
    return found


def children_of(parent: int) -> list[int]:
    """Live processes whose parent is `parent`."""
    found = []
    for pid in _pids():
        st = stat(pid)
        if st is not None and st[0] == parent:
            found.append(pid)
    return found


def kill(pid: int, group: bool = False) -> None:
    """SIGKILL to `pid` (or its process group); nothing when it is gone or not ours."""
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def guard_this_process() -> None:
    """For a process that runs kernels and holds answers (`k3conf run`): another process of the same user may not
    read its memory through /proc or ptrace (not dumpable), and a process orphaned by a killed fork server is
    re-parented here (a child subreaper), where sweep_orphans finds it. Linux; elsewhere nothing changes."""
    prctl(PR_SET_DUMPABLE, 0)
    prctl(PR_SET_CHILD_SUBREAPER, 1)


def _mark_of(pid: int) -> bool | None:
    """Whether `pid`'s environment carries this process's worker mark (WORKER_MARK=<this pid>); None while it cannot
    be read (a process on its way out)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    if not environ:
        return None
    return f"{WORKER_MARK}={os.getpid()}".encode() in environ.split(b"\0")


def sweep_orphans(workers: list[int], wait: float = 1.0) -> list[dict]:
    """Kill the children of this process that came from its workers (their environment carries the mark every
    worker is given): processes orphaned when a fork server died, re-parented here by guard_this_process. The dead
    server's `workers` (and their process groups) are killed first, and the children that come here are looked for
    during `wait` seconds (each is re-parented as the process above it dies); their pids and command lines. A
    process that cleared its environment is not found."""
    found: list[dict] = []
    deadline = time.monotonic() + wait
    for pid in workers:
        kill(pid, group=True)
        kill(pid)
    while any(stat(pid) is not None for pid in workers) and time.monotonic() < deadline:
        time.sleep(SWEEP_PAUSE)
    while True:
        seen = {f["pid"] for f in found}
        marks = {p: _mark_of(p) for p in children_of(os.getpid()) if p not in seen}
        for p in (p for p, mark in marks.items() if mark):
            found.append({"pid": p, "command": command_line(p), "how": "orphaned by the worker server's death"})
            kill(p, group=True)
            kill(p)
        if time.monotonic() > deadline:   # re-parenting races the workers' deaths: look for the whole time
            break
        time.sleep(SWEEP_PAUSE)
    for f in found:
        try:
            os.waitpid(f["pid"], os.WNOHANG)
        except ChildProcessError:
            pass
    return found
