"""The conformance runner: every case x backend, every output tensor compared with its golden and gated.

    report = run(cases, backend_names, root)      # -> RunReport; report.exit_code is 0 / 1

Per case the golden is read once (a broken golden makes the case an `error` row carrying the regen
command; the run goes on). Per backend the case's kind runs it, each golden output is compared
(conformance.judge.compare) and judged by its gate row (conformance.judge.gates). Low-precision rows need the error of
the same-precision baseline (fp32: numpy32, bf16: torch-bf16) on the same tensor, so the baseline is run
on the case too (cached) even when it was not asked for; when it cannot run, the cap alone applies and the
row says so. The baseline itself is judged by its absolute row (gates.BASELINE_GATES), never by itself. Each case
is gated by the caps measured on its own shape set (its config); on a set with none measured, no cap applies.
Speed: each (case, backend) with a timer gets bytes/s over the copy bandwidth measured in the same run and its time
over the baseline backend's time; the run pins BLAS to one thread (k3ref.threads), as the references do.

Every (case, backend) ends as one of: pass, fail (a gate failed), error (the backend or the golden broke;
counted as a failure), skip (the backend's core raised UnsupportedShape: valid inputs it is not built for)
or n/a (none of the cores the case exercises is one the backend supplies itself, so only the reference
core would run: nothing of the backend is tested, and the case is not run). A kind may mark tensors as
reported, not gated (the free-running trace's intermediates): they are shown and never fail a case.
Under K3_STRICT=1 a backend that cannot run here, other than those needing an accelerator (DEVICE_BACKENDS), fails
the run with its reason.

Every backend but the built-in NumPy references (IN_PROCESS) is untrusted: its kernels run in a worker process of
its own (conformance.isolation), which is sent each call's inputs and never a golden; the kinds, the host graph of
the traces, the comparison and the gates run here, on what the worker sends back. A crash, an exit, a signal,
anything raised or a core silent past the time limit is an `error` row naming the backend, the core and the case,
and the run goes on. A per-block case runs its kernel twice on the same inputs (candidate, the worker's freed
memory filled with NaN, candidate): the bits must agree unless the backend declares `deterministic = False`. A
per-block case that passes on its golden is judged again on inputs drawn with a fresh seed (conformance.cases.fresh;
the seed is in a note, K3CONF_FRESH_SEED=N replays it), against the same gates and the baseline's larger error, on
those inputs or on the golden. Speed (conformance.timing) is measured on calls whose outputs are judged too.
"""
from __future__ import annotations

import dataclasses
import time
import traceback
import weakref
from pathlib import Path

import numpy as np

from conformance import timing as speed_of
from conformance.backends.protocol import BackendBase
from conformance.backends.registry import IN_PROCESS, get_backend
from conformance.cases.catalog import kind_of
from conformance.cases.fresh import PER_BLOCK_KINDS, env_seed, fresh_golden
from conformance.cases.protocol import Case, Evaluation
from conformance.cases.trace_names import layer_of
from conformance.golden.errors import GoldenError
from conformance.golden.regen import golden_problems
from conformance.golden.store import load_manifest, read_golden, regen_command
from conformance.isolation.client import DEFAULT_TIMEOUT, WorkerPool
from conformance.isolation.errors import KernelFailure
from conformance.isolation.remote import RemoteBackend
from conformance.isolation.repeat import repeat_results
from conformance.judge import gates
from conformance.judge.compare import Comparison, compare
from conformance.judge.diagnose import diagnose_tensor
from conformance.metadata import collect as collect_metadata
from conformance.results import CaseResult, RunReport, TensorResult
from conformance.session import BackendCheck, SessionError, backend_checks, in_processes, run_rows, strict_missing
from k3ref.cores import UnsupportedShape
from k3ref.threads import fixed_blas

FRESH_SEED_ENV = "K3CONF_FRESH_SEED"
__all__ = ["IN_PROCESS", "FreshRunner", "IsolatedEvaluation", "Runner", "case_runner", "fresh_seed", "run"]


@dataclasses.dataclass
class IsolatedEvaluation(Evaluation):
    """An isolated backend's Evaluation; `again`: the outputs of its second call on the same inputs (per-block
    cases: candidate, its worker's freed memory filled with NaN, candidate)."""

    again: dict[str, np.ndarray] | None = None


