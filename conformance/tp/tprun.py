"""`k3conf run --tp N`: the model traces on N ranks, gated against the same goldens as TP 1.

The parent (or rank 0 under torchrun) reads the goldens, refuses an impossible plan before any process
starts, runs the ranks (conformance.tp.launch), and gates rank 0's outputs through the runner's own
per-case code (`runner.Runner.run_one`), so a TP result reads like any other row of the report; the
backend column says `numpy64-tp<N>`. Each result's notes list every rank: pid, bytes read from the golden
file, bytes held, and the plan's bytes for that rank. When a tensor fails, the rank whose partial sum at
that layer differs from its share of the golden is named (`blame`).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

from conformance import runner as _runner
from conformance.backends.protocol import BackendBase
from conformance.cases.protocol import Evaluation
from conformance.cases.traces import PROMPT, model_name
from conformance.tp.blame import blame_ranks
from conformance.tp.launch import TpFailure, check_dist, spawn, under_torchrun
from conformance.tp.lifetime import TpStopped
from conformance.tp.rank import make_plan, read_result, run_job
from k3ref.config import K3Config
from k3ref.cores import Cores, reference_cores

TRACE_KIND = "trace"


@dataclasses.dataclass
class TpBackend(BackendBase):
    """The row label of a TP run: the reference cores at float64 on `tp` ranks (which run them; this process
    only gates rank 0's outputs)."""

    tp: int
    dist: str
    precision: str = "fp64"
    name: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.name = f"numpy64-tp{self.tp}"

    def available(self) -> tuple[bool, str]:
        return True, f"{self.tp} ranks over torch.distributed ({self.dist})"

    def cores(self) -> Cores:
        return reference_cores()


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
        return self.tp_outputs[case.name]

    def baseline_errors(self, case, golden, precision):
        return None, None        # fp64 rows are absolute bounds: no baseline


def check_plan(config: str, tp: int, mutant: str | None = None):
    """The plan, or ValueError before any process starts (heads not divisible, a rank without experts)."""
    return make_plan(K3Config.preset(config), tp, mutant)


def _rank_notes(rows: list[dict], source: str) -> list[str]:
    return [f"rank {r['rank']} (pid {r['pid']}): read {r['bytes_read']:,} B of {source}, holds {r['resident']:,} B "
            f"of weights; plan for this rank {r['plan_bytes']:,} B ({r['plan_replicated']:,} B replicated)"
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
           workdir: Path | None = None, on_start=None):
    """Run the trace `cases` on `tp` ranks; a RunReport (rank 0), or None on the other torchrun ranks."""
    check_dist(dist, tp)
    check_plan(config, tp, mutant)
    t0 = time.perf_counter()
    backend = TpBackend(tp, dist)
    cases, results = _splittable(cases, tp, mutant, backend)
    runner = _TpRunner(root, config, {})   # rank 0 reads (and checks) the goldens after the run, to gate
    job = {"kind": "trace", "tp": tp, "dist": dist, "timeout": timeout, "config": config, "golden_root": str(root),
           "cases": [c.name for c in cases], "mode": {c.name: c.params["mode"] for c in cases}, "mutant": mutant,
           "model": {c.name: model_name(c) for c in cases},
           "prompt": {c.name: c.params.get("prompt", len(PROMPT)) for c in cases}}
    result = execute(job, workdir, on_start) if cases else {"tensors": {}, "ranks": {}}
    if not result:
        return None
    per_case: dict[str, dict] = {c.name: {} for c in cases}
    for key, v in result["tensors"].items():
        case, name = key.split("::", 1)
        per_case[case][name] = v
    for case in cases:
        outs = per_case[case.name]
        runner.tp_outputs[case.name] = Evaluation(outs, _rank_notes(result["ranks"][case.name], f"golden/{case.name}"))
        res = runner.run_one(case, backend)
        if res.status == "fail":
            res.notes.extend(blame(case, runner.golden(case), outs, tp))
        results.append(res)
    ok, why = backend.available()
    row = {"name": backend.name, "precision": backend.precision, "available": ok, "reason": why}
    return TpRunReport(config, [row], results, time.perf_counter() - t0, {}, ranks=result["ranks"])


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


def blame(case, golden, outs: dict, tp: int) -> list[str]:
    """Which rank's partial sum is wrong at the first failing layer (layerwise traces; [] when unknown)."""
    try:
        return blame_ranks(case, golden, outs, tp)
    except Exception as e:  # noqa: BLE001 - attribution is a hint on a failure already reported
        return [f"could not attribute the failure to a rank: {type(e).__name__}: {e}"]
