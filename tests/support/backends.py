"""Backends a test defines in its own process (a registered factory, a mutant): the run builds them there too.

A worker process is forked from a fresh interpreter (conformance.isolation.zygote), which knows the registry as
the package defines it, not as a test changed it. A test of the runner's logic therefore names the backends it
registered as built in the run's process; a test of isolation loads its backend from a file instead
(tests/conformance/untrusted/)."""
from __future__ import annotations

from conformance.backends import registry


def built_here(monkeypatch, *names: str) -> None:
    """For this test, the run builds the backends `names` in its own process (registry.IN_PROCESS)."""
    monkeypatch.setattr(registry, "IN_PROCESS", registry.IN_PROCESS | set(names))
