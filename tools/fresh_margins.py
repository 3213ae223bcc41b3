"""Judge one backend on many fresh draws of every per-block case and print how often, and where, it fails.

    python tools/fresh_margins.py --backend torch --seeds 1000:1500 [--config tiny] [--cases 'kda_prefill/*']
        [--dist] [--dump errors.jsonl]
    python tools/fresh_margins.py --rejudge errors.jsonl [--dist]

`k3conf run` judges each per-block case once more on inputs drawn with a random seed (conformance.cases.fresh),
against k x the baseline's error on those same inputs + the row's floor, and the per-element rule. One draw per
run says little about how often a correct backend lands past that bound; this draws the seeds given (each a
replayable `K3CONF_FRESH_SEED`), runs the backend in this process, and prints every failing (seed, case, tensor,
rule) and the cases closest to their bound (error / bound, 1 = at the bound). Use it before changing a row's k
or floor, and to tell a backend's real fault from a row that the baseline's lucky draws make too tight.

--dist prints, per (case, tensor) and rule (relative RMS, per element), the distribution over the seeds of
error / bound and of the backend's error over the baseline's (the multiple a row's k or elem_k must exceed), with
the floor the row's own k would need. --dump writes every (seed, case, tensor)'s errors and its baseline's as JSON
lines; --rejudge reads such a file and judges it again by the current gate rows (gates.judge, nothing rerun), so
a row's new k or floor is checked against the very draws that measured it.
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np

from conformance.backends.registry import get_backend
from conformance.cases.catalog import all_cases, select
from conformance.cases.fresh import PER_BLOCK_KINDS
from conformance.fuzz.draws import FuzzRunner, plan
from conformance.golden.store import COMMITTED_ROOT
from conformance.judge import gates
from conformance.judge.compare import Comparison
from conformance.runner import FreshRunner, Runner


def _seeds(text: str) -> range:
    lo, _, hi = text.partition(":")
    if not (lo.isdigit() and hi.isdigit() and int(lo) < int(hi)):
        raise argparse.ArgumentTypeError(f"expected FIRST:END (non-negative, FIRST < END), found {text!r}")
    return range(int(lo), int(hi))


def _records(args) -> tuple[list[dict], str]:
    """One record per (seed, case, tensor) of a fresh run (and, with --fuzz, of each fuzz draw of the seed): the
    backend's and its baseline's errors."""
    cases = [c for c in select(all_cases(args.config), args.cases) if c.kind in PER_BLOCK_KINDS]
    runner = Runner(COMMITTED_ROOT, args.config, False, seed=None,
                    in_process=frozenset({"numpy64", "numpy32", "torch-bf16", args.backend}))
    backend = get_backend(args.backend)
    records: list[dict] = []
    try:
        for seed in args.seeds:
            fresh = FreshRunner(runner, seed)
            for case in cases:
                records += _case_records(fresh, case, backend, seed)
            fresh.close()
            if args.fuzz:
                fuzz_runner = FuzzRunner(runner)
                for draw in plan(backend.kernel_cores(), seed, rounds=args.fuzz):
                    records += _case_records(fuzz_runner, draw.case, backend, seed)
                fuzz_runner.close()
    finally:
        runner.close()
    fuzz = f" and {args.fuzz} round(s) of fuzz draws" if args.fuzz else ""
    return records, f"{args.backend} on {len(cases)} {args.config} cases{fuzz}"


def _case_records(runner: Runner, case, backend, seed: int) -> list[dict]:
    result = runner.run_one(case, backend)
    golden = runner.golden(case)
    if isinstance(golden, Exception):
        return []
    _, base = runner.baseline_errors(case, golden, backend.precision)
    out = []
    for t in result.tensors:
        b = (base or {}).get(t.tensor)
        if t.comparison.exact or t.comparison.problem or b is None:
            continue
        c = t.comparison
        out.append(dict(seed=seed, case=case.name, config=case.config, block=t.block, tensor=t.tensor,
                        gate_tensor=t.gate_key[1], precision=backend.precision, rel_rms=c.rel_rms,
                        worst_err=c.worst_err, max_abs=c.max_abs, worst_out=c.worst_out, worst_ref=c.worst_ref,
                        lean=_lean(c, b),
                        base_rel_rms=b.rel_rms, base_worst_err=b.worst_err, 
                        passed=bool(t.verdict.passed), why=t.verdict.why))
    return out


def _lean(c: Comparison, b: gates.BaselineError) -> list | None:
    """The bias rule's statistic (gates.lean_test): [rows, mean lean over the baseline's, t]."""
    test = gates.lean_test(c.row_leans, b.row_leans)
    return None if test is None else list(test)


def _comparison(r: dict) -> Comparison:
    """The record's errors as the Comparison gates.judge reads (no max_abs, an older dump: abs_floor adds nothing)."""
    return Comparison((), "float64", max_abs=r.get("max_abs", 0.0), rel_rms=r["rel_rms"], worst_err=r["worst_err"],
                      n_within=1, n_total=1, 
                      worst_out=r.get("worst_out"), worst_ref=r.get("worst_ref"))


def _rejudged(records: list[dict]) -> list[dict]:
    """Each record judged again by the current rows: the verdict fresh inputs get (gates.judge, capped=False)."""
    out = []
    for r in records:
        gate = gates.gate_for(r["block"], r["tensor"], r["precision"], r["config"])[1]
        cmp = _comparison(r)
        base = gates.BaselineError(r["base_rel_rms"], r["base_worst_err"])
        v = gates.judge(cmp, gate, r["precision"], base, capped=False)
        out.append({**r, "passed": v.passed, "why": v.why})
    return out


