"""`k3conf run`: every case on every backend, gated; terminal table + report.json/md/html."""
from __future__ import annotations

import sys
from pathlib import Path

from conformance.cli.usage import UsageError


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
    add_tp_options(p)
    p.add_argument("--tp-mutant", default=None, metavar="NAME",
                   help="with --tp: a deliberately wrong TP plan (g_proj-row-split, q_proj-neighbour-heads), to "
                        "see a bad split caught")
    p.set_defaults(func=run)


def add_tp_options(p) -> None:
    """--tp / --dist / --tp-timeout (shared by run and decode; see conformance.tp)."""
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks, one process each over torch.distributed (run: the model traces)")
    p.add_argument("--dist", choices=("gloo", "nccl"), default=None,
                   help="collective backend for --tp (default: nccl when every rank has a GPU, else gloo)")
    p.add_argument("--tp-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a collective may wait before the ranks give up (default 60)")


def pick_cases(config: str, patterns):
    """The selected cases; UsageError when none match."""
    from conformance.cases.core import all_cases, select

    everything = all_cases(config)
    cases = select(everything, patterns)
    if not cases:
        raise UsageError(f"no case matches {patterns} in config {config!r}; `k3conf list cases` shows them")
    idle = [p for p in patterns or [] if not select(everything, [p])]
    if idle:   # a typo next to a good pattern would otherwise drop cases silently
        raise UsageError(f"--cases {' '.join(repr(p) for p in idle)}: matches no case in config {config!r} "
                         "(`k3conf list cases` shows them)")
    return cases


def run(args) -> int:
    from rich.console import Console

    from conformance import report as rep

    if args.tp != 1:
        from conformance.tp.cli import run_tp_command

        return run_tp_command(args)
    cases = pick_cases(args.config, args.cases)
    check_backends(args.backend or [])
    root = golden_root(args)
    check_report_dir(args.report)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    report = run_with_progress(cases, args, root, console)
    rep.print_terminal(report, console)
    try:
        paths = write_reports_together(report, args.report)
    except OSError as e:   # the folder was writable before the run; it is not now
        print(f"k3conf run: cannot write the reports to {args.report} ({e.strerror}); none was written",
              file=sys.stderr)
        return report.exit_code or 2   # a failed gate still says 1
    console.print(f"reports: {', '.join(str(p) for p in paths)}", highlight=False)
    return report.exit_code


def check_backends(names: list[str]) -> None:
    """UsageError for an unknown or unloadable backend name, or when none of the requested ones can run here;
    an external backend's cores are first tried on a tiny input, to name a wrong one before the run."""
    from conformance.backends.external import BackendError, check_cores
    from conformance.backends.registry import get_backend, is_external

    why_not = {}
    for name in names:
        try:
            backend = get_backend(name)
            ok, why = backend.available()
            if ok and is_external(name):
                check_cores(backend)
        except KeyError as e:
            raise UsageError(e.args[0]) from None
        except BackendError as e:
            raise UsageError(str(e)) from None
        if not ok:
            why_not[name] = why
    if names and len(why_not) == len(set(names)):
        raise UsageError("none of the requested backends can run here: "
                         + "; ".join(f"{n}: {w}" for n, w in why_not.items()))


def golden_root(args) -> Path:
    """The golden folder of the run (--golden, else the config's committed one); UsageError when it has no
    manifest, naming the command that makes one."""
    from conformance.golden.store import MANIFEST, default_root

    root = args.golden or default_root(args.config)
    try:
        has_manifest = (root / MANIFEST).is_file()
    except OSError as e:   # a name too long, a path through a file
        raise UsageError(f"--golden {str(root)[:300]}: not usable as a golden directory ({e.strerror})") from None
    if not has_manifest:
        raise UsageError(f"no goldens in {root} (no {MANIFEST}); generate them with: k3conf regen --config {args.config}"
                         + (f" --out {root}" if args.golden else ""))
    return root


def run_with_progress(cases, args, root: Path, console):
    """The run's report; a progress bar on a terminal when there are more than a handful of cases."""
    from rich.progress import Progress

    from conformance.runner import run as run_cases

    if not (console.is_terminal and len(cases) > 10):
        return run_cases(cases, args.backend, root, config=args.config, timing=not args.no_timing)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("k3conf run", total=None)

        def progress(done, total, label):
            bar.update(task, completed=done, total=total, description=label)

        return run_cases(cases, args.backend, root, config=args.config, timing=not args.no_timing,
                         progress=progress)


def check_report_dir(out: Path) -> None:
    """Refuse an unwritable --report before running anything (not after a long run): create the folder
    and a probe file in it."""
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise UsageError(f"--report {str(out)[:300]}: cannot write reports there ({why}); pass --report DIR") from None


def write_reports_together(report, out: Path) -> list[Path]:
    """report.json, .md and .html: all three, or none. They are written into a temporary folder inside
    `out` first and renamed into place only when all three exist, so a failure (disk full, say) never
    leaves a new JSON next to a stale HTML."""
    import os
    import shutil
    import tempfile

    from conformance import report as rep

    tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=out))
    try:
        written = rep.write_reports(report, tmp)
        final = [out / p.name for p in written]
        for src, dst in zip(written, final):
            os.replace(src, dst)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
