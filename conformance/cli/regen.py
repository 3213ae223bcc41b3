"""`k3conf regen`: (re)generate goldens from the k3ref float64 references, deterministically.

Refuses to overwrite a golden whose content changed unless --accept (then shows what changed);
--check recomputes and compares without writing (exit 1 with a per-tensor drift summary).
"""
from __future__ import annotations

from pathlib import Path

from conformance.cases.catalog import all_cases
from conformance.cli.run import add_shape_options
from conformance.cli.usage import UsageError
from conformance.golden.drift import ROUNDING_DRIFT
from conformance.golden.regen import RegenOutcome, regenerate
from conformance.golden.store import COMMITTED_ROOT, default_root
from conformance.session import pick_cases


def register(sub) -> None:
    p = sub.add_parser("regen", help="regenerate goldens (deterministic; --check to verify, --accept to overwrite)")
    p.add_argument("--cases", action="extend", nargs="+", metavar="GLOB", help="case-name globs (default: all)")
    p.add_argument("--check", action="store_true", help="recompute and compare; write nothing; exit 1 on drift")
    p.add_argument("--accept", action="store_true", help="overwrite goldens whose content changed")
    add_shape_options(p)   # tiny goes to golden/ (committed), the other sets to $K3CONF_CACHE or ~/.cache/k3conf
    p.add_argument("--out", type=Path, default=None, metavar="DIR", help="golden directory to write")
    p.set_defaults(func=run)


_SAY = {
    "new": "written", "unchanged": "unchanged", "rounding": "unchanged (rounding-level drift only, file kept)",
    "changed": "CHANGED, not overwritten (rerun with --accept to overwrite)", "accepted": "changed, overwritten",
    "drift": "DRIFT", "missing": "MISSING",
    "stale": "STALE manifest entry (no case of this config owns it; k3conf regen prunes it)",
    "pruned": "stale manifest entry pruned (no case of this config owns it; the file, if any, is left alone)",
    "leftover": "LEFTOVER temporary file of an interrupted regen (k3conf regen removes it)",
    "removed": "temporary file of an interrupted regen removed",
}


def run(args) -> int:
    if args.check and args.accept:
        raise UsageError("--check writes nothing; it cannot be combined with --accept")
    cases = pick_cases(args.config, args.cases)
    root = args.out or default_root(args.config)
    if args.config != "tiny" and _inside(root, COMMITTED_ROOT):
        raise UsageError(f"--out {root}: the committed golden/ holds the tiny set only; the {args.config} goldens go "
                         f"to the cache ({default_root(args.config)}) or another --out DIR")
    try:
        if root.exists() and not root.is_dir():
            raise UsageError(f"--out {root}: is a file, expected a golden directory (or a path to create one at)")
    except OSError as e:   # a name too long, a path through a file
        raise UsageError(f"--out {str(root)[:300]}: not usable as a golden directory ({e.strerror})") from None
    known = [c.name for c in all_cases(args.config)]
    try:
        outcomes = regenerate(cases, root, check=args.check, accept=args.accept, known=known,
                              config=args.config)
    except OSError as e:
        raise UsageError(f"cannot write the goldens to {str(root)[:300]} ({e.strerror}: {e.filename}); "
                         f"`k3conf regen --check{' --out ' + str(root) if args.out else ''}` says what is there "
                         "now, or pass --out DIR") from None
    for line in report_lines(outcomes, {c.name for c in cases}, root):
        print(line)
    bad = [o for o in outcomes if o.failed]
    if bad and not args.check:
        print(f"{len(bad)} golden(s) changed and were kept; inspect the drift above, then rerun with --accept")
    if bad and args.check:
        print("to fix: " + "; ".join(_fixes(bad, args)))
    return 1 if bad else 0


# Per case that needs a look, its drift lines are cut to the largest few (a model trace moves hundreds of tensors).
DRIFT_LINES = 12


def report_lines(outcomes: list[RegenOutcome], names: set[str], root: Path) -> list[str]:
    """What a regeneration says: one block per case that needs action or was written (with its largest drift),
    then one summary line; identical goldens and rounding-level drift are counted there, not listed, with the
    largest rounding drift named so a person sees how far below the rule it stayed."""
    lines = []
    for o in outcomes:
        if o.status in ("unchanged", "rounding"):
            continue
        lines.append(f"{o.case}: {_SAY[o.status]}  [{o.path}]")
        shown = sorted(o.drift, key=lambda d: (not d.detail, -d.rounding_rms))[:DRIFT_LINES]   # metadata first
        lines += [f"    {d.line()}" for d in o.drift if d in shown]
        if len(o.drift) > len(shown):
            lines.append(f"    ... and {len(o.drift) - len(shown)} more tensor(s) changed less")
    counts = {s: sum(o.status == s for o in outcomes) for s in _SAY}
    summary = ", ".join(f"{n} {_COUNTED.get(s, s)}" for s, n in counts.items() if n)
    lines.append(f"{sum(o.case in names for o in outcomes)} case(s) in {root}: {summary or 'nothing to do'}")
    rounding = [(d, o.case) for o in outcomes if o.status == "rounding" for d in o.drift]
    if rounding:
        d, case = max(rounding, key=lambda dc: dc[0].rounding_rms)
        lines.append(f"rounding-level drift (<= {ROUNDING_DRIFT:g} relative RMS; the files are kept): largest "
                     f"{d.rounding_rms:.3g} on {case} {d.name}")
    return lines


_COUNTED = {"rounding": "rounding-only drift (kept)", "changed": "CHANGED", "drift": "DRIFT", "missing": "MISSING",
            "stale": "STALE", "leftover": "LEFTOVER", "accepted": "changed and overwritten", "new": "written"}


def _inside(path: Path, folder: Path) -> bool:
    """True when `path` is `folder` or lies under it (symbolic links resolved)."""
    try:
        return path.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False


def _fixes(bad, args) -> list[str]:
    """The commands that make a failed --check pass: re-list or rewrite exactly the cases named."""
    out_opt = (f" --shapes {args.config}" if args.config != "tiny" else "") + (f" --out {args.out}" if args.out else "")
    relist = [o.case for o in bad if o.status == "drift" and all(d.name == "MANIFEST.json" for d in o.drift)
              or o.status == "missing"]
    rewrite = [o.case for o in bad if o.status == "drift" and o.case not in relist]
    fixes = []
    if relist:
        fixes.append(f"k3conf regen{out_opt} --cases " + " ".join(f"'{c}'" for c in relist))
    if rewrite:
        names = " ".join(f"'{c}'" for c in rewrite)
        fixes.append(f"inspect the drift, then k3conf regen --accept{out_opt} --cases {names}")
    if any(o.status in ("stale", "leftover") for o in bad):
        fixes.append(f"k3conf regen{out_opt} (prunes stale entries, removes leftover temporary files)")
    return fixes
