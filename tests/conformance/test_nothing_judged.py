"""Nothing judged is not a pass, and what a backend says about itself is checked before it is believed: a
requested backend with no kernel core or only skip / n/a cells fails the run; kernel_cores(), available(), cores()
and the name of a backend are checked when it is loaded; two backends of one run may not share a name, nor an
external one take a built-in name; the gate table is read-only before any external code is loaded; K3_STRICT
has one parsing rule."""
from __future__ import annotations

import dataclasses
import json
import re
import textwrap
from pathlib import Path

import pytest

from conformance.backends import protocol
from conformance.backends import registry as backends
from conformance.backends.external import BackendError, as_backend
from conformance.cli import main
from conformance.isolation.client import WorkerPool
from conformance.judge import gate_table, gates
from conformance.judge.gate_row import Gate
from conformance.results import CaseResult, RunReport
from conformance.session import SessionError, checked_backend, resolve_backends, strict
from k3ref.cores import reference_cores
from tests.support import strict as suite_strict
from tests.support.backends import built_here

CASES = ["rmsnorm/T1-D113", "moe_route/T1-E8-k2"]

# a module of backends a kernel author could write; each is loaded by `<file>:<attr>`
BACKENDS = """
    from conformance import Backend
    from k3ref.cores import UnsupportedShape

    def _wrapped(fn):
        def core(*args, **kwargs):
            return fn(*args, **kwargs)
        return core

    def _refuse(*args, **kwargs):
        raise UnsupportedShape("built for D = 7168 only")

    def _forgets(base):
        base.replace(rmsnorm=_wrapped(base.rmsnorm))   # the result is dropped: base comes back unchanged
        return base

    good = Backend.from_cores("good", "fp32", lambda base: base.replace(rmsnorm=_wrapped(base.rmsnorm)))
    forgets = Backend.from_cores("forgets", "fp32", _forgets)
    refuses = Backend.from_cores("refuses", "fp32", lambda base: base.replace(rmsnorm=_refuse))
    mine_a = Backend.from_cores("mine", "fp32", lambda base: base.replace(rmsnorm=_wrapped(base.rmsnorm)))
    mine_b = Backend.from_cores("mine", "fp32", lambda base: base.replace(rmsnorm=_wrapped(base.rmsnorm)))
    numpy32 = Backend.from_cores("numpy32", "fp32", lambda base: base)
    model_bf16 = Backend.from_cores("torch-model-bf16", "bf16", lambda base: base)
"""


@pytest.fixture
def pool():
    """Worker processes for one test, stopped after it."""
    workers = WorkerPool(60)
    yield workers
    workers.close()


@pytest.fixture
def spec(tmp_path):
    """spec(attr) -> 'path/to/backends.py:attr' for the author's module above."""
    path = tmp_path / "author_backends.py"
    path.write_text(textwrap.dedent(BACKENDS))
    return lambda attr: f"{path}:{attr}"


def _run(tmp_path: Path, *backend_specs: str, cases=CASES) -> tuple[int, dict]:
    out = tmp_path / "report"
    rc = main(["run", "--backend", *backend_specs, "--cases", *cases, "--report", str(out), "--no-timing"])
    data = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    return rc, data


# ------------------------------------------------------------------------------------------ nothing judged


def test_a_backend_that_swaps_no_core_fails_the_run(tmp_path, spec, capsys):
    rc, data = _run(tmp_path, spec("forgets"))
    assert rc == 1
    assert data["exit_code"] == 1 and data["summary"]["pass"] == 0 and data["summary"]["fail"] == 0
    why = "backend forgets was judged on nothing: it supplies no kernel core (kernel_cores() is empty)"
    assert data["first_failure"].startswith(f"FIRST FAILURE: {why}")
    assert data["nothing_judged"][0].startswith(why)
    assert capsys.readouterr().out.startswith(f"FIRST FAILURE: {why}")
    assert why in (tmp_path / "report" / "report.md").read_text()


def test_a_backend_unsupported_everywhere_fails_the_run(tmp_path, spec):
    rc, data = _run(tmp_path, spec("refuses"), cases=["rmsnorm/*"])
    statuses = {r["status"] for r in data["results"]}
    assert rc == 1 and statuses == {"skip"}
    assert data["first_failure"] == (f"FIRST FAILURE: backend refuses was judged on nothing: every one of its "
                                     f"{len(data['results'])} result(s) is skip or n/a "
                                     f"({len(data['results'])} skip, 0 n/a)")


