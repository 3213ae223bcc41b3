"""The conformance runner: every case x backend, every output tensor compared with its golden and gated.

    report = run(cases, backend_names, root)      # -> RunReport; report.exit_code is 0 / 1

Per case the golden is read once (a broken golden makes the case an `error` row carrying the regen
command; the run goes on). Per backend the case's kind runs it, each golden output is compared
(conformance.judge.compare) and judged by its gate row (conformance.judge.gates). Low-precision rows need the error of
the same-precision baseline (fp32: numpy32, bf16: torch-bf16) on the same tensor, so the baseline is run
on the case too (cached) even when it was not asked for; when it cannot run, the cap alone applies and the
row says so. The baseline itself is judged by its absolute row (gates.BASELINE_GATES), never by itself.
Speed: each (case, backend) with a timer gets bytes/s over the copy bandwidth measured in the same run and
its time over the baseline backend's time.

Every (case, backend) ends as one of: pass, fail (a gate failed), error (the backend or the golden broke;
counted as a failure), skip (the backend's core raised UnsupportedShape: valid inputs it is not built for)
or n/a (none of the cores the case exercises is one the backend supplies itself, so only the reference
core would run: nothing of the backend is tested, and the case is not run). A kind may mark tensors as
reported, not gated (the free-running trace's intermediates): they are shown and never fail a case.
Under K3_STRICT=1 a backend that cannot run here, other than those needing an accelerator
(backends.DEVICE_BACKENDS), fails the run with its reason.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
import traceback
from pathlib import Path

import numpy as np

from conformance.backends.registry import DEVICE_BACKENDS, get_backend, kernel_cores
from conformance.cases.core import INFO_KEY, NOTES_KEY, Case, kind_of
from conformance.golden.store import GoldenError, golden_problems, load_manifest, read_golden, regen_command
from conformance.judge import gates
from conformance.judge.compare import Comparison, compare
from k3ref.cores import UnsupportedShape

# The speed baseline is PyTorch eager doing the same math at the same precision: on the CPU numpy
# vs torch per block, on a GPU the kernels vs torch eager on the same device.
TIME_BASELINE = {"fp64": "torch64", "fp32": "torch", "bf16": "torch-bf16"}
_LAYER = re.compile(r"layer[._-]?(\d+)")


@dataclasses.dataclass
class TensorResult:
    """One output tensor of one (case, backend): its metrics, the gate row and the verdict."""

    tensor: str
    block: str
    comparison: Comparison
    gate_key: tuple
    gate: gates.Gate
    verdict: gates.Verdict
    baseline: str | None = None          # the baseline backend name, when the row is baseline-relative
    baseline_err: float | None = None
    layer: int | None = None             # trace tensors: the layer index (per-layer error plot)
    gated: bool = True                   # False: reported only (never fails the case)
    note: str = ""                       # what the kind says about this tensor (a greedy-token flip, ...)

    @property
    def baseline_multiple(self) -> float | None:
        """This tensor's error over the same-precision baseline's ("0.7x the bf16 baseline"), when both exist."""
        if self.baseline_err is None or self.baseline_err <= 0 or self.comparison.exact:
            return None
        return self.comparison.rel_rms / self.baseline_err

    @property
    def passed(self) -> bool:
        """The verdict; a reported-only tensor never fails."""
        return self.verdict.passed or not self.gated

    def to_dict(self) -> dict:
        return {
            "tensor": self.tensor, "block": self.block, "passed": self.passed, "layer": self.layer,
            "gated": self.gated, "within_bound": self.verdict.passed, "note": self.note,
            "comparison": self.comparison.to_dict(), "gate": {"key": list(self.gate_key), **dataclasses.asdict(self.gate)},
            "bound": self.verdict.bound, "rule": self.verdict.why,
            "baseline": self.baseline, "baseline_err": self.baseline_err, "baseline_multiple": self.baseline_multiple,
        }


@dataclasses.dataclass
class CaseResult:
    """One (case, backend): status pass | fail | error | skip | n/a, the tensors, an error message, speed.

    skip: the backend's core raised UnsupportedShape (valid inputs it is not built for); `error` says why.
    n/a: only reference cores would run (or ran) for this backend; `error` says which.
    role: "baseline" when the backend is the baseline of its precision (gated by its absolute rows).
    notes: what a kind reports beside the numbers (a model trace: the cores that ran the reference and why).
    flips: greedy-token flips (step, expected, found, margin); teacher_forced: near-tie choices (argmax or
    router) for which the backend was given the golden's choice."""

    case: str
    block: str
    backend: str
    precision: str
    status: str
    tensors: list[TensorResult] = dataclasses.field(default_factory=list)
    error: str = ""
    speed: gates.SpeedResult | None = None
    seconds: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)
    role: str = ""
    flips: list[dict] = dataclasses.field(default_factory=list)
    teacher_forced: dict = dataclasses.field(default_factory=dict)

    @property
    def first_failing(self) -> TensorResult | None:
        return next((t for t in self.tensors if not t.passed), None)

    @property
    def worst(self) -> TensorResult | None:
        """The gated tensor with the largest error relative to its bound."""
        gated = [t for t in self.tensors if t.gated]
        if not gated:
            return None
        return max(gated, key=lambda t: (not t.passed, t.comparison.rel_rms / max(t.verdict.bound, 1e-300)))

    def to_dict(self) -> dict:
        return {
            "case": self.case, "block": self.block, "backend": self.backend, "precision": self.precision,
            "status": self.status, "error": self.error, "seconds": self.seconds, "notes": self.notes,
            "role": self.role, "flips": self.flips, "teacher_forced": self.teacher_forced,
            "tensors": [t.to_dict() for t in self.tensors],
            "speed": None if self.speed is None else dataclasses.asdict(self.speed),
        }