def fresh_seed() -> int:
    """The seed of this run's fresh inputs: K3CONF_FRESH_SEED when set (a replay), else a new random one."""
    return env_seed(FRESH_SEED_ENV, "a report", SessionError)


class Runner:
    """Holds the per-run caches: goldens, baseline errors and timings."""

    capped = True   # the gate rows' caps apply where measured (on the goldens of the case's shape set)

    def __init__(self, root: Path, config: str, timing: bool, *, timeout: float = DEFAULT_TIMEOUT,
                 seed: int | None = None, in_process: frozenset[str] | None = None, pool: WorkerPool | None = None,
                 handles: dict[str, BackendBase] | None = None):
        """seed: of the fresh inputs (None: per-block cases are judged on their goldens only); in_process: the
        backends run in this process; pool: the worker processes of the others (shared with the fresh runner);
        handles: backends already loaded, by the name they were asked for (the baselines are loaded on use)."""
        self.root, self.config, self.timing = Path(root).resolve(), config, timing
        self.seed, self.in_process = seed, in_processes(in_process)
        self.pool = pool if pool is not None else WorkerPool(timeout)
        self.handles: dict[str, BackendBase] = dict(handles or {})
        self.fresh: FreshRunner | None = None
        self.judged: dict[tuple[str, str], dict] = {}   # (case, backend) -> the outputs judged (timed calls match them)
        # the runner that made the pool stops its workers, when closed or collected (a pytest session's runner)
        self._closer = weakref.finalize(self, WorkerPool.close, self.pool) if pool is None else None
        self.manifest: dict | None = None
        self.goldens: dict[str, object] = {}
        self.faults: dict[str, str] = {}    # case -> what is wrong with its golden ('' when nothing)
        # (case, backend) -> tensor -> the baseline's errors
        self.errors: dict[tuple[str, str], dict[str, gates.BaselineError] | None] = {}
        self.times: dict[tuple[str, str], float | None] = {}
        self.copy_bw: dict[str, float | None] = {}

    def backend(self, name: str) -> BackendBase:
        """The backend asked for by `name`: built here for the in-process references, else loaded and described
        by its worker (never imported here)."""
        if name not in self.handles:
            self.handles[name] = get_backend(name) if name in self.in_process else self.pool.backend(name)
        return self.handles[name]

    def golden(self, case: Case):
        if case.name not in self.goldens:
            try:
                if self.manifest is None:
                    self.manifest = load_manifest(self.root)
                self.goldens[case.name] = read_golden(self.root, case.name, self.manifest, case.config)
            except GoldenError as e:
                self.goldens[case.name] = e
        return self.goldens[case.name]

    def golden_fault(self, case: Case, golden) -> str:
        """'' when the golden is what the generator makes in kind (tensor names, dtypes, shapes, kwargs, where
        it is non-finite), else an error naming the golden and the command that regenerates it. Asked only
        when a case crashed or failed, so a passing run never pays for the regeneration it takes."""
        if case.name not in self.faults:
            try:
                problems = golden_problems(case, golden)
            except Exception:  # noqa: BLE001 - no verdict on the golden: blame stays where it was
                problems = []
            self.faults[case.name] = (f"broken golden {golden.path}: {'; '.join(problems)}. Regenerate it with: "
                                      f"{regen_command(case.name, case.config)}") if problems else ""
        return self.faults[case.name]

    def evaluate(self, case: Case, golden, backend) -> Evaluation:
        """The backend's run of `case` (the TP runner takes it from its ranks instead). An isolated backend's
        kernels run in its worker, called from here; a per-block case runs twice, the worker's freed memory
        filled with NaN in between (the determinism check)."""
        kind = kind_of(case)
        if not isinstance(backend, RemoteBackend):
            return kind.evaluate(case, golden, backend)
        self.pool.case = case.name
        first = kind.evaluate(case, golden, backend)
        if case.kind not in PER_BLOCK_KINDS:
            return first
        backend.scrub()
        again = kind.evaluate(case, golden, backend)
        return IsolatedEvaluation(first.outputs, first.notes, first.info, again.outputs)

    def close(self) -> None:
        """Stop the worker processes (also done when the runner is collected)."""
        if self._closer is not None:
            self._closer()
        if self.fresh is not None:
            self.fresh.close()

    def baseline_errors(self, case: Case, golden,
                        precision: str) -> tuple[str | None, dict[str, gates.BaselineError] | None]:
        """(baseline name, tensor -> the baseline's relative RMS and worst element errors) or (name, None) when it
        cannot run."""
        name = gates.BASELINE.get(precision)
        if name is None:
            return None, None
        key = (case.name, name)
        if key not in self.errors:
            try:
                b = self.backend(name)
                ok, _ = b.available()
                self.errors[key] = gates.errors_against(self.evaluate(case, golden, b).outputs,
                                                        golden.group("outputs")) if ok else None
            except Exception:  # noqa: BLE001 - a broken baseline means "cap only", never a crash
                self.errors[key] = None
        return name, self.errors[key]

    def run_one(self, case: Case, backend) -> CaseResult:
        """One case on one backend: run it, judge every output tensor by its gate row, then its speed."""
        t0 = time.perf_counter()
        res = CaseResult(case.name, case.block, backend.name, backend.precision, "pass")
        is_baseline = backend.name == gates.BASELINE.get(backend.precision)
        res.role = "baseline" if is_baseline else ""
        exercised = kind_of(case).cores_of(case)
        if not exercised & backend.kernel_cores():
            res.status = "n/a"
            res.error = (f"reference core: {backend.name} supplies no kernel for {', '.join(sorted(exercised))}, "
                         "so only k3ref's core would run")
            return res
        golden = self.golden(case)
        if isinstance(golden, GoldenError):
            res.status, res.error = "error", str(golden)
            return res
        run = self._evaluation_or_status(case, golden, backend, res)
        if run is None:
            return res
        res.notes = [str(n) for n in run.notes]
        res.flips, res.teacher_forced = list(run.info.flips), dict(run.info.teacher_forced)
        if run.info.kernels_ran is not None and not run.info.kernels_ran:
            res.status = "n/a"
            res.error = (f"reference core: no kernel of {backend.name} ran on this case "
                         "(every call fell back to k3ref's core; see the notes)")
            res.seconds = time.perf_counter() - t0
            return res
        if is_baseline:   # the baseline itself: no second run
            self.errors[(case.name, backend.name)] = gates.errors_against(run.outputs, golden.group("outputs"))
        self.judged[(case.name, backend.name)] = run.outputs
        res.tensors = self._judge_tensors(case, golden, backend, run.outputs, run.info.tensor_notes, is_baseline)
        if isinstance(run, IsolatedEvaluation) and run.again is not None:
            cores = ", ".join(sorted(kind_of(case).cores_of(case) & backend.kernel_cores()))
            failed, notes = repeat_results(res.tensors, run.outputs, run.again, backend.deterministic, cores)
            res.tensors += failed
            res.notes += notes
        if all(t.passed for t in res.tensors):
            self.judge_fresh(case, backend, res)
        if any(not t.passed for t in res.tensors):
            res.status = "fail"
            fault = self.golden_fault(case, golden)
            if fault:   # the golden, not the backend, is wrong: say so instead of blaming the backend
                res.status, res.error = "error", fault
        if res.status == "pass" and self.timing:
            speed_of.judge(self, case, golden, backend, res)
        res.seconds = time.perf_counter() - t0
        return res

    def judge_fresh(self, case: Case, backend, res: CaseResult) -> None:
        """`res` (passed on its golden) judged again on fresh inputs: a note with the seed, and a failure there
        fails the cell, its tensors noted "on fresh inputs"."""
        if self.seed is None or case.kind not in PER_BLOCK_KINDS:
            return
        if res.role == "baseline":   # its own caps were measured on the goldens; on fresh inputs it sets the bounds
            return
        if self.fresh is None:
            self.fresh = FreshRunner(self, self.seed)
        seed = self.seed
        spec = backend.spec if isinstance(backend, RemoteBackend) else backend.name   # the name that loads it
        replay = f"{FRESH_SEED_ENV}={seed} k3conf run --backend {spec} --cases '{case.name}'"
        golden = self.fresh.golden(case)
        if isinstance(golden, GoldenError):
            res.notes.append(f"fresh inputs: seed {seed} could not be drawn ({golden}); judged on the golden only")
            return
        again = self.fresh.run_one(case, backend)
        res.notes.append(f"fresh inputs: seed {seed} ({again.status}; replay: {replay})")
        res.notes += [f"on fresh inputs: {n}" for n in again.notes]
        if again.status == "error":
            res.status, res.error = "error", f"on fresh inputs (seed {seed}; replay: {replay}): {again.error}"
        res.tensors += [dataclasses.replace(t, note=f"on fresh inputs (seed {seed}; replay: {replay})"
                                            + (f"; {t.note}" if t.note else "")) for t in again.tensors if not t.passed]

    def _evaluation_or_status(self, case: Case, golden, backend, res: CaseResult) -> Evaluation | None:
        """The backend's run; None when it could not give one, with res's status and error saying why."""
        try:
            return self.evaluate(case, golden, backend)
        except GoldenError as e:
            res.status, res.error = "error", str(e)
        except UnsupportedShape as e:
            res.status, res.error = "skip", f"unsupported by {backend.name}: {e}"
        except KernelFailure as e:   # raised, crashed or hung in its worker: the message names core and case
            res.status = "error"
            res.error = self.golden_fault(case, golden) or str(e)
        except Exception as e:  # noqa: BLE001 - a crashing backend is a failed case, with where it crashed
            where = traceback.extract_tb(e.__traceback__)[-1]
            res.status = "error"
            res.error = (self.golden_fault(case, golden)
                         or f"{type(e).__name__}: {e} (at {Path(where.filename).name}:{where.lineno})")
        return None

    def _judge_tensors(self, case: Case, golden, backend, outs: dict, tensor_notes: dict,
                       is_baseline: bool) -> list[TensorResult]:
        """Each golden output against the backend's, by its gate row (and the baseline's error, below fp64)."""
        kind = kind_of(case)
        base_name, base_errs = self.baseline_errors(case, golden, backend.precision)
        if base_errs:
            base_errs = kind.pooled_baseline(case, base_errs)
        relative = backend.precision != "fp64" and not is_baseline   # the baseline is not its own yardstick
        # a case is gated by the caps measured on its own shape set; on a set without them no cap applies
        family = "traces" if case.kind == "trace" else "blocks"
        measured_here = gates.caps_measured(case.config, family)
        why = gates.FRESH if not self.capped else gates.no_cap_measured(case.config, family)
        results = []
        # name order = compute order (traces number their tensors so), whatever order the file lists them in
        for tensor, ref in sorted(golden.group("outputs").items()):
            block = kind.block_of(case, tensor)
            gate_name = kind.gate_tensor(case, tensor)   # the name its gate rows are looked up by
            if is_baseline:
                key, gate = gates.baseline_gate_for(block, gate_name, backend.precision, case.config)
            else:
                key, gate = gates.gate_for(block, gate_name, backend.precision, case.config)
            if tensor in outs:
                cmp = compare(outs[tensor], ref, gate.atol, gate.rtol)
            else:
                cmp = Comparison(ref.shape, str(ref.dtype), problem=f"missing: the backend returned {sorted(outs)}")
            b_err = None if base_errs is None or not relative else base_errs.get(tensor)
            if b_err is not None and kind.is_gated(case, tensor) and self.capped:
                # a baseline over its own cap on a gated tensor has failed there: it sets no bound (gates.judge);
                # on fresh inputs its caps, measured on the goldens, say nothing
                own = gates.baseline_gate_for(block, gate_name, backend.precision, case.config)[1].cap
                b_err = dataclasses.replace(b_err, own_cap=own)
            verdict = gates.judge(cmp, gate, backend.precision, b_err, as_baseline=is_baseline,
                                  capped=self.capped and measured_here, uncapped_why=why)
            # the shape of the error (a scale, swapped heads, a split), only where it failed: it reads the tensors
            shape = (diagnose_tensor(outs[tensor], ref, block, tensor)
                     if not verdict.passed and tensor in outs and not cmp.problem else None)
            results.append(TensorResult(tensor, block, cmp, key, gate, verdict,
                                        base_name if relative else None, None if b_err is None else b_err.rel_rms,
                                        layer_of(tensor), kind.is_gated(case, tensor),
                                        str(tensor_notes.get(tensor, "")), shape))
        return results


