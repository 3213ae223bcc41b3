"""pytest plugin: the conformance cases as test items of a kernel author's own test run.

    pytest --k3conf-backend my_kernels.k3:make              # every case, besides the repository's tests
    pytest --k3conf-backend ./k3_backend.py:make -k kda_decode

Registered under the entry point `pytest11` (name `k3conf`), so it loads in every pytest run of an
environment where k3-conformance is installed; without `--k3conf-backend` it only adds its options (no
import of the package's heavy modules, no items, no markers). With it, each case becomes one item whose
id is the case name (`kda_decode/B2-H3-K16`), marked `k3conf` and with its block (`-m kda_decode`); a
failing item shows the runner's first-failure line, and the session ends with the run's table. Cases whose
cores the backend does not supply skip as "n/a (reference core)"; an unavailable backend skips every item
with its reason.
"""
from __future__ import annotations

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("k3conf", "K3 conformance cases on a kernel backend (k3-conformance)")
    group.addoption("--k3conf-backend", metavar="MODULE:ATTR", default=None,
                    help="run the K3 conformance cases on this backend: MODULE:ATTR, ./file.py:ATTR or a name "
                         "from `k3conf list backends`")
    group.addoption("--k3conf-cases", action="append", metavar="GLOB", default=None,
                    help="only cases matching this glob (repeatable), e.g. 'kda_*'")
    group.addoption("--k3conf-config", choices=("tiny", "small"), default="tiny", help="case set (default tiny)")
    group.addoption("--k3conf-golden", metavar="DIR", default=None,
                    help="golden directory (default: the package's goldens for tiny, the cache for small)")
    group.addoption("--k3conf-timing", action="store_true",
                    help="also measure speed and apply the speed gates (off by default: tests are not benchmarks)")


def pytest_configure(config) -> None:
    spec = config.getoption("k3conf_backend", None)
    if spec:
        config.pluginmanager.register(ConformanceSession(config, spec), "k3conf-session")


class CaseFailed(AssertionError):
    """A case that failed its gates (or errored) on the backend; the message is the runner's first-failure line."""


class ConformanceSession:
    """The backend, the cases and one runner (goldens and baseline errors cached) for a pytest session."""

    def __init__(self, config, spec: str):
        from pathlib import Path

        from conformance.backends.external import BackendError, check_cores
        from conformance.backends.registry import get_backend, is_external
        from conformance.cases.core import all_cases, select
        from conformance.golden.store import MANIFEST, default_root
        from conformance.runner import case_runner

        try:
            self.backend = get_backend(spec)
            self.ok, self.why = self.backend.available()
            if self.ok and is_external(spec):
                check_cores(self.backend)
        except (KeyError, BackendError) as e:
            raise pytest.UsageError(f"--k3conf-backend {spec}: {e.args[0] if isinstance(e, KeyError) else e}") from None
        cfg = config.getoption("k3conf_config")
        patterns = config.getoption("k3conf_cases")
        self.cases = select(all_cases(cfg), patterns)
        if not self.cases:
            raise pytest.UsageError(f"--k3conf-cases {patterns}: no case matches in config {cfg!r}; "
                                    "`k3conf list cases` shows them")
        golden = config.getoption("k3conf_golden")
        root = Path(golden) if golden else default_root(cfg)
        if not (root / MANIFEST).exists():
            raise pytest.UsageError(f"no goldens in {root} (no {MANIFEST}); generate them with: k3conf regen "
                                    f"--config {cfg}" + (f" --out {root}" if golden else ""))
        self.runner = case_runner(root, cfg, config.getoption("k3conf_timing"))
        self.results = []             # CaseResult of every item run, for the summary table
        config.addinivalue_line("markers", "k3conf: a K3 conformance case (k3-conformance)")
        for block in dict.fromkeys(c.block for c in self.cases):
            config.addinivalue_line("markers", f"{block}: K3 conformance cases of the block {block}")

    def report(self, results):
        from conformance.runner import RunReport

        row = {"name": self.backend.name, "precision": self.backend.precision, "available": self.ok, "reason": self.why}
        return RunReport(config=self.runner.config, backends=[row], results=list(results),
                         wall_seconds=sum(r.seconds for r in results), copy_bandwidth={})

    def run(self, case):
        res = self.runner.run_one(case, self.backend)
        self.results.append(res)
        return res, self.report([res]).first_failure_line()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        """The run's table (case x backend, worst error per cell) and its first failure, as `k3conf run` prints."""
        if not self.results:
            return
        import io
        import shutil

        from rich.console import Console

        from conformance.report import print_terminal

        text = io.StringIO()
        print_terminal(self.report(self.results), Console(file=text, width=max(100, shutil.get_terminal_size().columns)))
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
        if not self.conformance.ok:
            pytest.skip(f"backend {self.conformance.backend.name} unavailable: {self.conformance.why}")
        res, line = self.conformance.run(self.case)
        if res.status == "skip":
            pytest.skip(res.error)
        if res.status == "n/a":        # only k3ref's reference core would run: neither a pass nor a fail
            pytest.skip(f"n/a (reference core): {res.error}")
        if res.status != "pass":
            raise CaseFailed(line)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CaseFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"k3conf {self.case.name} on {self.conformance.backend.name}"