@dataclasses.dataclass
class RunReport:
    """Everything one `k3conf run` found."""

    config: str
    backends: list[dict]          # name, precision, available, reason
    results: list[CaseResult]
    wall_seconds: float
    copy_bandwidth: dict          # backend -> bytes/s measured in this run
    strict_missing: list[str] = dataclasses.field(default_factory=list)   # K3_STRICT=1: backends that must run

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.status in ("fail", "error")]

    @property
    def first_failure(self) -> CaseResult | None:
        return self.failures[0] if self.failures else None

    def counts(self) -> dict[str, int]:
        """(case, backend) results by verdict: pass, fail (errors included), n/a, skip; and errors, total."""
        st = [r.status for r in self.results]
        return {"pass": st.count("pass"), "fail": st.count("fail") + st.count("error"), "n/a": st.count("n/a"),
                "skip": st.count("skip"), "error": st.count("error"), "total": len(st)}

    def first_failure_line(self) -> str:
        """'FIRST FAILURE: <case> on <backend>: <tensor> (block <block>): <why>' or a pass line."""
        if self.strict_missing:
            return f"FIRST FAILURE: K3_STRICT=1 and {self.strict_missing[0]}"
        r = self.first_failure
        if r is None:
            c = self.counts()
            extra = [f"{c['n/a']} n/a: reference core only" if c["n/a"] else "",
                     f"{c['skip']} skipped: not supported by that backend" if c["skip"] else ""]
            extra = "; ".join(e for e in extra if e)
            return (f"ALL PASS: {c['pass']} (case, backend) result(s) within their gates"
                    + (f" ({extra})" if extra else ""))
        if r.status == "error":
            return f"FIRST FAILURE: {r.case} on {r.backend} (block {r.block}): error: {r.error}"
        t = r.first_failing
        if t is None:
            sp = r.speed
            return (f"FIRST FAILURE: {r.case} on {r.backend} (block {r.block}): speed: bw ratio {sp.bw_ratio} "
                    f"(target {sp.target_bw_ratio}), time ratio {sp.time_ratio} (target {sp.target_time_ratio}); {sp.note}")
        return (f"FIRST FAILURE: {r.case} on {r.backend}: outputs.{t.tensor} (block {t.block}): "
                + (f"{t.note}; " if t.note else "") + f"{t.comparison.summary()} [{t.verdict.why}]")

    @property
    def exit_code(self) -> int:
        return 1 if self.failures or self.strict_missing else 0

    def to_dict(self) -> dict:
        return {
            "config": self.config, "exit_code": self.exit_code, "first_failure": self.first_failure_line(),
            "summary": self.counts(), "strict_missing": self.strict_missing,
            "wall_seconds": self.wall_seconds, "backends": self.backends,
            "copy_bandwidth": self.copy_bandwidth, "results": [r.to_dict() for r in self.results],
        }


