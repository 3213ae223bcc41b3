"""The pytest plugin as a CI route: the cases counted as collected items, selectable by every core they exercise
(`-m kda_decode` keeps the traces that run kda_decode), each failing item with its own failure line, JUnit rows
classed by block, and the report files `k3conf run` writes. And docs/kernel_authors.md: a table for every core
naming every argument of its reference signature, the fp32-kept inputs marked, the bounds it quotes recomputed
from the gate table.

The plugin runs in a pytest subprocess started in an author's folder holding one test of its own."""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from conformance.cases.catalog import kind_of
from conformance.cases.core import CORE_SPECS
from conformance.judge import gates, measured
from conformance.judge.gate_table import GATES
from conformance.session import pick_cases
from k3ref import kda
from k3ref.cores import CORE_NAMES, reference_cores

DOC = Path(__file__).parents[2] / "docs" / "kernel_authors.md"

# every kind of case, two cores whose names nest (kda_decode in kda_decode_pool, rmsnorm in add_rmsnorm)
SELECTION = ["rmsnorm", "add_rmsnorm", "kda_decode", "kda_decode_pool", "latent_moe", "trace/free-P7-D5"]
MUTANT = "mutant:kda-decode-v-batch0"    # kda_decode with batch row 0's v given to every row: fails most cases
FAILING = ["kda_decode", "rmsnorm/T1-D113"]
FAILING_CORES = ("kda_decode", "rmsnorm")     # the cores those cases run: the fuzz items of a run of them


@pytest.fixture(scope="module")
def author(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("author")
    (root / "test_mine.py").write_text("def test_mine():\n    assert 1 + 1 == 2\n")
    return root


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "K3_STRICT": ""}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _cases_args(patterns: list[str]) -> list[str]:
    return [f"--k3conf-cases={p}" for p in patterns]


# ------------------------------------------------------------------------------------------ collection, selection


def _keywords(case) -> set[str]:
    """What -k and -m see of a case: its name, its block and every core its kind says it runs."""
    return {case.name, case.block, *kind_of(case).cores_of(case)}


@pytest.mark.parametrize("select, kept", [
    pytest.param([], lambda case: True, id="all"),
    pytest.param(["-k", "rmsnorm"], lambda case: any("rmsnorm" in w for w in _keywords(case)), id="k-substring"),
    pytest.param(["-m", "kda_decode"], lambda case: "kda_decode" in _keywords(case) - {case.name}, id="m-core"),
    pytest.param(["-k", "kda_decode/"], lambda case: case.name.startswith("kda_decode/"), id="k-by-name"),
])
def test_the_header_counts_the_cases_and_k_and_m_select_by_core(author, select, kept):
    p = _pytest(author, "--co", "--strict-markers", "--k3conf-backend=numpy32", *_cases_args(SELECTION), *select)
    cases = pick_cases("tiny", SELECTION)
    want = [c.name for c in cases if kept(c)]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    collected = len(cases) + 1                       # and the author's own test
    selected = len(want) + (not select)              # test_mine is deselected by every selection here
    header = f"collected {collected} items" + (f" / {collected - selected} deselected / {selected} selected"
                                               if select else "")
    assert re.search(rf"^{re.escape(header)}$", p.stdout, re.M), p.stdout[:3000]
    assert re.findall(r"<CaseItem (\S+)>", p.stdout) == want
    if select == ["-m", "kda_decode"]:     # the traces run kda_decode; kda_decode_pool's cases do not
        assert "trace/free-P7-D5" in want and not any(n.startswith("kda_decode_pool/") for n in want)


def test_every_core_is_a_registered_marker(author):
    p = _pytest(author, "--markers", "--k3conf-backend=numpy32", "--k3conf-cases=rmsnorm")
    assert p.returncode == 0, p.stderr[-2000:]
    registered = set(re.findall(r"^@pytest\.mark\.(\w+):", p.stdout, re.M))
    missing = {"k3conf", "latent_moe", "trace", *CORE_NAMES} - registered
    assert not missing, f"markers not registered: {sorted(missing)}"


# ------------------------------------------------------------------------------------------ a failing run


@pytest.fixture(scope="module")
def failing(author, tmp_path_factory):
    """One failing run with JUnit XML and the report files: (process, junit root, report folder)."""
    out = tmp_path_factory.mktemp("ci")
    p = _pytest(author, "-rA", f"--k3conf-backend={MUTANT}", *_cases_args(FAILING), f"--junitxml={out / 'j.xml'}",
                f"--k3conf-report={out / 'reports'}")
    return p, ET.parse(out / "j.xml").getroot(), out / "reports"


