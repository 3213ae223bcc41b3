"""Fixtures shared by the judge's tests."""
from __future__ import annotations

import pytest

from conformance.backends import registry as backends


@pytest.fixture
def extra_backend(monkeypatch):
    """register(name, factory): a backend in the registry for the duration of one test, built afresh. It is defined
    in the test's process only, so the run builds it there (registry.IN_PROCESS) instead of in a worker process:
    a test of isolation loads its backend from a file (tests/conformance/untrusted/)."""
    registered: list[str] = []

    def register(name, factory):
        monkeypatch.setitem(backends.BACKENDS, name, factory)
        monkeypatch.delitem(backends._CACHE, name, raising=False)
        monkeypatch.setattr(backends, "IN_PROCESS", backends.IN_PROCESS | {name})
        registered.append(name)

    yield register
    for name in registered:   # the backend built during the test must not outlive its registration
        backends._CACHE.pop(name, None)
