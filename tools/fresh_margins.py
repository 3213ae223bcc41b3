"""Judge one backend on many fresh draws of every per-block case and print how often, and where, it fails.

    python tools/fresh_margins.py --backend torch --seeds 1000:1500 [--config tiny] [--cases 'kda_prefill/*']

`k3conf run` judges each per-block case once more on inputs drawn with a random seed (conformance.cases.fresh),
against k x the baseline's error on those same inputs + the row's floor, and the per-element rule. One draw per
run says little about how often a correct backend lands past that bound; this draws the seeds given (each a
replayable `K3CONF_FRESH_SEED`), runs the backend in this process, and prints every failing (seed, case, tensor,
rule) and the cases closest to their bound (error / bound, 1 = at the bound). Use it before changing a row's k
or floor, and to tell a backend's real fault from a row that the baseline's lucky draws make too tight.
"""
from __future__ import annotations

import argparse
import collections
import time

from conformance.backends.registry import get_backend
from conformance.cases.catalog import all_cases, select
from conformance.cases.fresh import PER_BLOCK_KINDS
from conformance.golden.store import COMMITTED_ROOT
from conformance.runner import FreshRunner, Runner


def _seeds(text: str) -> range:
    lo, _, hi = text.partition(":")
    if not (lo.isdigit() and hi.isdigit() and int(lo) < int(hi)):
        raise argparse.ArgumentTypeError(f"expected FIRST:END (non-negative, FIRST < END), found {text!r}")
    return range(int(lo), int(hi))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="torch", help="the backend judged (default torch)")
    ap.add_argument("--seeds", type=_seeds, default=range(0, 100), help="FIRST:END, END excluded (default 0:100)")
    ap.add_argument("--config", default="tiny", help="shape set of the committed goldens (default tiny)")
    ap.add_argument("--cases", nargs="*", help="case globs (default every per-block case)")
    ap.add_argument("--closest", type=int, default=15, help="how many of the closest (case, tensor) to print")
    args = ap.parse_args()

    cases = [c for c in select(all_cases(args.config), args.cases) if c.kind in PER_BLOCK_KINDS]
    runner = Runner(COMMITTED_ROOT, args.config, False, seed=None,
                    in_process=frozenset({"numpy64", "numpy32", args.backend}))
    backend = get_backend(args.backend)
    closest: dict[tuple[str, str], tuple[float, int]] = collections.defaultdict(lambda: (0.0, -1))
    fails = []
    t0 = time.perf_counter()
    try:
        for seed in args.seeds:
            fresh = FreshRunner(runner, seed)
            for case in cases:
                for t in fresh.run_one(case, backend).tensors:
                    if t.verdict.bound and t.comparison.rel_rms / t.verdict.bound > closest[(case.name, t.tensor)][0]:
                        closest[(case.name, t.tensor)] = (t.comparison.rel_rms / t.verdict.bound, seed)
                    if not t.verdict.passed:
                        rule = "rel RMS" if t.comparison.rel_rms > t.verdict.bound else "per element"
                        fails.append(f"seed {seed} {case.name} {t.tensor} ({rule}): {t.verdict.why[:160]}")
            fresh.close()
    finally:
        runner.close()
    seeds, failed_seeds = args.seeds, len({f.split()[1] for f in fails})
    print(f"{args.backend} on {len(cases)} {args.config} cases x {len(seeds)} fresh seeds "
          f"({seeds.start}:{seeds.stop}), {time.perf_counter() - t0:.0f} s: {len(fails)} failing tensor(s) on "
          f"{failed_seeds} seed(s)")
    for line in fails:
        print("FAIL", line)
    print("closest to the bound (rel RMS / bound, worst over the seeds):")
    for (case, tensor), (ratio, seed) in sorted(closest.items(), key=lambda kv: -kv[1][0])[:args.closest]:
        print(f"  {ratio:6.3f}  {case} {tensor} (seed {seed})")


if __name__ == "__main__":
    main()
