"""`k3conf calibrate DUMPS... --checkpoint DIR --out FILE`: a budget table from a deployment's own clean dumps.

Each dump (of a correct engine running the deployment's precision recipe: fp8 KV, a bf16 state, its TP layout)
is recomputed in float64 like `k3conf compare` does, and becomes its worst value per budget row; each row's
limit is the margin times the largest over the dumps (conformance/dumps/calibrate.py). `k3conf compare DUMP
--checkpoint DIR --budgets FILE` then judges by it. Use many prompts (the committed table used hundreds);
the dumps' geometry and dtype key the rows. Exit 0 with the table written, 2 for a bad dump or usage.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from conformance.cli.usage import UsageError
from conformance.dumps.budgets import MARGIN
from conformance.dumps.calibrate import dump_stats, table_json, write_json
from conformance.dumps.errors import DumpError

__all__ = ["register", "run"]


def margin(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not x >= 1:
        raise argparse.ArgumentTypeError(f"expected a margin >= 1, found {text!r}")
    return x


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="derive compare budgets from clean dumps of a deployment's own engine",
                       description="Exit 0: the table is written; 2: a bad dump or bad usage. "
                                   "See docs/dumps_compare.md.")
    p.add_argument("dumps", type=Path, nargs="+", metavar="DUMP", help="clean dumps (docs/dumps.md)")
    p.add_argument("--checkpoint", type=Path, required=True, metavar="DIR", help="the checkpoint they ran")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="the budget table (JSON) to write")
    p.add_argument("--engine", default="", help="what made the dumps, for the table's reasons")
    p.add_argument("--margin", type=margin, default=MARGIN, help=f"limit = margin x the worst (default {MARGIN})")
    p.set_defaults(func=run)


def run(args) -> int:
    if not (args.checkpoint / "config.json").is_file():
        raise UsageError(f"--checkpoint: expected a checkpoint directory with config.json, found {args.checkpoint}")
    stats = []
    for d in args.dumps:
        try:
            stats.append(dump_stats(d, args.checkpoint))
        except DumpError as e:
            raise UsageError(f"{d}: {e}") from None
        print(f"{d}: {len(stats[-1].worst)} rows measured", file=sys.stderr)
    command = "k3conf calibrate " + " ".join(map(str, args.dumps)) + f" --checkpoint {args.checkpoint}"
    table = table_json(stats, command=command, engine=args.engine or "; ".join(sorted({s.dtype for s in stats})),
                       prompts=f"{len(stats)} clean dumps", margin=args.margin)
    write_json(args.out, table)
    for r in table["rows"]:
        m = r["measured"]
        print(f"{r['geometry']:<7} {r['dtype']:<9} {r['row']:<20} limit {r['limit']:.3g}  max {m['max']:.3g}  "
              f"n {int(m['n'])}")
    print(f"wrote {args.out}: k3conf compare DUMP --checkpoint {args.checkpoint} --budgets {args.out}")
    return 0
