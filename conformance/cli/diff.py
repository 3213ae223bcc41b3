"""`k3conf diff A.json B.json`: what changed between two runs (two kernel versions, or one kernel on two GPUs).

Per (case, backend) found in either report.json: the verdict change (pass -> fail or error: a regression; fail or
error -> pass: an improvement; a case in one run only: new / gone), per output tensor the ratio B/A of the
relative RMS error and of the worst element error where both runs measured one, and the speed ratio B/A of the
timed seconds where both runs were timed. A still-passing case whose error ratio exceeds --threshold is flagged
"worse" (a warning, never a failure). The header says what differs between the two runs' metadata (commit, GPU,
versions, the golden manifest's digest: a different digest means the cases may not be the same inputs).
Exit 1 on a regression (the first line names the cases), 0 otherwise, 2 on bad usage or a file that is not a
report.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from conformance.cli.usage import UsageError

PASSED, FAILED = ("pass",), ("fail", "error")
# metadata fields that differ between any two runs and say nothing about what ran
VOLATILE = ("started", "duration_s", "command", "seed", "metadata_version")
# metadata fields whose difference makes the two runs' numbers incomparable, not just different
# (a different shape set is warned about from the reports' `config`, which reports without metadata have too)
WARN_IF_DIFFERENT = {"golden.manifest_sha256": "the golden manifests differ: the cases may not be the same inputs"}
DEFAULT_THRESHOLD = 2.0


def register(sub) -> None:
    p = sub.add_parser("diff", help="compare two runs' report.json files: regressions, error and speed ratios",
                       description="Exit 0: no (case, backend) that passed in A fails in B; 1: a regression (the "
                                   "first line names the cases); 2: bad usage or a file that is not a report.json.")
    p.add_argument("a", type=Path, metavar="A.json", help="the report.json of the earlier run (the reference)")
    p.add_argument("b", type=Path, metavar="B.json", help="the report.json of the later run (the candidate)")
    p.add_argument("--backend", default=None, metavar="B",
                   help="compare one backend only; NAME_A=NAME_B pairs a backend of A with a differently named one "
                        "of B (e.g. torch-bf16=mutant:bf16-rmsnorm-1pct)")
    p.add_argument("--threshold", type=_positive, default=DEFAULT_THRESHOLD, metavar="X",
                   help="error ratio B/A above which a case that still passes is flagged 'worse' (a warning, not a "
                        f"failure; default {DEFAULT_THRESHOLD:g})")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the diff as JSON to OUT")
    p.set_defaults(func=diff)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"expected a positive number, found {text!r}")
    return value


@dataclasses.dataclass
class TensorDiff:
    """One output tensor judged in both runs: its errors in A and B and the ratios B/A (None: no ratio, a run
    measured no error on it, e.g. an exact integer tensor)."""

    tensor: str
    rel_rms_a: float | None
    rel_rms_b: float | None
    worst_a: float | None
    worst_b: float | None

    @property
    def rel_rms_ratio(self) -> float | None:
        return _ratio(self.rel_rms_b, self.rel_rms_a)

    @property
    def worst_ratio(self) -> float | None:
        return _ratio(self.worst_b, self.worst_a)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "rel_rms_ratio": self.rel_rms_ratio, "worst_ratio": self.worst_ratio}


@dataclasses.dataclass
class CellDiff:
    """One (case, backend): its status in A and B (None: not in that run), its tensors, its speed."""

    case: str
    backend: str                  # the name in B (in A when the cell is gone)
    status_a: str | None
    status_b: str | None
    tensors: list[TensorDiff] = dataclasses.field(default_factory=list)
    seconds_a: float | None = None
    seconds_b: float | None = None
    worse: bool = False           # still passes, but an error ratio is above the threshold
    why_b: str = ""               # why B failed: its error, or its first failing tensor and rule

    @property
    def change(self) -> str:
        """regression | improvement | new | gone | changed (another status change) | same."""
        a, b = self.status_a, self.status_b
        if a is None:
            return "new"
        if b is None:
            return "gone"
        if a in PASSED and b in FAILED:
            return "regression"
        if a in FAILED and b in PASSED:
            return "improvement"
        return "same" if a == b else "changed"

    @property
    def speed_ratio(self) -> float | None:
        return _ratio(self.seconds_b, self.seconds_a)

    @property
    def label(self) -> str:
        return f"{self.case} on {self.backend}"

    def worst_ratio(self) -> float | None:
        """The largest error ratio over the tensors (relative RMS or worst element), None when there is none."""
        ratios = [r for t in self.tensors for r in (t.rel_rms_ratio, t.worst_ratio) if r is not None]
        return max(ratios) if ratios else None

    def to_dict(self) -> dict:
        return {"case": self.case, "backend": self.backend, "status_a": self.status_a, "status_b": self.status_b,
                "change": self.change, "worse": self.worse, "seconds_a": self.seconds_a,
                "seconds_b": self.seconds_b, "speed_ratio": self.speed_ratio, "why_b": self.why_b,
                "tensors": [t.to_dict() for t in self.tensors]}


@dataclasses.dataclass
class RunDiff:
    """Two runs compared: the cells, what differs in their metadata, and warnings."""

    a: str
    b: str
    cells: list[CellDiff]
    threshold: float
    metadata_changes: list[tuple[str, object, object]]   # (field, value in A, value in B)
    warnings: list[str]

    def of(self, change: str) -> list[CellDiff]:
        return [c for c in self.cells if c.change == change]

    @property
    def exit_code(self) -> int:
        return 1 if self.of("regression") else 0

    def first_line(self) -> str:
        """'REGRESSION: N ... : <case> on <backend>, ...' or 'NO REGRESSION: ...' with the counts."""
        regressions = self.of("regression")
        if regressions:
            return (f"REGRESSION: {len(regressions)} (case, backend) result(s) passed in A and fail in B: "
                    + ", ".join(c.label for c in regressions))
        counts = {k: len(self.of(k)) for k in ("improvement", "new", "gone", "changed")}
        worse = sum(c.worse for c in self.cells)
        extra = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
        return (f"NO REGRESSION: {len(self.cells)} (case, backend) result(s) compared"
                + (f"; {extra}" if extra else "") + (f"; {worse} flagged worse" if worse else ""))

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "exit_code": self.exit_code, "first_line": self.first_line(),
                "threshold": self.threshold, "warnings": self.warnings,
                "metadata_changes": [{"field": f, "a": va, "b": vb} for f, va, vb in self.metadata_changes],
                "regressions": [c.label for c in self.of("regression")],
                "improvements": [c.label for c in self.of("improvement")],
                "new": [c.label for c in self.of("new")], "gone": [c.label for c in self.of("gone")],
                "worse": [c.label for c in self.cells if c.worse], "cells": [c.to_dict() for c in self.cells]}


def diff(args) -> int:
    a, b = read_report(args.a), read_report(args.b)
    result = diff_reports(a, b, backend=args.backend, threshold=args.threshold, names=(str(args.a), str(args.b)))
    print("\n".join(render(result, a, b)))
    if args.json is not None:
        args.json.write_text(json.dumps(_finite(result.to_dict()), indent=1, allow_nan=False) + "\n")
    return result.exit_code


def read_report(path: Path) -> dict:
    """A report.json as a dict; UsageError naming the file and what is wrong when it is no report."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageError(f"{path}: cannot read it ({why})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno}); expected the "
                         "report.json a `k3conf run --report DIR` writes") from None
    except RecursionError:
        raise UsageError(f"{path}: JSON nested deeper than Python reads ({sys.getrecursionlimit()} levels); "
                         "expected the report.json a `k3conf run --report DIR` writes") from None
    try:
        problem = _report_problem(data)
    except RecursionError:
        problem = "nested deeper than a report is"
    if problem:
        raise UsageError(f"{path}: not a k3conf report.json: {problem}; expected the report.json a "
                         "`k3conf run --report DIR` writes")
    return data


