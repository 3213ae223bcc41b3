"""Comparable runs: the metadata block of report.json and `k3conf diff A.json B.json` on reports of real runs.

The runs: one kernel version (examples/wrapped_reference_backend.py, the reference cores wrapped) judged on the
tiny rmsnorm cases, clean twice and with its rmsnorm output off by 1e-3 relative (a second "version" of the same
backend, same name), numpy32 beside it each time.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import sys
import types
from pathlib import Path

import pytest

from conformance import metadata
from conformance.backends import registry
from conformance.cases.catalog import all_cases, select
from conformance.cli import main
from conformance.cli.diff import diff_reports
from conformance.golden.store import COMMITTED_ROOT
from conformance.report import write_reports
from conformance.runner import run

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = f"{REPO / 'examples' / 'wrapped_reference_backend.py'}:make"
KERNEL = "example-wrapped"          # the name that backend gives itself
CASES = ["rmsnorm/*"]
PERTURB_ENV = "K3CONF_EXAMPLE_PERTURB"

# metadata field -> the types it may hold (None: a field this machine may not be able to read)
METADATA_TYPES = {
    "metadata_version": (int,), "package": (dict,), "git": (dict, type(None)), "golden": (dict,), "host": (dict,),
    "python": (str,), "numpy": (str,), "torch": (dict, type(None)), "gpu": (dict, type(None)),
    "blas": (dict, type(None)), "env": (dict,), "command": (str,), "started": (str,), "duration_s": (float,),
    "seed": (int,),
}


def _run_into(out: Path, *, timing: bool) -> Path:
    """One real run of the example kernel and numpy32 on the tiny rmsnorm cases, its reports written to `out` with
    the metadata block; the path of its report.json."""
    cases = select(all_cases("tiny"), CASES)
    registry._CACHE.pop(EXAMPLE, None)   # built afresh: make() reads the perturbation from the environment
    report = run(cases, ["numpy32", EXAMPLE], COMMITTED_ROOT, timing=timing)
    report.metadata = metadata.collect(root=COMMITTED_ROOT, config="tiny", seed=1234, duration=report.wall_seconds)
    write_reports(report, out)
    return out / "report.json"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """report.json of three runs: clean, clean again, and the kernel with rmsnorm off by 1e-3 (its new version)."""
    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(PERTURB_ENV, raising=False)
        paths = {"clean": _run_into(root / "clean", timing=True), "again": _run_into(root / "again", timing=True)}
        mp.setenv(PERTURB_ENV, "rmsnorm")
        paths["perturbed"] = _run_into(root / "perturbed", timing=False)
    registry._CACHE.pop(EXAMPLE, None)   # the perturbed version must not outlive its runs
    return paths


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _diff(capsys, *argv) -> tuple[int, list[str], str]:
    rc = main(["diff", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


def test_report_json_carries_the_metadata_block(runs):
    meta = _load(runs["clean"])["metadata"]
    assert set(METADATA_TYPES) <= set(meta)
    for field, allowed in METADATA_TYPES.items():
        assert isinstance(meta[field], allowed), f"metadata.{field}: {type(meta[field]).__name__}, expected {allowed}"
    assert re.fullmatch(r"[0-9a-f]{64}", meta["golden"]["manifest_sha256"])
    assert meta["golden"]["shape_set"] == "tiny"
    assert isinstance(meta["host"]["cores"], int) and isinstance(meta["host"]["name"], str)
    assert isinstance(meta["package"]["version"], str)
    if meta["git"] is not None:
        assert re.fullmatch(r"[0-9a-f]{40}", meta["git"]["sha"]) and isinstance(meta["git"]["dirty"], bool)


def test_a_regression_exits_1_and_names_the_failing_cases(runs, capsys):
    failing = [f"{r['case']} on {r['backend']}" for r in _load(runs["perturbed"])["results"] if r["status"] == "fail"]
    assert failing and all(KERNEL in f for f in failing)   # the perturbed kernel fails; numpy32 beside it does not
    rc, lines, _ = _diff(capsys, runs["clean"], runs["perturbed"])
    assert rc == 1
    assert lines[0].startswith(f"REGRESSION: {len(failing)} ")
    assert all(f in lines[0] for f in failing)
    assert any(line.startswith(f"  {failing[0]}: pass -> fail (outputs.y: rel RMS ") for line in lines)


def test_clean_against_clean_exits_0_with_error_and_speed_ratios(runs, capsys, tmp_path):
    rc, lines, _ = _diff(capsys, runs["clean"], runs["again"], "--json", tmp_path / "d.json")
    assert rc == 0 and lines[0].startswith("NO REGRESSION")
    d = _load(tmp_path / "d.json")
    assert d["exit_code"] == 0 and d["regressions"] == [] and d["new"] == [] and d["gone"] == []
    judged = [c for c in d["cells"] if c["status_a"] == "pass"]
    assert judged and all(c["speed_ratio"] is not None and c["speed_ratio"] > 0 for c in judged)
    # the same deterministic cores on the same goldens err the same: every ratio is 1
    assert all(abs(t["rel_rms_ratio"] - 1) < 1e-12 for c in judged for t in c["tensors"])


def test_the_json_diff_holds_the_ratios_of_the_two_reports(runs, capsys, tmp_path):
    rc, _, _ = _diff(capsys, runs["clean"], runs["perturbed"], "--json", tmp_path / "d.json")
    d, a, b = _load(tmp_path / "d.json"), _load(runs["clean"]), _load(runs["perturbed"])
    assert rc == d["exit_code"] == 1
    assert d["regressions"] == [f"{r['case']} on {r['backend']}" for r in b["results"] if r["status"] == "fail"]
    rel = {(r["case"], r["backend"]): r["tensors"][0]["comparison"]["rel_rms"] for r in a["results"]}
    for cell in d["cells"]:
        (t,) = cell["tensors"]
        b_err = next(r for r in b["results"] if (r["case"], r["backend"]) == (cell["case"], cell["backend"]))
        expected = b_err["tensors"][0]["comparison"]["rel_rms"] / rel[(cell["case"], cell["backend"])]
        assert abs(t["rel_rms_ratio"] - expected) <= 1e-12 * expected
        assert cell["speed_ratio"] is None   # B was not timed


@pytest.mark.torch
def test_a_one_percent_bf16_mutant_is_a_regression_against_its_baseline(tmp_path, capsys):
    """torch-bf16 run alone, then beside the mutant off by 1% on rmsnorm, both through `k3conf run`: paired by
    --backend, the mutant's every rmsnorm case is a regression; the clean backend in both runs is none."""
    mutant = "mutant:bf16-rmsnorm-1pct"
    for out, backends in (("a", ["torch-bf16"]), ("b", ["torch-bf16", mutant])):
        main(["run", "--backend", *backends, "--cases", *CASES, "--report", str(tmp_path / out), "--no-timing"])
    capsys.readouterr()
    a, b = tmp_path / "a" / "report.json", tmp_path / "b" / "report.json"
    failing = [r["case"] for r in _load(b)["results"] if r["backend"] == mutant and r["status"] == "fail"]
    assert len(failing) == len(select(all_cases("tiny"), CASES))
    rc, lines, _ = _diff(capsys, a, b, "--backend", f"torch-bf16={mutant}")
    assert rc == 1 and all(f"{case} on {mutant}" in lines[0] for case in failing)
    rc, lines, _ = _diff(capsys, a, b)   # unpaired: the mutant's cells are new, not regressions
    assert rc == 0 and f"{len(failing)} new" in lines[0]


