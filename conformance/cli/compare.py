"""`k3conf compare DUMP --checkpoint DIR`: an engine's per-layer dump against a float64 recompute of each layer
from the dump's own inputs; the layer and sublayer where the divergence starts, the layers that carry it.

Exit 0: every judged layer within budget and the tokens agree; 1: a source, a token disagreement or a missing
layer; 2: a bad dump (named), bad usage or a checkpoint that does not fit the dump. docs/dumps_compare.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conformance.cli.usage import UsageError
from conformance.dumps.distributed import NotDistributed, check_environment
from conformance.dumps.errors import DumpError
from conformance.dumps.report_files import report_json, write_reports
from conformance.dumps.report_text import text_lines
from conformance.dumps.spread import compare_spread

__all__ = ["layer_list", "register", "run"]


def layer_list(text: str) -> list[int]:
    """A --layers value: '1,3', '0-5' or '0-3,7' (ranges inclusive)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            a, dash, b = part.strip().partition("-")
            out += list(range(int(a), int(b) + 1)) if dash else [int(a)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer numbers like 1,3 or 0-5, found {text!r}") from None
    if any(x < 0 for x in out) or not out:
        raise argparse.ArgumentTypeError(f"expected non-negative layer numbers, found {text!r}")
    return out


def positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of workers >= 1, found {text!r}")
    return n


def register(sub) -> None:
    p = sub.add_parser("compare", help="judge an engine's per-layer dump: the layer and sublayer where the error "
                                       "starts, against a float64 recompute from the engine's own inputs",
                       description="Exit 0: every judged layer within budget and the tokens agree; 1: a source "
                                   "of divergence, a token disagreement or a missing layer; 2: a bad dump or "
                                   "bad usage. See docs/dumps_compare.md.")
    p.add_argument("dump", type=Path, metavar="DUMP", help="the dump directory (docs/dumps.md)")
    p.add_argument("--checkpoint", type=Path, required=True, metavar="DIR",
                   help="the checkpoint the engine ran (Hugging Face layout: config.json + safetensors shards)")
    p.add_argument("--layers", type=layer_list, default=None, metavar="L",
                   help="judge only these dumped layers, e.g. 1,3 or 0-5 (default: every dumped layer)")
    p.add_argument("--workers", type=positive, default=1, metavar="N",
                   help="recompute the layers in N worker processes (each holds one layer's weights at a time; "
                        "default 1: in this process)")
    p.add_argument("--no-free-run", action="store_true",
                   help="skip the float64 free run: no carried divergence and no token check (faster; the "
                        "source is still named)")
    p.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help="also write report.json, report.md and report.html (with the per-layer plot) here")
    p.add_argument("--json", action="store_true", help="print report.json's content instead of the text")
    p.add_argument("--distributed", action="store_true",
                   help="under torchrun: rank r recomputes layers r::world, rank 0 writes the report")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.distributed:
        if args.workers != 1:
            raise UsageError("--distributed and --workers: expected one of them (each rank works in its process)")
        try:
            check_environment()
        except NotDistributed as e:
            raise UsageError(str(e)) from None
    if not (args.checkpoint / "config.json").is_file():
        raise UsageError(f"--checkpoint: expected a checkpoint directory with config.json, found {args.checkpoint}")
    try:
        done = compare_spread(args.dump, args.checkpoint, layers=args.layers, workers=args.workers,
                              free=not args.no_free_run, distributed=args.distributed)
    except DumpError as e:
        raise UsageError(f"{args.dump}: {e}") from None
    except ValueError as e:   # layers not dumped, a checkpoint that does not hold the layers or their shapes
        raise UsageError(str(e)) from None
    if done is None:          # a torchrun rank other than 0: rank 0 reports
        return 0
    report, how = done
    if args.json:
        print(report_json(report, how))
    else:
        title = (f"compared: {args.dump} (engine {report.engine!r}, {report.dtype}, TP {report.tp_size}) "
                 f"against {args.checkpoint}")
        print("\n".join(text_lines(report, title=title)))
    if args.report is not None:
        try:
            paths = write_reports(report, how, args.report)
        except OSError as e:
            print(f"k3conf compare: cannot write the reports to {args.report} ({e.strerror or e}); none was written",
                  file=sys.stderr)
            return report.exit_code or 2
        print(f"reports: {', '.join(map(str, paths))}", file=sys.stderr if args.json else sys.stdout)
    return report.exit_code
