"""The runner and the CLI: exit codes, reports, broken goldens, skipped backends, baselines, speed, new kinds."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.backends import registry as backends
from conformance.backends.registry import NumpyBackend
from conformance.cases import catalog
from conformance.cases.catalog import all_cases, select
from conformance.cases.engine_routes import HOST_CORES
from conformance.cases.inputs import cast
from conformance.cases.protocol import Case, Content, Evaluation, KindBase
from conformance.cases.trace_names import TraceName
from conformance.cli import main
from conformance.golden import store as goldens
from conformance.golden.regen import regenerate
from conformance.golden.store import COMMITTED_ROOT
from conformance.judge import gates
from conformance.report import markdown
from conformance.runner import run
from conformance.session import strict_missing
from k3ref.cores import UnsupportedShape, reference_cores
from k3ref.ops import rmsnorm
from tests.support.backends import built_here

SUBSET = ["rmsnorm/T1-D113", "moe_route/T1-E8-k2"]


@dataclasses.dataclass
class Offline:
    """A backend that cannot run here."""

    name: str = "offline"
    precision: str = "fp32"

    def available(self):
        return False, "no such device on this machine (test backend)"


def test_run_subset_passes_and_writes_self_contained_reports(tmp_path, capsys):
    rc = main(["run", "--backend", "numpy64", "numpy32", "--cases", *SUBSET, "--report", str(tmp_path), "--no-timing"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("ALL PASS")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["exit_code"] == 0 and len(data["results"]) == 4
    assert {r["status"] for r in data["results"]} == {"pass"}
    assert "ALL PASS" in (tmp_path / "report.md").read_text().splitlines()[2]
    page = (tmp_path / "report.html").read_text()
    assert "<style>" in page and "rmsnorm/T1-D113" in page
    for external in ("http://", "https://", "<link", "src="):     # self-contained: the script is inline
        assert external not in page


@pytest.mark.parametrize("argv, message", [
    pytest.param(["run", "--backend", "nope"], "unknown backend 'nope'", id="unknown-backend"),
    pytest.param(["run", "--backend", "mutant:nope"], "unknown mutant", id="unknown-mutant"),
    pytest.param(["run", "--cases", "no_such_block/*"], "no case matches", id="no-case"),
    pytest.param(["show", "kda_decode/B9"], "unknown case", id="show-unknown"),
    pytest.param(["regen", "--check", "--accept"], "cannot be combined", id="check-and-accept"),
    pytest.param(["run", "--golden", "/nonexistent/golden"], "no goldens in /nonexistent/golden", id="no-goldens"),
])
def test_bad_usage_exits_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_broken_golden_is_an_error_row_and_the_run_goes_on(tmp_path, capsys):
    root = tmp_path / "golden"
    regenerate(select(all_cases("tiny"), SUBSET), root)
    broken = goldens.golden_path(root, SUBSET[0])
    broken.write_bytes(broken.read_bytes()[:100])
    rc = main(["run", "--backend", "numpy64", "--golden", str(root), "--cases", *SUBSET,
               "--report", str(tmp_path / "rep"), "--no-timing"])
    out = capsys.readouterr().out
    assert rc == 1
    assert out.startswith(f"FIRST FAILURE: {SUBSET[0]} on numpy64")
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    status = {r["case"]: (r["status"], r["error"]) for r in data["results"]}
    assert status[SUBSET[1]][0] == "pass"
    assert status[SUBSET[0]][0] == "error" and f"k3conf regen --cases '{SUBSET[0]}'" in status[SUBSET[0]][1]


def test_golden_missing_an_input_names_the_file_and_the_regen_command(tmp_path):
    """Not a TypeError from deep inside the core: the golden is broken, so say which file and how to fix it."""
    case = "kda_decode/B2-H3-K16"
    regenerate(select(all_cases("tiny"), [case]), tmp_path)
    path = goldens.golden_path(tmp_path, case)
    meta, tensors = goldens.decode(path.read_bytes(), "x", "y")
    del tensors["inputs.state"]
    path.write_bytes(goldens.encode(tensors, meta))
    manifest = goldens.load_manifest(tmp_path)            # consistently signed, but an input short
    manifest["files"][f"{case}.safetensors"] = goldens.manifest_entry(path.read_bytes(), meta)
    goldens.save_manifest(tmp_path, manifest)
    (r,) = run(select(all_cases("tiny"), [case]), ["numpy64"], tmp_path, timing=False).results
    assert r.status == "error" and "missing tensor(s) ['inputs.state']" in r.error
    assert f"k3conf regen --cases '{case}'" in r.error


def test_only_unavailable_backends_is_bad_usage(capsys, extra_backend):
    extra_backend("offline", Offline)
    assert main(["run", "--backend", "offline", "--cases", SUBSET[0], "--no-timing"]) == 2
    assert "none of the requested backends can run here: offline: no such device" in capsys.readouterr().err


def test_unavailable_backend_is_skipped_with_its_reason(tmp_path, capsys, extra_backend, monkeypatch):
    monkeypatch.delenv("K3_STRICT", raising=False)     # CI's strict mode would fail the run (tested below)
    extra_backend("offline", Offline)
    rc = main(["run", "--backend", "numpy64", "offline", "--cases", SUBSET[0], "--report", str(tmp_path),
               "--no-timing"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "skipped offline: no such device on this machine (test backend)" in out
    rows = json.loads((tmp_path / "report.json").read_text())["backends"]
    assert {r["name"]: r["available"] for r in rows} == {"numpy64": True, "offline": False}


def test_missing_baseline_means_cap_only_and_says_so(monkeypatch, extra_backend, tmp_path):
    extra_backend("offline", Offline)
    monkeypatch.setitem(gates.BASELINE, "fp32", "offline")
    report = run(select(all_cases("tiny"), SUBSET[:1]), ["numpy32"], COMMITTED_ROOT, timing=False)
    (t,) = report.results[0].tensors
    assert t.baseline == "offline" and t.baseline_err is None
    assert "cap only" in t.verdict.why and t.verdict.bound == t.gate.cap
    assert "baseline offline unavailable for fp32: the absolute cap alone applied" in markdown(report)


def test_baseline_error_sets_the_bound(extra_backend):
    extra_backend("slow32", lambda: NumpyBackend("slow32", "fp32"))
    report = run(select(all_cases("tiny"), SUBSET[:1]), ["slow32"], COMMITTED_ROOT, timing=False)
    (t,) = report.results[0].tensors
    assert report.results[0].role == ""
    assert t.baseline == "numpy32" and t.baseline_err == t.comparison.rel_rms > 0
    assert np.isclose(t.verdict.bound, min(t.gate.cap, t.gate.k * t.baseline_err + t.gate.floor))


def test_the_baseline_is_gated_by_its_measured_cap_not_by_itself(tmp_path):
    rc = main(["run", "--backend", "numpy32", "--cases", SUBSET[0], "--report", str(tmp_path), "--no-timing"])
    assert rc == 0
    data = json.loads((tmp_path / "report.json").read_text())
    (r,) = data["results"]
    (t,) = r["tensors"]
    assert r["role"] == "baseline" and t["gate"]["key"] == ["rmsnorm", "tiny:y", "fp32"]   # measured on tiny
    assert t["bound"] == gates.BASELINE_GATES[("rmsnorm", "tiny:y", "fp32")].cap
    assert "the fp32 baseline itself" in t["rule"] and "numpy32 measured" in t["rule"]
    assert f"baseline {t['comparison']['rel_rms']:.0e}" in (tmp_path / "report.html").read_text()


def test_a_baseline_worse_than_its_measurement_fails(monkeypatch, extra_backend):
    """Judged against itself it would pass (bound = k x its own error); its absolute row catches it."""
    def off(base):
        return base.replace(rmsnorm=lambda x, w, eps: np.asarray(backends.reference_cores().rmsnorm(x, w, eps))
                            * np.float32(1 + 1e-5))

    extra_backend("offline", lambda: NumpyBackend("offline", "fp32", lambda: off(backends.reference_cores())))
    monkeypatch.setitem(gates.BASELINE, "fp32", "offline")
    report = run(select(all_cases("tiny"), SUBSET[:1]), ["offline"], COMMITTED_ROOT, timing=False)
    (r,) = report.results
    assert r.role == "baseline" and r.status == "fail", report.first_failure_line()
    assert "the fp32 baseline itself" in r.first_failing.verdict.why


def test_every_bf16_bound_is_under_3x_the_baseline_error():
    """Both rules at bf16: k x baseline (other backends) and the baseline's own cap stay within 3x a measurement.
    Two kinds of row are set otherwise, each by its own measurement: a trace's (k from the spread of correct bf16
    implementations over many models, tests/conformance/test_verdicts.py) and the router's weights, computed from
    fp32 logits at every precision (the fp32 rule)."""
    for (block, tensor, precision), g in gates.GATES.items():
        if precision != "bf16" or g.k is None or "/step*" in tensor:
            continue
        if (block, tensor) == ("moe_route", "weights"):
            assert g.k == 4.0 and "fp32 logits" in g.reason, g
            continue
        assert g.k <= 3.0 and g.floor == 0.0, (block, tensor, g)
    for (block, tensor, precision), g in gates.BASELINE_GATES.items():
        measured = float(g.reason.split("measured ")[1].split()[0])
        assert g.cap <= 3.0 * measured * (1 + 1e-9), (block, tensor, precision)


def test_speed_is_measured_and_a_target_can_fail(monkeypatch, extra_backend):
    extra_backend("slow32", lambda: NumpyBackend("slow32", "fp32", repeats=3))
    picked = select(all_cases("tiny"), SUBSET[:1])
    report = run(picked, ["slow32"], COMMITTED_ROOT, timing=True)
    sp = report.results[0].speed
    assert sp.seconds > 0 and sp.bytes_moved > 0 and sp.bw_ratio > 0 and sp.time_ratio > 0
    assert sp.passed is None and report.exit_code == 0      # CPU rows are report-only
    monkeypatch.setattr(gates, "SPEED_TARGETS", {**gates.SPEED_TARGETS,      # the table is read-only: a test copy
                                                 ("rmsnorm", "slow32"): (1e9, None, "test: impossible target")})
    report = run(picked, ["slow32"], COMMITTED_ROOT, timing=True)
    assert report.results[0].status == "fail" and report.exit_code == 1
    assert report.first_failure_line().startswith("FIRST FAILURE: rmsnorm/T1-D113 on slow32 (block rmsnorm): speed:")


def _strict_json(text: str):
    """json.loads that rejects the NaN / Infinity tokens (not JSON; jq, JavaScript and most readers refuse them)."""
    def refuse(token):
        raise ValueError(f"non-JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_report_json_is_strict_json_when_outputs_are_nan(monkeypatch, tmp_path, capsys):
    """A kernel that writes NaN is the failing run whose report matters most: report.json must still parse."""
    def nan_rmsnorm(base):
        return base.replace(rmsnorm=lambda x, w, eps: np.full(np.shape(x), np.nan))

    monkeypatch.setitem(backends.MUTANTS, "test-nan", backends.Mutant("rmsnorm", "NaN everywhere", nan_rmsnorm))
    monkeypatch.setattr(backends, "_CACHE", {})
    built_here(monkeypatch, "mutant:test-nan")
    rc = main(["run", "--backend", "mutant:test-nan", "--cases", SUBSET[0], "--report", str(tmp_path), "--no-timing"])
    out = capsys.readouterr().out
    assert rc == 1 and "non-finite mismatch" in out and "FAIL NaN/Inf" in out
    data = _strict_json((tmp_path / "report.json").read_text())
    (t,) = data["results"][0]["tensors"]
    assert t["comparison"]["worst_out"] == "nan" and t["comparison"]["nonfinite_mismatch"]["nan"] == 113


def test_a_baseline_that_cannot_be_compared_means_cap_only(monkeypatch, extra_backend):
    """A baseline returning a misshaped tensor has no error to scale the bound by: not k * 0 + floor."""
    def bad_shape(base):
        return base.replace(rmsnorm=lambda x, w, eps: np.asarray(x)[..., :-1])

    extra_backend("offline", lambda: NumpyBackend("offline", "fp32", lambda: bad_shape(backends.reference_cores())))
    monkeypatch.setitem(gates.BASELINE, "fp32", "offline")
    report = run(select(all_cases("tiny"), SUBSET[:1]), ["numpy32"], COMMITTED_ROOT, timing=False)
    (t,) = report.results[0].tensors
    assert t.baseline_err is None and t.verdict.bound == t.gate.cap and "cap only" in t.verdict.why


def test_a_backend_named_twice_runs_once():
    report = run(select(all_cases("tiny"), SUBSET[:1]), ["numpy64", "numpy64"], COMMITTED_ROOT, timing=False)
    assert len(report.results) == 1 and [b["name"] for b in report.backends] == ["numpy64"]


def test_unreadable_manifest_is_bad_input_not_a_traceback(tmp_path, capsys):
    regenerate(select(all_cases("tiny"), SUBSET[:1]), tmp_path)
    (tmp_path / "MANIFEST.json").write_text("{not json")
    assert main(["regen", "--out", str(tmp_path), "--cases", SUBSET[0]]) == 2
    assert "unreadable manifest" in capsys.readouterr().err
    (tmp_path / "MANIFEST.json").unlink()          # what the message says to do
    assert main(["regen", "--out", str(tmp_path), "--cases", SUBSET[0]]) == 0
    assert goldens.read_golden(tmp_path, SUBSET[0]).tensors


# ---- a new kind of case: what conformance/cases/traces.py does (docs/runner.md)


def _layer_name(layer: int) -> str:
    return str(TraceName.of_layer(0, layer, 1, "h"))


class LayerKind(KindBase):
    """Three 'layers' of RMSNorm; tensors named like a trace's (step0.layerNN.1_h); each layer's block is rmsnorm."""

    name = "test-layers"

    def cases(self, config):
        return [Case("toy_trace/L3", self.name, config, 7, {"layers": 3})]

    def generate(self, case):
        rng = np.random.default_rng(case.seed)
        x = rng.standard_normal((case.params["layers"], 4, 32))
        w = 1 + 0.1 * rng.standard_normal(32)
        outs = {f"outputs.{_layer_name(i)}": rmsnorm(x[i], w, 1e-5) for i in range(len(x))}
        return Content({"inputs.x": x, "inputs.w": w, **outs}, {"eps": 1e-5})

    def evaluate(self, case, golden, backend):
        x, w = (cast(golden.group("inputs")[n], backend.precision) for n in ("x", "w"))
        cores = backend.cores()
        return Evaluation({_layer_name(i): cores.rmsnorm(x[i], w, golden.kwargs["eps"]) for i in range(len(x))})

    def block_of(self, case, tensor):
        return "rmsnorm"


def test_a_registered_kind_runs_with_per_layer_plot(monkeypatch, tmp_path):
    monkeypatch.setitem(catalog.KINDS, "test-layers", LayerKind())
    picked = select(all_cases("tiny"), ["toy_trace/*"])
    assert [c.name for c in picked] == ["toy_trace/L3"]
    regenerate(picked, tmp_path / "g")
    assert main(["run", "--backend", "numpy64", "numpy32", "--golden", str(tmp_path / "g"), "--cases", "toy_trace",
                 "--report", str(tmp_path / "r"), "--no-timing"]) == 0
    page = (tmp_path / "r" / "report.html").read_text()
    # one plot per backend, each one series (the toy trace has one step)
    assert page.count("<svg") == 2 and "toy_trace/L3 on numpy64" in page and "toy_trace/L3 on numpy32" in page
    assert page.count("<polyline") == 2

    def break_rmsnorm(base):
        return base.replace(rmsnorm=lambda x, w, eps: np.asarray(x) * 2.0)

    monkeypatch.setitem(backends.MUTANTS, "test-rmsnorm", backends.Mutant("rmsnorm", "x * 2", break_rmsnorm))
    built_here(monkeypatch, "mutant:test-rmsnorm")
    report = run(picked, ["mutant:test-rmsnorm"], tmp_path / "g", timing=False)
    backends._CACHE.pop("mutant:test-rmsnorm", None)
    assert report.first_failure_line().startswith(
        "FIRST FAILURE: toy_trace/L3 on mutant:test-rmsnorm: outputs.step0.layer00.1_h (block rmsnorm)")


# ---- list, show, python -m


def test_list_shows_cases_backends_mutants_gates(capsys):
    assert main(["list", "cases", "mutants", "gates"]) == 0
    out = capsys.readouterr().out
    for needle in ("kda_decode/B2-H3-K16", "mutant:mla-scale-128", "(*, *, fp64): cap 1e-12", "exact by construction"):
        assert needle in out


def test_show_prints_tensors_with_stats(capsys):
    assert main(["show", "mla_decode/B2-H3-R32-P16-L65-1"]) == 0
    out = capsys.readouterr().out
    assert "outputs.o_lat" in out and "float64" in out and "[2, 3, 32]" in out and "rms" in out
    assert "non-finite" in out          # the NaN-filled unused cache slots are counted, not averaged


def test_python_dash_m_is_the_same_cli():
    p = subprocess.run([sys.executable, "-m", "conformance", "list", "cases"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert p.returncode == 0 and "rmsnorm/T1-D113" in p.stdout


def test_plain_list_shows_everything_incl_the_trace_rows_and_mutant():
    """A fresh process (nothing imported yet): `k3conf list` with no section lists all four, and the gate rows and
    mutant that conformance.cases.traces registers are there even though no case was listed."""
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "conformance", "list"], capture_output=True, text=True, cwd=root,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert all(f"{s} (" in p.stdout or f"{s}:" in p.stdout for s in ("cases", "backends", "mutants", "gates"))
    p = subprocess.run([sys.executable, "-m", "conformance", "list", "gates", "mutants"], capture_output=True,
                       text=True, cwd=root, timeout=60)
    assert "(attnres_mix, tiny:*/layerwise/step*, fp32)" in p.stdout
    assert "mutant:attnres-boundary-off-by-one" in p.stdout


@pytest.mark.parametrize("patterns, expected", [
    pytest.param(["mxfp4_gemv"], 3, id="bare-block"),
    pytest.param(["mla_decode/*L65*"], 1, id="glob"),
    pytest.param(["rmsnorm/T1-D113", "situ_glu/I239"], 2, id="exact-names"),
])
def test_case_selection(patterns, expected):
    assert len(select(all_cases("tiny"), patterns)) == expected


def test_progress_is_reported_per_result():
    seen = []
    run(select(all_cases("tiny"), SUBSET), ["numpy64", "numpy32"], COMMITTED_ROOT, timing=False,
        progress=lambda done, total, label: seen.append((done, total)))
    assert seen == [(i, 4) for i in range(1, 5)]


def _picky(monkeypatch, name: str, precision: str, core: str, why: str) -> None:
    """Register (for this test only) numpy with `core` raising UnsupportedShape(why)."""
    def refuse(*args, **kwargs):
        raise UnsupportedShape(why)

    monkeypatch.setitem(backends.BACKENDS, name, lambda: NumpyBackend(
        name, precision, lambda: reference_cores().replace(**{core: refuse})))
    monkeypatch.setattr(backends, "_CACHE", {})
    built_here(monkeypatch, name)


def test_unsupported_shape_is_a_skip_with_its_reason_not_a_failure(monkeypatch):
    """A kernel built for K3's head_dim given head_dim 16: the case is skipped for that backend, the run passes."""
    _picky(monkeypatch, "picky", "fp32", "kda_decode", "built for K = V = 128")
    selected = select(all_cases("tiny"), ["kda_decode/B2-H3-K16", "rmsnorm/T1-D113"])
    report = run(selected, ["picky"], goldens.COMMITTED_ROOT, timing=False)
    status = {r.case: (r.status, r.error) for r in report.results}
    assert status["kda_decode/B2-H3-K16"] == ("skip", "unsupported by picky: built for K = V = 128")
    assert status["rmsnorm/T1-D113"][0] == "pass"
    assert report.exit_code == 0
    # a skip is not counted as a pass anywhere
    assert report.first_failure_line() == ("ALL PASS: 1 (case, backend) result(s) within their gates "
                                           "(1 skipped: not supported by that backend)")
    assert "(case, backend) results: 1 passed, 0 failed, 0 n/a, 1 skipped of 2" in markdown(report)