def _junit_rows(root) -> dict[tuple[str, str], str]:
    """(classname, name) -> passed / failed / skipped, and the failure message for a failed row."""
    rows = {}
    for tc in root.iter("testcase"):
        failure = tc.find("failure")
        verdict = "skipped" if tc.find("skipped") is not None else "passed"
        rows[(tc.get("classname"), tc.get("name"))] = failure.get("message") if failure is not None else verdict
    return rows


def test_a_failing_run_fails_the_session(failing):
    p, _, _ = failing
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
    assert "passed" in p.stdout.splitlines()[-1] and "failed" in p.stdout.splitlines()[-1]


def test_junit_rows_are_classed_by_block_and_named_by_case(failing):
    p, root, _ = failing
    rows = _junit_rows(root)
    cases = pick_cases("tiny", FAILING)
    fuzzed = {("k3conf.fuzz", core) for core in FAILING_CORES}    # one fuzz item per core the cases run
    want = {(f"k3conf.{c.block}", c.name.split("/", 1)[1]) for c in cases} | {("test_mine", "test_mine")} | fuzzed
    assert set(rows) == want, p.stdout[-2000:]


def test_each_failing_item_reports_its_own_failure(failing):
    p, root, _ = failing
    rows = _junit_rows(root).items()
    failed = {name: msg for (cls, name), msg in rows if msg not in ("passed", "skipped") and cls != "k3conf.fuzz"}
    assert len(failed) >= 2, p.stdout[-3000:]
    for name, message in failed.items():
        assert message.startswith(f"kda_decode/{name} on {MUTANT}: outputs."), message
        assert "FIRST FAILURE" not in message
    # the fuzz item of the mutated core fails with its smallest failing draw; the other core's passes
    fuzz = {name: msg for (cls, name), msg in rows if cls == "k3conf.fuzz"}
    assert fuzz["kda_decode"].startswith(f"{MUTANT}: kda_decode: smallest failing: B=2 "), fuzz["kda_decode"]
    assert fuzz["rmsnorm"] == "passed", fuzz
    assert len(set(failed.values())) == len(failed), "two items share one failure message"
    assert p.stdout.count("FIRST FAILURE: ") == 1, p.stdout[-3000:]     # the run's one, in the k3conf section


def test_the_report_files_hold_the_items_verdicts(failing):
    p, root, reports = failing
    paths = [reports / f"report.{ext}" for ext in ("json", "md", "html")]
    assert all(f.is_file() and f.stat().st_size for f in paths), p.stdout[-2000:]
    assert f"k3conf reports: {', '.join(str(f) for f in paths)}" in p.stdout
    report = json.loads(paths[0].read_text())
    verdict = {"pass": "passed", "fail": "failed", "error": "failed", "skip": "skipped", "n/a": "skipped"}
    in_report = {(f"k3conf.{r['block']}", r["case"].split("/", 1)[1]): verdict[r["status"]]
                 for r in report["results"]}
    in_junit = {key: v if v in ("passed", "skipped") else "failed" for key, v in _junit_rows(root).items()
                if key[0].startswith("k3conf.") and key[0] != "k3conf.fuzz"}
    assert in_report == in_junit
    assert report["fuzz"]["findings"][0].startswith(f"{MUTANT}: kda_decode: smallest failing:"), report["fuzz"]
    assert report["exit_code"] == 1 and report["backends"][0]["name"] == MUTANT
    assert report["first_failure"] in p.stdout and report["metadata"]["package"]["name"] == "k3-conformance"


