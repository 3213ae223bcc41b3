"""The engine-shaped KDA cores' cases through the judge: the reference passes them, each known pool / padding /
packing mistake (conformance.backends.mutants_kda) fails its block's tiny cases and is named there first.

The goldens are generated into a temporary directory from the case table (the committed ones may not exist yet
or may be older than the table), and the mutants run in this process under a `mutant:<name>` registered for the
test.
"""
from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import registry
from conformance.backends.mutants import Mutant
from conformance.backends.mutants_kda import ENGINE_MUTANTS
from conformance.cases.catalog import all_cases, select
from conformance.cases.core import CORE_SPECS
from conformance.cases.engine_kda import TABLE
from conformance.golden.regen import regenerate
from conformance.runner import IN_PROCESS, run

BLOCKS = ("kda_decode_pool", "kda_conv_pool", "kda_prefill_varlen")
# a mutant must miss the golden by far more than any precision's budget (the loosest, bf16, caps at 5e-2)
MIN_MUTANT_ERROR = 0.1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the tiny cases of the three blocks, the directory of their freshly generated goldens)."""
    cases = select(all_cases("tiny"), [f"{b}/*" for b in BLOCKS])
    root = tmp_path_factory.mktemp("engine_kda_golden")
    assert {o.status for o in regenerate(cases, root)} == {"new"}
    return cases, root


def test_every_block_has_tiny_cases_in_both_layouts(tiny):
    cases, _ = tiny
    for block in BLOCKS:
        layouts = {c.params.get("state_layout", c.params.get("layout")) for c in cases if c.block == block}
        assert len(layouts) == 2, f"{block}: layouts {layouts}"


def test_numpy64_passes_the_engine_cases(tiny):
    cases, root = tiny
    report = run(cases, ["numpy64"], root, timing=False)
    assert report.exit_code == 0, report.first_failure_line()
    assert len(report.results) == len(cases)


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in ENGINE_MUTANTS])
def test_mutant_fails_its_block_first(tiny, monkeypatch, name):
    cases, root = tiny
    block, description, make, base, shows_on = ENGINE_MUTANTS[name]
    assert block in BLOCKS and shows_on == "tiny" and base == "numpy64"
    monkeypatch.setitem(registry.MUTANTS, name, Mutant(block, description, make, base, shows_on))
    backend = f"mutant:{name}"
    report = run(cases, [backend], root, timing=False, in_process=IN_PROCESS | {backend})
    assert report.exit_code == 1, f"{name} ({description}) passed every engine KDA case"
    first = report.first_failure
    assert first.status == "fail", first.error
    assert first.first_failing.block == block, report.first_failure_line()
    assert {r.block for r in report.failures} == {block}
    worst = max(t.comparison.rel_rms for r in report.results for t in r.tensors if t.block == block)
    assert worst > MIN_MUTANT_ERROR, f"{name}: worst relative RMS error only {worst:.3g}"


@pytest.mark.parametrize("config", ["tiny", "k3", "k3-tp8"])
def test_cases_have_padded_rows_shuffled_slots_and_junk(config):
    """The builders' traps, on every case of every set (k3 pools built at a reduced head count: same slots)."""
    for name, params in TABLE[config]:
        block = name.split("/")[0]
        if params.get("H", 0) > 3 or params.get("C", 0) > 384:
            params = {**params, "H": 1} if "H" in params else {**params, "C": 8}
        if "history" in params:
            params = {**params, "history": 2}
        inputs, _ = CORE_SPECS[block].make(np.random.default_rng(0), **params)
        slots = inputs["slots"]
        assert slots.dtype == np.int32, name
        live = slots[slots >= 0]
        assert len(set(live.tolist())) == live.size, name
        pool = inputs["state_pool" if "state_pool" in inputs else "conv_pool"]
        unused = np.setdiff1d(np.arange(pool.shape[0]), live)
        if unused.size:   # junk at the live entries' size: finite, not zeros, not a copy of a live slot
            junk, real = pool[unused], pool[live] if live.size else pool[unused]
            assert np.all(np.isfinite(junk)) and 0.5 < np.std(junk) / np.std(real) < 2, name
            assert not any(np.array_equal(j, r) for j in junk for r in pool[live]), name
        if "cu_seqlens" in inputs:
            assert inputs["cu_seqlens"].dtype == np.int32 and inputs["cu_seqlens"][-1] == inputs["q"].shape[1]
        if "padded" in params and params["padded"]:
            assert np.all(slots[list(params["padded"])] == -1), name
