"""Conformance of every committed case on every CPU backend (ids = case names: `pytest -k kda`).

A backend that cannot run here (torch missing, ...) is skipped with its reason (a failure under K3_STRICT=1).
A result that is n/a (the backend supplies none of the case's cores) or skipped (UnsupportedShape) is a skip
here too, with its reason. The same check runs
from the command line as `k3conf run`; this file puts it in the test suite, one test per (case, backend).
"""
from __future__ import annotations

import pytest

from conformance.backends.registry import get_backend
from conformance.cases.catalog import all_cases
from conformance.golden.store import COMMITTED_ROOT, read_golden
from conformance.runner import run
from conformance.session import strict

CPU_BACKENDS = {"numpy64": (), "numpy32": (), "torch": (pytest.mark.torch,), "torch-bf16": (pytest.mark.torch,),
                "torch64": (pytest.mark.torch,), "cuda-emu": ()}

PARAMS = [pytest.param(case, backend, id=f"{case.name}-{backend}", marks=marks)
          for case in all_cases("tiny") for backend, marks in CPU_BACKENDS.items()]


@pytest.mark.parametrize("case, backend", PARAMS)
def test_case_passes_its_gates(case, backend):
    ok, why = get_backend(backend).available()
    if not ok:
        (pytest.fail if strict() else pytest.skip)(f"backend {backend} unavailable: {why}")
    report = run([case], [backend], COMMITTED_ROOT, timing=False)
    (result,) = report.results
    if result.status in ("skip", "n/a"):
        pytest.skip(f"{result.status}: {result.error}")
    assert result.status == "pass", report.first_failure_line()
    assert {t.tensor for t in result.tensors} == {k.split(".", 1)[1] for k in result_outputs(case)}


def result_outputs(case):
    return [k for k in read_golden(COMMITTED_ROOT, case.name).tensors if k.startswith("outputs.")]
