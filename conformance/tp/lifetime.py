"""Rank processes live no longer than the launcher that started them.

Two directions:
- the launcher, stopped by SIGINT, SIGTERM or SIGHUP, raises `TpStopped` out of whatever it is doing
  (`stop_on_signals`), so the code on the way out (`launch.spawn` kills its ranks, the work directory's
  context removes it) runs as for any other failure, and the command prints one line instead of a traceback;
- a rank whose launcher died, even by SIGKILL where nothing runs on the way out, ends by itself
  (`die_with_parent`): the kernel sends it SIGKILL when the launcher's thread that started it exits
  (PR_SET_PDEATHSIG, Linux), and a watchdog thread that polls the parent pid covers the other systems and the
  window before the request was made.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PARENT_ENV = "K3CONF_TP_PARENT"   # the launcher's pid, set in a spawned rank's environment
PARENT_POLL_S = 0.5               # how often a rank's watchdog checks that its launcher is alive
_PR_SET_PDEATHSIG = 1             # linux/prctl.h


class TpStopped(Exception):
    """The launcher was asked to stop by a signal; every rank has been ended on the way out."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}: every rank ended, work directory removed")

    @property
    def exit_code(self) -> int:
        """128 + the signal number, the shell's convention for a process ended by a signal."""
        return 128 + self.signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise TpStopped; further ones are ignored until the block
    is left, so the cleanup the first one started is not cut short. A signal the process ignores already
    (SIGHUP under nohup) stays ignored. Handlers can only be set in the main thread: elsewhere nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    caught = [s for s, h in previous.items() if h is not signal.SIG_IGN]

    def stop(signum, _frame) -> None:
        for s in caught:
            signal.signal(s, signal.SIG_IGN)
        raise TpStopped(signum)

    for s in caught:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def die_with_parent(parent: int, *, pdeathsig: bool = True) -> None:
    """End this process (exit 1) as soon as `parent` is no longer its parent.

    pdeathsig: also ask the kernel for SIGKILL when the parent dies (Linux only; a no-op elsewhere).
    """
    if pdeathsig and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent:   # the parent died before the request above: nobody will signal us
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), name="k3conf-tp-parent", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:   # re-parented: the launcher is gone and will never read our result
            os._exit(1)
