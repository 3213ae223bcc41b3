"""Model traces: layer-by-layer mode names the first failing step, layer and block; free-running passes.

Each mutant is run through the runner on the layer-by-layer trace of tiny; the first failing tensor must
sit in the block that holds the mistake, at the first layer and step where that block runs (prefill uses
the kda_prefill core and the expanded MLA form, decode the kda_decode / mla_decode cores, so a mistake in
the MLA decode core first shows at step 1; the KDA mutants replace both KDA cores).
"""
from __future__ import annotations

import re

import pytest

from conformance.cases import all_cases, select
from conformance.goldens import COMMITTED_ROOT
from conformance.runner import run
from k3ref.config import K3Config

TINY = K3Config.preset("tiny")
FIRST_KDA = min(i for i in range(TINY.num_hidden_layers) if not TINY.is_mla(i))
FIRST_MLA = min(i for i in range(TINY.num_hidden_layers) if TINY.is_mla(i))
FIRST_MOE = TINY.first_k_dense_replace
# blocks close at 0, bs, 2 bs...; the mutant closes the second block at layer 1 instead of bs
FIRST_BOUNDARY_MOVED = 1

# mutant: (block named first, step, layer)
EXPECTED = [
    pytest.param("attnres-boundary-off-by-one", "attnres_mix", 0, FIRST_BOUNDARY_MOVED, id="attnres-boundary"),
    pytest.param("kda-l2-eps-1e-12", "kda_prefill", 0, FIRST_KDA, id="kda-l2-eps"),
    pytest.param("kda-no-lower-bound", "kda_prefill", 0, FIRST_KDA, id="kda-no-lower-bound"),
    pytest.param("mla-scale-128", "mla_decode", 1, FIRST_MLA, id="mla-scale-128"),
    pytest.param("router-bias-in-weights", "latent_moe", 0, FIRST_MOE, id="router-bias"),
    pytest.param("mxfp4-nibbles-swapped", "latent_moe", 0, FIRST_MOE, id="mxfp4-nibbles"),
]


@pytest.fixture(scope="module")
def layerwise():
    return select(all_cases("tiny"), ["trace/layerwise-*"])


@pytest.mark.parametrize("mutant, block, step, layer", EXPECTED)
def test_layerwise_trace_names_step_layer_and_block(layerwise, mutant, block, step, layer):
    report = run(layerwise, [f"mutant:{mutant}"], COMMITTED_ROOT, timing=False)
    assert report.exit_code == 1, f"{mutant} passed the layer-by-layer trace"
    first = report.first_failure.first_failing
    assert first.block == block, report.first_failure_line()
    m = re.search(r"step(\d+)\.layer(\d+)", first.tensor)
    assert m and (int(m[1]), int(m[2])) == (step, layer), report.first_failure_line()
    assert f"(block {block})" in report.first_failure_line()


@pytest.mark.parametrize("backend", [pytest.param(b, id=b) for b in ("numpy64", "numpy32")])
def test_traces_pass_on_the_reference_backends(backend):
    report = run(select(all_cases("tiny"), ["trace/*"]), [backend], COMMITTED_ROOT, timing=False)
    assert report.exit_code == 0, report.first_failure_line()


def test_layerwise_isolates_a_layer_free_run_accumulates():
    """A wrong KDA core: the layerwise trace fails only inside KDA layers (each layer is fed its golden input),
    and in each of them first at the mixer output; the free run carries the error into the MLA layers too."""
    cases = select(all_cases("tiny"), ["trace/*"])
    report = run(cases, ["mutant:kda-no-lower-bound"], COMMITTED_ROOT, timing=False)
    by_case = {r.case: r for r in report.results}
    kda_layers = {i for i in range(TINY.num_hidden_layers) if not TINY.is_mla(i)}
    bad = [t for t in by_case["trace/layerwise-P7-D5"].tensors if not t.passed and t.layer is not None]
    assert {t.layer for t in bad} == kda_layers
    for layer in kda_layers:
        first = min((t for t in bad if t.layer == layer), key=lambda t: t.tensor.split(".", 2)[2])
        assert first.tensor.endswith("3_a") and first.block.startswith("kda_"), first.tensor
    bad_free = {t.layer for t in by_case["trace/free-P7-D5"].tensors if not t.passed and t.layer is not None}
    assert bad_free - kda_layers, "the free run must carry the KDA error into the MLA layers"
