"""`k3conf fuzz`: draws from the whole legal space of each core a backend supplies, judged against the float64
reference; a failing draw is shrunk to the smallest that still fails and written as a replay file (docs/fuzz.md)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from conformance import report as rep
from conformance.cases.fresh import env_seed
from conformance.cli.run import fuzz_seconds, seconds
from conformance.cli.usage import UsageError, check_cuda_env
from conformance.fuzz import replay, space
from conformance.fuzz.draws import MEMORY_MIB, FuzzRunner, judge
from conformance.fuzz.inrun import fuzz_backends, judged_backends
from conformance.golden.store import COMMITTED_ROOT
from conformance.isolation.client import DEFAULT_TIMEOUT, WorkerPool
from conformance.isolation.processes import guard_this_process
from conformance.judge import gates
from conformance.metadata import collect as collect_metadata
from conformance.results import RunReport
from conformance.runner import FRESH_SEED_ENV, Runner
from conformance.session import SessionError, check_backends, check_report_dir, run_rows, strict_missing

__all__ = ["register", "run"]


def register(sub) -> None:
    p = sub.add_parser("fuzz", help="fuzz a backend's cores over their whole legal space; shrink what fails",
                       description="Exit 0: every draw passed; 1: a draw failed (shrunk, a replay file written), or "
                                   "the backend was refused at start-up; 2: bad usage.")
    p.add_argument("--backend", action="extend", nargs="+", metavar="B", required=True,
                   help="the backends to fuzz (names as for `k3conf run`; the precision baselines and numpy64 set "
                        "the bounds and are not fuzzed)")
    p.add_argument("--cores", action="extend", nargs="+", metavar="CORE", choices=list(space.REGIONS),
                   help="only these cores (default: every core the backend supplies)")
    p.add_argument("--budget", type=fuzz_seconds, default=30.0, metavar="SECONDS",
                   help="seconds of draws after the first round (one draw of every region of every core), default 30")
    p.add_argument("--memory", type=_mib, default=MEMORY_MIB, metavar="MIB",
                   help=f"the most one draw may take, its inputs and expected outputs (default {MEMORY_MIB:g}); a "
                        "larger draw is counted, not judged")
    p.add_argument("--seed", type=int, default=None, metavar="N",
                   help=f"the draws' seed (default: {FRESH_SEED_ENV}, else a new one; printed)")
    p.add_argument("--replay", type=Path, default=None, metavar="FILE",
                   help="judge the draw of a replay file (written by an earlier fuzz) again, on --backend")
    p.add_argument("--report", type=Path, default=Path("reports/fuzz-run"), metavar="DIR",
                   help="report.json / .md / .html and the replay files (DIR/fuzz/) here (default reports/fuzz-run)")
    p.add_argument("--timeout", type=seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"how long a backend's core may run in its worker (default {DEFAULT_TIMEOUT:g})")
    p.set_defaults(func=run)


def _mib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of MiB, found {text!r}")
    return value


def run(args) -> int:
    check_cuda_env()
    guard_this_process()
    seed = args.seed if args.seed is not None else env_seed(FRESH_SEED_ENV, "a report", SessionError)
    if seed < 0:
        raise UsageError(f"--seed: expected a non-negative integer, found {seed}")
    report_dir = args.report.resolve()
    check_report_dir(report_dir)
    pool = WorkerPool(args.timeout)
    try:
        checks = check_backends(args.backend, pool)
        rows = run_rows(checks, timeout=args.timeout)
        backends = [c.backend for c in checks if c.available and not c.refused]
        runner = Runner(COMMITTED_ROOT, "tiny", False, seed=seed, pool=pool, handles={c.name: c.backend
                                                                                       for c in checks})
        if args.replay is not None:
            return _replay(args.replay, runner, backends)
        judged = judged_backends(backends)
        if not judged and not any(c.refused for c in checks):
            raise UsageError(f"--backend {' '.join(args.backend)}: nothing to fuzz (the float64 reference and the "
                             f"precision baselines {', '.join(sorted(set(gates.BASELINE.values())))} set the bounds)")
        summary = fuzz_backends(runner, judged, args.budget, report_dir / "fuzz", seed,
                                frozenset(args.cores) if args.cores else None, args.memory)
    finally:
        pool.close()
    report = RunReport("fuzz", rows, [], summary.seconds, {}, strict_missing(rows), fuzz=summary,
                       left_running=pool.left_lines(),
                       metadata=collect_metadata(root=COMMITTED_ROOT, config="tiny", seed=seed,
                                                 duration=summary.seconds))
    console = Console() if sys.stdout.isatty() else Console(width=160)
    return rep.present(report, report_dir, "k3conf fuzz", console)


def _replay(path: Path, runner: Runner, backends) -> int:
    """Judge a replay file's draw on each backend; 1 when it fails on any."""
    try:
        draw, spec, said = replay.read(path)
    except replay.ReplayError as e:
        raise UsageError(str(e)) from None
    print(f"replaying {draw.core} {space.describe(draw.params)} (seed {draw.seed}); it failed on {spec}: {said[:300]}")
    worst = 0
    fuzz_runner = FuzzRunner(runner)
    for backend in backends:
        result = judge(fuzz_runner, draw, backend)
        print(f"{backend.name}: {result.status}" + (f": {result.failure_line()}" if result.failure_line() else ""))
        worst = max(worst, int(result.status in ("fail", "error")))
    return worst