def _ratios(r: dict) -> dict[str, tuple[float, float, float]]:
    """rule -> (error / bound, error / baseline's error, floor needed at the row's k, abs_floor aside) for one
    record."""
    gate = gates.gate_for(r["block"], r["tensor"], r["precision"], r["config"])[1]
    cmp = _comparison(r)
    out = {}
    if gate.k is not None:
        bound = gate.k * r["base_rel_rms"] + gates.rule_floor(cmp, gate.floor, gate)[0]
        out["rel RMS"] = (r["rel_rms"] / max(bound, 1e-300), r["rel_rms"] / max(r["base_rel_rms"], 1e-300),
                          r["rel_rms"] - gate.k * r["base_rel_rms"])
    if gate.elem_k is not None and r["base_worst_err"] is not None:
        bound = gate.elem_k * r["base_worst_err"] + gates.rule_floor(cmp, gate.elem_floor, gate)[0]
        out["per element"] = (r["worst_err"] / max(bound, 1e-300), r["worst_err"] / max(r["base_worst_err"], 1e-300),
                              r["worst_err"] - gate.elem_k * r["base_worst_err"])
    return out


def _print_dist(records: list[dict], top: int) -> None:
    """Per (case, tensor, rule): max, 99.9th and 99th percentile, median of error / bound; the same of the
    backend's error over the baseline's; the largest floor the row's k would need (<= 0: k alone suffices)."""
    by: dict[tuple[str, str, str], list[tuple[float, float, float, int]]] = collections.defaultdict(list)
    for r in records:
        for rule, (ratio, multiple, need) in _ratios(r).items():
            by[(r["case"], r["tensor"], rule)].append((ratio, multiple, need, r["seed"]))
    print("distribution over the seeds, per (case, tensor, rule): error/bound max p99.9 p99 median | "
          "error/baseline's max p99.9 | floor needed at the row's k (max) | seed of the max")
    rows = sorted(by.items(), key=lambda kv: -max(v[0] for v in kv[1]))[:top]
    for (case, tensor, rule), vals in rows:
        a = np.array([v[:3] for v in vals])
        worst = max(vals, key=lambda v: v[0])
        q = np.quantile(a[:, 0], [0.999, 0.99, 0.5])
        print(f"  {a[:, 0].max():6.3f} {q[0]:6.3f} {q[1]:6.3f} {q[2]:6.3f} | {a[:, 1].max():7.2f} "
              f"{np.quantile(a[:, 1], 0.999):7.2f} | {a[:, 2].max():9.3g} | seed {worst[3]:<6} "
              f"{case} {tensor} ({rule}, n={len(vals)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="torch", help="the backend judged (default torch)")
    ap.add_argument("--seeds", type=_seeds, default=range(0, 100), help="FIRST:END, END excluded (default 0:100)")
    ap.add_argument("--config", default="tiny", help="shape set of the committed goldens (default tiny)")
    ap.add_argument("--cases", nargs="*", help="case globs (default every per-block case)")
    ap.add_argument("--fuzz", type=int, default=0, metavar="ROUNDS",
                    help="also judge ROUNDS rounds of fuzz draws (every region of the backend's cores) per seed")
    ap.add_argument("--closest", type=int, default=15, help="how many of the closest (case, tensor) to print")
    ap.add_argument("--dist", action="store_true", help="print the distribution per (case, tensor, rule)")
    ap.add_argument("--dump", help="write every (seed, case, tensor)'s errors to this file (JSON lines)")
    ap.add_argument("--rejudge", help="judge the records of a --dump file again by the current rows; runs nothing")
    args = ap.parse_args()

    t0 = time.perf_counter()
    if args.rejudge:
        with open(args.rejudge) as f:
            records = _rejudged([json.loads(line) for line in f if line.strip()])
        what = f"{args.rejudge} judged again by the current rows"
    else:
        records, what = _records(args)
        if args.dump:
            with open(args.dump, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    fails = [r for r in records if not r["passed"]]
    seeds = sorted({r["seed"] for r in records})
    span = f"{seeds[0]}:{seeds[-1] + 1}" if seeds else "none"
    print(f"{what} x {len(seeds)} fresh seeds ({span}), {time.perf_counter() - t0:.0f} s: {len(fails)} failing "
          f"tensor(s) on {len({r['seed'] for r in fails})} seed(s)")
    for r in fails:
        rule = "per element" if r["why"].startswith("worst element") else "rel RMS"
        print(f"FAIL seed {r['seed']} {r['case']} {r['tensor']} ({rule}): {r['why'][:160]}")
    closest: dict[tuple[str, str], tuple[float, int]] = collections.defaultdict(lambda: (0.0, -1))
    for r in records:
        ratio = _ratios(r).get("rel RMS", (0.0,))[0]
        if ratio > closest[(r["case"], r["tensor"])][0]:
            closest[(r["case"], r["tensor"])] = (ratio, r["seed"])
    print("closest to the bound (rel RMS / bound, worst over the seeds):")
    for (case, tensor), (ratio, seed) in sorted(closest.items(), key=lambda kv: -kv[1][0])[:args.closest]:
        print(f"  {ratio:6.3f}  {case} {tensor} (seed {seed})")
    if args.dist:
        _print_dist(records, args.closest)


if __name__ == "__main__":
    main()
