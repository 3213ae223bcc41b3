"""The model traces and the LatentMoE case run a backend's engine-shaped cores (conformance.cases.engine_routes):
a backend that supplies only an engine core is judged inside the model, its mistakes show there, and a backend that
supplies the host core as well keeps running the host core."""
from __future__ import annotations

import numpy as np
import pytest

from conformance.backends import registry
from conformance.backends.external import Backend
from conformance.backends.mutants_kda import ENGINE_MUTANTS as KDA_MUTANTS
from conformance.backends.mutants_moe import ENGINE_MUTANTS as MOE_MUTANTS
from conformance.cases.catalog import all_cases, kind_of, select
from conformance.cases.engine_routes import ROUTES, TRACE_CORES, through_engine
from conformance.golden.store import COMMITTED_ROOT
from conformance.runner import IN_PROCESS, run
from k3ref import engine
from k3ref.cores import ENGINE_CORES, reference_cores

TRACE = "trace/layerwise-P7-D5"


def _wrapped(fn):
    """`fn` under another identity: a backend's own callable (the judge tells a kernel by identity)."""
    def call(*args, **kwargs):
        return fn(*args, **kwargs)
    return call


def _backend(monkeypatch, name: str, **swaps) -> str:
    """Register an fp64 backend that swaps `swaps` into the reference cores; returns its name."""
    monkeypatch.setitem(registry.BACKENDS, name,
                        lambda: Backend.from_cores(name, "fp64", lambda base: base.replace(**swaps)))
    return name


def test_an_engine_core_stands_in_for_its_host_core_only_where_the_host_core_is_not_supplied():
    ref = reference_cores()
    pool = _wrapped(engine.kda_decode_pool)
    cores, run_cores, routed = through_engine(ref.replace(kda_decode_pool=pool), {"kda_decode_pool"})
    assert routed == {"kda_decode": "kda_decode_pool"} and run_cores == {"kda_decode"}
    assert cores.kda_decode is not ref.kda_decode and cores.kda_decode_pool is pool
    cores, run_cores, routed = through_engine(ref.replace(kda_decode_pool=pool), {"kda_decode", "kda_decode_pool"})
    assert routed == {} and run_cores == {"kda_decode"}
    assert cores.kda_decode is ref.kda_decode and cores.kda_decode_pool is ref.kda_decode_pool   # host path kept
    _, run_cores, routed = through_engine(ref, set(ENGINE_CORES) - set(ROUTES))
    assert routed == {} and run_cores == frozenset()


def test_traces_count_the_routable_engine_cores_and_not_the_others():
    [case] = select(all_cases("tiny"), [TRACE])
    exercised = kind_of(case).cores_of(case)
    assert exercised == TRACE_CORES
    assert {"kda_decode_pool", "kda_prefill_varlen", "add_rmsnorm", "moe_experts", "mla_prefill"} <= exercised
    assert not {"kda_conv_pool", "mla_decode_fp8"} & exercised


@pytest.mark.parametrize("core, host_note", [
    ("kda_decode_pool", "kda_decode: ran through"),
    ("kda_prefill_varlen", "kda_prefill: ran through"),
    ("add_rmsnorm", "rmsnorm: ran through"),
    ("moe_experts", "routed experts: ran through"),
    ("mla_prefill", "MLA prefill attention: ran through"),
])
def test_a_backend_with_only_an_engine_core_passes_the_trace_through_it(monkeypatch, core, host_note):
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return getattr(engine, core)(*args, **kwargs)

    name = _backend(monkeypatch, f"only-{core.replace('_', '-')}", **{core: counted})
    cases = select(all_cases("tiny"), [TRACE])
    report = run(cases, [name], COMMITTED_ROOT, timing=False, in_process=IN_PROCESS | {name})
    [result] = report.results
    assert result.status == "pass", report.first_failure_line()
    assert calls, f"{core} was never called by the trace"
    assert any(n.startswith(host_note) and n.endswith(core) for n in result.notes), result.notes


@pytest.mark.parametrize("mutant, table", [("kda-pool-slot-off-by-one", KDA_MUTANTS),
                                           ("moe-experts-w13-halves-swapped", MOE_MUTANTS)])
def test_an_engine_core_mistake_fails_the_trace(monkeypatch, mutant, table):
    block = table[mutant][0]
    wrong = getattr(table[mutant][2](reference_cores()), block)
    name = _backend(monkeypatch, f"wrong-{block.replace('_', '-')}", **{block: wrong})
    cases = select(all_cases("tiny"), [TRACE])
    report = run(cases, [name], COMMITTED_ROOT, timing=False, in_process=IN_PROCESS | {name})
    assert report.exit_code == 1, f"{mutant} passed the trace through {block}"


def test_the_latent_moe_case_runs_a_fused_expert_kernel(monkeypatch):
    seen = []

    def fused(x, *args, **kwargs):
        seen.append(np.shape(x))
        return engine.moe_experts(x, *args, **kwargs)

    name = _backend(monkeypatch, "fused-experts", moe_experts=fused)   # a name no other test caches
    cases = select(all_cases("tiny"), ["latent_moe/*"])
    report = run(cases, [name], COMMITTED_ROOT, timing=False, in_process=IN_PROCESS | {name})
    assert report.exit_code == 0, report.first_failure_line()
    assert len(seen) >= len(cases)
    assert all(any("moe_experts" in n for n in r.notes) for r in report.results)
