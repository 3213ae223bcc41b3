"""Durable writes into a golden directory (POSIX): staged files, atomic renames, the directory lock, and
signals held back while a set of renames lands.

A file is written and fsynced before it takes its name, so a crash never leaves half a file under a real
name. On Linux the bytes wait in an unnamed O_TMPFILE inode; elsewhere (or on a file system without it)
in a '.<name>.<random>.tmp' file next to the target, which a SIGKILL can leave behind (`temporaries`
finds those). Nothing here knows what a golden is.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from conformance.golden.errors import GoldenError

TMP_SUFFIX = ".tmp"
# '.<target name>.<random>.tmp': the random part (mkstemp's, or urandom hex) holds no dot
_TEMP_NAME = re.compile(r"\.(?P<target>.+)\.[^.]+" + re.escape(TMP_SUFFIX))
_AT_FDCWD, _AT_SYMLINK_FOLLOW = -100, 0x400


class RegenBusy(GoldenError):
    """Another regeneration holds the golden directory's lock."""


def _file_mode() -> int:
    """0o666 less the process umask: what open() would give a new file (mkstemp's files are 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def temporaries(root: Path, target: re.Pattern[str]) -> list[Path]:
    """Temporary files an interrupted writer left under `root` for targets whose names match `target` (a
    killed process cannot remove its own)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.rglob("." + "*" + TMP_SUFFIX):
        name = _TEMP_NAME.fullmatch(path.name)
        if path.is_file() and name is not None and target.fullmatch(name["target"]):
            found.append(path)
    return sorted(found)


class Staged:
    """A file written and fsynced but not yet in place; `commit()` renames it over `path`.

    On Linux the data lives in an unnamed O_TMPFILE inode until the commit, so a process killed before
    then leaves nothing behind; elsewhere a '.<name>.<random>.tmp' file next to `path`, removed on any
    exception (a SIGKILL leaves it; the next regen removes it, `regen --check` lists it).
    """

    def __init__(self, path: Path, blob: bytes):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd, self.tmp = self._open()
        try:
            os.fchmod(self.fd, _file_mode())
            view = memoryview(blob)
            while view:
                view = view[os.write(self.fd, view):]
            os.fsync(self.fd)
        except BaseException:
            self.discard()
            raise

    def _open(self) -> tuple[int, Path | None]:
        if sys.platform == "linux" and Path("/proc/self/fd").is_dir():
            try:
                return os.open(self.path.parent, os.O_TMPFILE | os.O_WRONLY, 0o600), None
            except OSError:
                pass   # a file system without O_TMPFILE: a named temporary file instead
        fd, tmp = tempfile.mkstemp(prefix="." + self.path.name + ".", suffix=TMP_SUFFIX, dir=self.path.parent)
        return fd, Path(tmp)

    def commit(self) -> None:
        while self.tmp is None:   # give the unnamed inode a name, then move it over the target in one rename
            tmp = self.path.with_name(f".{self.path.name}.{os.urandom(6).hex()}{TMP_SUFFIX}")
            try:
                _link_follow(f"/proc/self/fd/{self.fd}", tmp)
            except FileExistsError:
                continue
            self.tmp = tmp
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        finally:
            self.tmp = None
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)


def _link_follow(src: str, dst: Path) -> None:
    """linkat(src, dst, AT_SYMLINK_FOLLOW): os.link calls link(2), which would link the /proc symlink itself
    instead of the O_TMPFILE inode it points at (open(2) documents this linkat call for O_TMPFILE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(str(dst)), _AT_SYMLINK_FOLLOW) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(dst))


def _fsync_dir(path: Path) -> None:
    """Make renames in `path` durable (a power cut after the rename keeps the new name)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, blob: bytes) -> None:
    """Write blob to a temporary file next to `path`, fsync it, then rename it into place.

    The file gets the usual permissions (0o644 under umask 022), not mkstemp's owner-only 0o600: goldens
    and their manifest are shared data that other users and CI jobs must be able to read.
    """
    staged = Staged(Path(path), blob)
    try:
        staged.commit()
    finally:
        staged.discard()
    _fsync_dir(Path(path).parent)


@contextlib.contextmanager
def regen_lock(root: Path, wait: bool = True, shared: bool = False) -> Iterator[None]:
    """Hold an exclusive flock on the golden directory itself while regenerating into it.

    Two regenerations into one directory would each write the manifest from what they read, and the
    later one would drop the other's entries. The second waits (wait=True, saying so on stderr) or
    raises RegenBusy. The lock is on the directory's own descriptor: no lock file to leave behind, and
    the kernel drops it when the holder dies, even by SIGKILL. shared: a reader's lock (`--check`), which
    only waits for a writer to finish its renames.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise RegenBusy(f"{root}: another `k3conf regen` is writing this golden directory; wait for it to "
                                "finish, then rerun") from None
            print(f"k3conf regen: waiting for another regeneration writing {root} to finish", file=sys.stderr)
            fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold back Ctrl-C / SIGTERM / SIGHUP while the files and the manifest are renamed into place (a few
    milliseconds), so that an interrupt lands before the commit or after it, never inside it.

    The Python handlers are swapped for ones that only record the signal, then the first recorded one is
    re-sent once the commit is done. (Masking the signals would not do: the kernel hands a process signal
    to any thread not masking it, BLAS worker threads included.)"""
    if threading.current_thread() is not threading.main_thread():   # handlers can only be set from there
        yield
        return
    got: list[int] = []
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            os.kill(os.getpid(), got[0])
