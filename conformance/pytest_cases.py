"""The conformance cases as pytest items, on the backend named by `--k3conf-backend` (conformance.pytest_plugin
loads this plugin only when that option is given; see its docstring for the options).

The run is prepared by conformance.session, as for `k3conf run`: the backend checked (an external one's cores
tried on tiny inputs first), the cases selected, the goldens found, K3_STRICT read by the same rule. The verdicts
are the CLI's: an item passes, fails or skips as its (case, backend) cell does, each failing item says why in its
own line, and the session fails where `k3conf run` would exit 1 although no item failed (the backend was judged
on nothing: every item skip or n/a).
"""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from conformance.cases.catalog import select
from conformance.report import print_terminal
from conformance.results import CaseResult, RunReport
from conformance.runner import case_runner
from conformance.session import (
    SessionError,
    backend_row,
    cases_of,
    checked_backend,
    golden_root,
    strict,
    strict_missing,
)


def pytest_configure(config) -> None:
    spec = config.getoption("k3conf_backend")
    config.pluginmanager.register(ConformanceSession(config, spec), "k3conf-session")


class CaseFailed(AssertionError):
    """A case that failed its gates (or errored) on the backend; the message is its result's failure line."""


class ConformanceSession:
    """The backend, the cases and one runner (goldens and baseline errors cached) for a pytest session."""

    def __init__(self, config, spec: str):
        try:
            strict()
        except SessionError as e:
            raise pytest.UsageError(str(e)) from None
        try:
            check = checked_backend(spec)
        except SessionError as e:
            raise pytest.UsageError(f"--k3conf-backend {spec}: {e}") from None
        self.backend, self.ok, self.why = check.backend, check.available, check.reason
        self.row = backend_row(spec, check.backend, check, must_judge=True)   # the one backend asked for
        self.strict_missing = strict_missing([self.row])
        cfg = config.getoption("k3conf_config")
        patterns = config.getoption("k3conf_cases")
        self.cases = select(cases_of(cfg), patterns)
        if not self.cases:
            raise pytest.UsageError(f"--k3conf-cases {patterns}: no case matches in config {cfg!r}; "
                                    "`k3conf list cases` shows them")
        golden = config.getoption("k3conf_golden")
        try:
            root = golden_root(Path(golden) if golden else None, cfg)
        except SessionError as e:
            raise pytest.UsageError(str(e)) from None
        self.runner = case_runner(root, cfg, config.getoption("k3conf_timing"), specs={check.backend.name: spec})
        self.results: list[CaseResult] = []   # every item run, for the summary table
        config.addinivalue_line("markers", "k3conf: a K3 conformance case (k3-conformance)")
        for block in dict.fromkeys(c.block for c in self.cases):
            config.addinivalue_line("markers", f"{block}: K3 conformance cases of the block {block}")

    def report(self, results) -> RunReport:
        return RunReport(config=self.runner.config, backends=[self.row], results=list(results),
                         wall_seconds=sum(r.seconds for r in results), copy_bandwidth={},
                         strict_missing=self.strict_missing)

    def run(self, case) -> CaseResult:
        res = self.runner.run_one(case, self.backend)
        self.results.append(res)
        return res

    def pytest_sessionfinish(self, session) -> None:
        """A session in which no item failed still fails where `k3conf run` exits 1: the backend was judged on
        nothing (every item skip or n/a). The reason is the first line of the k3conf summary section."""
        if self.results and self.report(self.results).exit_code and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        """The run's table (case x backend, worst error per cell) and its first failure, as `k3conf run` prints."""
        if not self.results:
            return
        text = io.StringIO()
        width = max(100, shutil.get_terminal_size().columns)
        print_terminal(self.report(self.results), Console(file=text, width=width))
        terminalreporter.section("k3conf")
        terminalreporter.write(text.getvalue())

    @pytest.hookimpl(tryfirst=True)   # before -k / -m deselect
    def pytest_collection_modifyitems(self, session, config, items) -> None:
        for case in self.cases:
            item = CaseItem.from_parent(session, name=case.name, nodeid=case.name, case=case, conformance=self)
            item.add_marker("k3conf")
            item.add_marker(case.block)
            items.append(item)

    def pytest_report_header(self, config) -> str:
        state = "available" if self.ok else "unavailable"
        return (f"k3conf: backend {self.backend.name} ({self.backend.precision}, {state}: {self.why}), "
                f"{len(self.cases)} case(s) of {self.runner.config}, goldens in {self.runner.root}")


class CaseItem(pytest.Item):
    """One conformance case on the session's backend."""

    def __init__(self, *, case, conformance: ConformanceSession, **kwargs):
        super().__init__(**kwargs)
        self.case, self.conformance = case, conformance

    def runtest(self) -> None:
        if self.conformance.strict_missing:     # K3_STRICT: a backend that cannot run here fails, as in the CLI
            raise CaseFailed(f"K3_STRICT=1 and {self.conformance.strict_missing[0]}")
        if not self.conformance.ok:
            pytest.skip(f"backend {self.conformance.backend.name} unavailable: {self.conformance.why}")
        res = self.conformance.run(self.case)
        if res.status == "skip":
            pytest.skip(res.error)
        if res.status == "n/a":        # only k3ref's reference core would run: neither a pass nor a fail
            pytest.skip(f"n/a (reference core): {res.error}")
        if res.status != "pass":
            raise CaseFailed(res.failure_line())

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CaseFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"k3conf {self.case.name} on {self.conformance.backend.name}"
