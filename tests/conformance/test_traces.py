"""Model traces: layer-by-layer mode names the first failing step, layer and block; free-running passes.

Each mutant is run through the runner on the layer-by-layer trace of tiny; the first failing tensor must
sit in the block that holds the mistake, at the first layer and step where that block runs (prefill uses
the kda_prefill core and the expanded MLA form, decode the kda_decode / mla_decode cores, so a mistake in
the MLA decode core first shows at step 1; the KDA mutants replace both KDA cores).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from conformance.cases import trace_run, traces
from conformance.cases.catalog import all_cases, select
from conformance.cases.trace_names import TraceName, layer_of
from conformance.cases.trace_run import route_margin
from conformance.cases.traces import TIE_MARGIN
from conformance.golden.errors import GoldenError
from conformance.golden.store import COMMITTED_ROOT, read_golden
from conformance.judge import gate_table, gates, measured
from conformance.judge.gate_row import BASELINE_FACTOR
from conformance.runner import run
from k3ref.config import K3Config
from k3ref.cpu_forward import final_logits

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
    and in each of them first at the mixer output; the free run carries the error into the MLA layers too,
    where it is reported (above the bound), not gated: the free run fails on its logits."""
    cases = select(all_cases("tiny"), ["trace/*"])
    report = run(cases, ["mutant:kda-no-lower-bound"], COMMITTED_ROOT, timing=False)
    by_case = {r.case: r for r in report.results}
    kda_layers = {i for i in range(TINY.num_hidden_layers) if not TINY.is_mla(i)}
    bad = [t for t in by_case["trace/layerwise-P7-D5"].tensors if not t.passed and t.layer is not None]
    assert {t.layer for t in bad} == kda_layers
    for layer in kda_layers:
        first = min((t for t in bad if t.layer == layer), key=lambda t: t.tensor.split(".", 2)[2])
        assert first.tensor.endswith("3_a") and first.block.startswith("kda_"), first.tensor
    free = by_case["trace/free-P7-D5"]
    above = {t.layer for t in free.tensors if not t.verdict.passed and t.layer is not None}
    assert above - kda_layers, "the free run must carry the KDA error into the MLA layers"
    assert all(not t.gated for t in free.tensors if t.layer is not None)
    assert free.status == "fail" and free.first_failing.tensor.endswith(".logits")


# ---- discrete choices: greedy tokens and routes


def _flip_at(monkeypatch, step: int):
    """The final logits with the runner-up raised just above the top at decode step `step` (a wrong lm_head)."""
    calls = []

    def flipped(ctx, hub):
        logits = np.array(final_logits(ctx, hub))
        if len(calls) == step:
            order = np.argsort(logits[-1])
            logits[-1, order[-2]] = logits[-1, order[-1]] + 1e-3
        calls.append(step)
        return logits

    monkeypatch.setattr(trace_run, "final_logits", flipped)


def test_a_flipped_greedy_token_fails_at_fp32_and_is_named(monkeypatch):
    golden = read_golden(COMMITTED_ROOT, "trace/free-P7-D5")
    expected = int(golden.group("outputs")["step2.token"][0])
    margin = float(golden.group("inter")["argmax.step2.margin"][0])
    _flip_at(monkeypatch, 2)
    report = run(select(all_cases("tiny"), ["trace/free-*"]), ["numpy32"], COMMITTED_ROOT, timing=False)
    (r,) = report.results
    assert r.status == "fail"
    (flip,) = r.flips
    assert flip["step"] == 2 and flip["expected"] == expected and flip["found"] != expected
    assert flip["margin"] == margin and margin > gates.MARGIN_BUDGETS["bf16"]["argmax"][0]
    token = next(t for t in r.tensors if t.tensor == "step2.token")
    assert not token.passed and token.comparison.exact
    assert token.note == (f"greedy token flip at step 2: expected {expected}, found {flip['found']} "
                          f"(reference logit margin {margin:.3g})")
    assert all(t.passed for t in r.tensors if t.tensor.endswith(".token") and t.tensor != "step2.token")


def test_goldens_store_exact_tokens_and_the_margins_of_every_choice():
    cfg = TINY
    moe_layers = [i for i in range(cfg.num_hidden_layers) if not cfg.mlp_is_dense(i)]
    for case in ("trace/layerwise-P7-D5", "trace/free-P7-D5"):
        g = read_golden(COMMITTED_ROOT, case)
        outs, inter = g.group("outputs"), g.group("inter")
        for step in range(6):
            assert outs[f"step{step}.token"].dtype == np.int64
            assert inter[f"argmax.step{step}.margin"][0] >= TIE_MARGIN["argmax"]
            for layer in moe_layers:
                margin = inter[f"route.step{step}.layer{layer:02d}.margin"]
                assert margin.min() >= TIE_MARGIN["router"]
                choice = inter[f"route.step{step}.layer{layer:02d}.choice"]
                assert choice.shape == (margin.shape[0], cfg.num_experts_per_tok)


def test_the_generator_refuses_a_golden_on_a_near_tie(monkeypatch):
    monkeypatch.setitem(traces.TIE_MARGIN, "argmax", 1e-2)      # the step-1 margin (1.2e-3) is now a "tie"
    (case,) = select(all_cases("tiny"), ["trace/free-P7-D5"])
    with pytest.raises(GoldenError, match=r"trace/free-P7-D5: the golden would sit on a near-tie.*"
                                         r"argmax\.step1\.margin = 0\.0012.*Choose another prompt or weight seed"):
        traces.TraceKind().generate(case)


