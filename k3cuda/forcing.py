"""Which kernel entry a wrapper must launch instead of the one it would pick (set by k3cuda.force_entry).

A module of its own, importing nothing of k3cuda, so that the wrappers (which read the choice) and the package
(which validates it against the wrappers' CHOOSABLE_ENTRIES) both import it without importing each other.
"""
from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Iterator, Mapping

# block -> entry forced in this context (a contextvar: threads and tasks do not leak it); read-only mapping, so
# the shared default can never be changed in place
_FORCED: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
    "k3cuda_forced_entries", default=types.MappingProxyType({}))


@contextlib.contextmanager
def forcing(block: str, entry: str) -> Iterator[None]:
    """Inside the `with`, forced_entry(block) answers `entry` (no check: k3cuda.force_entry checks the name)."""
    token = _FORCED.set(types.MappingProxyType({**_FORCED.get(), block: entry}))
    try:
        yield
    finally:
        _FORCED.reset(token)


def forced_entry(block: str) -> str | None:
    """The entry forced for `block` in this context, else None (the wrapper picks)."""
    return _FORCED.get().get(block)


def forced_entries() -> Mapping[str, str]:
    """Every entry forced in this context, block -> entry (what another process must force to run the same)."""
    return _FORCED.get()
