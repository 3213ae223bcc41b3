"""The pytest plugin and `k3conf run` give one verdict: the same backends on the same cases through both front ends
pass, fail or skip cell by cell alike, and the runs pass or fail alike (a backend judged on nothing fails both);
each failing item says why in its own line; both read K3_STRICT by one rule."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.cli import main

CASES = ["rmsnorm/T1-D113", "rmsnorm/T7-D203", "moe_route/T1-E8-k2"]

# good: the reference behind a wrapper; one_off: one element of every output off by 5e-6 of the output's norm (a rel
# RMS error of 5e-6: under the fp32 cap that the start-up check applies, above the bound set by numpy32 in the run);
# forgets: the swap is dropped, no kernel core; refuses: UnsupportedShape on every call; offline: cannot run here
BACKENDS = """
    import numpy as np

    from conformance import Backend
    from k3ref.cores import UnsupportedShape

    def _wrapped(fn):
        def core(*args, **kwargs):
            return fn(*args, **kwargs)
        return core

    def _one_off(fn):
        def core(*args, **kwargs):
            y = np.array(fn(*args, **kwargs), copy=True)
            y.flat[-1] += 5e-6 * np.linalg.norm(y)
            return y
        return core

    def _refuse(*args, **kwargs):
        raise UnsupportedShape("built for D = 7168 only")

    def _forgets(base):
        base.replace(rmsnorm=_wrapped(base.rmsnorm))
        return base

    good = Backend.from_cores("good", "fp32", lambda base: base.replace(rmsnorm=_wrapped(base.rmsnorm)))
    one_off = Backend.from_cores("one-off", "fp32", lambda base: base.replace(rmsnorm=_one_off(base.rmsnorm)))
    forgets = Backend.from_cores("forgets", "fp32", _forgets)
    refuses = Backend.from_cores("refuses", "fp32", lambda base: base.replace(rmsnorm=_refuse))
    offline = Backend.from_cores("offline", "fp32", lambda base: base, available=lambda: (False, "no device here"))
"""

# a cell's verdict: what pytest makes of it
VERDICT = {"pass": "PASSED", "fail": "FAILED", "error": "FAILED", "skip": "SKIPPED", "n/a": "SKIPPED"}


@pytest.fixture(scope="module")
def author(tmp_path_factory) -> Path:
    """A kernel author's folder with the backends above (and no tests of its own)."""
    root = tmp_path_factory.mktemp("author")
    (root / "k3_backends.py").write_text(textwrap.dedent(BACKENDS))
    return root


def _cells(report: dict) -> dict[str, str]:
    """case -> verdict of a `k3conf run` report, and 'fuzz/<core>' -> the verdict the plugin's item of that core's
    draws gives: FAILED with a shrunk finding, PASSED when a draw passed, else SKIPPED."""
    cells = {r["case"]: VERDICT[r["status"]] for r in report["results"]}
    fuzz = report.get("fuzz") or {"results": [], "findings": []}
    for core in {r["block"] for r in fuzz["results"]}:
        passed = any(r["status"] == "pass" for r in fuzz["results"] if r["block"] == core)
        found = any(f": {core}: smallest failing" in line for line in fuzz["findings"])
        cells[f"fuzz/{core}"] = "FAILED" if found else "PASSED" if passed else "SKIPPED"
    return cells


def _cli(author: Path, attr: str, tmp_path: Path) -> tuple[int, dict[str, str]]:
    """(exit code, case -> verdict) of `k3conf run` on the backend `attr`, its fuzz draws' too."""
    out = tmp_path / f"cli-{attr}"
    rc = main(["run", "--backend", f"{author / 'k3_backends.py'}:{attr}", "--cases", *CASES, "--report", str(out),
               "--no-timing"])
    return rc, _cells(json.loads((out / "report.json").read_text()))


def _plugin(author: Path, attr: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    env.pop("PYTEST_ADDOPTS", None)
    cases = [f"--k3conf-cases={c}" for c in CASES]
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA",
                           f"--k3conf-backend={author / 'k3_backends.py'}:{attr}", *cases],
                          cwd=author, env=env, capture_output=True, text=True, timeout=300)


def _item_verdicts(stdout: str) -> dict[str, str]:
    """case -> PASSED / FAILED / SKIPPED from pytest's verbose lines ('rmsnorm/T1-D113 PASSED  [ 14%]')."""
    return dict(re.findall(r"^(\S+/\S+) (PASSED|FAILED|SKIPPED)\b", stdout, re.M))


