"""The conformance cases as pytest items, on the backend named by `--k3conf-backend` (conformance.pytest_plugin
loads this plugin only when that option is given; see its docstring for the options).

The run is prepared by conformance.session, as for `k3conf run`: the backend loaded by a worker process of its own
(its module is never imported into pytest's process, which holds the goldens and the judge), an external one's
cores tried on tiny inputs first, the cases selected, the goldens found, K3_STRICT read by the same rule. The
verdicts are the CLI's: an item passes, fails or skips as its (case, backend) cell does, each failing item says
why in its own line (a backend the start-up check refused fails every item with the reason), and the session
fails where `k3conf run` would exit 1 although no item failed (the backend was judged on nothing, or its kernels
left processes running).

The cases are collected as pytest collects a test file: one collector `k3conf` beside the session's own, so the
header counts them and `-k` / `-m` deselect from them like any test. Each item is marked `k3conf`, with its block
and with every core its kind says it exercises (kind_of(case).cores_of(case)), so `-m kda_decode` (or `-k`) keeps
the model traces that run kda_decode too; every core name is registered as a marker, so `--strict-markers` and
`-m` on a core no case of the run exercises stay quiet.
"""
from __future__ import annotations

import io
import math
import time
from pathlib import Path

import pytest
from rich.console import Console

from conformance.cases.catalog import all_cases, kind_of
from conformance.cases.protocol import Case
from conformance.fuzz import replay
from conformance.fuzz.draws import fuzzable
from conformance.fuzz.inrun import cores_run_by, fuzz_backends, judged_backends, spec_of
from conformance.isolation.client import WorkerPool
from conformance.judge.gates import judge_state, tables_changed
from conformance.metadata import collect as collect_metadata
from conformance.report import print_terminal, write_reports
from conformance.results import CaseResult, FuzzSummary, RunReport
from conformance.runner import case_runner
from conformance.session import (
    SessionError,
    backend_row,
    check_report_dir,
    checked_backend,
    golden_root,
    pick_cases,
    strict,
    strict_missing,
)
from k3ref.cores import CORE_NAMES

try:   # pytest's JUnit writer: its per-test attributes (what the record_xml_attribute fixture writes to) live here
    from _pytest.junitxml import xml_key as JUNIT_KEY
except ImportError:   # a pytest that moved it: the JUnit rows keep pytest's own classname (empty for these ids)
    JUNIT_KEY = None  # type: ignore[assignment]  # the key's type is pytest's; None marks it missing

COLLECTOR = "k3conf"   # the collector's name and nodeid, the marker every case carries, the JUnit classname's head
FUZZ = "fuzz"          # the fuzz items' id prefix (fuzz/<core>) and marker
SUMMARY_WIDTH = 160    # the table's width in the summary section, as `k3conf run` prints it off a terminal


def pytest_configure(config) -> None:
    spec = config.getoption("k3conf_backend")
    config.pluginmanager.register(ConformanceSession(config, spec), "k3conf-session")


class CaseFailed(AssertionError):
    """A case that failed its gates (or errored) on the backend; the message is its result's failure line."""


def markers_of(case: Case) -> list[str]:
    """`k3conf`, the case's block, and every core the case exercises (a trace exercises them all)."""
    return list(dict.fromkeys([COLLECTOR, case.block, *sorted(kind_of(case).cores_of(case))]))


