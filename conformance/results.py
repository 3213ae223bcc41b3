"""What a run found, as data: one TensorResult per compared tensor, one CaseResult per (case, backend), and the
RunReport of a whole run (counts, the first failure line, the JSON form the report files are written from).
"""
from __future__ import annotations

import dataclasses

from conformance.judge.compare import Comparison
from conformance.judge.gates import Gate, SpeedResult, Verdict


@dataclasses.dataclass
class TensorResult:
    """One output tensor of one (case, backend): its metrics, the gate row and the verdict."""

    tensor: str
    block: str
    comparison: Comparison
    gate_key: tuple
    gate: Gate
    verdict: Verdict
    baseline: str | None = None          # the baseline backend name, when the row is baseline-relative
    baseline_err: float | None = None
    layer: int | None = None             # trace tensors: the layer index (per-layer error plot)
    gated: bool = True                   # False: reported only (never fails the case)
    note: str = ""                       # what the kind says about this tensor (a greedy-token flip, ...)
    diagnosis: str | None = None         # the shape of the error of a failing tensor (conformance.judge.diagnose)

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

    def why(self) -> str:
        """'<note>; <metrics>; shape of the error: <diagnosis> [<rule>]': what the failure line says of this tensor."""
        return ((f"{self.note}; " if self.note else "") + self.comparison.summary()
                + (f"; shape of the error: {self.diagnosis}" if self.diagnosis else "") + f" [{self.verdict.why}]")

    def to_dict(self) -> dict:
        return {
            "tensor": self.tensor, "block": self.block, "passed": self.passed, "layer": self.layer,
            "gated": self.gated, "within_bound": self.verdict.passed, "note": self.note, "diagnosis": self.diagnosis,
            "comparison": self.comparison.to_dict(),
            "gate": {"key": list(self.gate_key), **dataclasses.asdict(self.gate)},
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
    speed: SpeedResult | None = None
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

    def failure_line(self) -> str:
        """'<case> on <backend>: <tensor> (block <block>): <why>' for a failed or crashed result; '' otherwise."""
        if self.status == "error":
            return f"{self.case} on {self.backend} (block {self.block}): error: {self.error}"
        if self.status != "fail":
            return ""
        t = self.first_failing
        if t is None:
            sp = self.speed
            assert sp is not None, "a failed result without a failing tensor failed its speed target"
            return (f"{self.case} on {self.backend} (block {self.block}): speed: bw ratio {sp.bw_ratio} "
                    f"(target {sp.target_bw_ratio}), time ratio {sp.time_ratio} "
                    f"(target {sp.target_time_ratio}); {sp.note}")
        why = t.why() if self.counts_elements(t) else t.why().replace(f"; {t.comparison.passed_line}", "", 1)
        return f"{self.case} on {self.backend}: outputs.{t.tensor} (block {t.block}): {why}"

    def counts_elements(self, t: TensorResult) -> bool:
        """Whether `t`'s 'N of M passed' decided anything: an integer tensor (every element must match), or a row
        judged element by element within atol + rtol (fp64, or a row with no baseline multiple), never the
        baseline itself. Elsewhere it counts elements within a tolerance no rule uses (0 of N for a passing
        baseline), so it is left out."""
        if t.comparison.exact:
            return True
        return self.role != "baseline" and (self.precision == "fp64" or t.gate.k is None)

    def to_dict(self) -> dict:
        return {
            "case": self.case, "block": self.block, "backend": self.backend, "precision": self.precision,
            "status": self.status, "error": self.error, "seconds": self.seconds, "notes": self.notes,
            "role": self.role, "flips": self.flips, "teacher_forced": self.teacher_forced,
            "tensors": [t.to_dict() for t in self.tensors],
            "speed": None if self.speed is None else dataclasses.asdict(self.speed),
        }


@dataclasses.dataclass
class FuzzSummary:
    """The fuzz draws of a run: every draw's result, one line per shrunk finding ("smallest failing: ..."), the
    replay files written for them, the seed (the run's), and the seconds spent."""

    results: list[CaseResult]
    findings: list[str]
    replays: list[str]
    seed: int
    seconds: float

    def line(self) -> str:
        """'fuzz: 102 draws of 15 cores on 3 backends passed (seed S; ...)' or the count of findings."""
        backends = len({r.backend for r in self.results})
        cores = len({r.block for r in self.results})
        over = [r for r in self.results if r.status == "error" and "within the memory budget" in r.error]
        judged = [r for r in self.results if r.status in ("pass", "fail", "error") and r not in over]
        head = f"fuzz: {len(judged)} draw(s) of {cores} core(s) on {backends} backend(s)"
        tail = f"; {len(over)} over the memory budget, not judged" if over else ""
        if not self.findings:
            return (f"{head} passed (seed {self.seed}, {self.seconds:.1f} s; K3CONF_FRESH_SEED={self.seed} replays "
                    f"them{tail})")
        return f"{head}: {len(self.findings)} failing draw(s), each shrunk (seed {self.seed}{tail})"

    @classmethod
    def merged(cls, parts: list[FuzzSummary]) -> FuzzSummary | None:
        """One summary of several drawn with one seed (the pytest plugin's items, one per core); None for none."""
        if not parts:
            return None
        return cls([r for p in parts for r in p.results], [f for p in parts for f in p.findings],
                   [r for p in parts for r in p.replays], parts[0].seed, sum(p.seconds for p in parts))

    def to_dict(self) -> dict:
        return {"seed": self.seed, "seconds": self.seconds, "findings": self.findings, "replays": self.replays,
                "line": self.line(), "results": [r.to_dict() for r in self.results]}


@dataclasses.dataclass
class RunReport:
    """Everything one `k3conf run` found."""

    config: str
    backends: list[dict]          # name, precision, available, reason
    results: list[CaseResult]
    wall_seconds: float
    copy_bandwidth: dict          # backend -> bytes/s measured in this run
    strict_missing: list[str] = dataclasses.field(default_factory=list)   # K3_STRICT=1: backends that must run
    metadata: dict = dataclasses.field(default_factory=dict)   # what the run ran on (conformance.metadata.collect)
    # processes a backend's kernels left running after its worker was stopped (killed then), one line per backend
    left_running: list[str] = dataclasses.field(default_factory=list)
    judge_problem: str = ""   # the gate tables changed while the run judged (gates.tables_changed): no verdict holds
    fuzz: FuzzSummary | None = None   # the run's fuzz draws (conformance.fuzz), None when it drew none

    @property
    def refused(self) -> list[str]:
        """One line per backend the start-up check refused: a core that breaks the interface or answers nothing."""
        return [str(row["refused"]) for row in self.backends if row.get("refused")]

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.status in ("fail", "error")]

    @property
    def first_failure(self) -> CaseResult | None:
        return self.failures[0] if self.failures else None

    @property
    def nothing_judged(self) -> list[str]:
        """One line per backend the run had to judge (its row's `must_judge`: a requested or an external one) that
        could run but earned neither a pass nor a fail: it supplies no kernel core, or every result of it is
        skip or n/a. Such a run proves nothing about that backend, so it fails."""
        lines = []
        for row in self.backends:
            if not (row.get("must_judge") and row["available"]):
                continue
            name = row.get("backend", row["name"])
            mine = [r.status for r in self.results if r.backend == name]
            if not mine or any(s not in ("skip", "n/a") for s in mine):
                continue
            why = (f"every one of its {len(mine)} result(s) is skip or n/a ({mine.count('skip')} skip, "
                   f"{mine.count('n/a')} n/a)")
            if not row.get("kernel_cores", True):
                why = "it supplies no kernel core (kernel_cores() is empty), so only k3ref's cores would run"
            lines.append(f"backend {name} was judged on nothing: {why}")
        return lines

    def counts(self) -> dict[str, int]:
        """(case, backend) results by verdict: pass, fail (errors included), n/a, skip; and errors, total."""
        st = [r.status for r in self.results]
        return {"pass": st.count("pass"), "fail": st.count("fail") + st.count("error"), "n/a": st.count("n/a"),
                "skip": st.count("skip"), "error": st.count("error"), "total": len(st)}

    def run_failures(self) -> list[str]:
        """What fails the run besides its cells: the judge itself changed, a backend refused at start-up, one that
        left processes running, a backend K3_STRICT needs that cannot run, one judged on nothing."""
        return ([f"the judge was changed during the run: {self.judge_problem}"] if self.judge_problem else []) + \
            self.refused + self.left_running + [f"K3_STRICT=1 and {m}" for m in self.strict_missing] + \
            [f"fuzz: {f}" for f in (self.fuzz.findings if self.fuzz else [])]

    def first_failure_line(self) -> str:
        """'FIRST FAILURE: <case> on <backend>: <tensor> (block <block>): <why>' or a pass line. A changed judge, a
        refused backend and K3_STRICT come before the cells; processes left running after them."""
        late = set(self.left_running) | {f"fuzz: {f}" for f in (self.fuzz.findings if self.fuzz else [])}
        early = [f for f in self.run_failures() if f not in late]
        if early:
            return f"FIRST FAILURE: {early[0]}"
        r = self.first_failure
        if r is None and self.nothing_judged:
            return f"FIRST FAILURE: {self.nothing_judged[0]}"
        later = [f for f in self.run_failures() if f in late]
        if r is None and later:
            return f"FIRST FAILURE: {later[0]}"
        if r is None:
            c = self.counts()
            parts = [f"{c['n/a']} n/a: reference core only" if c["n/a"] else "",
                     f"{c['skip']} skipped: not supported by that backend" if c["skip"] else ""]
            extra = "; ".join(e for e in parts if e)
            return (f"ALL PASS: {c['pass']} (case, backend) result(s) within their gates"
                    + (f" ({extra})" if extra else ""))
        return f"FIRST FAILURE: {r.failure_line()}"

    @property
    def exit_code(self) -> int:
        """1 when a gate failed, a result is an error, or anything of run_failures() or nothing_judged holds (a
        backend refused at start-up or judged on nothing, processes left running, a changed judge, K3_STRICT);
        else 0."""
        return 1 if self.failures or self.run_failures() or self.nothing_judged else 0

    def to_dict(self) -> dict:
        return {
            "config": self.config, "exit_code": self.exit_code, "first_failure": self.first_failure_line(),
            "summary": self.counts(), "strict_missing": self.strict_missing, "nothing_judged": self.nothing_judged,
            "refused": self.refused, "left_running": self.left_running, "judge_problem": self.judge_problem,
            "fuzz": None if self.fuzz is None else self.fuzz.to_dict(),
            "wall_seconds": self.wall_seconds, "backends": self.backends,
            "copy_bandwidth": self.copy_bandwidth, "metadata": self.metadata,
            "results": [r.to_dict() for r in self.results],
        }