class Runner:
    """Holds the per-run caches: goldens, baseline errors and timings."""

    def __init__(self, root: Path, config: str, timing: bool):
        self.root, self.config, self.timing = Path(root), config, timing
        self.manifest = None
        self.goldens: dict[str, object] = {}
        self.faults: dict[str, str] = {}    # case -> what is wrong with its golden ('' when nothing)
        self.errors: dict[tuple[str, str], dict[str, float] | None] = {}   # (case, backend) -> tensor -> rel RMS
        self.times: dict[tuple[str, str], float | None] = {}
        self.copy_bw: dict[str, float] = {}

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

    def outputs(self, case: Case, golden, backend) -> dict[str, np.ndarray]:
        return kind_of(case).evaluate(case, golden, backend)

    def baseline_errors(self, case: Case, golden, precision: str) -> tuple[str | None, dict[str, float] | None]:
        """(baseline name, tensor -> rel RMS error of the baseline) or (name, None) when it cannot run."""
        name = gates.BASELINE.get(precision)
        if name is None:
            return None, None
        key = (case.name, name)
        if key not in self.errors:
            try:
                b = get_backend(name)
                ok, _ = b.available()
                self.errors[key] = _rel_errors(self.outputs(case, golden, b), golden) if ok else None
            except Exception:  # noqa: BLE001 - a broken baseline means "cap only", never a crash
                self.errors[key] = None
        return name, self.errors[key]

    def time_of(self, case: Case, golden, backend) -> tuple[float, int] | None:
        try:
            return kind_of(case).timing(case, golden, backend)
        except Exception:  # noqa: BLE001 - a timer failure is reported as "not timed", not a failed case
            return None

    def speed(self, case: Case, golden, backend) -> gates.SpeedResult | None:
        if not self.timing:
            return None
        t = self.time_of(case, golden, backend)
        self.times[(case.name, backend.name)] = None if t is None else t[0]
        if t is None:
            return None
        if backend.name not in self.copy_bw:
            fn = getattr(backend, "copy_bandwidth", None)
            bw = fn() if fn else None
            self.copy_bw[backend.name] = bw
        base = TIME_BASELINE.get(backend.precision)
        base_s = None
        if base and base != backend.name:
            if (case.name, base) not in self.times:
                try:
                    bb = get_backend(base)
                    bt = self.time_of(case, golden, bb) if bb.available()[0] else None
                except Exception:  # noqa: BLE001
                    bt = None
                self.times[(case.name, base)] = None if bt is None else bt[0]
            base_s = self.times[(case.name, base)]
        target = getattr(backend, "speed_target", lambda block: None)(case.block)
        return gates.judge_speed(case.block, backend.name, t[0], t[1], self.copy_bw[backend.name], base_s, target,
                                 baseline=base if base_s else None)

    def run_one(self, case: Case, backend) -> CaseResult:
        """One case on one backend: run it, judge every output tensor by its gate row, then its speed."""
        t0 = time.perf_counter()
        res = CaseResult(case.name, case.block, backend.name, backend.precision, "pass")
        is_baseline = backend.name == gates.BASELINE.get(backend.precision)
        res.role = "baseline" if is_baseline else ""
        kind = kind_of(case)
        exercised = getattr(kind, "cores_of", lambda c: None)(case)
        if exercised is not None and not exercised & kernel_cores(backend):
            res.status = "n/a"
            res.error = (f"reference core: {backend.name} supplies no kernel for {', '.join(sorted(exercised))}, "
                         "so only k3ref's core would run")
            return res
        golden = self.golden(case)
        if isinstance(golden, GoldenError):
            res.status, res.error = "error", str(golden)
            return res
        outs = self._outputs_or_status(case, golden, backend, res)
        if outs is None:
            return res
        res.notes = [str(n) for n in outs.pop(NOTES_KEY, [])]
        info = outs.pop(INFO_KEY, {})
        res.flips, res.teacher_forced = list(info.get("flips", [])), dict(info.get("teacher_forced", {}))
        if "kernels_ran" in info and not info["kernels_ran"]:
            res.status = "n/a"
            res.error = (f"reference core: no kernel of {backend.name} ran on this case "
                         "(every call fell back to k3ref's core; see the notes)")
            res.seconds = time.perf_counter() - t0
            return res
        if is_baseline:   # the baseline itself: no second run
            self.errors[(case.name, backend.name)] = _rel_errors(outs, golden)
        res.tensors = self._judge_tensors(case, golden, backend, outs, info.get("tensor_notes", {}), is_baseline)
        if any(not t.passed for t in res.tensors):
            res.status = "fail"
            fault = self.golden_fault(case, golden)
            if fault:   # the golden, not the backend, is wrong: say so instead of blaming the backend
                res.status, res.error = "error", fault
        res.speed = self.speed(case, golden, backend)
        if res.speed is not None and res.speed.passed is False and res.status == "pass":
            res.status = "fail"
        res.seconds = time.perf_counter() - t0
        return res

    def _outputs_or_status(self, case: Case, golden, backend, res: CaseResult) -> dict | None:
        """The backend's outputs; None when it could not give them, with res's status and error saying why."""
        try:
            return self.outputs(case, golden, backend)
        except GoldenError as e:
            res.status, res.error = "error", str(e)
        except UnsupportedShape as e:
            res.status, res.error = "skip", f"unsupported by {backend.name}: {e}"
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
        gated = getattr(kind, "is_gated", lambda c, t: True)
        gate_name = getattr(kind, "gate_tensor", lambda c, t: t)   # the name its gate rows are looked up by
        relative = backend.precision != "fp64" and not is_baseline   # the baseline is not its own yardstick
        results = []
        # name order = compute order (traces number their tensors so), whatever order the file lists them in
        for tensor, ref in sorted(golden.group("outputs").items()):
            block = kind.block_of(case, tensor)
            if is_baseline:
                key, gate = gates.baseline_gate_for(block, gate_name(case, tensor), backend.precision)
            else:
                key, gate = gates.gate_for(block, gate_name(case, tensor), backend.precision)
            if tensor in outs:
                cmp = compare(outs[tensor], ref, gate.atol, gate.rtol)
            else:
                cmp = Comparison(ref.shape, str(ref.dtype), problem=f"missing: the backend returned {sorted(outs)}")
            b_err = None if base_errs is None or not relative else base_errs.get(tensor)
            verdict = gates.judge(cmp, gate, backend.precision, b_err, as_baseline=is_baseline)
            m = _LAYER.search(tensor)
            results.append(TensorResult(tensor, block, cmp, key, gate, verdict,
                                        base_name if relative else None, b_err,
                                        int(m.group(1)) if m else None, gated(case, tensor),
                                        str(tensor_notes.get(tensor, ""))))
        return results


