"""The judge's two error rates, measured: how many planted bugs it misses, and how often it fails a correct kernel.

    python tools/verdict_rates.py mutants [--config tiny] [--fuzz SECONDS] [--only NAME ...]
    python tools/verdict_rates.py correct --backends torch cuda-emu recipe:fp32-wide ... --seeds 0:300 [--fuzz 1]
    python tools/verdict_rates.py committed --backends numpy32 torch torch-bf16 cuda-emu recipe:bf16-wide ...
    python tools/verdict_rates.py region --core mxfp4_gemv --region split-k --backends recipe:fp32-numpy-sums \
        --draws 1500

`mutants`: every mutant of the corpus (`k3conf list mutants`: the table's mistakes, and conformance.backends.
mutants_space's size-only, contract, biased-rounding and precision bugs) through what a default `k3conf run`
does on the shape set: every case, then the fuzz draws. For each: caught or missed, and how (the first failing
case, tensor and rule, or the shrunk fuzz finding). A mutant whose bug only K3's sizes show (shows_on k3-tp8) is
run on that set when its goldens are in the cache, and said so otherwise.

`correct`: correct backends over fresh draws: every per-block case drawn again with each seed (the inputs
`k3conf run` draws afresh on every run) and, with --fuzz ROUNDS, that many rounds of fuzz draws per seed; the
baselines are left out (they set the bounds). Prints each backend's failures and the rate, with a 95% upper bound
when none failed (3 / N). `committed`: the same backends over the committed cases and traces, as `make run`
judges them. `region`: many draws of one fuzz region (one per seed 0..draws-1) on correct backends, with each one's
worst error over its bound. docs/verdict_rates.md publishes all of them, with these commands.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from conformance.backends.registry import MUTANTS, get_backend
from conformance.cases.catalog import all_cases
from conformance.fuzz import space
from conformance.fuzz.draws import FuzzRunner, judge, plan
from conformance.fuzz.inrun import cores_run_by, fuzz_step
from conformance.golden.store import COMMITTED_ROOT, default_root
from conformance.judge import gates
from conformance.runner import Runner, run

sys.path.insert(0, str(Path(__file__).parent))
import fresh_margins  # noqa: E402 - a sibling script: its records are the fresh draws' verdicts


def _root(config: str) -> Path:
    return COMMITTED_ROOT if config == "tiny" else default_root(config)


def _caught(report) -> str:
    """How a run caught its backend: the first failing case's line, else the first fuzz finding; '' when it
    passed."""
    if report.failures:
        line = report.first_failure_line().removeprefix("FIRST FAILURE: ")
        return "case " + line[:240]
    if report.fuzz is not None and report.fuzz.findings:
        return "fuzz " + report.fuzz.findings[0][:240]
    return ""


def mutants(args) -> None:
    names = args.only or list(MUTANTS)
    caught = 0
    print(f"| mutant | base | shows on | caught by ({args.config} cases + fuzz {args.fuzz:g} s) |")
    print("|---|---|---|---|")
    t0 = time.perf_counter()
    for name in names:
        m = MUTANTS[name]
        config = m.shows_on if m.shows_on in ("k3", "k3-tp8", "small") else args.config
        root = _root(config)
        if not (root / "MANIFEST.json").is_file():
            print(f"| {name} | {m.base} | {m.shows_on} | not run: no {config} goldens (k3conf regen --shapes "
                  f"{config}) |")
            continue
        cases = all_cases(config)
        with tempfile.TemporaryDirectory() as tmp:
            report = run(cases, [f"mutant:{name}"], root, config=config, timing=False,
                         fuzz=fuzz_step(args.fuzz, Path(tmp), cores_run_by(cases)))
        how = _caught(report)
        caught += bool(how)
        print(f"| {name} | {m.base} | {m.shows_on} | {how.replace('|', '/') if how else '**missed**'} |", flush=True)
    print(f"\ncaught {caught} of {len(names)} ({time.perf_counter() - t0:.0f} s)")


def correct(args) -> None:
    print("| backend | precision | draws judged | failing draws | rate | seeds | fuzz rounds per seed |")
    print("|---|---|---|---|---|---|---|")
    lines = []
    for backend in args.backends:
        rec_args = argparse.Namespace(config=args.config, cases=None, backend=backend, seeds=args.seeds,
                                      fuzz=args.fuzz)
        records, _ = fresh_margins._records(rec_args)
        draws = {(r["seed"], r["case"]) for r in records}
        failing = sorted({(r["seed"], r["case"]) for r in records if not r["passed"]})
        n = len(draws)
        rate = f"{len(failing) / n:.2%}" if failing else f"0 (< {3 / n:.2%} at 95%)"
        precision = records[0]["precision"] if records else "?"
        print(f"| {backend} | {precision} | {n:,} | {len(failing)} | {rate} | {args.seeds.start}:{args.seeds.stop} "
              f"| {args.fuzz} |", flush=True)
        lines += [f"{backend} seed {r['seed']} {r['case']} {r['tensor']}: {r['why'][:200]}" for r in records
                  if not r["passed"]]
    for line in lines:
        print("FAIL", line)


def committed(args) -> None:
    cases = all_cases(args.config)
    report = run(cases, args.backends, _root(args.config), config=args.config, timing=False)
    print("| backend | precision | cases judged | failed |")
    print("|---|---|---|---|")
    for row in report.backends:
        mine = [r for r in report.results if r.backend == row["name"]]
        judged = [r for r in mine if r.status in ("pass", "fail", "error")]
        failed = [r for r in judged if r.status != "pass"]
        print(f"| {row['name']} | {row['precision']} | {len(judged)} | {len(failed)} |")
        for r in failed:
            print(f"FAIL {r.failure_line()[:300]}")


def region(args) -> None:
    parent = Runner(COMMITTED_ROOT, "tiny", False, seed=None,
                    in_process=frozenset({"numpy64", "numpy32", "torch-bf16", *args.backends}))
    runner = FuzzRunner(parent)
    try:
        for name in args.backends:
            backend, failing, worst, t0 = get_backend(name), [], 0.0, time.perf_counter()
            for seed in range(args.draws):
                (draw,) = [d for d in plan([args.core], seed) if d.region == args.region]
                r = judge(runner, draw, backend)
                worst = max([worst] + [t.comparison.rel_rms / t.verdict.bound for t in r.tensors if t.verdict.bound])
                if r.status in ("fail", "error"):
                    failing.append(f"seed {seed} {space.describe(draw.params)}: {r.failure_line()[:200]}")
            print(f"{name} on {args.core} region {args.region}: {len(failing)} failing of {args.draws} draws, worst "
                  f"error / bound {worst:.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            for line in failing:
                print("FAIL", line)
    finally:
        parent.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("mutants", help="every mutant through a default run's cases and fuzz draws")
    m.add_argument("--config", default="tiny")
    m.add_argument("--fuzz", type=float, default=0.0, help="fuzz seconds after the first round (default 0)")
    m.add_argument("--only", nargs="+", choices=list(MUTANTS), help="only these mutants")
    c = sub.add_parser("correct", help="correct backends over fresh draws of every per-block case and fuzz draws")
    c.add_argument("--backends", nargs="+", required=True)
    c.add_argument("--config", default="tiny")
    c.add_argument("--seeds", type=fresh_margins._seeds, default=range(0, 300))
    c.add_argument("--fuzz", type=int, default=1, help="rounds of fuzz draws per seed (default 1)")
    k = sub.add_parser("committed", help="backends over the committed cases and traces")
    k.add_argument("--backends", nargs="+", required=True)
    k.add_argument("--config", default="tiny")
    g = sub.add_parser("region", help="many draws of one fuzz region on correct backends")
    g.add_argument("--core", required=True, choices=list(space.REGIONS))
    g.add_argument("--region", required=True)
    g.add_argument("--backends", nargs="+", required=True)
    g.add_argument("--draws", type=int, default=1000)
    args = ap.parse_args()
    if args.what == "region" and args.region not in {r.name for r in space.REGIONS[args.core]}:
        ap.error(f"--region: expected one of {[r.name for r in space.REGIONS[args.core]]}, found {args.region!r}")
    baselines = set(gates.BASELINE.values()) | {"numpy64"}
    if args.what in ("correct", "region") and baselines & set(args.backends):
        ap.error(f"correct: {sorted(baselines & set(args.backends))} set the bounds of fresh draws; judge them with "
                 "`committed`")
    {"mutants": mutants, "correct": correct, "committed": committed, "region": region}[args.what](args)


if __name__ == "__main__":
    main()
