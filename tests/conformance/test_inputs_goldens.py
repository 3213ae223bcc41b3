"""Hostile golden directories: interrupted and concurrent regeneration, damaged manifests, wrong goldens,
options checked before running, and fuzzed golden files (every failure a GoldenError naming the file)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance import report as rep
from conformance.cases.catalog import all_cases, select
from conformance.cli import main
from conformance.cli.app import EXIT_INTERRUPTED
from conformance.golden import durable
from conformance.golden import store as goldens
from conformance.golden.regen import regenerate
from conformance.golden.store import GoldenError, decode, encode, read_golden
from conformance.runner import run

REPO = Path(__file__).resolve().parents[2]
CASE = "rmsnorm/T1-D113"
# the cases an interrupted regen rewrites: a slow trace (so a kill lands inside the work) and two quick ones
KILL_CASES = ["trace/free-P7-D5", "rmsnorm/T1-D113", "situ_glu/T1-I113"]
HOSTILE = settings(settings.get_profile("hostile-inputs"))
# a bound on how long a subprocess may take once the test has seen it reach the point it waits for: a guard
# against a hang, not a synchronisation (every step waits for an event the process reports)
HANG_S = 600


def _resign(root: Path, case: str, blob: bytes) -> None:
    """Write `blob` as the golden of `case` and list it in the manifest: a consistent but wrong golden."""
    path = goldens.golden_path(root, case)
    path.write_bytes(blob)
    m = json.loads((root / "MANIFEST.json").read_text())
    m["files"][path.relative_to(root).as_posix()]["sha256"] = hashlib.sha256(blob).hexdigest()
    m["files"][path.relative_to(root).as_posix()]["bytes"] = len(blob)
    (root / "MANIFEST.json").write_text(json.dumps(m))


def _edit(root: Path, case: str, fn_tensors=None, fn_meta=None) -> None:
    meta, tensors = decode(goldens.golden_path(root, case).read_bytes(), "x", "y")
    _resign(root, case, encode(fn_tensors(tensors) if fn_tensors else tensors, fn_meta(meta) if fn_meta else meta))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """A golden dir holding KILL_CASES, generated here (this CPU's bits), read-only for the tests."""
    root = tmp_path_factory.mktemp("fresh")
    regenerate(select(all_cases("tiny"), KILL_CASES), root)
    return root


@pytest.fixture
def root(fresh, tmp_path) -> Path:
    out = tmp_path / "golden"
    shutil.copytree(fresh, out)
    return out


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


# ----- interrupted regeneration -----

_KILL_AT = """
import os, signal, sys
import conformance.golden.durable as durable
import conformance.golden.regen as regen
where, n, sig = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# Ctrl-C as at a terminal: a process started in the background (a CI step, `pytest &`) inherits SIGINT
# ignored, and Python then keeps ignoring it, so the interrupt this test sends would never land
signal.signal(signal.SIGINT, signal.default_int_handler)
done = [0]
def hook(orig):
    def call(*args):
        if where == "build_blob":   # the n-th case's computation starts: earlier cases are staged
            done[0] += 1
            if done[0] == n:
                os.kill(os.getpid(), sig)
            return orig(*args)
        out = orig(*args)           # the n-th file is renamed into place
        done[0] += 1
        if done[0] == n:
            os.kill(os.getpid(), sig)
        return out
    return call
if where == "build_blob":
    regen.build_blob = hook(regen.build_blob)
else:
    durable.Staged.commit = hook(durable.Staged.commit)
from conformance.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _regen_accept(root: Path, sig: int, *, after_s: float | None = None, at: tuple[str, int] | None = None) -> int:
    """`k3conf regen --accept` into root in a subprocess, sent `sig` after a delay, or at the n-th
    build_blob (a case's computation) or Staged.commit (a file's rename) call."""
    argv = ["regen", "--accept", "--out", str(root), "--cases", *KILL_CASES]
    if at is None:
        cmd = [sys.executable, "-m", "conformance", *argv]
    else:
        cmd = [sys.executable, "-c", _KILL_AT, at[0], str(at[1]), str(int(sig)), *argv]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if after_s is not None:
        time.sleep(after_s)
        proc.send_signal(sig)
    return proc.wait(timeout=HANG_S)


@pytest.mark.parametrize("sig, after_s, at", [
    pytest.param(signal.SIGKILL, 0.3, None, id="sigkill-while-starting"),
    pytest.param(signal.SIGKILL, None, ("build_blob", 3), id="sigkill-while-computing"),
    pytest.param(signal.SIGKILL, None, ("commit", 2), id="sigkill-between-renames"),
    pytest.param(signal.SIGINT, None, ("build_blob", 2), id="ctrl-c-while-computing"),
])
def test_interrupted_regen_is_consistent_or_names_what_to_rerun(root, capsys, sig, after_s, at):
    for case in KILL_CASES:   # make every golden differ, so --accept has all of them to rewrite
        _edit(root, case, fn_meta=lambda m: {**m, "seed": "99"})
    _regen_accept(root, sig, after_s=after_s, at=at)
    assert goldens.leftover_temps(root) == [] and not list(root.rglob("*.tmp"))
    rc = main(["regen", "--check", "--out", str(root), "--cases", *KILL_CASES])
    out = capsys.readouterr().out
    if rc == 0:
        return
    fix = next(line for line in out.splitlines() if line.startswith("to fix: "))
    for command in fix[len("to fix: "):].split("; "):   # run exactly what it names; then it must be consistent
        words = command.replace("inspect the drift, then ", "").replace("'", "").split()
        assert words[:2] == ["k3conf", "regen"], command
        assert main(words[1:]) == 0, command
    capsys.readouterr()
    assert main(["regen", "--check", "--out", str(root), "--cases", *KILL_CASES]) == 0


def test_ctrl_c_between_renames_still_commits_everything(root):
    """Ctrl-C is held back while the files and the manifest are renamed: all of them land, then it stops."""
    for case in KILL_CASES:
        _edit(root, case, fn_meta=lambda m: {**m, "seed": "99"})
    # the interrupt, held back during the renames, is delivered once they are done: the command stops with the
    # CLI's interrupted status (one line, no traceback), not as a finished regeneration
    assert _regen_accept(root, signal.SIGINT, at=("commit", 1)) == EXIT_INTERRUPTED
    for case in KILL_CASES:
        assert read_golden(root, case).meta["seed"] != "99", case


def test_leftover_temporary_file_is_listed_then_removed(root, capsys):
    stray = root / "rmsnorm" / ".T1-D113.safetensors.abc123.tmp"
    stray.write_bytes(b"half a golden")
    assert main(["regen", "--check", "--out", str(root), "--cases", CASE]) == 1
    assert "LEFTOVER" in capsys.readouterr().out and stray.exists()
    assert main(["regen", "--out", str(root), "--cases", CASE]) == 0
    assert not stray.exists()


# ----- concurrent regeneration -----

_HOLD_FIRST_CASE = """
import sys
import conformance.golden.regen as regen
orig, calls = regen.build_blob, [0]
def build_blob(case):   # the first case is computed under the directory lock: say so, hold it until told to go on
    calls[0] += 1
    if calls[0] == 1:
        print("holding the lock", flush=True)
        sys.stdin.readline()
    return orig(case)
regen.build_blob = build_blob
from conformance.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _read_until(stream, text: str) -> bool:
    """Read lines of a subprocess's output until one holds `text` (True) or the stream ends (False)."""
    for line in stream:
        if text in line:
            return True
    return False


def test_concurrent_regens_keep_every_manifest_entry(tmp_path):
    """A regen into a directory another regen is writing waits for it, then adds to its manifest. The second
    starts once the first reports that it holds the lock, and the first goes on once the second reports
    that it waits: the overlap is certain, whatever the machine's load."""
    root = tmp_path / "g"
    groups = [["rmsnorm"], ["situ_glu"]]
    argv = ["regen", "--out", str(root), "--cases"]
    first = subprocess.Popen([sys.executable, "-c", _HOLD_FIRST_CASE, *argv, *groups[0]], env=_env(), text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert _read_until(first.stdout, "holding the lock"), f"the first regen exited with {first.wait()}"
    second = subprocess.Popen([sys.executable, "-m", "conformance", *argv, *groups[1]], env=_env(), text=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert _read_until(second.stderr, "waiting for another regeneration"), f"second: exit {second.wait()}"
    first.stdin.write("go on\n")
    first.stdin.close()
    assert first.wait(timeout=HANG_S) == 0 and second.wait(timeout=HANG_S) == 0
    first.stdout.close()
    second.stderr.close()
    listed = set(json.loads((root / "MANIFEST.json").read_text())["files"])
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*.safetensors")}
    want = {c.name + ".safetensors" for c in select(all_cases("tiny"), [b for g in groups for b in g])}
    assert listed == on_disk == want


def test_a_held_lock_refuses_or_waits(tmp_path):
    with durable.regen_lock(tmp_path):
        with pytest.raises(durable.RegenBusy, match="another `k3conf regen` is writing"):
            with durable.regen_lock(tmp_path, wait=False):
                pass
    with durable.regen_lock(tmp_path, wait=False):   # released: free again
        pass
    with durable.regen_lock(tmp_path, shared=True):   # readers (--check) share; a writer must wait for them
        with durable.regen_lock(tmp_path, wait=False, shared=True):
            pass
        with pytest.raises(durable.RegenBusy):
            with durable.regen_lock(tmp_path, wait=False):
                pass


# ----- the manifest -----

@pytest.mark.parametrize("entry, message", [
    pytest.param("abc", "entry is str", id="not-an-object"),
    pytest.param({"sha256": "xyz"}, "64 lowercase hex", id="short-sha"),
    pytest.param({"sha256": 5}, "64 lowercase hex", id="sha-not-a-string"),
    pytest.param(None, "entry is NoneType", id="null"),
])
def test_malformed_manifest_entry_is_named(root, entry, message):
    m = json.loads((root / "MANIFEST.json").read_text())
    m["files"][CASE + ".safetensors"] = entry
    (root / "MANIFEST.json").write_text(json.dumps(m))
    with pytest.raises(GoldenError, match=message) as e:
        read_golden(root, CASE)
    assert str(goldens.golden_path(root, CASE)) in str(e.value) and f"--cases '{CASE}'" in str(e.value)
    (r,) = run(select(all_cases("tiny"), [CASE]), ["numpy64"], root, timing=False).results
    assert r.status == "error" and message.split()[0] in r.error
    (o,) = regenerate(select(all_cases("tiny"), [CASE]), root, check=True)
    assert o.failed
    regenerate(select(all_cases("tiny"), [CASE]), root)            # the fix: a plain regen re-lists it
    assert read_golden(root, CASE).tensors


@pytest.mark.parametrize("text", [
    pytest.param(b"\xff\xfe{}", id="not-utf8"),
    pytest.param(b"[" * 100_000, id="deeply-nested"),
    pytest.param(b'{"files": {"a": 1}, "files": {}}', id="duplicate-key"),
    pytest.param(b'{"files": NaN}', id="nan"),
    pytest.param(b'[1, 2]', id="not-an-object"),
])
def test_unreadable_manifest_is_a_golden_error(root, text):
    (root / "MANIFEST.json").write_bytes(text)
    with pytest.raises(GoldenError, match="unreadable manifest") as e:
        goldens.load_manifest(root)
    assert "MANIFEST.json" in str(e.value)
    (r,) = run(select(all_cases("tiny"), [CASE]), ["numpy64"], root, timing=False).results
    assert r.status == "error" and "unreadable manifest" in r.error


def test_stale_entry_is_listed_by_check_and_pruned_by_regen(root, capsys):
    m = json.loads((root / "MANIFEST.json").read_text())
    m["files"]["gone/old-case.safetensors"] = dict(m["files"][CASE + ".safetensors"])
    (root / "MANIFEST.json").write_text(json.dumps(m))
    assert main(["regen", "--check", "--out", str(root), "--cases", CASE]) == 1
    assert "gone/old-case.safetensors: STALE" in capsys.readouterr().out
    assert main(["regen", "--out", str(root), "--cases", CASE]) == 0
    assert "gone/old-case.safetensors" not in json.loads((root / "MANIFEST.json").read_text())["files"]


# ----- wrong goldens are error rows that say so -----

def _as_f32(t):
    return {k: (v.astype(np.float32) if k == "outputs.y" else v) for k, v in t.items()}


def _reshaped(t):
    return {k: (v.reshape(-1) if k == "inputs.x" else v) for k, v in t.items()}


def _nan_output(t):
    y = t["outputs.y"].copy()
    y.flat[3] = np.nan
    return {**t, "outputs.y": y}


@pytest.mark.parametrize("tensors, meta, message", [
    pytest.param(_as_f32, None, "are float32, goldens hold float64", id="dtype"),
    pytest.param(_reshaped, None, "tensor inputs.x is float64[113]", id="shape"),
    pytest.param(_nan_output, None, "outputs.y holds 1 non-finite", id="nan-in-output"),
    pytest.param(None, lambda m: {**m, "kwargs": '{"eps": 0.5}'}, "kwargs are", id="kwargs-value"),
    pytest.param(None, lambda m: {**m, "kwargs": "{eps"}, "metadata kwargs: not valid JSON", id="kwargs-not-json"),
    pytest.param(None, lambda m: {**m, "kwargs": "[1]"}, "expected a JSON object", id="kwargs-not-object"),
])
def test_wrong_golden_is_an_error_row_that_blames_the_golden(root, tmp_path, capsys, tensors, meta, message):
    _edit(root, CASE, tensors, meta)
    other = "situ_glu/T1-I113"
    rc = main(["run", "--backend", "numpy64", "numpy32", "--golden", str(root), "--cases", CASE, other,
               "--report", str(tmp_path / "rep"), "--no-timing"])
    capsys.readouterr()
    assert rc == 1
    rows = json.loads((tmp_path / "rep" / "report.json").read_text())["results"]
    for r in rows:
        if r["case"] == CASE:
            assert r["status"] == "error" and message in r["error"], r["error"]
            assert f"k3conf regen --cases '{CASE}'" in r["error"]
        else:
            assert r["status"] == "pass"


# ----- options checked before running -----

def test_options_are_checked_before_running(root, tmp_path, capsys):
    assert main(["run", "--cases", CASE, "no_such_*", "--golden", str(root), "--no-timing"]) == 2
    assert "--cases 'no_such_*': matches no case" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["run", "--cases", CASE, "--golden", str(root), "--report", str(blocker / "sub")]) == 2
    assert "--report" in capsys.readouterr().err and not (tmp_path / "reports").exists()
    assert main(["regen", "--out", str(blocker), "--cases", CASE]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(["regen", "--out", str(tmp_path / ("x" * 300)), "--cases", CASE]) == 2
    assert "--out" in capsys.readouterr().err


def test_failed_report_write_keeps_exit_1_and_writes_none(root, tmp_path, capsys, monkeypatch):
    _edit(root, CASE, _nan_output)
    out = tmp_path / "rep"

    def disk_full(report):   # the third report fails after report.json and report.md were written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rep.report_html, "html_report", disk_full)
    assert main(["run", "--backend", "numpy64", "--golden", str(root), "--cases", CASE, "--report", str(out),
                 "--no-timing"]) == 1
    assert "none was written" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == []


# ----- fuzzed golden files -----

def _mutate(blob: bytes, data) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "truncate", "header", "length", "splice"]))
    b = bytearray(blob)
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        b = b[: data.draw(st.integers(0, len(b) - 1))]
    elif kind == "length":
        b[:8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    elif kind == "splice":
        i = data.draw(st.integers(0, len(b)))
        b[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    else:   # rewrite one header value with a hostile JSON value
        n = int.from_bytes(b[:8], "little")
        header = json.loads(bytes(b[8:8 + n]))
        name = data.draw(st.sampled_from(sorted(header)))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
        value = data.draw(st.sampled_from([
            -1, 1.5, 10**30, "F64", "BF16", "x", None, [], [1e308], [-3, 2], [2**62, 2**62], {"a": 1},
            [[[[[]]]]], "\udcff", [0, 2**64], True, [113], [0, 0]]))
        if field is None or name == "__metadata__":
            header[name] = value
        else:
            header[name][field] = value
        raw = json.dumps(header).encode("utf-8", "surrogatepass")
        b = bytearray(len(raw).to_bytes(8, "little") + raw + bytes(b[8 + n:]))
    return bytes(b)


@HOSTILE
@given(data=st.data())
def test_fuzzed_golden_fails_only_with_a_golden_error_naming_the_file(fresh, tmp_path_factory, data):
    root = tmp_path_factory.mktemp("fuzz")
    path = goldens.golden_path(root, CASE)
    path.parent.mkdir(parents=True)
    shutil.copy(fresh / "MANIFEST.json", root / "MANIFEST.json")
    blob = _mutate(goldens.golden_path(fresh, CASE).read_bytes(), data)
    path.write_bytes(blob)
    _resign(root, CASE, blob)
    try:
        g = read_golden(root, CASE)
    except GoldenError as e:
        assert str(path) in str(e) and f"--cases '{CASE}'" in str(e)
    else:   # accepted: it must then be a golden the safetensors library reads the same way
        lib = safetensors.numpy.load(blob)
        assert sorted(lib) == sorted(g.tensors)


@HOSTILE
@given(doc=st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                        lambda kids: (st.lists(kids, max_size=3)
                                      | st.dictionaries(st.text(max_size=8), kids, max_size=3)),
                        max_leaves=12))
def test_fuzzed_manifest_fails_only_with_a_golden_error(fresh, tmp_path_factory, doc):
    root = tmp_path_factory.mktemp("fuzzm")
    goldens.golden_path(root, CASE).parent.mkdir()
    shutil.copy(goldens.golden_path(fresh, CASE), goldens.golden_path(root, CASE))
    shutil.copy(fresh / "MANIFEST.json", root / "MANIFEST.json")
    m = json.loads((root / "MANIFEST.json").read_text())
    m["files"][CASE + ".safetensors"] = doc
    (root / "MANIFEST.json").write_text(json.dumps(m))
    try:
        read_golden(root, CASE)
    except GoldenError as e:
        assert "MANIFEST.json" in str(e) or str(goldens.golden_path(root, CASE)) in str(e)


# ----- one golden directory, several configs -----

def test_regen_of_one_config_keeps_the_manifest_entries_of_another(root, capsys):
    """`regen --config small --out DIR` over a directory of tiny goldens prunes only small's stale rows."""
    tiny = json.loads((root / "MANIFEST.json").read_text())["files"]
    m = json.loads((root / "MANIFEST.json").read_text())
    m["files"]["gone/small-case.safetensors"] = {**m["files"][CASE + ".safetensors"], "config": "small"}
    (root / "MANIFEST.json").write_text(json.dumps(m))
    small = ["--config", "small", "--out", str(root), "--cases", "rmsnorm/*"]
    assert main(["regen", "--check", *small]) == 1
    out = capsys.readouterr().out
    assert "gone/small-case.safetensors: STALE" in out
    assert not any(f"{rel}: STALE" in out for rel in tiny), out
    assert main(["regen", *small]) == 0
    files = json.loads((root / "MANIFEST.json").read_text())["files"]
    assert {rel: files.get(rel) for rel in tiny} == tiny, "every tiny row kept as it was"
    assert "gone/small-case.safetensors" not in files
    assert [files[rel]["config"] for rel in files if rel not in tiny] == ["small"]
    assert main(["regen", "--check", "--out", str(root), "--cases", *KILL_CASES]) == 0   # small's row is not stale
    assert "STALE" not in capsys.readouterr().out
