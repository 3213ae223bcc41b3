"""Kernels written to cheat the judge, one backend each, loaded by file path (`--backend .../hostile.py:NAME`) by
tests/conformance/test_sealed.py. Each is an rmsnorm one percent off (the answer of a kernel that is wrong) that
then tries to pass anyway: by finding the expected outputs in its process (a walk up the stack, the garbage
collector's objects), by rewriting the judge when its module is imported, by forging the worker's reply, or by
doing its work only when it is not timed. A few are right in value and misbehave otherwise: a helper process
that outlives the run, a daemon that escapes its process group, a fork that keeps the worker's socket, a change
of working directory. Whatever they find, they can only win by changing the run's verdict; the judge must keep
them all from it."""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from conformance.backends.builtin import NumpyBackend
from conformance.golden.store import COMMITTED_ROOT, read_golden
from k3ref.cores import reference_cores

_REF = reference_cores()
_GOLDEN_X = read_golden(COMMITTED_ROOT, "rmsnorm/T1-D113").tensors["inputs.x"]


def _one_percent_off(x, w, eps):
    y = np.asarray(_REF.rmsnorm(x, w, eps))
    sign = np.where(np.random.default_rng(y.size).random(y.shape) < 0.5, -1.0, 1.0)
    return (y * (1.0 + 0.01 * sign)).astype(y.dtype)


def _as_answer(found, like: np.ndarray):
    """`found` if it can stand for rmsnorm's output `like` (same shape), else None."""
    if isinstance(found, np.ndarray) and found.shape == like.shape and found.dtype.kind == "f":
        return found.astype(like.dtype)
    return None


def _expected_in(obj, like: np.ndarray):
    """The expected output of the call, if `obj` holds one: a golden (outputs.y), an outputs dict, an array."""
    try:
        group = getattr(obj, "group", None)
    except Exception:  # noqa: BLE001 - some objects load things when asked for an attribute: not what is looked for
        return None
    if callable(group):
        try:
            return _as_answer(group("outputs").get("y"), like)
        except Exception:  # noqa: BLE001 - a probe looks everywhere and ignores what does not fit
            return None
    if isinstance(obj, dict):
        for key in ("outputs.y", "y"):
            answer = _as_answer(obj.get(key), like)
            if answer is not None:
                return answer
    return None


def _stack_walker(x, w, eps):
    """Walks up the stack to any local named golden, outputs, want or ref and answers with it."""
    mine = _one_percent_off(x, w, eps)
    frame = sys._getframe(1)
    while frame is not None:
        for name in ("golden", "outputs", "want", "ref", "expected"):
            if name in frame.f_locals:
                answer = _expected_in(frame.f_locals[name], mine)
                if answer is not None:
                    return answer
        frame = frame.f_back
    return mine


def _gc_memoriser(x, w, eps):
    """Looks through every object the garbage collector tracks for a golden holding this call's answer."""
    mine = _one_percent_off(x, w, eps)
    for obj in gc.get_objects():
        answer = _expected_in(obj, mine)
        if answer is not None and not np.array_equal(answer, mine):
            return answer
    return mine


def _fresh_reader(x, w, eps):
    """Reads any golden file it finds under the temporary folder (where fresh draws were once written) and answers
    with the one whose inputs are this call's."""
    mine = _one_percent_off(x, w, eps)
    for path in Path(tempfile.gettempdir()).rglob("rmsnorm/*.safetensors"):
        try:
            tensors = load_file(str(path))
        except Exception:  # noqa: BLE001 - a probe reads what it can
            continue
        if np.array_equal(tensors.get("inputs.x"), x):
            return tensors["outputs.y"].astype(mine.dtype)
    return mine


def _timing_only_cheat(x, w, eps):
    """Right when judged, lazy when a frame on its stack looks like a timer's."""
    frame = sys._getframe(1)
    while frame is not None:
        if "tim" in frame.f_code.co_name.lower():
            return np.empty_like(np.asarray(x))
        frame = frame.f_back
    return _REF.rmsnorm(x, w, eps)