# selection scores .9 .1 .7 .6 (bias 0). One group, k=2: .7 - .6. Two groups {.9 .1} = 1.0 and {.7 .6} = 1.3 and
# one kept: the group gap is .3, the gap inside the kept group (k=1) .7 - .6, so .1.
@pytest.mark.parametrize("top_k, n_group, topk_group, expected", [
    pytest.param(2, 1, 1, [0.1], id="k2-one-group"),
    pytest.param(1, 2, 1, [0.1], id="k1-two-groups-one-kept"),
    pytest.param(3, 1, 1, [0.5], id="k3-one-group"),
])
def test_route_margin(top_k, n_group, topk_group, expected):
    choice = np.array([[0.9, 0.1, 0.7, 0.6]])
    logits = np.log(choice / (1 - choice))          # sigmoid(logits) = choice, bias 0
    assert np.allclose(route_margin(logits, np.zeros(4), top_k, n_group, topk_group), expected)


@pytest.mark.torch
def test_bf16_traces_pass_with_near_ties_teacher_forced():
    # tiny's traces: the rows measured on them, and a near-tie greedy token (k3geom's traces have none)
    tiny = select(all_cases("tiny"), ["trace/layerwise-P7-D5", "trace/free-P7-D5"])
    report = run(tiny, ["torch-bf16"], COMMITTED_ROOT, timing=False)
    assert report.exit_code == 0, report.first_failure_line()
    for r in report.results:
        assert r.role == "baseline" and not r.flips
        assert r.teacher_forced["router"] > 0 and r.teacher_forced["argmax"] >= 1
        assert any(n.startswith("teacher-forced near-ties") for n in r.notes)
        # every bound is the torch-bf16 baseline's own measured cap: 3x its worst on that block
        for t in r.tensors:
            if t.gated and not t.comparison.exact:
                worst = measured.trace_blocks("layerwise" if "layerwise" in r.case else "free")[t.block][1][0]
                assert t.verdict.bound == pytest.approx(BASELINE_FACTOR * worst), t.tensor


@pytest.mark.gxx
def test_cuda_emu_trace_names_every_core_that_ran_the_reference():
    report = run(select(all_cases("tiny"), ["trace/layerwise-*"]), ["cuda-emu"], COMMITTED_ROOT, timing=False)
    (r,) = report.results
    assert r.status == "pass", report.first_failure_line()
    reference = {n.split(":")[0] for n in r.notes if "reference core ran" in n}
    assert {"kda_prefill", "moe_route", "attnres_hub"} <= reference      # no kernel for them
    assert any(n.startswith("kda_decode:") and "UnsupportedShape" in n for n in r.notes)   # head_dim 8, not 128


def test_a_model_config_with_its_own_measurements_gets_its_own_rows(monkeypatch):
    """Rows '<model>/step*' win over the shared '*/step*' ones: a (deliberately tiny) measurement for `tiny`
    makes the numpy32 baseline fail there, by the new row."""
    rows, baseline_rows = gate_table.trace_rows("tiny", "tiny", {"lm_head": ((1e-9, "test"), (1e-9, "test"))},
                                                "a test")
    monkeypatch.setattr(gates, "GATES", {**gates.GATES, **rows})
    monkeypatch.setattr(gates, "BASELINE_GATES", {**gates.BASELINE_GATES, **baseline_rows})
    report = run(select(all_cases("tiny"), ["trace/free-*"]), ["numpy32"], COMMITTED_ROOT, timing=False)
    (r,) = report.results
    assert r.status == "fail" and r.first_failing.tensor.endswith(".logits")
    assert tuple(r.first_failing.gate_key) == ("lm_head", "tiny:tiny/*/step*", "fp32")
    assert "measured 1e-09 worst on tiny (a test test)" in r.first_failing.verdict.why


@pytest.mark.parametrize("name, parsed", [
    pytest.param("step1.layer02.3_a", TraceName(1, "a", 2, 3), id="layer"),
    pytest.param("step0.layer10.2_x_mixer", TraceName(0, "x_mixer", 10, 2), id="two-word"),
    pytest.param("step3.logits", TraceName(3, "logits"), id="logits"),
    pytest.param("step3.token", TraceName(3, "token"), id="token"),
])
def test_trace_names_read_back_what_they_write(name, parsed):
    assert TraceName.parse(name) == parsed and str(parsed) == name


@pytest.mark.parametrize("name", ["y", "layer00.h", "step1.final", "step1.layer02", "route.step1.layer04.margin"])
def test_other_names_are_not_trace_tensors(name):
    assert TraceName.parse(name) is None and layer_of(name) is None


def test_a_free_runs_step_outputs_are_scaled_by_the_baselines_worst_step():
    """One step's baseline error is one draw of compounded noise: a free run's logits are bounded by the worst the
    baseline made on them over the steps; per-layer tensors and every layerwise tensor keep their own."""
    (free,) = select(all_cases("tiny"), ["trace/free-P7-D5"])
    (layerwise,) = select(all_cases("tiny"), ["trace/layerwise-P7-D5"])
    errs = {"step0.logits": gates.BaselineError(2e-6, 3e-6), "step1.logits": gates.BaselineError(5e-6, 1e-6),
            "step2.logits": gates.BaselineError(1e-6, None), "step1.layer02.3_a": gates.BaselineError(7e-6, 9e-6)}
    pooled = traces.TraceKind().pooled_baseline(free, errs)
    assert {t: pooled[t].rel_rms for t in errs} == {"step0.logits": 5e-6, "step1.logits": 5e-6, "step2.logits": 5e-6,
                                                    "step1.layer02.3_a": 7e-6}
    assert pooled["step0.logits"].worst_err is None                       # not measured at one step: not pooled
    assert pooled["step1.layer02.3_a"] == errs["step1.layer02.3_a"]
    assert traces.TraceKind().pooled_baseline(layerwise, errs) == errs