class ConformanceSession:
    """The backend, the cases and one runner (goldens and baseline errors cached) for a pytest session."""

    def __init__(self, config, spec: str):
        try:
            strict()
        except SessionError as e:
            raise pytest.UsageError(str(e)) from None
        self.judge_at_start = judge_state()
        self.pool = WorkerPool()
        try:
            check = checked_backend(spec, self.pool)
        except SessionError as e:
            self.pool.close()
            raise pytest.UsageError(f"--k3conf-backend {spec}: {e}") from None
        self.backend, self.ok, self.why, self.refused = check.backend, check.available, check.reason, check.refused
        self.row = backend_row(spec, check.backend, check, must_judge=True)   # the one backend asked for
        self.strict_missing = strict_missing([self.row])
        cfg = config.getoption("k3conf_config")
        try:
            self.cases = pick_cases(cfg, config.getoption("k3conf_cases"))
        except SessionError as e:
            raise pytest.UsageError(_as_plugin_option(str(e), "--cases")) from None
        golden = config.getoption("k3conf_golden")
        try:
            root = golden_root(Path(golden) if golden else None, cfg)
        except SessionError as e:
            raise pytest.UsageError(str(e)) from None
        self.report_dir = self._report_dir(config)
        self.runner = case_runner(root, cfg, config.getoption("k3conf_timing"), self.pool, {spec: check.backend})
        self.fuzz_cores, self.fuzz_seconds = self._fuzz_plan(config, cores_run_by(self.cases))
        self.fuzzed: list[FuzzSummary] = []   # each fuzz item's draws, merged into the report
        self.results: list[CaseResult] = []   # every item run, for the summary table and the report files
        self.seconds = 0.0                    # the cases' own time (the session's other tests not counted)
        self.written: list[Path] = []         # the report files written at the session's end
        self.unwritten = ""                   # why they could not be, when they could not
        self._register_markers(config, cfg)

    @staticmethod
    def _report_dir(config) -> Path | None:
        """--k3conf-report, relative to where pytest was started; refused before any case runs when unwritable."""
        given = config.getoption("k3conf_report")
        if not given:
            return None
        out = Path(config.invocation_params.dir) / given
        try:
            check_report_dir(out)
        except SessionError as e:
            raise pytest.UsageError(_as_plugin_option(str(e), "--report")) from None
        return out

    def _fuzz_plan(self, config, run: frozenset[str]) -> tuple[list[str], float]:
        """The cores the fuzz items draw for, those of the backend's the selected cases run (none: --k3conf-no-fuzz,
        or a backend that is not fuzzed: the float64 reference, a precision baseline, a whole model, one that cannot
        run), and each item's seconds."""
        seconds = config.getoption("k3conf_fuzz")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise pytest.UsageError(f"--k3conf-fuzz: expected a finite number of seconds >= 0, found {seconds}")
        if config.getoption("k3conf_no_fuzz") or not self.ok or self.refused or not judged_backends([self.backend]):
            return [], 0.0
        cores = fuzzable(self.backend.kernel_cores() & run)
        return cores, seconds / max(len(cores), 1)

    def fuzz(self, core: str) -> FuzzSummary:
        """One fuzz item: every region of `core` drawn with the session's seed (more while its seconds last),
        a failing draw shrunk and written as a replay file (under --k3conf-report DIR/fuzz, else the cache)."""
        t0 = time.perf_counter()
        out = self.report_dir / "fuzz" if self.report_dir is not None else replay.cache_root() / "replays"
        seed = self.runner.seed
        assert seed is not None   # case_runner always draws one (fresh_seed)
        summary = fuzz_backends(self.runner, [self.backend], self.fuzz_seconds, out, seed, frozenset({core}))
        self.seconds += time.perf_counter() - t0
        self.fuzzed.append(summary)
        return summary

    @staticmethod
    def _register_markers(config, cfg: str) -> None:
        """`k3conf`, every core and every block of the case set: the names a marker expression may use, whichever
        cases this run selected."""
        config.addinivalue_line("markers", f"{COLLECTOR}: a K3 conformance case (k3-conformance)")
        config.addinivalue_line("markers", f"{FUZZ}: the fuzz draws of one core (k3-conformance)")
        blocks = [c.block for c in all_cases(cfg)]
        for name in dict.fromkeys([*CORE_NAMES, *blocks]):
            config.addinivalue_line("markers", f"{name}: K3 conformance cases of {name} and the cases that run it "
                                               "(composite cases, model traces)")

    def report(self) -> RunReport:
        return RunReport(config=self.runner.config, backends=[self.row], results=list(self.results),
                         wall_seconds=self.seconds, copy_bandwidth={}, strict_missing=self.strict_missing,
                         left_running=self.pool.left_lines(), judge_problem=tables_changed(self.judge_at_start),
                         fuzz=FuzzSummary.merged(self.fuzzed))

    def run(self, case: Case) -> CaseResult:
        t0 = time.perf_counter()
        res = self.runner.run_one(case, self.backend)
        self.seconds += time.perf_counter() - t0
        self.results.append(res)
        return res

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector):
        """The session's top-level collectors, and `k3conf` after them: collected, counted and deselected as a
        test file is."""
        report = yield
        if isinstance(collector, pytest.Session) and report.passed:
            report.result.append(CaseCollection.from_parent(collector, name=COLLECTOR, nodeid=COLLECTOR,
                                                            conformance=self))
        return report

    def pytest_sessionfinish(self, session) -> None:
        """The report files, when asked for. A session in which no item failed still fails where `k3conf run`
        exits 1: the backend was judged on nothing (every item skip or n/a). The reason is the first line of
        the k3conf summary section."""
        self.close()   # the workers stopped now: what they left running fails the session
        if not self.results and not self.fuzzed:
            return
        report = self.report()
        if self.report_dir is not None:
            self._write(report)
        if report.exit_code and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.unwritten and session.exitstatus == pytest.ExitCode.OK:   # as `k3conf run`: a run without its
            session.exitstatus = pytest.ExitCode.USAGE_ERROR                 # report files is no pass

    def _write(self, report: RunReport) -> None:
        report.metadata = collect_metadata(root=self.runner.root, config=self.runner.config, seed=self.runner.seed,
                                           duration=self.seconds)
        assert self.report_dir is not None
        try:
            self.written = write_reports(report, self.report_dir)
        except OSError as e:
            self.unwritten = (f"cannot write the reports to {self.report_dir} ({e.strerror or e}); "
                              "none was written")

    def close(self) -> None:
        """Stop the worker processes (idempotent) and remove the fresh inputs."""
        self.runner.close()
        self.pool.close()

    def pytest_unconfigure(self, config) -> None:
        self.close()   # its worker processes and fresh inputs, now rather than when it is collected

    def pytest_terminal_summary(self, terminalreporter) -> None:
        """The run's table (case x backend, worst error per cell) and its first failure, as `k3conf run` prints,
        and where the report files went."""
        if not self.results and not self.fuzzed:
            if self.report_dir is not None:
                terminalreporter.write_line(f"k3conf: no case ran here, so no report was written to {self.report_dir}")
            return
        text = io.StringIO()
        width = max(SUMMARY_WIDTH, terminalreporter.config.get_terminal_writer().fullwidth)
        print_terminal(self.report(), Console(file=text, width=width))
        terminalreporter.section("k3conf")
        terminalreporter.write(text.getvalue())
        if self.written:
            terminalreporter.write_line(f"k3conf reports: {', '.join(str(p) for p in self.written)}")
        if self.unwritten:
            terminalreporter.write_line(f"k3conf: {self.unwritten}", red=True)

    def pytest_report_header(self, config) -> list[str]:
        state = "available" if self.ok else "unavailable"
        lines = [f"k3conf: backend {self.backend.name} ({self.backend.precision}, {state}: {self.why}), "
                 f"{len(self.cases)} case(s) of {self.runner.config}, goldens in {self.runner.root}"]
        if self.report_dir is not None:
            lines.append(f"k3conf: reports to {self.report_dir}")
        return lines


