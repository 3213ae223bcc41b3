"""`k3conf run`: every case on every backend, gated; terminal table + report.json/md/html."""
from __future__ import annotations

import sys
from pathlib import Path

from ..cli import UsageError


def register(sub) -> None:
    p = sub.add_parser("run", help="run the conformance cases on the backends and gate the results",
                       description="Exit 0: all pass; 1: a failed gate or a broken golden; 2: bad usage.")
    p.add_argument("--backend", action="extend", nargs="+", metavar="B",
                   help="backends to run (default: every available one; see `k3conf list`), e.g. numpy32 "
                        "mutant:mla-scale-128, or MODULE:ATTR / ./file.py:ATTR for a backend defined outside "
                        "the package (docs/external_backends.md)")
    p.add_argument("--config", choices=("tiny", "small"), default="tiny", help="case set (default tiny)")
    p.add_argument("--cases", action="extend", nargs="+", metavar="GLOB",
                   help="case-name globs, e.g. 'kda_*' or kda_decode (a block name selects its cases)")
    p.add_argument("--report", type=Path, default=Path("reports"), metavar="DIR",
                   help="write report.json, report.md, report.html here (default reports/)")
    p.add_argument("--golden", type=Path, default=None, metavar="DIR",
                   help="golden directory (default golden/ for tiny, the cache for small)")
    p.add_argument("--no-timing", action="store_true", help="skip the speed measurements")
    p.set_defaults(func=run)


def pick_cases(config: str, patterns):
    """The selected cases; UsageError when none match."""
    from ..cases import all_cases, select

    cases = select(all_cases(config), patterns)
    if not cases:
        raise UsageError(f"no case matches {patterns} in config {config!r}; `k3conf list cases` shows them")
    return cases


def run(args) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from .. import report as rep
    from ..backends import get_backend
    from ..external import BackendError, check_cores, is_external
    from ..goldens import MANIFEST, default_root
    from ..runner import run as run_cases

    cases = pick_cases(args.config, args.cases)
    why_not = {}
    for name in args.backend or []:
        try:
            backend = get_backend(name)
            ok, why = backend.available()
            if ok and is_external(name):    # an author's cores: on a tiny input first, to name a wrong one
                check_cores(backend)
        except KeyError as e:
            raise UsageError(e.args[0]) from None
        except BackendError as e:
            raise UsageError(str(e)) from None
        if not ok:
            why_not[name] = why
    if args.backend and len(why_not) == len(set(args.backend)):
        raise UsageError("none of the requested backends can run here: "
                         + "; ".join(f"{n}: {w}" for n, w in why_not.items()))
    root = args.golden or default_root(args.config)
    if not (root / MANIFEST).exists():
        raise UsageError(f"no goldens in {root} (no {MANIFEST}); generate them with: k3conf regen --config {args.config}"
                         + (f" --out {root}" if args.golden else ""))
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if console.is_terminal and len(cases) > 10:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("k3conf run", total=None)

            def progress(done, total, label):
                bar.update(task, completed=done, total=total, description=label)

            report = run_cases(cases, args.backend, root, config=args.config, timing=not args.no_timing,
                               progress=progress)
    else:
        report = run_cases(cases, args.backend, root, config=args.config, timing=not args.no_timing)
    rep.print_terminal(report, console)
    try:
        paths = rep.write_reports(report, args.report)
    except OSError as e:
        raise UsageError(f"cannot write the reports to {args.report} ({e}); pass --report DIR") from None
    console.print(f"reports: {', '.join(str(p) for p in paths)}", highlight=False)
    return report.exit_code
