"""The mutation table: each known mistake, run through the runner, must FAIL and name its block first.

Every mutant is numpy64 with one core replaced by a deliberately wrong one (conformance.backends.MUTANTS).
A mutant that passed would mean the cases' data cannot see that bug; a first failure in another block
would mean the report points the kernel engineer at the wrong kernel.
"""
from __future__ import annotations

import pytest

from conformance.backends import MUTANTS
from conformance.cases import all_cases
from conformance.goldens import COMMITTED_ROOT
from conformance.runner import run


@pytest.fixture(scope="module")
def cases():
    return all_cases("tiny")


@pytest.mark.parametrize("mutant", [pytest.param(name, id=name) for name in MUTANTS])
def test_mutant_fails_in_its_block_first(cases, mutant):
    report = run(cases, [f"mutant:{mutant}"], COMMITTED_ROOT, timing=False)
    assert report.exit_code == 1, f"mutant {mutant} ({MUTANTS[mutant].description}) passed every case"
    first = report.first_failure
    assert first.status == "fail", first.error
    assert first.first_failing.block == MUTANTS[mutant].block, report.first_failure_line()
    assert f"(block {MUTANTS[mutant].block})" in report.first_failure_line()
    # the failures are confined to blocks that call the mutated core (model traces run every block)
    touched = {r.block for r in report.failures} - {"trace"}
    assert touched <= {MUTANTS[mutant].block, "kda_prefill", "latent_moe"}, touched


def test_unmutated_numpy64_passes_the_same_cases(cases):
    report = run(cases, ["numpy64"], COMMITTED_ROOT, timing=False)
    assert report.exit_code == 0, report.first_failure_line()


# A mutant must fail by far more than any precision's error budget of the per-block cases, so that their data
# exposes the bug at every precision (the loosest cap of those rows is the bf16 one, 5e-2). The model-trace rows
# at bf16 are looser (baseline-relative only, cap 2: a router near-tie flips an expert; conformance/traces.py):
# at bf16 the traces locate a mistake, the per-block cases are what catch it.
MIN_MUTANT_ERROR = 0.1


@pytest.mark.parametrize("mutant", [pytest.param(name, id=name) for name in MUTANTS])
def test_mutant_error_is_far_above_every_budget(cases, mutant):
    block = MUTANTS[mutant].block
    report = run([c for c in cases if c.block in (block, "trace")], [f"mutant:{mutant}"], COMMITTED_ROOT,
                 timing=False)
    worst = max(t.comparison.rel_rms for r in report.results for t in r.tensors if t.block == block)
    assert worst > MIN_MUTANT_ERROR, f"{mutant}: worst relative RMS error only {worst:.3g} in {block}"