def test_one_judged_case_is_enough(tmp_path, spec):
    rc, data = _run(tmp_path, spec("good"))
    assert rc == 0 and data["nothing_judged"] == []
    assert {r["case"]: r["status"] for r in data["results"]} == {"rmsnorm/T1-D113": "pass", "moe_route/T1-E8-k2": "n/a"}


def _result(backend: str, status: str) -> CaseResult:
    return CaseResult("rmsnorm/T1-D113", "rmsnorm", backend, "fp32", status)


def _row(name: str, must_judge: bool, available: bool = True, kernel_cores=("rmsnorm",)) -> dict:
    return {"name": name, "backend": name, "precision": "fp32", "available": available, "reason": "",
            "kernel_cores": list(kernel_cores), "must_judge": must_judge}


def test_only_backends_the_run_must_judge_can_be_judged_on_nothing():
    rows = [_row("asked", True), _row("registered", False), _row("offline", True, available=False)]
    results = [_result("asked", "n/a"), _result("registered", "n/a")]
    report = RunReport("tiny", rows, results, 0.0, {})
    assert report.nothing_judged == ["backend asked was judged on nothing: every one of its 1 result(s) is skip "
                                     "or n/a (0 skip, 1 n/a)"]
    assert report.exit_code == 1
    rows[0]["must_judge"] = False     # a run of every registered backend: torch-model is n/a on the block cases
    assert RunReport("tiny", rows, results, 0.0, {}).exit_code == 0


def test_a_run_of_every_registered_backend_must_judge_only_the_external_ones(pool):
    _, rows = resolve_backends(None, pool)
    assert {r["name"] for r in rows if r["must_judge"]} <= {n for n in backends.backend_names()
                                                          if backends.is_external(n)}
    _, asked = resolve_backends(["numpy64"], pool)
    assert asked[0]["must_judge"] and asked[0]["kernel_cores"] == sorted(backends.ALL_CORES)


# ------------------------------------------------------------------------------------------ what a backend says


@dataclasses.dataclass
class Foreign:
    """A backend written against the bare protocol; each test breaks one member."""

    name: object = "foreign"
    precision: str = "fp32"
    kernels: object = ("rmsnorm",)
    probe: object = (True, "here")

    def available(self):
        if isinstance(self.probe, Exception):
            raise self.probe
        return self.probe

    def cores(self):
        return reference_cores()

    def time_core(self, core, inputs):
        return None

    def kernel_cores(self):
        if isinstance(self.kernels, Exception):
            raise self.kernels
        return self.kernels


@pytest.mark.parametrize("kernels, expect", [
    pytest.param("rmsnorm", "kernel_cores() returned str 'rmsnorm'; expected a set of core names", id="str"),
    pytest.param({"rmsnorm", "rms_norm"}, "kernel_cores() names ['rms_norm'], which are not core names", id="unknown"),
    pytest.param(7, "kernel_cores() returned int 7; expected a set of core names", id="not-iterable"),
    pytest.param(RuntimeError("no table"), "kernel_cores() raised RuntimeError: no table", id="raises"),
])
def test_kernel_cores_are_checked_when_the_backend_is_loaded(monkeypatch, pool, kernels, expect):
    monkeypatch.setitem(backends.BACKENDS, "foreign", lambda: Foreign(kernels=kernels))
    monkeypatch.setitem(backends._CACHE, "foreign", backends.adapt(Foreign(kernels=kernels)))
    built_here(monkeypatch, "foreign")
    with pytest.raises(SessionError, match=re.escape(f"backend foreign: {expect}")):
        checked_backend("foreign", pool)


def test_kernel_cores_are_checked_in_the_worker_that_loads_a_backend(tmp_path, pool):
    """The same check where a backend is loaded by its worker: the run refuses it with the worker's words."""
    path = tmp_path / "letters.py"
    path.write_text(textwrap.dedent("""
        from conformance.backends.builtin import NumpyBackend

        class Letters(NumpyBackend):
            def kernel_cores(self):
                return "rmsnorm"   # a str, not a set of names

        letters = Letters("letters", "fp32")
    """))
    with pytest.raises(SessionError, match="backend letters: kernel_cores\\(\\) returned str 'rmsnorm'"):
        checked_backend(f"{path}:letters", pool)


