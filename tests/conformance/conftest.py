"""Fixtures shared by the judge's tests."""
from __future__ import annotations

import pytest

from conformance.backends import registry as backends


@pytest.fixture
def extra_backend(monkeypatch):
    """register(name, factory): a backend in the registry for the duration of one test, built afresh."""
    registered: list[str] = []

    def register(name, factory):
        monkeypatch.setitem(backends.BACKENDS, name, factory)
        monkeypatch.delitem(backends._CACHE, name, raising=False)
        registered.append(name)

    yield register
    for name in registered:   # the backend built during the test must not outlive its registration
        backends._CACHE.pop(name, None)
