"""`k3conf run --tp N --backend B`: the model traces on N ranks with B's cores, gated against the TP 1 goldens.

The parent (or rank 0 under torchrun) reads the goldens, refuses an impossible plan before any process
starts, runs the ranks (conformance.tp.launch; each rank builds B by its name and calls B's cores on its
shard's shapes: H / N heads), and gates rank 0's outputs through the runner's own per-case code
(`runner.Runner.run_one`) at B's precision, so a TP result reads like any other row of the report; the
backend column says `<B>-tp<N>`. Below fp64 the bound is the precision's baseline (numpy32, torch-bf16) on the
same case at TP 1, as for one process. Each result's notes list every rank: pid, bytes read from the golden
file, bytes held, the routed-expert bytes served from the mapping, and the plan's bytes for that rank. When
a tensor fails, the rank whose partial sum at that layer differs from its share of the golden is named
(`blame`).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from conformance import runner as _runner
from conformance.backends.protocol import BackendBase, WholeModelBackend
from conformance.cases.engine_routes import HOST_CORES
from conformance.cases.protocol import Evaluation, RunInfo
from conformance.cases.trace_run import check_forced, forcing_budgets
from conformance.cases.traces import PROMPT, forced_notes, judge_tokens, model_name
from conformance.golden.errors import GoldenError
from conformance.isolation.client import DEFAULT_TIMEOUT, WorkerPool
from conformance.metadata import collect as collect_metadata
from conformance.session import SessionError, load_backend
from conformance.tp.blame import blame_ranks
from conformance.tp.launch import TpFailure, check_dist, spawn, under_torchrun
from conformance.tp.lifetime import TpStopped
from conformance.tp.rank import make_plan, read_result, run_job
from k3ref.config import K3Config
from k3ref.cores import CORE_NAMES, Cores

TRACE_KIND = "trace"
DEFAULT_BACKEND = "numpy64"


@dataclasses.dataclass
class TpBackend(BackendBase):
    """The row of a TP run: backend `inner` (built by its name `spec`) on `tp` ranks, which run its cores; this
    process only gates rank 0's outputs, at the inner backend's precision."""

    inner: BackendBase
    spec: str
    tp: int
    dist: str
    precision: str = dataclasses.field(init=False)
    name: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.name, self.precision = f"{self.inner.name}-tp{self.tp}", self.inner.precision

    def available(self) -> tuple[bool, str]:
        ok, why = self.inner.available()
        return ok, f"{self.tp} ranks over torch.distributed ({self.dist}), each running {self.inner.name}: {why}"

    def cores(self) -> Cores:
        return self.inner.cores()

    def kernel_cores(self) -> frozenset[str]:
        return self.inner.kernel_cores()


def tp_backend(spec: str, tp: int, dist: str) -> TpBackend:
    """The TP row of backend `spec`, as a worker process describes it (its module is never imported here: each
    rank loads it in a worker of its own); ValueError when it cannot run on ranks: a whole-model backend runs the
    trace by its own wiring (no cores for a rank to call on its shard), or one unavailable or unknown here."""
    pool = WorkerPool()
    try:
        inner = load_backend(spec, pool)
    except SessionError as e:
        raise ValueError(str(e)) from None
    finally:
        pool.close()
    if isinstance(inner, WholeModelBackend):
        raise ValueError(f"backend {spec} runs whole traces by its own wiring: --tp needs a backend of cores, "
                         "which each rank calls on its shard")
    ok, why = inner.available()
    if not ok:
        raise ValueError(f"backend {spec} cannot run here: {why}")
    return TpBackend(inner, spec, tp, dist)


@dataclasses.dataclass
class TpRunReport(_runner.RunReport):
    """A RunReport plus, per case, every rank's row: rank, pid, bytes read and held, the plan's bytes."""

    ranks: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "tp_ranks": self.ranks}


class _TpRunner(_runner.Runner):
    """The runner with the outputs of a case taken from the ranks instead of computed here."""

    def __init__(self, root: Path, config: str, outputs: dict[str, Evaluation]):
        super().__init__(root, config, timing=False)
        self.tp_outputs = outputs

    def evaluate(self, case, golden, backend):
        """The ranks' outputs for the TP row; any other backend (the precision's baseline) runs as in one process."""
        if isinstance(backend, TpBackend):
            return self.tp_outputs[case.name]
        return super().evaluate(case, golden, backend)

    def baseline_errors(self, case, golden, precision):
        """The precision's baseline on the same case at TP 1, run as one process runs it (fp64: none)."""
        return _runner.Runner.baseline_errors(self, case, golden, precision)

    def close(self) -> None:
        self.pool.close()


