"""The fuzz draws a run makes after its cases: `k3conf run` and the pytest plugin by default, `k3conf fuzz` on its
own.

    step = fuzz_step(seconds=0.0, out_dir=Path("reports/fuzz"))   # runner.run(..., fuzz=step)
    summary = step(runner, backends)                               # FuzzSummary (results, shrunk findings, replays)

Which backends: every judged one but the precision baselines (numpy32, torch-bf16: they set the bounds) and the
float64 reference itself (numpy64). How many draws: one of every region of every core a backend supplies (so each
size threshold and each contract is reached on every run), then, while `seconds` last, further rounds. The draws
come from the run's seed (printed, K3CONF_FRESH_SEED replays it), so a kernel cannot be tuned to them.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from conformance.backends.protocol import BackendBase, WholeModelBackend
from conformance.cases.catalog import kind_of
from conformance.cases.protocol import Case
from conformance.fuzz import replay
from conformance.fuzz.draws import MEMORY_MIB, Draw, Finding, FuzzRunner, fuzz, plan
from conformance.isolation.remote import RemoteBackend
from conformance.judge import gates
from conformance.results import CaseResult, FuzzSummary
from conformance.runner import Runner

REFERENCES = frozenset({"numpy64"})   # the float64 reference: a draw judges it against itself


def judged_backends(backends: list[BackendBase]) -> list[BackendBase]:
    """The backends a run fuzzes: not the float64 reference, not a precision's baseline, not a whole model (it has
    no cores to draw for)."""
    baselines = set(gates.BASELINE.values())
    return [b for b in backends if b.name not in REFERENCES and b.name not in baselines
            and not isinstance(b, WholeModelBackend)]


def spec_of(backend: BackendBase) -> str:
    """The name that loads `backend` again (its MODULE:ATTR for an external one)."""
    return backend.spec if isinstance(backend, RemoteBackend) else backend.name


def fuzz_backends(runner: Runner, backends: list[BackendBase], seconds: float, out_dir: Path | None,
                  seed: int, only: frozenset[str] | None = None, memory_mib: float = MEMORY_MIB) -> FuzzSummary:
    """One round of every region for each backend's kernel cores (those in `only`, when given), then more rounds
    while `seconds` last; every failing draw shrunk and, with `out_dir`, written as a replay file there. A draw
    taking more than `memory_mib` is not judged (counted in the summary)."""
    t0 = time.monotonic()

    def cores(backend: BackendBase) -> frozenset[str]:
        own = backend.kernel_cores()
        return own if only is None else own & only

    fuzz_runner = FuzzRunner(runner, memory_mib)
    results: list[CaseResult] = []
    findings: list[tuple[str, Finding]] = []
    for backend in backends:
        findings += [(spec_of(backend), f) for f in
                     fuzz(fuzz_runner, backend, plan(cores(backend), seed), results=results)]
    extra, deadline = 1, t0 + seconds
    while seconds > 0 and time.monotonic() < deadline and not findings:
        for backend in backends:
            draws: list[Draw] = plan(cores(backend), seed, start=extra)
            findings += [(spec_of(backend), f) for f in fuzz(fuzz_runner, backend, draws,
                                                               deadline - time.monotonic(), results)]
        extra += 1
    replays = [str(replay.write(f, spec, out_dir)) for spec, f in findings] if out_dir is not None else []
    lines = [f.line() + (f"; replay: k3conf fuzz --replay {path}" if path else "")
             for (_, f), path in zip(findings, replays or [""] * len(findings), strict=True)]
    return FuzzSummary(results, lines, replays, seed, time.monotonic() - t0)


def cores_run_by(cases: list[Case]) -> frozenset[str]:
    """The cores `cases` exercise (a trace: every one): a run's selection of cases selects the cores it fuzzes."""
    return frozenset().union(*(kind_of(c).cores_of(c) for c in cases))


def fuzz_step(seconds: float, out_dir: Path | None, only: frozenset[str] | None = None
              ) -> Callable[[Runner, list[BackendBase]], FuzzSummary | None]:
    """The step runner.run calls after the cases (its `fuzz` argument): fuzz_backends over the judged backends,
    with the run's seed, on the cores in `only` (None: every one); None when nothing is fuzzed."""
    def step(runner: Runner, backends: list[BackendBase]) -> FuzzSummary | None:
        mine = judged_backends(backends)
        if not mine or runner.seed is None or (only is not None and not only):
            return None
        return fuzz_backends(runner, mine, seconds, out_dir, runner.seed, only)
    return step


__all__ = ["REFERENCES", "cores_run_by", "fuzz_backends", "fuzz_step", "judged_backends", "spec_of"]
