"""Bugs only real sizes show: each passes the toy goldens and fails a case of the k3 shape sets.

- a kernel that reads sequence 0's `v` for every sequence passes every B = 1 case at K3's head size (every K = 128
  golden had B = 1) and fails the B > 1 cases that force each kernel entry;
- an MLA split-KV combine that drops a sequence's last split of 1024 rows passes every toy context (<= 700 rows:
  one split) and fails the k3-tp8 batch of mixed contexts (4096 and 1025 rows among short ones);
- a KDA prefill whose state stops decaying after 1024 steps passes every toy prefill (<= 257 tokens) and fails
  the k3-tp8 prefill of 8192 tokens.
Only the one k3 case each needs is generated, into tmp_path.
"""
from __future__ import annotations

import pytest

from conformance.backends.mutants import MUTANTS
from conformance.cases.catalog import all_cases, select
from conformance.golden.regen import regenerate
from conformance.golden.store import COMMITTED_ROOT
from conformance.runner import run

# the bug, not rounding: the mutant's error is this many times the fp32 baseline's (numpy32) on the same golden
MIN_BASELINE_MULTIPLE = 1000.0


def _worst_multiple(report, block: str) -> float:
    return max(t.baseline_multiple or 0.0 for r in report.results for t in r.tensors if t.block == block)


def _tiny(patterns: list[str]):
    cases = select(all_cases("tiny"), patterns)
    assert cases, patterns
    return cases


def test_v_of_batch0_passes_the_b1_k128_cases_and_fails_a_forced_entry_at_b2():
    mutant = "mutant:kda-decode-v-batch0"
    old = _tiny(["kda_decode/B1-H1-K128", "kda_decode/B1-H2-K128-nolb-full"])
    assert all(c.params["B"] == 1 and c.params["K"] == 128 for c in old)
    report = run(old, [mutant], COMMITTED_ROOT, timing=False)
    assert report.exit_code == 0, report.first_failure_line()
    for name in ("kda_decode/B2-H1-K128-full", "kda_decode/B2-H1-K128-split"):
        report = run(_tiny([name]), [mutant], COMMITTED_ROOT, timing=False)
        assert report.exit_code == 1, f"{name}: the batch-0 v mutant passed"
        assert report.first_failure.first_failing.block == "kda_decode", report.first_failure_line()


@pytest.mark.parametrize("mutant, case", [
    ("mla-combine-drops-last-split", "mla_decode/B64-H12-R512-P64-mixed"),
    ("kda-prefill-decay-stops", "kda_prefill/B1-T8192-H2-K128"),
])
def test_size_only_mutant_passes_tiny_and_fails_k3(tmp_path, mutant, case):
    m = MUTANTS[mutant]
    assert m.shows_on == "k3-tp8"
    tiny = [c for c in all_cases("tiny") if c.block == m.block]
    report = run(tiny, [f"mutant:{mutant}"], COMMITTED_ROOT, timing=False)
    assert report.exit_code == 0, f"{mutant} should pass the toy goldens: {report.first_failure_line()}"

    [big] = select(all_cases(m.shows_on), [case])
    outcomes = regenerate([big], tmp_path)
    assert [o.status for o in outcomes] == ["new"]
    report = run([big], [f"mutant:{mutant}"], tmp_path, config=m.shows_on, timing=False)
    assert report.exit_code == 1, f"{mutant} passed {case}"
    assert report.first_failure.first_failing.block == m.block, report.first_failure_line()
    assert _worst_multiple(report, m.block) > MIN_BASELINE_MULTIPLE
