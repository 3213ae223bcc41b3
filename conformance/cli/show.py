"""`k3conf show CASE`: a golden's metadata and tensors (shape, dtype, min/max/mean/rms)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from conformance.cases.catalog import all_cases
from conformance.cases.protocol import CONFIGS
from conformance.cli.usage import UsageError
from conformance.golden.errors import GoldenError
from conformance.golden.store import GROUPS, default_root, read_golden


def register(sub) -> None:
    p = sub.add_parser("show", help="show a golden's tensors with shapes, dtypes and statistics")
    p.add_argument("case", help="case name, e.g. kda_decode/B2-H3-K16")
    p.add_argument("--config", choices=CONFIGS, default="tiny")
    p.add_argument("--golden", type=Path, default=None, metavar="DIR", help="golden directory")
    p.set_defaults(func=run)


def stats(a: np.ndarray) -> str:
    """min / max / mean / rms over the finite elements, and the count of non-finite ones."""
    f = a.astype(np.float64)
    fin = f[np.isfinite(f)]
    bad = f.size - fin.size
    if fin.size == 0:
        return f"all {f.size} non-finite"
    s = (f"min {fin.min():.6g}  max {fin.max():.6g}  mean {fin.mean():.6g}  "
         f"rms {np.sqrt(np.mean(fin * fin)):.6g}")
    return s + (f"  ({bad} non-finite)" if bad else "")


def run(args) -> int:
    names = [c.name for c in all_cases(args.config)]
    if args.case not in names:
        near = [n for n in names if n.split("/")[0] == args.case.split("/")[0]] or names[:10]
        raise UsageError(f"unknown case {args.case!r} in config {args.config!r}; e.g. {near}")
    try:
        g = read_golden(args.golden or default_root(args.config), args.case, config=args.config)
    except GoldenError as e:
        raise UsageError(str(e)) from None
    print(f"{g.case}  ({g.path})")
    for k, v in sorted(g.meta.items()):
        print(f"  {k}: {v}")
    width = max(map(len, g.tensors))
    for name in sorted(g.tensors, key=lambda n: (GROUPS.index(n.split(".")[0]), n)):
        a = g.tensors[name]
        print(f"  {name:<{width}}  {str(a.dtype):8s} {str(list(a.shape)):18s} {stats(a)}")
    return 0