def test_trace_falls_back_per_core_and_says_so(monkeypatch):
    _picky(monkeypatch, "picky-mla", "fp64", "mla_decode", "built for kv_rank 512")
    selected = select(all_cases("tiny"), ["trace/layerwise-*"])
    report = run(selected, ["picky-mla"], goldens.COMMITTED_ROOT, timing=False)
    (result,) = report.results
    assert result.status == "pass", report.first_failure_line()
    (note,) = result.notes
    assert note.startswith("mla_decode: k3ref's reference core ran instead on 15 of 15 call(s)")
    assert note.endswith("(UnsupportedShape: built for kv_rank 512)")


# ---- n/a: cases where only the reference core would run


@dataclasses.dataclass
class OneKernel(NumpyBackend):
    """numpy32 that supplies only `kernel` itself (the other cores are the reference's)."""

    kernel: str = "rmsnorm"

    def kernel_cores(self):
        return frozenset({self.kernel})


def test_a_case_without_a_kernel_core_is_na_and_counted_apart(tmp_path, extra_backend, capsys):
    extra_backend("one32", lambda: OneKernel("one32", "fp32"))
    rc = main(["run", "--backend", "one32", "--cases", "rmsnorm/T1-D113", "kda_prefill/B1-T1-H1-K16",
               "trace/layerwise-*", "--report", str(tmp_path), "--no-timing"])
    assert rc == 0
    data = json.loads((tmp_path / "report.json").read_text())
    status = {r["case"]: r for r in data["results"]}
    assert status["kda_prefill/B1-T1-H1-K16"]["status"] == "n/a"
    assert "one32 supplies no kernel for kda_prefill" in status["kda_prefill/B1-T1-H1-K16"]["error"]
    assert status["rmsnorm/T1-D113"]["status"] == "pass"
    trace = status["trace/layerwise-P7-D5"]
    assert trace["status"] == "pass"
    not_kernel = {n.split(":")[0] for n in trace["notes"] if "not a kernel core of one32" in n}
    assert not_kernel == set(HOST_CORES) - {"rmsnorm"}        # the engine-shaped cores have cases of their own
    assert data["summary"] == {"pass": 2, "fail": 0, "n/a": 1, "skip": 0, "error": 0, "total": 3}
    assert "2 pass, 0 fail, 1 n/a, 0 skip" in (tmp_path / "report.md").read_text()
    page = (tmp_path / "report.html").read_text()
    assert "one32: 1 case n/a (reference core only" in page
    assert re.search(r"2 pass</b>, <b class=fail>0 fail</b>, <b class=na>1 n/a</b>, <b class=skip>0 skip", page)
    capsys.readouterr()
    assert main(["list", "backends"]) == 0
    listed = capsys.readouterr().out
    assert "one32        fp32  available: k3ref (NumPy) [kernels: rmsnorm; other cores: k3ref's]" in listed