def _as_plugin_option(message: str, cli_option: str) -> str:
    """A conformance.session message about a `k3conf run` option, naming the plugin's option instead."""
    option = cli_option.replace("--", "--k3conf-", 1)
    if cli_option in message:
        return message.replace(cli_option, option)
    return f"{option}: {message}"


class CaseCollection(pytest.Collector):
    """The session's conformance cases, as a test file holds its tests: one item per case, in catalog order."""

    def __init__(self, *, conformance: ConformanceSession, **kwargs):
        super().__init__(**kwargs)
        self.conformance = conformance

    def collect(self):
        for case in self.conformance.cases:
            # the item's id is the case name, as `k3conf run` prints it (and as --deselect takes it)
            item = CaseItem.from_parent(self, name=case.name, nodeid=case.name, case=case,
                                        conformance=self.conformance)
            for marker in markers_of(case):
                item.add_marker(marker)
            yield item
        for core in self.conformance.fuzz_cores:
            item = FuzzItem.from_parent(self, name=f"{FUZZ}/{core}", nodeid=f"{FUZZ}/{core}", core=core,
                                        conformance=self.conformance)
            for marker in (COLLECTOR, FUZZ, core):
                item.add_marker(marker)
            yield item


def junit_names(item: pytest.Item, classname: str, name: str) -> None:
    """An item's JUnit row classed and named as given (a case: `k3conf.kda_decode`, `B2-H3-K16`): pytest would
    derive the class from a file path in the id, and a case id has none (its rows came out with an empty
    classname)."""
    xml = item.config.stash.get(JUNIT_KEY, None) if JUNIT_KEY is not None else None
    if xml is None:   # no --junitxml
        return
    if xml.prefix:    # --junitprefix, as pytest applies it to its own rows
        classname = f"{xml.prefix}.{classname}"
    reporter = xml.node_reporter(item.nodeid)
    reporter.add_attribute("classname", classname)
    reporter.add_attribute("name", name)


class CaseItem(pytest.Item):
    """One conformance case on the session's backend."""

    def __init__(self, *, case: Case, conformance: ConformanceSession, **kwargs):
        super().__init__(**kwargs)
        self.case, self.conformance = case, conformance

    def setup(self) -> None:
        junit_names(self, f"{COLLECTOR}.{self.case.block}", self.case.name.removeprefix(f"{self.case.block}/"))

    def runtest(self) -> None:
        if self.conformance.strict_missing:     # K3_STRICT: a backend that cannot run here fails, as in the CLI
            raise CaseFailed(f"K3_STRICT=1 and {self.conformance.strict_missing[0]}")
        if self.conformance.refused:            # the start-up check found a core that answers nothing
            raise CaseFailed(self.conformance.refused)
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


class FuzzItem(pytest.Item):
    """The fuzz draws of one core on the session's backend; fails with the shrunk findings' lines. Its JUnit row
    is classed `k3conf.fuzz`, named by the core."""

    def __init__(self, *, core: str, conformance: ConformanceSession, **kwargs):
        super().__init__(**kwargs)
        self.core, self.conformance = core, conformance

    def setup(self) -> None:
        junit_names(self, f"{COLLECTOR}.{FUZZ}", self.core)

    def runtest(self) -> None:
        if self.conformance.strict_missing:
            raise CaseFailed(f"K3_STRICT=1 and {self.conformance.strict_missing[0]}")
        summary = self.conformance.fuzz(self.core)
        if summary.findings:
            raise CaseFailed("\n".join(summary.findings))
        if not any(r.status == "pass" for r in summary.results):
            pytest.skip(f"no draw of {self.core} was judged ({summary.line()})")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CaseFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"k3conf fuzz {self.core} on {spec_of(self.conformance.backend)}"