def _rel_errors(outs: dict, golden) -> dict[str, float]:
    """tensor -> relative RMS error of a baseline's outputs. A tensor the baseline got wrong in kind (missing,
    misshaped, NaN where the golden has none) has no error to scale a bound by: it is left out, so that row
    falls back to the cap alone instead of to k * 0 + floor."""
    errs = {}
    for t, ref in golden.group("outputs").items():
        if t in outs:
            c = compare(outs[t], ref)
            if not c.problem and not c.exact and c.nonfinite_ok:
                errs[t] = c.rel_rms
    return errs


def case_runner(root: Path, config: str = "tiny", timing: bool = True) -> Runner:
    """A runner with empty caches for callers that run cases one at a time (`.run_one(case, backend)`): the
    pytest plugin, one test item per case."""
    return Runner(root, config, timing)


def resolve_backends(names: list[str] | None) -> tuple[list, list[dict]]:
    """(runnable backends, availability rows for all requested, each name once); KeyError for an unknown name."""
    from conformance.backends.registry import backend_names

    names = list(dict.fromkeys(names)) if names else backend_names()
    runnable, rows = [], []
    for name in names:
        b = get_backend(name)
        ok, why = b.available()
        rows.append({"name": name, "precision": b.precision, "available": ok, "reason": why,
                     "device": getattr(b, "device", "cpu")})
        if ok:
            runnable.append(b)
    return runnable, rows


def strict() -> bool:
    """K3_STRICT=1 (CI): a missing tool or library fails instead of skipping."""
    return os.environ.get("K3_STRICT", "").strip() == "1"


def strict_missing(rows: list[dict]) -> list[str]:
    """Under K3_STRICT=1: one line per unavailable backend that needs no accelerator (not in DEVICE_BACKENDS
    and declaring no device other than the CPU, e.g. the `fla` adapter's "cuda"), with its reason."""
    if not strict():
        return []
    return [f"backend {r['name']} cannot run here: {r['reason']}" for r in rows
            if not r["available"] and r["name"] not in DEVICE_BACKENDS and r.get("device", "cpu") == "cpu"]


def run(cases: list[Case], backend_names: list[str] | None, root: Path, *, config: str = "tiny",
        timing: bool = True, progress=None) -> RunReport:
    """Run `cases` on the named backends (every registered one when None) against the goldens in `root`.

    progress: optional callable(done, total, label) called after each (case, backend).
    """
    t0 = time.perf_counter()
    backends, rows = resolve_backends(backend_names)
    runner = Runner(root, config, timing)
    results = []
    total = len(cases) * len(backends)
    for case in cases:
        for b in backends:
            results.append(runner.run_one(case, b))
            if progress:
                progress(len(results), total, f"{case.name} on {b.name}")
    bw = {k: v for k, v in runner.copy_bw.items() if v}
    return RunReport(config, rows, results, time.perf_counter() - t0, bw, strict_missing(rows))