def test_kernel_cores_of_a_base_class_backend_are_checked_too(monkeypatch, pool):
    @dataclasses.dataclass
    class Letters(backends.NumpyBackend):
        def kernel_cores(self):
            return "rmsnorm"   # the mistake under test: a str, not a set of names

    monkeypatch.setitem(backends._CACHE, "letters", Letters("letters", "fp32"))
    monkeypatch.setitem(backends.BACKENDS, "letters", lambda: Letters("letters", "fp32"))
    built_here(monkeypatch, "letters")
    with pytest.raises(SessionError, match="backend letters: kernel_cores\\(\\) returned str 'rmsnorm'"):
        checked_backend("letters", pool)


@pytest.mark.parametrize("probe, reason", [
    pytest.param(OSError("driver gone"), "available() raised OSError: driver gone", id="raises"),
    pytest.param("yes", "available() must return (bool, reason), returned 'yes'", id="a-string"),
    pytest.param((1, "here"), "available() must return (bool, reason), returned (1, 'here')", id="not-a-bool"),
])
def test_a_broken_availability_probe_is_an_unavailable_row(probe, reason):
    backend = backends.adapt(Foreign(probe=probe))
    assert backend.available() == (False, reason)


@pytest.mark.parametrize("obj, expect", [
    pytest.param(Foreign(name=42), "name: expected a non-empty backend name, found int 42", id="name-int"),
    pytest.param(Foreign(name=""), "name: expected a non-empty backend name, found ''", id="name-empty"),
])
def test_a_foreign_backend_with_a_wrong_name_is_refused(obj, expect):
    with pytest.raises(BackendError, match=expect):
        backends.adapt(obj)


def test_a_foreign_backends_cores_must_be_cores():
    @dataclasses.dataclass
    class NoCores(Foreign):
        def cores(self):
            return {"rmsnorm": None}

    with pytest.raises(BackendError, match="backend foreign: cores\\(\\) returned dict, expected k3ref.cores.Cores"):
        backends.adapt(NoCores()).cores()


def test_a_foreign_backend_says_whether_it_is_deterministic():
    @dataclasses.dataclass
    class Atomics(Foreign):
        deterministic: object = False

    assert backends.adapt(Atomics()).deterministic is False
    assert backends.adapt(Foreign()).deterministic is True           # BackendBase's default
    with pytest.raises(BackendError, match="deterministic: expected True or False, found str 'no'"):
        backends.adapt(Atomics(deterministic="no"))


# ------------------------------------------------------------------------------------------ names