def check_plan(config: str, tp: int, mutant: str | None = None):
    """The plan, or ValueError before any process starts (heads not divisible, a rank without experts)."""
    return make_plan(K3Config.preset(config), tp, mutant)


def _rank_notes(rows: list[dict], source: str) -> list[str]:
    return [f"rank {r['rank']} (pid {r['pid']}): read {r['bytes_read']:,} B of {source}, holds {r['resident']:,} B "
            f"of weights, its routed experts ({r['mapped']:,} B) served from the mapping ({r['copied_experts']} "
            f"copied); plan for this rank {r['plan_bytes']:,} B ({r['plan_replicated']:,} B replicated)"
            for r in rows]


def execute(job: dict, workdir: Path | None = None, on_start=None) -> dict:
    """Run `job` on its ranks (spawned, or in place under torchrun); rank 0's result, {} on other ranks."""
    if under_torchrun():   # this process is a rank; torchrun's agent ends the others when it fails
        try:
            return run_job(job) or {}
        except TpStopped:
            raise
        except Exception as e:  # noqa: BLE001 - reported as this rank's cause, exit 1
            raise TpFailure(f"rank {os.environ.get('RANK')} (pid {os.getpid()}): {type(e).__name__}: {e}") from e
    with tempfile.TemporaryDirectory(prefix="k3conf-tp-") as tmp:
        wd = Path(workdir) if workdir else Path(tmp)
        job = dict(job, workdir=str(wd))
        spawn(job, wd, on_start=on_start)
        return read_result(wd)


def run_tp(cases, root: Path, *, config: str, tp: int, dist: str, timeout: float, mutant: str | None = None,
           workdir: Path | None = None, on_start=None, backend: str = DEFAULT_BACKEND,
           worker_timeout: float = DEFAULT_TIMEOUT):
    """Run the trace `cases` on `tp` ranks with the cores of `backend` (a name get_backend knows); a RunReport
    (rank 0), or None on the other torchrun ranks. timeout: of a collective; worker_timeout: of a core call in a
    rank's worker process."""
    check_dist(dist, tp)
    check_plan(config, tp, mutant)
    t0 = time.perf_counter()
    row_backend = tp_backend(backend, tp, dist)
    cases, results = _splittable(cases, tp, mutant, row_backend)
    runner = _TpRunner(root, config, {})   # rank 0 reads (and checks) the goldens after the run, to gate
    job = {"kind": "trace", "tp": tp, "dist": dist, "timeout": timeout, "config": config, "golden_root": str(root),
           "cases": [c.name for c in cases], "mode": {c.name: c.params["mode"] for c in cases}, "mutant": mutant,
           "model": {c.name: model_name(c) for c in cases}, "backend": backend, "worker_timeout": worker_timeout,
           "prompt": {c.name: c.params.get("prompt", len(PROMPT)) for c in cases}}
    result = execute(job, workdir, on_start) if cases else {"tensors": {}, "ranks": {}}
    if not result:
        return None
    per_case: dict[str, dict] = {c.name: {} for c in cases}
    for key, v in result["tensors"].items():
        case, name = key.split("::", 1)
        per_case[case][name] = v
    try:
        for case in cases:
            outs = per_case[case.name]
            golden = runner.golden(case)
            if not isinstance(golden, GoldenError):   # else run_one reports the broken golden
                runner.tp_outputs[case.name] = rank_evaluation(golden, outs, row_backend, _rank_notes(
                    result["ranks"][case.name], f"golden/{case.name}"))
            res = runner.run_one(case, row_backend)
            if res.status == "fail":
                res.notes.extend(blame(case, golden, outs, tp, row_backend.precision))
            results.append(res)
    finally:
        runner.close()
    ok, why = row_backend.available()
    row = {"name": row_backend.name, "precision": row_backend.precision, "available": ok, "reason": why,
           "backend": backend, "isolation": ISOLATION_NOTE, "must_judge": True}   # a run that judged nothing fails
    wall = time.perf_counter() - t0
    return TpRunReport(config, [row], results, wall, {}, ranks=result["ranks"],
                       metadata=collect_metadata(root=root, config=config, duration=wall))