class FreshRunner(Runner):
    """The runner of one run's fresh inputs: a case's golden is drawn again with the run's seed, in memory
    (conformance.cases.fresh), judged like any golden, its baseline errors measured on it (own caches), but
    against the baseline alone: the caps were measured on the goldens' inputs (gates.judge, capped=False)."""

    capped = False

    def golden_fault(self, case: Case, golden) -> str:
        """'': a fresh draw was written by the generator itself moments ago, with this run's seed; comparing it
        with what the generator writes under the case's own seed only found the seeds differ ("broken golden")."""
        return ""

    def __init__(self, parent: Runner, seed: int):
        super().__init__(parent.root, parent.config, False, seed=None, in_process=parent.in_process, pool=parent.pool,
                         handles=parent.handles)
        self.fresh_seed = seed
        self.parent = parent

    def baseline_errors(self, case: Case, golden,
                        precision: str) -> tuple[str | None, dict[str, gates.BaselineError] | None]:
        """Per tensor, the larger of the baseline's errors on these inputs and on the case's golden
        (gates.larger_errors: one draw's error alone is one lucky sample too often)."""
        name, fresh = super().baseline_errors(case, golden, precision)
        committed = self.parent.golden(case)
        if fresh is None or isinstance(committed, GoldenError):
            return name, fresh
        return name, gates.larger_errors(fresh, self.parent.baseline_errors(case, committed, precision)[1])

    def golden(self, case: Case):
        if case.name not in self.goldens:
            try:
                self.goldens[case.name] = fresh_golden(case, self.fresh_seed)
            except Exception as e:  # noqa: BLE001 - data that cannot be drawn is said in a note, never a verdict
                self.goldens[case.name] = GoldenError(f"{type(e).__name__}: {e}")
        return self.goldens[case.name]

    def close(self) -> None:
        """Nothing to remove (the draws are in memory); the workers are the parent's: it stops them."""