def _report_problem(data) -> str:
    """What keeps `data` from being a report.json ('' when it is one)."""
    if not isinstance(data, dict):
        return f"found a JSON {type(data).__name__}, expected an object"
    if not isinstance(data.get("results"), list):
        return f"no 'results' list (keys found: {sorted(data)[:10]})"
    for i, r in enumerate(data["results"]):
        if not (isinstance(r, dict) and all(isinstance(r.get(k), str) for k in ("case", "backend", "status"))):
            return f"results[{i}] has no 'case', 'backend' and 'status' strings"
        if not isinstance(r.get("tensors", []), list):
            return f"results[{i}] ({r['case']} on {r['backend']}): 'tensors' is not a list"
    return ""


def diff_reports(a: dict, b: dict, *, backend: str | None = None, threshold: float = DEFAULT_THRESHOLD,
                 names: tuple[str, str] = ("A", "B")) -> RunDiff:
    """A and B (report.json dicts) compared per (case, backend). backend: one backend's cells only; 'NAME_A=NAME_B'
    pairs a backend of A with a differently named one of B. UsageError when a named backend is missing from a run."""
    rows_a, rows_b = _cells(a["results"]), _cells(b["results"])
    if backend is not None:
        name_a, _, name_b = backend.partition("=") if "=" in backend else (backend, "", backend)
        _require_backend(name_a, rows_a, names[0])
        _require_backend(name_b, rows_b, names[1])
        rows_a = {(case, name_b): r for (case, be), r in rows_a.items() if be == name_a}
        rows_b = {k: r for k, r in rows_b.items() if k[1] == name_b}
    cells = [_cell(key, rows_a.get(key), rows_b.get(key), threshold)
             for key in list(rows_a) + [k for k in rows_b if k not in rows_a]]
    changes = metadata_changes(a.get("metadata") or {}, b.get("metadata") or {})
    warnings = [f"{WARN_IF_DIFFERENT[f]} ({f}: {va} vs {vb})" for f, va, vb in changes if f in WARN_IF_DIFFERENT]
    if a.get("config") != b.get("config"):
        warnings.append(f"the runs used different case sets: {a.get('config')} vs {b.get('config')}")
    for name, report in zip(names, (a, b), strict=True):
        if not report.get("metadata"):
            warnings.append(f"{name} has no metadata (written by a k3conf that did not record it): what differs "
                            "between the runs cannot be shown")
    return RunDiff(names[0], names[1], cells, threshold, changes, warnings)


