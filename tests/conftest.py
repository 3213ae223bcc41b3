"""Shared test setup: the hypothesis CI profile, the machine requirements of marked tests, small fixtures."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from conformance.session import SessionError
from tests.support.strict import require, strict

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=400)
# The hostile-input suites (fuzzed goldens, shards, indexes, configs): a few hundred examples even in CI,
# since each failure they exist to catch is one odd input among many.
settings.register_profile("hostile-inputs", deadline=None, derandomize=True, max_examples=200,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REQUIREMENT_MARKERS = ("torch", "nvcc", "gxx")


def pytest_configure(config):
    """A K3_STRICT value that is neither strict nor not (conformance.session.strict) stops the run before any test,
    as it stops `k3conf run`: guessing would either skip what CI must run or fail what it need not."""
    try:
        strict()
    except SessionError as e:
        raise pytest.UsageError(str(e)) from None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test marked torch / nvcc / gxx is skipped with the reason when that is missing, and fails under
    K3_STRICT=1 (tests/support/strict.py). tryfirst: before any skipif of the test itself."""
    for marker in REQUIREMENT_MARKERS:
        if item.get_closest_marker(marker) is not None:
            require(marker)


@pytest.fixture
def rng() -> np.random.Generator:
    """A fixed-seed generator; tests that need several draw from one."""
    return np.random.default_rng(20261202)
