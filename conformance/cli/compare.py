"""`k3conf compare DUMP --checkpoint DIR`: an engine's per-layer dump against a float64 recompute of each layer
from the dump's own inputs; the layer and sublayer where the divergence starts, the layers that carry it.

Exit 0: every judged layer within budget and the tokens agree; 1: a source, a token disagreement or a missing
layer; 2: a bad dump (named), bad usage or a checkpoint that does not fit the dump. With `--control DUMP` the
candidate is also judged against a trusted dump of the same prompts (control.py): exit 1 as well when a layer
adds more than the control's error allows, or its precision recipe differs. docs/dumps_compare.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from conformance.cli.usage import UsageError
from conformance.dumps.calibrate import read_table
from conformance.dumps.control import ControlVerdict, common_steps, control_limit, judge_against, same_prompts
from conformance.dumps.distributed import NotDistributed, check_environment
from conformance.dumps.errors import DumpError
from conformance.dumps.format import Dump
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
    p.add_argument("--control", type=Path, default=None, metavar="DUMP",
                   help="a dump of the same prompts from a trusted configuration: judge the candidate's added "
                        "divergence per sublayer against the control's (both against the float64 recompute)")
    p.add_argument("--budgets", type=Path, default=None, metavar="FILE",
                   help="a budget table from `k3conf calibrate` (default: the committed one)")
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
    table = None
    if args.budgets is not None:
        try:
            table = read_table(args.budgets)
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"--budgets {args.budgets}: expected a table written by `k3conf calibrate`, found "
                             f"{e}") from None
    done = _compare(args, args.dump, table)
    if done is None:          # a torchrun rank other than 0: rank 0 reports
        return 0
    report, how = done
    against: ControlVerdict | None = None
    if args.control is not None:
        against = _against(args, report, table)
    if args.json:
        doc = json.loads(report_json(report, how))
        if against is not None:
            doc["control"] = against.to_json()
        print(json.dumps(doc, indent=1, sort_keys=True, allow_nan=False))
    else:
        title = (f"compared: {args.dump} (engine {report.engine!r}, {report.dtype}, TP {report.tp_size}) "
                 f"against {args.checkpoint}")
        print("\n".join(text_lines(report, title=title)))
        if against is not None:
            print("\n".join(against.lines()))
    if args.report is not None:
        try:
            paths = write_reports(report, how, args.report)
        except OSError as e:
            print(f"k3conf compare: cannot write the reports to {args.report} ({e.strerror or e}); none was written",
                  file=sys.stderr)
            return report.exit_code or 2
        print(f"reports: {', '.join(map(str, paths))}", file=sys.stderr if args.json else sys.stdout)
    return max(report.exit_code, 0 if against is None else against.exit_code)


def _compare(args, dump: Path, table):
    try:
        return compare_spread(dump, args.checkpoint, layers=args.layers, workers=args.workers,
                              free=not args.no_free_run, distributed=args.distributed, table=table)
    except DumpError as e:
        raise UsageError(f"{dump}: {e}") from None
    except ValueError as e:   # layers not dumped, a checkpoint that does not hold the layers or their shapes
        raise UsageError(str(e)) from None


def _against(args, report, table) -> ControlVerdict:
    """The candidate's report judged against the control's (the control compared here the same way)."""
    try:
        cand, ctrl = Dump.open(args.dump), Dump.open(args.control)
    except DumpError as e:
        raise UsageError(f"--control {args.control}: {e}") from None
    why = same_prompts(cand, ctrl)
    if why:
        raise UsageError(f"--control {args.control}: {why}")
    done = _compare(args, args.control, table)
    assert done is not None       # --distributed ranks other than 0 returned before
    return judge_against(report, done[0], control_limit(cand, table), common_steps(cand, ctrl))