def _require_backend(name: str, rows: dict, where: str) -> None:
    found = sorted({be for _, be in rows})
    if name not in found:
        raise UsageError(f"--backend {name}: not in {where} (its backends: {', '.join(found) or 'none'})")


def _cells(results: list[dict]) -> dict[tuple[str, str], dict]:
    """(case, backend) -> its result row, in report order."""
    return {(r["case"], r["backend"]): r for r in results}


def _cell(key: tuple[str, str], ra: dict | None, rb: dict | None, threshold: float) -> CellDiff:
    cell = CellDiff(key[0], key[1] if rb is not None or ra is None else ra["backend"],
                    None if ra is None else ra["status"], None if rb is None else rb["status"])
    if ra is None or rb is None:
        return cell
    ta, tb = _tensors(ra), _tensors(rb)
    for name in (t for t in ta if t in tb):
        (rel_a, worst_a), (rel_b, worst_b) = _errors(ta[name]), _errors(tb[name])
        cell.tensors.append(TensorDiff(name, rel_a, rel_b, worst_a, worst_b))
    cell.seconds_a, cell.seconds_b = _seconds(ra), _seconds(rb)
    cell.why_b = _why(rb) if rb["status"] in FAILED else ""
    worst = cell.worst_ratio()
    cell.worse = cell.change == "same" and cell.status_b in PASSED and worst is not None and worst > threshold
    return cell


def _why(row: dict) -> str:
    """A failed row's reason: its error message, else its first failing tensor with the rule it broke."""
    if row.get("error"):
        return str(row["error"])
    bad = next((t for t in row.get("tensors") or [] if isinstance(t, dict) and t.get("passed") is False), None)
    if bad is None:
        return ""
    rel_rms, _ = _errors(bad)
    found = f"rel RMS {rel_rms:.3g}" if rel_rms is not None else str((bad.get("comparison") or {}).get("problem"))
    return f"outputs.{bad.get('tensor')}: {found} [{bad.get('rule')}]"


def _tensors(row: dict) -> dict[str, dict]:
    """tensor name -> its row as judged on the golden: the first one of a name (rows a run adds later for the same
    tensor, judged on fresh inputs or on a repeated run, carry their own note and stay in the report)."""
    out: dict[str, dict] = {}
    for t in row.get("tensors") or []:
        if isinstance(t, dict) and isinstance(t.get("tensor"), str):
            out.setdefault(t["tensor"], t)
    return out


def _errors(tensor: dict) -> tuple[float | None, float | None]:
    """(relative RMS error, worst element error) of a tensor row; None where it has none (an exact integer
    tensor, a tensor not comparable: missing, misshaped)."""
    c = tensor.get("comparison")
    if not isinstance(c, dict) or c.get("exact") or c.get("problem"):
        return None, None
    return _number(c.get("rel_rms")), _number(c.get("worst_err"))


def _seconds(row: dict) -> float | None:
    speed = row.get("speed")
    return _number(speed.get("seconds")) if isinstance(speed, dict) else None