def test_two_requested_backends_of_one_name_are_refused(tmp_path, spec, capsys):
    rc = main(["run", "--backend", spec("mine_a"), spec("mine_b"), "--cases", CASES[0], "--no-timing",
               "--report", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"backends {spec('mine_a')} and {spec('mine_b')} are both named 'mine'" in err
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("attr, taken", [("numpy32", "numpy32"), ("model_bf16", "torch-model-bf16")])
def test_an_external_backend_may_not_take_a_built_in_name(tmp_path, spec, capsys, attr, taken):
    rc = main(["run", "--backend", spec(attr), "--cases", CASES[0], "--no-timing", "--report", str(tmp_path)])
    assert rc == 2
    assert f"the name {taken!r} is a built-in backend's; give yours another name" in capsys.readouterr().err


def test_a_backend_is_built_again_by_the_name_it_was_registered_under(spec):
    backend = backends.get_backend(spec("good"))
    assert backend.name == "good" and backends.registered_name(backend) == spec("good")
    assert backends.registered_name(backends.get_backend("numpy32")) == "numpy32"


def test_an_external_backend_may_not_take_a_mutant_name():
    with pytest.raises(BackendError, match="the name 'mutant:kda-no-lower-bound' is a built-in backend's"):
        as_backend(Foreign(name="mutant:kda-no-lower-bound"), "test", backends.reserved_names())


# ------------------------------------------------------------------------------------------ the gate table


@pytest.mark.parametrize("table", ["GATES", "BASELINE_GATES", "MARGIN_BUDGETS", "SPEED_TARGETS"])
def test_the_gate_tables_are_read_only(table):
    rows = vars(gates)[table]
    assert rows is vars(gate_table)[table]
    with pytest.raises(TypeError, match=f"the gate table {table} is read-only once built"):
        rows[("rmsnorm", "*", "bf16")] = Gate(1.0, None, 0.0, 1.0, 1.0, "mine")
    with pytest.raises(TypeError, match="read-only"):
        del rows[next(iter(rows), ("rmsnorm", "*", "fp32"))]


def test_the_margin_budgets_of_a_precision_are_read_only():
    with pytest.raises(TypeError, match=r"the gate table MARGIN_BUDGETS\['bf16'\] is read-only"):
        gates.MARGIN_BUDGETS["bf16"]["router"] = (1.0, "force every route")


@pytest.mark.parametrize("edit, code, says", [
    pytest.param("gates.GATES[('rmsnorm', '*', 'fp32')] = Gate(1.0, None, 0.0, 1.0, 1.0, 'mine')", 2,
                 "read-only once built", id="edit-row"),
    pytest.param("gates.GATES = {**gates.GATES, ('rmsnorm', '*', 'fp32'): Gate(1.0, None, 0.0, 1.0, 1.0, 'mine')}",
                 1, "no answer to its inputs", id="replace-table"),
])
def test_a_backend_that_edits_the_gate_table_on_import_never_reaches_the_runs_judge(tmp_path, capsys, monkeypatch,
                                                                                     edit, code, says):
    """Its module is imported in its worker only: an edit that raises there makes the backend unloadable (exit 2,
    naming the file); one that succeeds changes the worker's copy of the judge, and the kernel is judged by the
    run's own (here: refused at start-up, it returns its input)."""
    monkeypatch.setattr(gates, "GATES", gates.GATES)   # undone after the test, whatever the backend did
    path = tmp_path / "lenient.py"
    path.write_text(textwrap.dedent(f"""
        from conformance import Backend
        from conformance.judge import gates
        from conformance.judge.gate_row import Gate

        {edit}

        def _loose(x, w, eps):
            return x

        lenient = Backend.from_cores("lenient", "fp32", lambda base: base.replace(rmsnorm=_loose))
    """))
    rc = main(["run", "--backend", f"{path}:lenient", "--cases", CASES[0], "--no-timing", "--report", str(tmp_path)])
    said = capsys.readouterr()
    assert rc == code and says in said.out + said.err, said
    assert gates.tables_changed() == ""


# ------------------------------------------------------------------------------------------ K3_STRICT


@pytest.mark.parametrize("value, expect", [
    ("1", True), ("true", True), ("TRUE", True), ("Yes", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False), ("", False), (None, False),
])
def test_strict_reads_the_common_spellings(monkeypatch, value, expect):
    if value is None:
        monkeypatch.delenv("K3_STRICT", raising=False)
    else:
        monkeypatch.setenv("K3_STRICT", value)
    assert strict() is expect
    assert suite_strict.strict() is expect        # the test suite reads it by the same rule


@pytest.mark.parametrize("value", ["2", "maybe", "y", "enabled"])
def test_strict_refuses_any_other_value(monkeypatch, capsys, value):
    monkeypatch.setenv("K3_STRICT", value)
    with pytest.raises(SessionError, match=f"K3_STRICT: expected one of 1, true, yes, on .*found '{value}'"):
        strict()
    assert main(["run", "--backend", "numpy64", "--cases", CASES[0], "--no-timing"]) == 2
    assert f"found '{value}'" in capsys.readouterr().err


def test_strict_true_fails_on_an_unavailable_backend(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(backends._CACHE, "offline", backends.adapt(Foreign(name="offline", probe=(False, "no dev"))))
    monkeypatch.setitem(backends.BACKENDS, "offline", lambda: Foreign(name="offline", probe=(False, "no dev")))
    built_here(monkeypatch, "offline")
    monkeypatch.setenv("K3_STRICT", "true")
    argv = ["run", "--backend", "numpy64", "offline", "--cases", CASES[0], "--report", str(tmp_path), "--no-timing"]
    assert main(argv) == 1
    assert capsys.readouterr().out.startswith("FIRST FAILURE: K3_STRICT=1 and backend offline cannot run here: no dev")
    monkeypatch.setenv("K3_STRICT", "off")
    assert main(argv) == 0


def test_check_kernel_cores_accepts_any_collection_of_core_names():
    assert protocol.checked_kernel_cores(["rmsnorm", "rmsnorm"], "b") == frozenset({"rmsnorm"})
    assert protocol.checked_kernel_cores(frozenset(), "b") == frozenset()