def test_a_trace_where_every_kernel_call_fell_back_is_na(monkeypatch, extra_backend):
    def refuse(*args, **kwargs):
        raise UnsupportedShape("built for K = V = 128")

    extra_backend("one32", lambda: OneKernel("one32", "fp32", lambda: backends.reference_cores().replace(
        kda_decode=refuse), kernel="kda_decode"))
    report = run(select(all_cases("tiny"), ["trace/layerwise-*", "kda_decode/B2-H3-K16"]), ["one32"],
                 COMMITTED_ROOT, timing=False)
    status = {r.case: r for r in report.results}
    assert status["kda_decode/B2-H3-K16"].status == "skip"
    trace = status["trace/layerwise-P7-D5"]
    assert trace.status == "n/a" and "no kernel of one32 ran" in trace.error
    # one32 was asked for and judged on nothing (a skip and an n/a): that is not a pass
    assert report.exit_code == 1 and report.counts()["n/a"] == 1
    assert "backend one32 was judged on nothing" in report.first_failure_line()


def test_a_backend_without_kernel_cores_supplies_all_of_them():
    assert backends.kernel_cores(Offline()) == backends.ALL_CORES


# ---- strict mode (CI): a missing tool fails instead of skipping


def test_strict_mode_fails_on_an_unavailable_backend(monkeypatch, extra_backend, capsys, tmp_path):
    extra_backend("offline", Offline)
    argv = ["run", "--backend", "numpy64", "offline", "--cases", SUBSET[0], "--report", str(tmp_path), "--no-timing"]
    monkeypatch.setenv("K3_STRICT", "1")
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert out.startswith("FIRST FAILURE: K3_STRICT=1 and backend offline cannot run here: no such device")
    monkeypatch.setenv("K3_STRICT", "0")
    assert main(argv) == 0