def _number(x) -> float | None:
    """A float of the report (non-finite ones are written as the strings 'nan', 'inf', '-inf'), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float, str)):
        return None
    try:
        return float(x)
    except ValueError:
        return None


def _ratio(b: float | None, a: float | None) -> float | None:
    """b / a; inf when only A is zero, None when either is missing or NaN or both are zero (nothing to scale)."""
    if a is None or b is None or math.isnan(a) or math.isnan(b) or (a == 0 and b == 0):
        return None
    return math.inf if a == 0 else b / a


def metadata_changes(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(dotted field, value in A, value in B) for each metadata field that differs, the volatile ones (start
    time, duration, command line, seed) left out."""
    fa, fb = _flatten(a), _flatten(b)
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb))
            if fa.get(k) != fb.get(k) and k.split(".")[0] not in VOLATILE]


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_line(name: str, report: dict) -> str:
    """'A (a/report.json): git 1a2b3c4d5e6f (dirty), GPU NVIDIA H200, tiny goldens e932f6c48273, started ...,
    3 pass, 1 fail'."""
    m = report.get("metadata") or {}
    git, gpu, golden = m.get("git") or {}, m.get("gpu") or {}, m.get("golden") or {}
    sha = git.get("sha")
    parts = [f"git {sha[:12]}" + (" (dirty)" if git.get("dirty") else "") if isinstance(sha, str) else "no git",
             f"GPU {gpu['name']}" if gpu.get("name") else "no GPU seen",
             f"{report.get('config')}" + (f" goldens {str(golden['manifest_sha256'])[:12]}"
                                          if golden.get("manifest_sha256") else ""),
             f"started {m['started']}" if m.get("started") else "start unknown"]
    summary = report.get("summary")
    if isinstance(summary, dict):
        parts.append(f"{summary.get('pass')} pass, {summary.get('fail')} fail")
    return f"{name}: " + ", ".join(parts)


def render(d: RunDiff, a: dict | None = None, b: dict | None = None) -> list[str]:
    """The diff as text lines: the verdict line, the runs, what differs, the changed cells, then per (case,
    backend) and tensor the error ratios and the speed ratio."""
    lines = [d.first_line()]
    if a is not None and b is not None:
        lines += [run_line(f"A ({d.a})", a), run_line(f"B ({d.b})", b)]
    lines += [f"WARNING: {w}" for w in d.warnings]
    if d.metadata_changes:
        lines.append("differs between the runs:")
        lines += [f"  {f}: {_show(va)} -> {_show(vb)}" for f, va, vb in d.metadata_changes]
    for change, title in (("regression", "regressions (pass in A, fail in B)"),
                          ("improvement", "improvements (fail in A, pass in B)"),
                          ("changed", "other verdict changes"), ("new", "new in B"), ("gone", "gone from B")):
        cells = d.of(change)
        if cells:
            lines.append(f"{title}:")
            lines += [f"  {c.label}: {c.status_a or '-'} -> {c.status_b or '-'}" + (f" ({c.why_b})" if c.why_b else "")
                      for c in cells]
    worse = [c for c in d.cells if c.worse]
    if worse:
        lines.append(f"worse (still pass, an error ratio above {d.threshold:g}):")
        lines += [f"  {c.label}: error x{_fmt(c.worst_ratio())}" for c in worse]
    lines.append("case | backend | A -> B | tensor | rel RMS A | rel RMS B | B/A | worst B/A | speed B/A")
    for c in (c for c in d.cells if c.status_a is not None and c.status_b is not None):
        head = f"{c.case} | {c.backend} | {c.status_a or '-'} -> {c.status_b or '-'}"
        speed = _fmt(c.speed_ratio)
        if not c.tensors:
            lines.append(f"{head} | - | - | - | - | - | {speed}")
        for t in c.tensors:
            flag = "  worse" if c.worse and max(r for r in (t.rel_rms_ratio, t.worst_ratio, 0.0)
                                                if r is not None) > d.threshold else ""
            lines.append(f"{head} | {t.tensor} | {_fmt(t.rel_rms_a)} | {_fmt(t.rel_rms_b)} | "
                         f"{_fmt(t.rel_rms_ratio)} | {_fmt(t.worst_ratio)} | {speed}{flag}")
    return lines


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _show(v) -> str:
    return "(none)" if v is None else str(v)


def _finite(o):
    """`o` with non-finite floats as strings, like report.json: strict JSON readers reject NaN and Infinity."""
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return o