@pytest.mark.parametrize("attr, passes", [
    pytest.param("good", True, id="good"),
    pytest.param("one_off", False, id="wrong-in-one-element"),
    pytest.param("forgets", False, id="no-kernel-core"),
    pytest.param("refuses", False, id="unsupported-everywhere"),
])
def test_plugin_and_cli_give_the_same_verdicts(author, tmp_path, monkeypatch, attr, passes):
    monkeypatch.delenv("K3_STRICT", raising=False)
    cli_rc, cli_cells = _cli(author, attr, tmp_path)
    p = _plugin(author, attr, {"K3_STRICT": ""})
    plugin_cells = _item_verdicts(p.stdout)
    assert plugin_cells == cli_cells, p.stdout[-3000:] + p.stderr[-2000:]
    assert (cli_rc, p.returncode) == ((0, 0) if passes else (1, 1)), p.stdout[-3000:] + p.stderr[-2000:]
    if not passes:                # the plugin's summary names why, as the CLI's first line does
        assert p.stdout.count("FIRST FAILURE: ") == 1 and "k3conf" in p.stdout


def test_each_failing_item_says_why_in_its_own_line(author):
    p = _plugin(author, "one_off", {"K3_STRICT": ""})
    failed = [case for case, v in _item_verdicts(p.stdout).items() if v == "FAILED" and not case.startswith("fuzz/")]
    assert len(failed) >= 2, p.stdout[-3000:]
    # the fuzz item of the core fails with its shrunk draw's line
    assert _item_verdicts(p.stdout)["fuzz/rmsnorm"] == "FAILED" and "rmsnorm: smallest failing: " in p.stdout
    for case in failed:        # pytest's failure section of the item: its own case, tensor and rule
        first_line = p.stdout.split(f" k3conf {case} on one-off ", 1)[1].lstrip("_").strip().splitlines()[0]
        assert first_line.startswith(f"{case} on one-off: outputs.y (block rmsnorm): "), first_line


def test_a_backend_judged_on_nothing_fails_the_plugin_with_the_reason(author):
    p = _plugin(author, "forgets", {"K3_STRICT": ""})
    assert p.returncode == 1 and "failed" not in p.stdout.splitlines()[-1]
    assert ("FIRST FAILURE: backend forgets was judged on nothing: it supplies no kernel core "
            "(kernel_cores() is empty)") in p.stdout


@pytest.mark.parametrize("value, expect", [
    pytest.param("TRUE", "FAILED", id="strict"),
    pytest.param("Off", "SKIPPED", id="not-strict"),
])
def test_the_plugin_reads_k3_strict_as_the_cli_does(author, value, expect):
    p = _plugin(author, "offline", {"K3_STRICT": value})
    verdicts = set(_item_verdicts(p.stdout).values())
    assert verdicts == {expect}, p.stdout[-3000:]
    if expect == "FAILED":
        spec = f"{author / 'k3_backends.py'}:offline"
        assert f"K3_STRICT=1 and backend {spec} cannot run here: no device here" in p.stdout
        assert p.returncode == 1
    else:
        assert p.returncode == 0


def test_the_plugin_and_the_cli_refuse_an_unknown_k3_strict(author, tmp_path, monkeypatch, capsys):
    p = _plugin(author, "good", {"K3_STRICT": "sometimes"})
    assert p.returncode == 4, p.stdout[-2000:] + p.stderr[-2000:]
    message = "K3_STRICT: expected one of 1, true, yes, on (strict) or 0, false, no, off or empty (not strict)"
    assert f"{message}, found 'sometimes'" in p.stderr
    monkeypatch.setenv("K3_STRICT", "sometimes")
    assert main(["run", "--backend", f"{author / 'k3_backends.py'}:good", "--cases", *CASES, "--no-timing",
                 "--report", str(tmp_path)]) == 2
    assert f"{message}, found 'sometimes'" in capsys.readouterr().err


UNTRUSTED = Path(__file__).parent / "untrusted" / "kernels.py"   # kernels that crash, exit or scribble


@pytest.mark.parametrize("attr", ["SYS_EXIT", "OS_EXIT", "SEGFAULT", "WRITES_FLOAT", "NOISY"])
def test_a_kernel_that_ends_its_process_or_scribbles_fails_both_front_ends_alike(tmp_path, monkeypatch, attr):
    """A core that calls sys.exit or os._exit, crashes, writes into its input or gives other bits on a second call
    fails its cell through the plugin as through the CLI; neither front end is ended or fooled by it."""
    monkeypatch.delenv("K3_STRICT", raising=False)
    case = "rmsnorm/T1-D113"      # the case on whose golden inputs the ending kernels end
    rc = main(["run", "--backend", f"{UNTRUSTED}:{attr}", "--cases", case, "--report", str(tmp_path / "cli"),
               "--no-timing"])
    report = json.loads((tmp_path / "cli" / "report.json").read_text())
    cli_cells = _cells(report)
    env = {**os.environ, "K3_STRICT": ""}
    env.pop("PYTEST_ADDOPTS", None)
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rA",
                        f"--k3conf-backend={UNTRUSTED}:{attr}", f"--k3conf-cases={case}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert cli_cells[case] == "FAILED" and rc == 1, report["results"]
    assert _item_verdicts(p.stdout) == cli_cells and p.returncode == 1, p.stdout[-3000:] + p.stderr[-2000:]
