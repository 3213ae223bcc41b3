"""`k3conf regen`: (re)generate goldens from the k3ref float64 references, deterministically.

Refuses to overwrite a golden whose content changed unless --accept (then shows what changed);
--check recomputes and compares without writing (exit 1 with a per-tensor drift summary).
"""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("regen", help="regenerate goldens (deterministic; --check to verify, --accept to overwrite)")
    p.add_argument("--cases", action="extend", nargs="+", metavar="GLOB", help="case-name globs (default: all)")
    p.add_argument("--check", action="store_true", help="recompute and compare; write nothing; exit 1 on drift")
    p.add_argument("--accept", action="store_true", help="overwrite goldens whose content changed")
    p.add_argument("--config", choices=("tiny", "small"), default="tiny",
                   help="tiny goes to golden/ (committed); small to $K3CONF_CACHE or ~/.cache/k3conf")
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help="golden directory to write")
    p.set_defaults(func=run)


_SAY = {
    "new": "written", "unchanged": "unchanged", "rounding": "unchanged (rounding-level drift only, file kept)",
    "changed": "CHANGED, not overwritten (rerun with --accept to overwrite)", "accepted": "changed, overwritten",
    "drift": "DRIFT", "missing": "MISSING",
}


def run(args) -> int:
    from ..goldens import default_root, regenerate
    from .run import pick_cases

    if args.check and args.accept:
        from ..cli import UsageError
        raise UsageError("--check writes nothing; it cannot be combined with --accept")
    cases = pick_cases(args.config, args.cases)
    root = args.out or default_root(args.config)
    outcomes = regenerate(cases, root, check=args.check, accept=args.accept)
    for o in outcomes:
        if o.status != "unchanged":
            print(f"{o.case}: {_SAY[o.status]}  [{o.path}]")
        for d in o.drift:
            if o.status != "unchanged":
                print(f"    {d.line()}")
    bad = [o for o in outcomes if o.failed]
    counts = {s: sum(o.status == s for o in outcomes) for s in _SAY}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    print(f"{len(outcomes)} case(s) in {root}: {summary}")
    if bad and not args.check:
        print(f"{len(bad)} golden(s) changed and were kept; inspect the drift above, then rerun with --accept")
    return 1 if bad else 0
