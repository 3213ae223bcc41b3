"""`k3conf run`: every case on every backend, gated; terminal table + report.json/md/html."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from conformance import report as rep
from conformance.cases.protocol import CONFIGS
from conformance.cli.usage import check_cuda_env
from conformance.fuzz.inrun import cores_run_by, fuzz_step
from conformance.isolation.client import DEFAULT_TIMEOUT, WorkerPool
from conformance.isolation.processes import guard_this_process
from conformance.runner import run as run_cases
from conformance.session import check_backends, check_report_dir, golden_root, pick_cases
from conformance.tp.cli import run_tp_command

__all__ = ["add_shape_options", "add_tp_options", "register", "run", "seconds"]


def fuzz_seconds(text: str) -> float:
    """A --fuzz value: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, found {text!r}")
    return value


def seconds(text: str) -> float:
    """A --timeout value: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, found {text!r}")
    return value


def register(sub) -> None:
    p = sub.add_parser("run", help="run the conformance cases on the backends and gate the results",
                       description="Exit 0: all pass; 1: a failed gate or a broken golden; 2: bad usage.")
    p.add_argument("--backend", action="extend", nargs="+", metavar="B",
                   help="backends to run (default: every available one; see `k3conf list`), e.g. numpy32 "
                        "mutant:mla-scale-128, or MODULE:ATTR / ./file.py:ATTR for a backend defined outside "
                        "the package (docs/external_backends.md)")
    add_shape_options(p)
    p.add_argument("--cases", action="extend", nargs="+", metavar="GLOB",
                   help="case-name globs, e.g. 'kda_*' or kda_decode (a block name selects its cases)")
    p.add_argument("--report", type=Path, default=Path("reports"), metavar="DIR",
                   help="write report.json, report.md, report.html here (default reports/)")
    p.add_argument("--golden", type=Path, default=None, metavar="DIR",
                   help="golden directory (default golden/ for tiny, the cache for the other case sets)")
    p.add_argument("--no-timing", action="store_true", help="skip the speed measurements")
    p.add_argument("--fuzz", type=fuzz_seconds, default=0.0, metavar="SECONDS",
                   help="after the cases, fuzz every judged backend's cores: one draw of every region of each core's "
                        "space (sizes past its thresholds, stated contracts), then more while SECONDS last (default 0: "
                        "one round); a failing draw is shrunk and written as a replay file (docs/fuzz.md)")
    p.add_argument("--no-fuzz", action="store_true", help="no fuzz draws (the cases alone)")
    p.add_argument("--timeout", type=seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="how long a backend's core may run (in its worker process) before the case is an error "
                        f"and the worker is stopped (default {DEFAULT_TIMEOUT:g})")
    add_tp_options(p)
    p.add_argument("--tp-mutant", default=None, metavar="NAME",
                   help="with --tp: a deliberately wrong TP plan (g_proj-row-split, q_proj-neighbour-heads), to "
                        "see a bad split caught")
    p.set_defaults(func=run)


def add_shape_options(p) -> None:
    """--config / --shapes (one option, two names; shared by run and regen): the case set."""
    p.add_argument("--config", "--shapes", dest="config", choices=CONFIGS, default="tiny", metavar="SET",
                   help="case set: tiny (committed goldens, the default), small, k3 (K3's block sizes: KDA and MLA "
                        "at 96 heads, hidden 7168, 896 experts) or k3-tp8 (one rank's share at tensor parallelism "
                        "8: 12 heads); all but tiny are generated into the cache by `k3conf regen --shapes SET`")


def add_tp_options(p) -> None:
    """--tp / --dist / --tp-timeout (shared by run and decode; see conformance.tp)."""
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks, one process each over torch.distributed (run: the model traces)")
    p.add_argument("--dist", choices=("gloo", "nccl"), default=None,
                   help="collective backend for --tp (default: nccl when every rank has a GPU, else gloo)")
    p.add_argument("--tp-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a collective may wait before the ranks give up (default 60)")


def run(args) -> int:
    check_cuda_env()
    guard_this_process()   # the goldens and the judge live here: no other process of this user reads them
    if args.tp != 1:
        return run_tp_command(args)
    cases = pick_cases(args.config, args.cases)
    root = golden_root(args.golden, args.config)
    report_dir = args.report.resolve()
    check_report_dir(report_dir)
    pool = WorkerPool(args.timeout)
    try:
        checks = check_backends(args.backend, pool)
    except BaseException:
        pool.close()
        raise
    console = Console() if sys.stdout.isatty() else Console(width=160)
    report = run_with_progress(cases, args, root, console, checks, pool)
    return rep.present(report, report_dir, "k3conf run", console)


def run_with_progress(cases, args, root: Path, console, checks, pool):
    """The run's report; a progress bar on a terminal when there are more than a handful of cases."""
    step = None if args.no_fuzz else fuzz_step(args.fuzz, args.report.resolve() / "fuzz", cores_run_by(cases))
    if not (console.is_terminal and len(cases) > 10):
        return run_cases(cases, args.backend, root, config=args.config, timing=not args.no_timing,
                         timeout=args.timeout, checks=checks, pool=pool, fuzz=step)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("k3conf run", total=None)

        def progress(done, total, label):
            bar.update(task, completed=done, total=total, description=label)

        return run_cases(cases, args.backend, root, config=args.config, timing=not args.no_timing,
                         timeout=args.timeout, progress=progress, checks=checks, pool=pool, fuzz=step)
