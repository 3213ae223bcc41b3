"""The `--tp N` branches of `k3conf run` and `k3conf decode`. Bad usage is a SessionError (the command line
prints it and exits 2), so that this front end needs nothing of the command line that calls it.

Exit status: 0 every gate passed, 1 a failed gate or a failed rank, 2 bad usage (found before any rank
starts, the report folder included), 128 + N when signal N (SIGINT, SIGTERM, SIGHUP) stopped the run: then
every rank has been ended and the work directory removed, and one line says so.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import k3cuda
from conformance import report as rep
from conformance.cases.catalog import select
from conformance.session import SessionError, cases_of, check_report_dir, golden_root
from conformance.tp.launch import TpFailure, check_dist, default_dist, under_torchrun
from conformance.tp.lifetime import TpStopped, stop_on_signals
from conformance.tp.rank import make_plan
from conformance.tp.tprun import DEFAULT_BACKEND, TRACE_KIND, check_plan, execute, merge_reports, run_tp, tp_backend
from k3ref.tp_weights import check_geometry
from k3ref.weights import CheckpointReader

T = TypeVar("T")


def _common(args) -> str:
    """The collective backend, or SessionError before any process starts."""
    if args.tp < 1:
        raise SessionError(f"--tp: expected a positive number of ranks, found {args.tp}")
    dist = args.dist or default_dist(args.tp)
    try:
        check_dist(dist, args.tp)
    except TpFailure as e:
        raise SessionError(str(e)) from None
    return dist


def _announce(pids: list[int]) -> None:
    print("tp ranks: " + ", ".join(f"rank {r} pid {p}" for r, p in enumerate(pids)), file=sys.stderr, flush=True)


def run_tp_command(args) -> int:
    """`k3conf run --tp N [--backend B ...]`: the trace cases on N ranks, once per backend (default numpy64), each
    rank calling the backend's cores on its shard; exit 0 all pass, 1 a failure or a failed rank."""
    dist = _common(args)
    try:   # a misspelt K3_CUDA_* escape is a usage error, whichever backend runs
        k3cuda.check_env()
    except ValueError as e:
        raise SessionError(str(e)) from None
    backends = list(dict.fromkeys(args.backend or [DEFAULT_BACKEND]))
    if under_torchrun() and len(backends) > 1:   # a torchrun rank joins its group once
        raise SessionError(f"--tp under torchrun runs one backend per launch, found --backend {' '.join(backends)}")
    for name in backends:   # every backend checked before any rank starts
        try:
            tp_backend(name, args.tp, dist)
        except (KeyError, ValueError) as e:
            raise SessionError(f"--tp {args.tp} --backend {name}: {e.args[0] if isinstance(e, KeyError) else e}") \
                from None
    traces = cases_of(args.config, TRACE_KIND)
    cases = select(traces, args.cases) if args.cases else traces
    if not cases:
        raise SessionError(f"--tp runs the model traces ({', '.join(c.name for c in traces) or 'none'} in config "
                           f"{args.config!r}); no trace case matches {args.cases}")
    try:
        check_plan(args.config, args.tp, args.tp_mutant)
    except ValueError as e:
        raise SessionError(f"--tp {args.tp}: {e}") from None
    root = golden_root(args.golden, args.config)
    check_report_dir(args.report)
    command = f"k3conf run --tp {args.tp}"

    def start():
        reports = [run_tp(cases, root, config=args.config, tp=args.tp, dist=dist, timeout=args.tp_timeout,
                          mutant=args.tp_mutant, on_start=_announce, backend=name,
                          worker_timeout=args.timeout) for name in backends]
        return None if any(r is None for r in reports) else merge_reports(reports)

    report, failed = _on_ranks(command, start)
    if failed is not None:
        return failed
    if report is None:          # a torchrun rank other than 0: rank 0 reports
        return 0
    return rep.present(report, args.report, command)


def _on_ranks(command: str, start: Callable[[], T]) -> tuple[T | None, int | None]:
    """(what `start` returned, None) when the ranks ran to the end; (None, exit status) with one line naming why
    when they were stopped by a signal (128 + N) or one of them failed (1)."""
    try:
        with stop_on_signals():
            return start(), None
    except TpStopped as e:
        print(f"{command}: {e}", file=sys.stderr)
        return None, e.exit_code
    except TpFailure as e:
        print(f"{command}: {e}", file=sys.stderr)
        return None, 1


def decode_tp_command(args, cfg, prompt: list[int], show: Callable[[list[int]], None]) -> int:
    """`k3conf decode --tp N`: greedy decode on N ranks; `show` prints the tokens (rank 0's), as the TP 1 decode
    does."""
    dist = _common(args)
    try:
        plan = make_plan(cfg, args.tp, None)
    except ValueError as e:
        raise SessionError(f"--tp {args.tp}: {e}") from None
    if args.checkpoint:   # the whole geometry, from the headers, once, before any rank allocates
        try:
            check_geometry(plan, CheckpointReader(args.checkpoint).entries)
        except (ValueError, OSError) as e:
            raise SessionError(f"--checkpoint {args.checkpoint}: {e}") from None
    job = {"kind": "decode", "tp": args.tp, "dist": dist, "timeout": args.tp_timeout,
           "config_json": json.loads(json.dumps(dataclasses.asdict(cfg))),
           "checkpoint": str(Path(args.checkpoint).resolve()) if args.checkpoint else None, "seed": args.seed,
           "prompt": prompt, "max_new": args.max_new, "dtype": args.dtype}
    result, failed = _on_ranks(f"k3conf decode --tp {args.tp}", lambda: execute(job, on_start=_announce))
    if failed is not None:
        return failed
    if not result:
        return 0
    for row in result["ranks"]["decode"]:
        print(f"rank {row['rank']} (pid {row['pid']}): read {row['bytes_read']:,} B, holds {row['resident']:,} B "
              f"of weights, its routed experts ({row['mapped']:,} B) served from the mapping "
              f"({row['copied_experts']} expert tensors copied); plan {row['plan_bytes']:,} B "
              f"({row['plan_replicated']:,} B replicated)", file=sys.stderr)
    show(result["tokens"])
    return 0