ISOLATION_NOTE = ("in a worker process of each rank, sent each core call's inputs (never the golden the rank reads), "
                  "on its own copies, checked for writes; a crash or exit names the rank, a hang ends at the time "
                  "limit")


def rank_evaluation(golden, outs: dict, backend: TpBackend, rank_notes: list[str]) -> Evaluation:
    """What the ranks returned for one case, as the trace kind's own evaluation reads: the traced tensors, the
    notes (every rank's bytes; the cores that ran the reference instead, on which rank), the greedy tokens
    judged against the golden's near-ties, and which kernels ran (on any rank)."""
    info_rows = np.asarray(outs.get("tp.info", np.zeros((0, 2 * len(CORE_NAMES) + 2), np.int64)))
    why = bytes(np.asarray(outs.get("tp.note", np.zeros(0, np.uint8)), np.uint8)).decode()
    outs = {k: v for k, v in outs.items() if not k.startswith("tp.")}   # the partials stay for blame
    n = len(CORE_NAMES)
    own = backend.kernel_cores()
    notes = list(rank_notes)
    notes += [f"{core}: k3ref's reference core ran (not a kernel core of {backend.inner.name})"
              for core in CORE_NAMES if core in HOST_CORES and core not in own]
    ran = set()
    for r, row in enumerate(info_rows):
        calls, falls = row[:n], row[n:2 * n]
        ran |= {c for c, k, f in zip(CORE_NAMES, calls, falls, strict=True) if k > f}
        for c, k, f in zip(CORE_NAMES, calls, falls, strict=True):
            if f:
                notes.append(f"rank {r}: {c}: k3ref's reference core ran instead on {f} of {k} call(s)"
                             + (f" (UnsupportedShape on rank 0: {why})" if r == 0 and why else ""))
        notes.append(f"rank {r}: routed-expert bytes handed out by its memory-mapped store: {int(row[2 * n + 1]):,}")
    forced = int(info_rows[:, 2 * n].sum()) if len(info_rows) else 0
    info = RunInfo(teacher_forced={"router": forced, "argmax": 0})
    judge_tokens(golden, outs, forcing_budgets(backend.precision, golden.kwargs["mode"]).get("argmax", 0.0), info)
    check_forced(backend.precision, info.teacher_forced)
    notes += forced_notes(backend.precision, info.teacher_forced)
    info.kernels_ran = sorted(ran)
    return Evaluation(outs, notes, info)


def merge_reports(reports: list[TpRunReport]) -> TpRunReport:
    """One report of the runs of several backends (their rows, results and rank rows, by backend)."""
    first = reports[0]
    if len(reports) == 1:
        return first
    ranks = {f"{r.backends[0]['name']}::{case}": rows for r in reports for case, rows in r.ranks.items()}
    return TpRunReport(first.config, [b for r in reports for b in r.backends], [x for r in reports for x in r.results],
                       sum(r.wall_seconds for r in reports), {}, ranks=ranks,
                       metadata={**first.metadata, "duration_s": sum(r.wall_seconds for r in reports)})


def _splittable(cases, tp: int, mutant: str | None, backend):
    """(the cases whose model splits over `tp` ranks, a skip result for each of the others with the reason):
    e.g. k3geom's 2 heads do not split over 4 ranks, while tiny's 4 do."""
    keep, skipped = [], []
    for case in cases:
        try:
            check_plan(model_name(case), tp, mutant)
            keep.append(case)
        except ValueError as e:
            skipped.append(_runner.CaseResult(case.name, case.block, backend.name, backend.precision, "skip",
                                              error=f"--tp {tp} does not split model {model_name(case)}: {e}"))
    return keep, skipped


def blame(case, golden, outs: dict, tp: int, precision: str = "fp64") -> list[str]:
    """Which rank's partial sum is wrong at the first failing layer (layerwise traces; [] when unknown)."""
    try:
        return blame_ranks(case, golden, outs, tp, precision)
    except Exception as e:  # noqa: BLE001 - attribution is a hint on a failure already reported
        return [f"could not attribute the failure to a rank: {type(e).__name__}: {e}"]
