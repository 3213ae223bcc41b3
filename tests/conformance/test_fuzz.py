"""Shape fuzzing: the draws reach every size threshold and stated contract on every run, a planted bug that only
those reach fails a default run with a shrunk reproducer naming the threshold, the reproducer replays, and
correct backends pass the draws.

The mutants are conformance.backends.mutants_space's (size-only, contract and biased-rounding bugs); a default run
is `k3conf run` with its default fuzz budget (one draw of every region of every core), here on the cases of the
mutated block only (the other blocks' cases cannot fail it and take minutes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conformance.backends.mutants_space import SPACE_MUTANTS
from conformance.backends.recipes import RECIPES
from conformance.backends.registry import get_backend
from conformance.cases.catalog import all_cases
from conformance.fuzz import replay, space
from conformance.fuzz.draws import Draw, FuzzRunner, fuzz, plan
from conformance.fuzz.inrun import cores_run_by, fuzz_backends, fuzz_step
from conformance.golden.store import COMMITTED_ROOT
from conformance.runner import Runner, run

# what the smallest failing draw (or failing case) must name for each planted bug: the threshold or the contract
POINTS_AT = {
    "kda-heads-past-64": "H=65 ",
    "mxfp4-split-k-drops-tail": "K=2080",          # the smallest K past 2048 that leaves a partial chunk of 32
    "mla-batch-past-32": "B=33 ",
    "router-ties-to-higher": "ties=True",
    "experts-repeat-counted-once": "repeated=True",
    "kda-scale-ignored": "scale=",
}
BIASED = ("bf16-rmsnorm-truncated", "bf16-outputs-truncated")


@pytest.fixture(scope="module")
def tiny():
    return all_cases("tiny")


def _default_run(cases, backend: str, tmp_path):
    """runner.run as `k3conf run --backend B --cases ...` runs it: the cases, then the default fuzz step."""
    return run(cases, [backend], COMMITTED_ROOT, timing=False,
               fuzz=fuzz_step(0.0, tmp_path / "fuzz", cores_run_by(cases)))


@pytest.mark.parametrize("mutant", sorted(POINTS_AT))
def test_a_default_run_fails_each_size_and_contract_bug_with_a_shrunk_reproducer(tiny, tmp_path, mutant):
    block = SPACE_MUTANTS[mutant][0]
    report = _default_run([c for c in tiny if c.block == block], f"mutant:{mutant}", tmp_path)
    assert report.exit_code == 1
    assert report.fuzz is not None and report.fuzz.findings, report.fuzz and report.fuzz.line()
    mine = [f for f in report.fuzz.findings if f": {block}: smallest failing: " in f]
    assert any(POINTS_AT[mutant] in f.split("(region")[0] for f in mine), mine
    # each finding was written as a replay file whose draw is the shrunk one
    for path in report.fuzz.replays:
        doc = json.loads(open(path).read())
        assert doc["backend"] == f"mutant:{mutant}" and doc["failure"] in "\n".join(report.fuzz.findings)
    if SPACE_MUTANTS[mutant][4] == "tiny":   # a contract bug: a committed case of the table fails too
        failed = [r.case for r in report.failures]
        assert failed and all(block in c for c in failed), failed


@pytest.mark.torch
@pytest.mark.parametrize("mutant", BIASED)
def test_a_biased_rounding_fails_the_blocks_it_touches_by_the_bias_rule(tiny, tmp_path, mutant):
    block = SPACE_MUTANTS[mutant][0]
    report = _default_run([c for c in tiny if c.block == block], f"mutant:{mutant}", tmp_path)
    assert report.exit_code == 1
    lines = [r.failure_line() for r in report.failures]
    assert lines and all("biased rounding (toward zero)" in line for line in lines), lines
    # nothing but the bias: every failing tensor's error is within the size its rule allows (truncation's error is
    # at most one bf16 unit, 2^-8 of each value; rounding's half of one)
    failing = [t for r in report.failures for t in r.tensors if not t.passed]
    assert failing and all(t.comparison.rel_rms <= t.verdict.bound for t in failing), lines


def test_the_draws_reach_every_threshold_and_contract_on_every_round():
    for seed in range(40):
        draws = plan(list(space.REGIONS), seed)
        by = {}
        for d in draws:
            by.setdefault(d.core, []).append(d.params)
        assert max(p["H"] for p in by["kda_decode"]) > 64 and max(p["B"] for p in by["kda_decode"]) >= 32
        assert max(p["H"] for p in by["kda_prefill"]) > 64
        assert any(len(p["seq_lens"]) >= 32 for p in by["mla_decode"])
        assert any(p["page"] == 1 for p in by["mla_decode"] + by["mla_decode_fp8"])
        assert any(p["K"] > 2048 and p["K"] % 2048 for p in by["mxfp4_gemv"])
        assert any(p.get("ties") for p in by["moe_route"]) and any(p.get("repeated") for p in by["moe_experts"])
        assert any(p.get("scale") is not None for p in by["kda_decode"] + by["kda_prefill"])
        assert any(0 in p["lens"] for p in by["kda_prefill_varlen"])
        assert any(q == 0 for p in by["mla_prefill"] for q, _ in p["seqs"])   # a sequence with no query tokens
        assert any(p["T"] in space.TAILS for p in by["kda_prefill"])
        assert any(L % p["page"] == 1 for p in by["mla_decode"] for L in p["seq_lens"])   # one past a page


# the regions every contract mutant is caught in: a draw the builder refuses is no draw, so a contract that is
# undrawable on some seeds would go unjudged on those runs (top_k = E - 1 once left no room for a tie below)
CONTRACT_REGIONS = {"moe_route": "ties", "moe_experts": "repeated-ids", "kda_decode": "scale",
                    "kda_prefill_varlen": "empty-sequences", "mla_prefill": "empty-sequences"}


def test_every_contract_region_can_be_drawn_on_every_seed():
    from conformance.golden.regen import build_blob  # noqa: PLC0415 -- the float64 reference builds each draw

    undrawable = []
    for seed in range(200):
        for draw in plan(list(CONTRACT_REGIONS), seed):
            if CONTRACT_REGIONS[draw.core] == draw.region:
                try:
                    build_blob(draw.case)
                except (ValueError, RuntimeError) as e:
                    undrawable.append(f"seed {seed} {draw.core} {space.describe(draw.params)}: {e}")
    assert not undrawable, undrawable[:5]


def test_the_same_seed_draws_the_same_and_another_seed_other_draws():
    a, b, c = plan(["kda_decode", "mxfp4_gemv"], 11), plan(["mxfp4_gemv", "kda_decode"], 11), \
        plan(["kda_decode", "mxfp4_gemv"], 12)
    assert sorted(map(repr, a)) == sorted(map(repr, b))
    assert {d.seed for d in a}.isdisjoint({d.seed for d in c})


def test_a_draw_round_trips_through_json():
    for d in plan(list(space.REGIONS), 3):
        assert Draw.from_json(json.loads(json.dumps(d.to_json()))) == d


@pytest.fixture(scope="module")
def runner():
    r = Runner(COMMITTED_ROOT, "tiny", False, seed=None, in_process=frozenset({"numpy64", "numpy32", "torch-bf16"}))
    yield FuzzRunner(r)
    r.close()


def test_a_replay_file_judges_its_draw_again(runner, tmp_path):
    mutant = get_backend("mutant:kda-heads-past-64")
    draws = [d for d in plan(["kda_decode"], 5) if d.region == "heads-past-64"]
    (finding,) = fuzz(runner, mutant, draws)
    assert finding.smallest.params["H"] == 65 and finding.steps > 0
    path = replay.write(finding, "mutant:kda-heads-past-64", tmp_path)
    draw, spec, said = replay.read(path)
    assert draw == finding.smallest and spec == "mutant:kda-heads-past-64" and "H=65" in said
    cli = [sys.executable, "-m", "conformance", "fuzz", "--replay", str(path), "--report", str(tmp_path / "r")]
    bad = subprocess.run([*cli, "--backend", "mutant:kda-heads-past-64"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "fail" in bad.stdout, bad.stdout + bad.stderr
    good = subprocess.run([*cli, "--backend", "numpy64"], capture_output=True, text=True, timeout=300)
    assert good.returncode == 0 and "numpy64: pass" in good.stdout, good.stdout + good.stderr


def test_a_draw_over_the_memory_budget_is_counted_and_never_judged(runner):
    mutant = get_backend("mutant:kda-heads-past-64")
    # 96 heads of 32 x 32 states: about 0.4 MiB; a budget of 0.2 MiB holds the smaller draws only
    summary = fuzz_backends(runner, [mutant], 0.0, None, seed=5, only=frozenset({"kda_decode"}), memory_mib=0.2)
    over = [r for r in summary.results if "within the memory budget" in r.error]
    assert over and all(r.status == "error" for r in over), [r.error for r in summary.results]
    assert "over the memory budget, not judged" in summary.line()
    assert not summary.findings          # the only draw the bug shows on, past 64 heads, was over the budget
    whole = fuzz_backends(runner, [mutant], 0.0, None, seed=5, only=frozenset({"kda_decode"}))
    assert whole.findings and "over the memory budget" not in whole.line()


def test_a_file_that_is_no_replay_is_refused_with_what_was_expected(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(replay.ReplayError, match="expected 'k3conf-fuzz-replay/1'"):
        replay.read(bad)
    bad.write_text("{not json")
    with pytest.raises(replay.ReplayError, match="not JSON"):
        replay.read(bad)


@pytest.mark.parametrize("backend", ["recipe:fp32-wide", "recipe:fp32-numpy-sums",
                                     pytest.param("recipe:bf16-f32-math", marks=pytest.mark.torch),
                                     pytest.param("recipe:bf16-wide", marks=pytest.mark.torch)])
def test_correct_recipes_pass_two_rounds_of_draws(runner, backend):
    """A guard in CI; tools/verdict_rates.py measures the rate over hundreds of draws (docs/verdict_rates.md)."""
    b = get_backend(backend)
    results = []
    findings = fuzz(runner, b, plan(b.kernel_cores(), seed=int(np.random.default_rng().integers(2 ** 31)), rounds=2),
                    results=results)
    assert not findings, [f.line() for f in findings]
    assert sum(r.status == "pass" for r in results) > 50


def test_every_recipe_is_a_backend_of_its_precision():
    for name, (precision, _) in RECIPES.items():
        assert get_backend(f"recipe:{name}").precision == precision


def test_shrinking_walks_each_dimension_to_its_threshold(runner):
    mutant = get_backend("mutant:mla-batch-past-32")
    draws = [d for d in plan(["mla_decode"], 8) if d.region == "batch-32"]
    (finding,) = fuzz(runner, mutant, draws)
    assert len(finding.smallest.params["seq_lens"]) == 33
    assert finding.smallest.params["H"] <= finding.first.params["H"]
    assert "B=33 " in finding.line()


PRECISION = [name for name, m in SPACE_MUTANTS.items() if name.startswith(("fp32-", "bf16-kda"))]


@pytest.mark.torch
@pytest.mark.parametrize("mutant", PRECISION)
def test_a_precision_bug_of_a_lower_precisions_size_fails_its_block(tiny, mutant):
    block = SPACE_MUTANTS[mutant][0]
    report = run([c for c in tiny if c.block == block], [f"mutant:{mutant}"], COMMITTED_ROOT, timing=False)
    assert report.exit_code == 1 and report.first_failure.block == block, report.first_failure_line()


# ------------------------------------------------------------------------------------------ the pytest plugin


def _pytest(cwd, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "K3_STRICT": ""}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_plugin_fuzzes_the_cores_of_the_selected_cases_by_default(tmp_path):
    (tmp_path / "test_mine.py").write_text("def test_mine():\n    assert True\n")
    backend = "--k3conf-backend=mutant:kda-heads-past-64"
    p = _pytest(tmp_path, "-rA", backend, "--k3conf-cases=kda_decode/B2-H3-K16", "-m", "fuzz")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert "FAILED fuzz/kda_decode" in p.stdout and "smallest failing: B=1 H=65 " in p.stdout, p.stdout[-3000:]
    assert "fuzz/rmsnorm" not in p.stdout          # only the cores the selected cases run
    quiet = _pytest(tmp_path, "--co", "-q", backend, "--k3conf-cases=kda_decode/B2-H3-K16", "--k3conf-no-fuzz")
    assert quiet.returncode == 0 and "fuzz/" not in quiet.stdout, quiet.stdout[-2000:]
    bad = _pytest(tmp_path, "--co", backend, "--k3conf-fuzz=-1")
    assert bad.returncode == 4 and "--k3conf-fuzz: expected a finite number of seconds >= 0" in bad.stderr


def test_a_baseline_is_not_fuzzed_by_the_plugin(tmp_path):
    (tmp_path / "test_mine.py").write_text("def test_mine():\n    assert True\n")
    p = _pytest(tmp_path, "--co", "-q", "--k3conf-backend=numpy32", "--k3conf-cases=kda_decode/B2-H3-K16")
    assert p.returncode == 0 and "fuzz/" not in p.stdout, p.stdout[-2000:]