def case_runner(root: Path, config: str = "tiny", timing: bool = True, pool: WorkerPool | None = None,
                handles: dict[str, BackendBase] | None = None) -> Runner:
    """A runner with empty caches for callers that run cases one at a time (`.run_one(case, backend)`): the
    pytest plugin, one test item per case. `pool`: the caller's worker processes (the caller closes them; without
    one the runner makes its own, closed when it is closed or collected)."""
    return Runner(root, config, timing, seed=fresh_seed(), pool=pool, handles=handles)


@fixed_blas
def run(cases: list[Case], backend_names: list[str] | None, root: Path, *, config: str = "tiny",
        timing: bool = True, progress=None, timeout: float = DEFAULT_TIMEOUT,
        in_process: frozenset[str] | None = None, checks: list[BackendCheck] | None = None,
        pool: WorkerPool | None = None, fuzz=None) -> RunReport:
    """Run `cases` on the named backends (every registered one when None) against the goldens in `root`.

    progress: optional callable(done, total, label) called after each (case, backend). timeout: seconds an
    isolated backend's worker may stay silent (in one core call); in_process: the backends not isolated;
    checks, pool: the backends as the caller already checked them, in its worker processes (session.check_backends).
    The pool is closed when the run ends: what its workers left running is named in the report. fuzz: a step run
    after the cases, fuzz(runner, backends) -> FuzzSummary | None (conformance.fuzz.inrun.fuzz_step).
    """
    t0 = time.perf_counter()
    judge_at_start = gates.judge_state()
    pool = pool if pool is not None else WorkerPool(timeout)
    try:
        if checks is None:
            checks = backend_checks(backend_names, pool, in_process)
        rows = run_rows(checks, in_process, timeout)
        backends = [c.backend for c in checks if c.available and not c.refused]
        runner = Runner(root, config, timing, seed=fresh_seed(), in_process=in_process, pool=pool,
                        handles={c.name: c.backend for c in checks})
        results, total = [], len(cases) * len(backends)
        fuzzed = None
        try:
            for case in cases:
                for b in backends:
                    results.append(runner.run_one(case, b))
                    if progress:
                        progress(len(results), total, f"{case.name} on {b.name}")
            if fuzz is not None:
                fuzzed = fuzz(runner, backends)
        finally:
            runner.close()
    finally:
        pool.close()
    bw = {k: v for k, v in runner.copy_bw.items() if v}
    wall = time.perf_counter() - t0
    return RunReport(config, rows, results, wall, bw, strict_missing(rows),
                     metadata=collect_metadata(root=root, config=config, seed=runner.seed, duration=wall),
                     left_running=pool.left_lines(), judge_problem=gates.tables_changed(judge_at_start), fuzz=fuzzed)
