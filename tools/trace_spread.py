"""How far apart correct implementations land on a model trace: their errors over the baseline's, over many models.

    python tools/trace_spread.py --backends recipe:bf16-f32-math recipe:bf16-wide --seeds 0:30 \
        [--trace trace/free-P7-D5] [--config tiny]

A trace's bf16 (fp32) rows bound each tensor by k x the error torch-bf16 (numpy32) made on it (a free run's
logits: its worst over the run's steps, conformance.cases.traces.TraceKind.pooled_baseline). How large k must be
is a property of correct implementations, not of the baseline alone: two correct readings round differently
inside a layer, and a free run compounds that through every layer and step. This builds the trace again with
other weight seeds (other synthetic models, in memory; a seed whose golden sits on a near-tie is skipped, as regen
refuses it), runs each backend and the baseline on it, and prints, per backend and per block (the trace rows are
per block: a layer's mixer output is its attention's, the logits lm_head's), the distribution over the seeds of
its error over the baseline's (relative RMS, and worst element over worst element: the multiples a row's k and
elem_k must exceed), and every tensor the current rows fail.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from conformance.backends.registry import get_backend
from conformance.cases.catalog import all_cases, kind_of
from conformance.fuzz.draws import FuzzRunner
from conformance.golden.errors import GoldenError
from conformance.golden.store import COMMITTED_ROOT
from conformance.runner import Runner

sys.path.insert(0, str(Path(__file__).parent))
from fresh_margins import _seeds  # noqa: E402 - a sibling script: one reading of FIRST:END for every tool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", required=True, help="the backends judged (one precision or several)")
    ap.add_argument("--trace", default="trace/free-P7-D5", help="the trace case (default trace/free-P7-D5)")
    ap.add_argument("--config", default="tiny", help="the shape set it belongs to (default tiny)")
    ap.add_argument("--seeds", type=_seeds, default=range(0, 10), help="weight seeds FIRST:END (default 0:10)")
    args = ap.parse_args()

    (case,) = [c for c in all_cases(args.config) if c.name == args.trace]
    parent = Runner(COMMITTED_ROOT, args.config, False, seed=None,
                    in_process=frozenset({"numpy64", "numpy32", "torch-bf16", *args.backends}))
    runner = FuzzRunner(parent)
    backends = [get_backend(b) for b in args.backends]
    ratios: dict[tuple[str, str], list[tuple[float, int, str]]] = collections.defaultdict(list)
    fails: list[str] = []
    used, t0 = 0, time.perf_counter()
    try:
        for seed in args.seeds:
            drawn = dataclasses.replace(case, name=f"{case.name}-w{seed}", seed=seed)   # caches key on names
            if isinstance(runner.golden(drawn), GoldenError):
                continue
            used += 1
            for backend in backends:
                result = runner.run_one(drawn, backend)
                if result.status == "error":
                    fails.append(f"seed {seed} {backend.name}: error {result.error[:160]}")
                    continue
                golden = runner.golden(drawn)
                base = kind_of(drawn).pooled_baseline(drawn, runner.baseline_errors(drawn, golden,
                                                                                    backend.precision)[1] or {})
                for t in result.tensors:
                    if not t.gated or t.baseline_err is None or t.comparison.exact:
                        continue
                    ratios[(backend.name, t.block)].append(
                        (t.comparison.rel_rms / max(t.baseline_err, 1e-300), seed, t.tensor))
                    worst = base.get(t.tensor)
                    if worst is not None and worst.worst_err:
                        ratios[(backend.name, t.block + " (worst element)")].append(
                            (t.comparison.worst_err / worst.worst_err, seed, t.tensor))
                    if not t.passed:
                        fails.append(f"seed {seed} {backend.name} {t.tensor}: {t.verdict.why[:160]}")
    finally:
        parent.close()
    print(f"{case.name} on {used} weight seeds of {len(args.seeds)} ({time.perf_counter() - t0:.0f} s): "
          f"{len(fails)} failing tensor(s)")
    for line in fails:
        print("FAIL", line)
    print("error / the baseline's (a free run's logits: over its worst step), per backend and block of the trace "
          "rows: max p99 p90 median | seed and tensor of the max")
    for (backend, block), vals in sorted(ratios.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        a = np.array([v for v, _, _ in vals])
        q = np.quantile(a, [0.99, 0.9, 0.5])
        worst = max(vals)
        print(f"  {block:28} {a.max():7.3f} {q[0]:7.3f} {q[1]:7.3f} {q[2]:7.3f} | seed {worst[1]:<4} {worst[2]:24} "
              f"{backend} (n={len(vals)})")


if __name__ == "__main__":
    main()