def test_strict_mode_allows_a_missing_accelerator(monkeypatch):
    monkeypatch.setenv("K3_STRICT", "1")
    rows = [{"name": "cuda", "available": False, "reason": "no GPU"},
            {"name": "fla", "available": False, "reason": "no GPU", "device": "cuda"},   # an external GPU backend
            {"name": "torch", "available": False, "reason": "PyTorch is not installed"},
            {"name": "mine", "available": False, "reason": "no libfoo", "device": "cpu"}]
    assert strict_missing(rows) == ["backend torch cannot run here: PyTorch is not installed",
                                    "backend mine cannot run here: no libfoo"]


HIDE_TORCH = "import sys; sys.modules['torch'] = None; "   # `import torch` raises ImportError in this process


def test_strict_run_without_torch_fails_with_the_reason(tmp_path):
    """torch hidden from the run and from its worker processes (a package that refuses to import, first on the
    path every process of the run reads)."""
    root = Path(__file__).resolve().parents[2]
    hidden = tmp_path / "hide" / "torch"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'torch' (hidden by the test)\")\n")
    code = ("import sys; from conformance.cli import main; sys.exit(main(['run', '--cases', 'rmsnorm/T1-D113', "
            f"'--no-timing', '--report', {str(tmp_path)!r}]))")
    env = {**__import__("os").environ, "K3_STRICT": "1", "PYTHONPATH": f"{hidden.parent}:{root}"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "K3_STRICT=1 and backend torch cannot run here: ImportError: PyTorch is not installed" in p.stdout


def test_strict_suite_without_torch_fails_with_the_reason():
    """The torch tests skip without torch; under K3_STRICT=1 they fail and say why."""
    root = Path(__file__).resolve().parents[2]
    code = HIDE_TORCH + ("import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
                         "'tests/k3torch/test_torch_cores.py']))")
    env = {**__import__("os").environ, "K3_STRICT": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env, timeout=120)
    assert p.returncode not in (0, 5), p.stdout[-2000:]
    assert "K3_STRICT=1" in p.stdout and "PyTorch is not installed" in p.stdout
    env["K3_STRICT"] = "0"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env, timeout=120)
    # the module is skipped whole: pytest says "1 skipped" and exits 5 (no test collected), not a failure
    assert p.returncode in (0, 5) and "1 skipped" in p.stdout and "failed" not in p.stdout, p.stdout[-2000:]