def test_an_unwritable_report_folder_is_refused_before_any_case_runs(author, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    p = _pytest(author, "--k3conf-backend=numpy32", "--k3conf-cases=rmsnorm", f"--k3conf-report={blocker / 'r'}")
    assert p.returncode == 4, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"--k3conf-report {blocker / 'r'}: cannot write reports there" in p.stderr


def test_no_report_is_written_when_every_case_is_deselected(author, tmp_path):
    p = _pytest(author, "--k3conf-backend=numpy32", "--k3conf-cases=rmsnorm", f"--k3conf-report={tmp_path}",
                "-k", "test_mine")
    assert p.returncode == 0, p.stdout[-2000:]
    assert f"k3conf: no case ran here, so no report was written to {tmp_path}" in p.stdout
    assert not (tmp_path / "report.json").exists()


# ------------------------------------------------------------------------------------------ docs/kernel_authors.md


def _section(core: str) -> str:
    parts = DOC.read_text().split(f"\n### `{core}`\n", 1)
    assert len(parts) == 2, f"{DOC.name}: no section '### `{core}`'"
    return parts[1].split("\n### ", 1)[0]


def _rows(section: str) -> dict[str, list[str]]:
    """argument -> its table row's cells, from the section's first table ('| `name` | shape | dtype | ... |')."""
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


KERNEL_CORES = [c for c in CORE_NAMES if c != "attnres_hub"]


@pytest.mark.parametrize("core", KERNEL_CORES)
def test_the_kernel_authors_page_has_a_table_of_every_argument(core):
    section = _section(core)
    rows = _rows(section)
    args = list(inspect.signature(getattr(reference_cores(), core)).parameters)
    assert list(rows) == args, f"{DOC.name} `{core}`: table rows {list(rows)}, signature {args}"
    kept = set(CORE_SPECS[core].fp32_inputs)
    marked = {name for name, cells in rows.items() if cells[1] == "fp32-kept"}
    assert marked == kept, f"{DOC.name} `{core}`: fp32-kept {sorted(marked)}, CoreSpec.fp32_inputs {sorted(kept)}"
    returns = re.search(r"^Returns: (.*)$", section, re.M)
    assert returns, f"{DOC.name} `{core}`: no 'Returns:' line"
    named = re.findall(r"`(\w+)`", returns.group(1))
    outputs = list(CORE_SPECS[core].outputs)
    assert [n for n in named if n in outputs] == outputs, f"{DOC.name} `{core}`: returns {named}, outputs {outputs}"


def test_dt_bias_is_head_major_as_the_page_says():
    """kda_gate reads channel k of head h at dt_bias[h*K + k]: the page's claim, checked on distinct values."""
    assert "`dt_bias[h*K + k]`" in _section("kda_decode")
    H, K, lb = 3, 4, -5.0
    A_log = np.log(np.array([1.0, 2.0, 3.0]))
    dt_bias = np.linspace(-1.0, 1.0, H * K)
    g = kda.kda_gate(np.zeros((1, H, K)), A_log, dt_bias, lb)
    want = np.array([[lb / (1.0 + np.exp(-np.exp(A_log[h]) * dt_bias[h * K + k])) for k in range(K)]
                     for h in range(H)])
    np.testing.assert_allclose(g[0], want, rtol=1e-12, atol=1e-12)


def test_a_log_is_unpadded_as_the_page_says():
    """The core takes A_log [H]: a checkpoint's padded vector is refused, naming A_log."""
    assert "never padded" in _section("kda_decode")
    with pytest.raises(ValueError, match="A_log"):
        kda.kda_gate(np.zeros((1, 2, 4)), np.zeros(128), np.zeros(8), -5.0)


def _sci(x: float) -> str:
    """1e-05 -> '1e-5', 0.03 -> '3e-2': numbers as the page writes them."""
    mantissa, exponent = f"{x:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


def _ratio(r: float) -> str:
    return f"{r:,.0f}x" if r >= 10 else f"{r:.2g}x"


def test_the_precision_bounds_on_the_page_are_the_gate_tables():
    """Each row of the page's bound table, recomputed: min(cap, k x the baseline's worst + floor) per precision."""
    text = DOC.read_text()
    for (block, tensor), ((fp32, _), (bf16, _)) in measured.BLOCK_CASES["tiny"].items():
        _, g32 = gates.gate_for(block, tensor, "fp32", "tiny")
        _, g16 = gates.gate_for(block, tensor, "bf16", "tiny")
        b32, b16 = min(g32.cap, g32.k * fp32 + g32.floor), min(g16.cap, g16.k * bf16 + g16.floor)
        row = f"| `{block}` | `{tensor}` | {fp32:.2g} | {b32:.2g} | {bf16:.2g} | {b16:.2g} | {_ratio(b16 / b32)} |"
        assert row in text, f"{DOC.name}: expected the row\n{row}"
    fp32_row, bf16_row = GATES[("*", "*", "fp32")], GATES[("*", "*", "bf16")]    # the default rows it quotes
    assert f"min(cap {_sci(fp32_row.cap)}, {fp32_row.k:g} x numpy32's error + {_sci(fp32_row.floor)})" in text
    assert f"min(cap {_sci(bf16_row.cap)}, {bf16_row.k:g} x torch-bf16's error)" in text and bf16_row.floor == 0