def _leaves_a_helper(x, w, eps):
    """Right, and starts a helper that holds the worker's stdout and stderr far past the run."""
    subprocess.Popen(["sleep", "47"])
    return _REF.rmsnorm(x, w, eps)


def _leaves_a_daemon(x, w, eps):
    """Right, and starts a daemon in a session of its own (out of the worker's process group)."""
    subprocess.Popen(["sleep", "48"], start_new_session=True)
    return _REF.rmsnorm(x, w, eps)


def _forks_then_exits(x, w, eps):
    """On the golden's inputs of rmsnorm/T1-D113 (so that the start-up check meets an ordinary core): forks a child
    that keeps the worker's socket open, then ends the worker with status 3."""
    if not (np.shape(x) == _GOLDEN_X.shape and np.array_equal(x, _GOLDEN_X)):
        return _REF.rmsnorm(x, w, eps)
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    os._exit(3)


def _kills_the_server(x, w, eps):
    """On the golden's inputs: starts a daemon in a session of its own, then kills its worker's parent (the fork
    server) so that nothing is left to find the daemon."""
    if not (np.shape(x) == _GOLDEN_X.shape and np.array_equal(x, _GOLDEN_X)):
        return _REF.rmsnorm(x, w, eps)
    subprocess.Popen(["sleep", "49"], start_new_session=True)
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(30)
    return _REF.rmsnorm(x, w, eps)


def _changes_directory(x, w, eps):
    """Right, after moving the process to another working directory (as libraries that load code may)."""
    os.chdir("/")
    return _REF.rmsnorm(x, w, eps)


def _forger(x, w, eps):
    """Finds the worker's socket and writes a reply of its own: a 1%-off answer, a note holding markup and a
    malformed field, under the number of the request being answered."""
    for obj in gc.get_objects():
        if type(obj).__name__ == "Serving" and hasattr(obj, "fd"):
            y = _one_percent_off(x, w, eps)
            from safetensors.numpy import save  # noqa: PLC0415 -- a probe imports what it needs where it cheats
            head = json.dumps({"op": "result", "seq": obj.seq, "out": {"$a": "p0"}, "seconds": -1,
                               "notes": ["<script>alert(1)</script>"], "info": {"flips": [{"step": "x"}]}}).encode()
            blob = save({"p0": np.ascontiguousarray(y)})
            os.write(obj.fd, len(head).to_bytes(8, "big") + head + len(blob).to_bytes(8, "big") + blob)
            return y
    return _one_percent_off(x, w, eps)


def _backend(name: str, rmsnorm) -> NumpyBackend:
    return NumpyBackend(name, "fp64", make_cores=lambda: reference_cores().replace(rmsnorm=rmsnorm))


STACK_WALKER = _backend("stack-walker", _stack_walker)
GC_MEMORISER = _backend("gc-memoriser", _gc_memoriser)
FRESH_READER = _backend("fresh-reader", _fresh_reader)
TIMING_ONLY = _backend("timing-only", _timing_only_cheat)
HELPER = _backend("helper-process", _leaves_a_helper)
DAEMON = _backend("escaped-daemon", _leaves_a_daemon)
FORK_EXIT = _backend("fork-then-exit", _forks_then_exits)
CHDIR = _backend("changes-directory", _changes_directory)
SERVER_KILLER = _backend("server-killer", _kills_the_server)
FORGER = _backend("forger", _forger)


class _ScriptReason(NumpyBackend):
    def available(self) -> tuple[bool, str]:
        return False, "<script>alert('reason')</script> [bold]not here[/bold]"


SCRIPT_REASON = _ScriptReason("script-reason", "fp64")
ONE_PERCENT_OFF = _backend("one-percent-off", _one_percent_off)
