"""The serving engines' backends together: their documented findings, and the check `make engines` runs.

Each engine adapter module (conformance.backends.sglang, conformance.backends.vllm) keeps EXPECTED_FINDINGS:
backend -> case glob -> why that backend fails the case, as measured (docs/engines.md).
`python -m conformance.backends.engines REPORT.json [...]` reads one or more `k3conf run` reports and passes only
when, for every engine backend in them, the failed cases are exactly its documented findings: a new failure fails, a
listed case that now passes asks to be struck from the list, and a backend judged on nothing in all the reports
fails. The findings are data: when a gate or a kernel changes, the table changes with it, and the check says which
entry.
"""
from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path

from conformance.backends import sglang, vllm

EXPECTED_FINDINGS: dict[str, dict[str, str]] = {**sglang.EXPECTED_FINDINGS, **vllm.EXPECTED_FINDINGS}
BACKENDS = tuple(EXPECTED_FINDINGS)
JUDGED = ("pass", "fail", "error")


def expected_finding(case: str, backend: str, findings: dict[str, dict[str, str]] | None = None) -> str | None:
    """Why `backend` is known to fail `case`, or None."""
    table = (EXPECTED_FINDINGS if findings is None else findings).get(backend, {})
    return next((why for pattern, why in table.items() if fnmatch.fnmatchcase(case, pattern)), None)


def check_findings(results: list[dict], findings: dict[str, dict[str, str]] | None = None) -> list[str]:
    """report.json results (of one or more runs, concatenated) -> the problems that fail `make engines`: a failed
    or errored case of an engine backend that is not one of its findings, a finding that now passes (strike it),
    an engine backend present but judged on nothing. Empty: every engine backend's verdict is as documented."""
    table = EXPECTED_FINDINGS if findings is None else findings
    problems = []
    for backend in table:
        mine = [r for r in results if r.get("backend") == backend]
        if not mine:
            continue
        for r in mine:
            why = expected_finding(r["case"], backend, table)
            if r["status"] in ("fail", "error") and why is None:
                problems.append(f"{backend} {r['case']}: {r['status']} and not an expected finding "
                                f"({r.get('error') or 'a gate failed'})")
            elif r["status"] == "pass" and why is not None:
                problems.append(f"{backend} {r['case']}: passes now, but is listed as a finding ({why}); strike it "
                                "from EXPECTED_FINDINGS")
        if not any(r["status"] in JUDGED for r in mine):
            problems.append(f"{backend}: no case was judged (found {sorted({r['status'] for r in mine})})")
    return problems


def read_results(paths: list[str]) -> list[dict]:
    """The results of every report, concatenated; ValueError naming the file that is not a k3conf report."""
    results = []
    for path in paths:
        try:
            results += json.loads(Path(path).read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: expected a k3conf run report.json with 'results', found "
                             f"{type(e).__name__}: {e}") from e
    return results


def main(argv: list[str]) -> int:
    """python -m conformance.backends.engines REPORT.json [...]: 0 when every engine backend's failures are exactly
    its documented findings (each printed with its reason), 1 otherwise (each problem printed), 2 on bad usage."""
    if not argv:
        print("usage: python -m conformance.backends.engines REPORT.json [REPORT.json ...]", file=sys.stderr)
        return 2
    try:
        results = read_results(argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    for r in results:
        why = expected_finding(r["case"], r.get("backend", "")) if r["status"] == "fail" else None
        if why:
            print(f"expected finding: {r['case']} fails on {r['backend']}: {why}")
    problems = check_findings(results)
    for p in problems:
        print(f"engines verdict: {p}", file=sys.stderr)
    for backend in BACKENDS:
        mine = [r for r in results if r.get("backend") == backend]
        if mine:
            counts = ", ".join(f"{sum(r['status'] == s for r in mine)} {s}" for s in ("pass", "fail", "error", "n/a",
                                                                                     "skip"))
            print(f"{backend}: {counts}")
    print(f"engines verdict: {'as documented' if not problems else 'NOT as documented'}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