def test_backend_option_compares_one_backend_or_a_pair(runs, capsys):
    rc, lines, _ = _diff(capsys, runs["clean"], runs["perturbed"], "--backend", "numpy32")
    assert rc == 0 and lines[0].startswith("NO REGRESSION") and KERNEL not in "\n".join(lines)
    rc, lines, _ = _diff(capsys, runs["clean"], runs["perturbed"], "--backend", f"numpy32={KERNEL}")
    assert rc == 1 and lines[0].startswith("REGRESSION") and f"on {KERNEL}" in lines[0]
    rc, _, err = _diff(capsys, runs["clean"], runs["perturbed"], "--backend", "torch-nope")
    assert rc == 2 and "--backend torch-nope: not in" in err and "numpy32" in err


def test_a_still_passing_case_whose_error_grew_is_flagged_worse(runs, tmp_path, capsys):
    grown = _load(runs["again"])
    cell = next(r for r in grown["results"] if r["backend"] == KERNEL)
    cell["tensors"][0]["comparison"]["rel_rms"] *= 3          # still "pass": only the number moved
    path = tmp_path / "grown.json"
    path.write_text(json.dumps(grown))
    rc, lines, _ = _diff(capsys, runs["clean"], path)
    assert rc == 0 and "1 flagged worse" in lines[0]
    assert any(line.startswith(f"  {cell['case']} on {KERNEL}: error x3") for line in lines)
    rc, lines, _ = _diff(capsys, runs["clean"], path, "--threshold", "4")
    assert rc == 0 and "worse" not in lines[0]


def test_new_and_gone_cases_and_a_different_golden_digest_are_shown(runs, tmp_path, capsys):
    b = _load(runs["again"])
    dropped = b["results"].pop(0)
    b["results"].append({**dropped, "case": "rmsnorm/T9-D999"})
    b["metadata"]["golden"]["manifest_sha256"] = "0" * 64
    path = tmp_path / "b.json"
    path.write_text(json.dumps(b))
    d = diff_reports(_load(runs["clean"]), b, names=("A", "B"))
    assert d.exit_code == 0
    assert [c.label for c in d.of("gone")] == [f"{dropped['case']} on {dropped['backend']}"]
    assert [c.label for c in d.of("new")] == [f"rmsnorm/T9-D999 on {dropped['backend']}"]
    rc, lines, _ = _diff(capsys, runs["clean"], path)
    assert rc == 0 and "1 new, 1 gone" in lines[0]
    assert any(line.startswith("WARNING: the golden manifests differ") for line in lines)
    assert any(line.startswith("  golden.manifest_sha256: ") for line in lines)


def test_non_finite_errors_give_an_infinite_or_no_ratio(runs):
    a, b = _load(runs["clean"]), _load(runs["again"])
    for report, value in ((a, 0.0), (b, "inf")):
        report["results"][0]["tensors"][0]["comparison"]["rel_rms"] = value
    (t,) = diff_reports(a, b).cells[0].tensors
    assert t.rel_rms_ratio == math.inf
    b["results"][0]["tensors"][0]["comparison"]["rel_rms"] = "nan"
    assert diff_reports(a, b).cells[0].tensors[0].rel_rms_ratio is None


@pytest.mark.parametrize("content, message", [
    pytest.param(None, "cannot read it", id="missing"),
    pytest.param("{not json", "not JSON (", id="not-json"),
    pytest.param("[1, 2]", "not a k3conf report.json: found a JSON list", id="a-list"),
    pytest.param('{"config": "tiny"}', "no 'results' list", id="no-results"),
    pytest.param('{"results": [{"case": "x"}]}', "results[0] has no 'case', 'backend' and 'status'", id="bad-row"),
])
def test_a_file_that_is_no_report_exits_2_with_a_named_error(runs, tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    rc, out, err = _diff(capsys, runs["clean"], bad)
    assert rc == 2 and out == []
    assert err.startswith(f"k3conf diff: {bad}: ") and message in err and "Traceback" not in err


def test_bad_threshold_is_a_usage_error(runs, capsys):
    with pytest.raises(SystemExit) as e:
        main(["diff", str(runs["clean"]), str(runs["again"]), "--threshold", "-1"])
    assert e.value.code == 2 and "expected a positive number, found '-1'" in capsys.readouterr().err


def test_metadata_without_git_on_the_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))       # no git, no nvidia-smi
    meta = metadata.collect(root=COMMITTED_ROOT, config="tiny")
    assert meta["git"] is None and meta["gpu"] is None
    assert meta["golden"]["manifest_sha256"] is not None   # what needs no program is still read


def test_metadata_outside_a_checkout_and_with_unreadable_fields(monkeypatch, tmp_path):
    package = tmp_path / "site-packages" / "conformance"   # an installed copy: no repository of its own
    package.mkdir(parents=True)
    assert metadata.git_state(package) is None

    def broken():
        raise OSError("no platform here")

    monkeypatch.setattr(metadata.platform, "platform", broken)
    monkeypatch.setattr(metadata, "cpu_model", broken)
    meta = metadata.collect(root=tmp_path / "no-goldens", config="tiny")
    assert meta["host"]["os"] is None and meta["host"]["cpu"] is None
    assert meta["golden"]["manifest_sha256"] is None and meta["started"] is None


@pytest.mark.skipif(shutil.which("git") is None or metadata.git_state() is None,
                    reason="the package does not run from a git checkout here")
def test_metadata_in_a_checkout_names_its_commit():
    git = metadata.git_state()
    assert git is not None and re.fullmatch(r"[0-9a-f]{40}", git["sha"])
    assert isinstance(git["dirty"], bool)
    assert (git["diff_sha256"] is not None) == git["dirty"]


def test_metadata_gpu_from_nvidia_smi_without_touching_cuda(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 570.86.15'\necho 'NVIDIA H200, 570.86.15'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)   # no backend of the run imported torch
    gpu = metadata.gpu_state()
    assert gpu is not None and gpu["source"] == "nvidia-smi"
    assert (gpu["name"], gpu["driver"], gpu["count"]) == ("NVIDIA H200", "570.86.15", 2)


def test_metadata_gpu_from_the_torch_a_backend_initialised(monkeypatch, tmp_path):
    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=141 * 2**30)
    cuda = types.SimpleNamespace(is_initialized=lambda: True, current_device=lambda: 0,
                                 get_device_properties=lambda i: props)
    fake = types.SimpleNamespace(__version__="9.9.9", version=types.SimpleNamespace(cuda="12.8"), cuda=cuda)
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setenv("PATH", str(tmp_path))   # no nvidia-smi: the driver is unknown, the rest is torch's
    gpu = metadata.gpu_state()
    assert gpu is not None and (gpu["source"], gpu["name"], gpu["capability"], gpu["cuda"]) == (
        "torch", "NVIDIA H200", "9.0", "12.8")
    assert gpu["driver"] is None
    assert metadata.torch_state() == {"version": "9.9.9", "cuda": "12.8", "imported": True}
