"""External backends: Backend.from_cores, loading by MODULE:ATTR and entry point, the core check, the pytest
plugin, the example backend through the CLI and the plugin (the fla adapter: tests/conformance/test_fla.py)."""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conformance import Backend
from conformance.backends import external
from conformance.backends import registry as backends
from conformance.backends.checks import check_cores
from conformance.backends.external import BackendError
from conformance.cases.catalog import all_cases, select
from conformance.cases.core import CORE_SPECS
from conformance.cases.inputs import cast
from conformance.cli import main as k3conf
from conformance.golden.store import COMMITTED_ROOT, read_golden
from conformance.runner import case_runner
from k3ref.cores import UnsupportedShape
from tests.support.tolerances import rel_rms, tol

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "wrapped_reference_backend.py"
PERTURB_ENV = "K3CONF_EXAMPLE_PERTURB"


def _wrapped(fn):
    def core(*args, **kwargs):
        return fn(*args, **kwargs)
    return core


def _backend(precision="fp32", **swaps) -> Backend:
    """A backend whose swapped cores are `swaps` (name -> callable(base) -> core)."""
    return Backend.from_cores("test-ext", precision,
                              lambda base: base.replace(**{n: make(base) for n, make in swaps.items()}))


def _case(name: str):
    return next(c for c in all_cases("tiny") if c.name == name)


def _run_cli(*args, env_extra=None, cwd=REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _run_pytest(*args, cwd, env_extra=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------ the Backend API


@pytest.mark.parametrize("name, precision, make_cores, expect", [
    pytest.param("k", "fp16", lambda b: b, "precision expected one of", id="precision-fp16"),
    pytest.param("my kernel", "fp32", lambda b: b, "without spaces", id="name-with-space"),
    pytest.param("", "fp32", lambda b: b, "non-empty", id="name-empty"),
    pytest.param("k", "fp32", 3, "make_cores expected a callable", id="make-cores-not-callable"),
])
def test_from_cores_rejects_bad_arguments(name, precision, make_cores, expect):
    with pytest.raises(BackendError, match=expect):
        Backend.from_cores(name, precision, make_cores)


def test_kernel_cores_are_the_swapped_ones():
    b = Backend.from_cores("k", "fp32", lambda base: base.replace(kda_decode=_wrapped(base.kda_decode),
                                                                rmsnorm=base.rmsnorm))
    assert b.kernel_cores() == frozenset({"kda_decode"})


def test_make_cores_must_return_cores():
    b = Backend.from_cores("k", "fp32", lambda base: {"kda_decode": base.kda_decode})
    with pytest.raises(BackendError, match=r"returned dict, expected k3ref.cores.Cores"):
        b.cores()


def test_available_reports_a_broken_probe_as_unavailable():
    def probe():
        raise RuntimeError("driver missing")

    ok, why = Backend.from_cores("k", "fp32", lambda b: b, available=probe).available()
    assert not ok and "RuntimeError: driver missing" in why


def test_only_the_authors_cores_are_timed():
    b = _backend(rmsnorm=lambda base: _wrapped(base.rmsnorm))
    x = {"x": np.ones((2, 8), np.float32), "w": np.ones(8, np.float32), "eps": 1e-5}
    assert b.time_core("rmsnorm", x) > 0
    assert b.time_core("situ_glu", {"gate": x["x"], "up": x["x"]}) is None


def test_a_case_without_a_swapped_core_is_not_applicable():
    b = _backend(kda_decode=lambda base: _wrapped(base.kda_decode))
    runner = case_runner(COMMITTED_ROOT, "tiny", timing=False)
    rms, kda = (runner.run_one(_case(n), b) for n in ("rmsnorm/T1-D113", "kda_decode/B2-H3-K16"))
    assert rms.status == "n/a" and rms.error.startswith("reference core:"), (rms.status, rms.error)
    assert kda.status == "pass" and kda.tensors


# ------------------------------------------------------------------------------------------ the core check


def _transposed_state(base):
    def core(*args, **kwargs):
        o, s = base.kda_decode(*args, **kwargs)
        return o, np.swapaxes(s, -1, -2).copy()
    return core


def _nan_output(base):
    def core(*args, **kwargs):
        y = base.rmsnorm(*args, **kwargs).copy()
        y[0, 3] = np.nan
        return y
    return core


@pytest.mark.parametrize("core, make, expect", [
    pytest.param("kda_decode", lambda base: lambda q, k, v, g_raw, beta_raw, state: None,
                 r"core kda_decode .* TypeError: .* expected the signature kda_decode\(q, k, v, g_raw", id="signature"),
    pytest.param("kda_decode", _transposed_state,
                 r"kda_decode/B3-H2-K32-V16 .* output state has shape \[3, 2, 16, 32\], expected \[3, 2, 32, 16\]",
                 id="transposed-state"),
    pytest.param("kda_decode", lambda base: lambda *a, **k: base.kda_decode(*a, **k)[0],
                 r"core kda_decode .* returned 1 value\(s\), expected 2 \(o, state\)", id="one-output"),
    pytest.param("rmsnorm", lambda base: lambda *a, **k: base.rmsnorm(*a, **k).tolist(),
                 r"core rmsnorm .* output y is a builtins.list, expected a numpy.ndarray", id="list-output"),
    pytest.param("rmsnorm", _nan_output, r"core rmsnorm .* 1 non-finite value\(s\) .*\(first at \[0, 3\]: nan",
                 id="nan-output"),
    pytest.param("moe_route",
                 lambda base: lambda *a, **k: tuple(np.asarray(t, np.float32) for t in base.moe_route(*a, **k)),
                 r"core moe_route .* output indices has dtype float32, expected int64", id="float-indices"),
    pytest.param("mxfp4_gemv", lambda base: lambda *a, **k: 1 / 0,
                 r"core mxfp4_gemv .* raised ZeroDivisionError", id="crash"),
])
def test_check_names_the_core_and_what_is_wrong(core, make, expect):
    with pytest.raises(BackendError, match=expect):
        check_cores(_backend(**{core: make}))


def test_check_tries_the_next_case_when_a_shape_is_unsupported():
    def head_dim_128_only(base):
        def core(q, *args, **kwargs):
            if np.shape(q)[-1] != 128:
                raise UnsupportedShape("built for head_dim 128")
            o, s = base.kda_decode(q, *args, **kwargs)
            return o, s[..., :-1]                  # wrong: the check must reach the head_dim 128 case to see it
        return core

    with pytest.raises(BackendError, match=r"like kda_decode/B1-H1-K128 .* state has shape \[1, 1, 128, 127\]"):
        check_cores(_backend(kda_decode=head_dim_128_only))


# ------------------------------------------------------------------------------------------ loading


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


GOOD_MODULE = """
    from conformance import Backend

    def make():
        return Backend.from_cores("good-ext", "fp32",
                                  lambda base: base.replace(rmsnorm=lambda *a, **k: base.rmsnorm(*a, **k)))

    not_a_backend = 42

    def returns_a_string():
        return "numpy32"

    def numpy32():
        return Backend.from_cores("numpy32", "fp32", lambda base: base)
"""


@pytest.mark.parametrize("spec, expect", [
    pytest.param("no_such_k3conf_module:make", r"cannot import backend module 'no_such_k3conf_module'", id="no-module"),
    pytest.param("{dir}/missing.py:make", r"backend module file .*missing.py' not found", id="no-file"),
    pytest.param("{dir}/good.py:mak", r"has no attribute 'mak'; its callables: \[.*'make'", id="no-attribute"),
    pytest.param("{dir}/good.py:not_a_backend", r"is a int, expected a conformance.Backend", id="wrong-type"),
    pytest.param("{dir}/good.py:returns_a_string", r"returned a str, expected a conformance.Backend",
                 id="wrong-return"),
    pytest.param("{dir}/good.py:numpy32", r"the name 'numpy32' is a built-in backend's", id="built-in-name"),
    pytest.param("{dir}/broken.py:make", r"importing .*broken.py raised ModuleNotFoundError: .*kernel_lib_x",
                 id="import-fails"),
    pytest.param("{dir}/good.py", r"expected MODULE:ATTR", id="no-attr"),
])
def test_load_errors_name_what_is_wrong(tmp_path, spec, expect):
    _write(tmp_path / "good.py", GOOD_MODULE)
    _write(tmp_path / "broken.py", "import kernel_lib_x\n")
    if spec == "{dir}/good.py":
        spec = f"{tmp_path}/good.py:"
    with pytest.raises(BackendError, match=expect):
        external.load(spec.format(dir=tmp_path), reserved=backends.BACKENDS)


def test_load_finds_a_module_in_the_working_directory(tmp_path, monkeypatch):
    _write(tmp_path / "k3conf_cwd_backend.py", GOOD_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "k3conf_cwd_backend", raising=False)
    b = external.load("k3conf_cwd_backend:make")
    sys.modules.pop("k3conf_cwd_backend", None)
    assert (b.name, b.kernel_cores()) == ("good-ext", frozenset({"rmsnorm"}))


def test_a_backend_file_imports_its_neighbours(tmp_path, monkeypatch):
    _write(tmp_path / "k3conf_neighbour_kernels.py",
           "def rmsnorm(base):\n    return lambda *a, **k: base.rmsnorm(*a, **k)\n")
    _write(tmp_path / "k3_backend.py", """
        from conformance import Backend
        from k3conf_neighbour_kernels import rmsnorm

        def make():
            return Backend.from_cores("neighbour-ext", "fp32", lambda base: base.replace(rmsnorm=rmsnorm(base)))
    """)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "k3conf_neighbour_kernels", raising=False)
    b = external.load(f"{tmp_path}/k3_backend.py:make")
    sys.modules.pop("k3conf_neighbour_kernels", None)
    assert b.kernel_cores() == frozenset({"rmsnorm"})


@pytest.mark.parametrize("value, expect", [
    pytest.param("k3conf_ep_mod:make", "built a backend named 'good-ext'; name the entry point and the backend alike",
                 id="name-mismatch"),
    pytest.param("k3conf_ep_mod:nothing", "AttributeError", id="attribute-missing"),
])
def test_a_broken_entry_point_is_unavailable_with_the_reason(tmp_path, monkeypatch, value, expect):
    _write(tmp_path / "k3conf_ep_mod.py", GOOD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = importlib.metadata.EntryPoint(name="demo", value=value, group=external.ENTRY_POINT_GROUP)
    monkeypatch.setattr(external, "entry_points", lambda: {"demo": ep})
    ok, why = external.from_entry_point("demo").available()
    sys.modules.pop("k3conf_ep_mod", None)
    assert not ok and expect in why


def test_a_core_with_a_wrong_signature_is_refused_before_the_cases(tmp_path, capsys):
    """A wrong kernel, however wrong: exit 1, its backend runs no case, and the report says why (exit 2 is for
    usage)."""
    path = _write(tmp_path / "wrong.py", """
        from conformance import Backend

        def make():
            return Backend.from_cores("wrong-ext", "fp32",
                                      lambda base: base.replace(rmsnorm=lambda x, w: base.rmsnorm(x, w, 1e-5)))
    """)
    code = k3conf(["run", "--backend", f"{path}:make", "--cases", "rmsnorm", "--report", str(tmp_path)])
    out = capsys.readouterr().out
    first = json.loads((tmp_path / "report.json").read_text())["first_failure"]
    assert code == 1, out
    for said in (first, out):
        assert "core rmsnorm" in said and "TypeError" in said and "expected the signature rmsnorm(x, w, eps)" in said
    assert json.loads((tmp_path / "report.json").read_text())["results"] == []


# ------------------------------------------------------------------------------------------ the example, CLI


@pytest.mark.parametrize("perturb, module_form, code", [
    pytest.param("", False, 0, id="wrapped-file-path"),
    pytest.param("kda_decode", True, 1, id="kda_decode-perturbed-1e-3-module-name"),
])
def test_example_backend_through_the_cli(tmp_path, perturb, module_form, code):
    # the file as a path from the repository root, or as a module from its own directory
    spec, cwd = (f"{EXAMPLE.stem}:make", EXAMPLE.parent) if module_form else (f"{EXAMPLE.relative_to(REPO)}:make", REPO)
    # the passing run is the full command (speed measured too: that must not fail an external backend);
    # timing cannot turn a failure into a pass, so the failing run skips it
    timing = ["--no-timing"] if code else []
    p = _run_cli("run", "--backend", spec, "--cases", "kda_decode/*", *timing, "--report", str(tmp_path),
                 env_extra={PERTURB_ENV: perturb}, cwd=cwd)
    assert p.returncode == code, p.stdout + p.stderr
    first = p.stdout.splitlines()[0]
    if code:
        assert first.startswith("FIRST FAILURE: kda_decode/") and "on example-wrapped" in first
        assert "(block kda_decode)" in first
    else:
        n_cases = len(select(all_cases("tiny"), ["kda_decode/*"]))
        assert first.startswith(f"ALL PASS: {n_cases} "), first


def test_installed_entry_point_backends_are_listed(tmp_path):
    """A package installed by its metadata alone: a module and a dist-info with entry_points.txt on the path."""
    _write(tmp_path / "k3conf_demo_backend.py", """
        from conformance import Backend

        def make():
            return Backend.from_cores("demo", "bf16", lambda base: base, available=lambda: (False, "demo GPU absent"))
    """)
    info = tmp_path / "k3conf_demo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: k3conf-demo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[k3conf.backends]\ndemo = k3conf_demo_backend:make\n"
                                           "broken = k3conf_demo_backend:missing\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    p = _run_cli("list", "backends", env_extra={"PYTHONPATH": path})
    assert p.returncode == 0, p.stderr
    rows = {line.split()[0]: line for line in p.stdout.splitlines()[1:]}
    assert re.search(r"demo\s+bf16\s+skipped: demo GPU absent", rows["demo"])
    assert "skipped: " in rows["broken"] and "no attribute 'missing'" in rows["broken"]
    assert "fla" not in rows and "fla" in p.stdout.splitlines()[-1]   # this package's own adapter: run when named


# ------------------------------------------------------------------------------------------ the pytest plugin


@pytest.fixture
def author_repo(tmp_path) -> Path:
    """A kernel author's repository with one test of its own."""
    _write(tmp_path / "test_mine.py", "def test_mine():\n    assert 1 + 1 == 2\n")
    return tmp_path


def test_plugin_runs_the_cases_as_items_named_by_case(author_repo):
    # 'kda_decode/' names the kda_decode cases alone: the marker kda_decode also keeps the traces that run it
    p = _run_pytest("-rA", "--strict-markers", f"--k3conf-backend={EXAMPLE}:make", "-k", "kda_decode/ or rmsnorm/",
                    cwd=author_repo, env_extra={PERTURB_ENV: "kda_decode"})
    assert p.returncode == 1, p.stdout + p.stderr
    failed = set(re.findall(r"^FAILED (\S+)", p.stdout, re.M))
    passed = set(re.findall(r"^PASSED (\S+)", p.stdout, re.M))
    names = [c.name for c in all_cases("tiny")]
    assert failed == {n for n in names if n.startswith("kda_decode/")}
    assert passed == {n for n in names if n.startswith("rmsnorm/")}
    assert "FIRST FAILURE: kda_decode/B2-H3-K16 on example-wrapped: outputs.o (block kda_decode)" in p.stdout
    table = p.stdout[p.stdout.index(" k3conf "):]                 # the summary section: the run's table
    assert re.search(r"kda_decode/B1-H1-K128\W+FAIL 1e-03", table) and re.search(r"rmsnorm/T1-D113\W+ok", table)


def test_plugin_is_inert_without_its_option(author_repo):
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    assert installed.get("k3conf") == "conformance.pytest_plugin", "reinstall: pip install -e ."
    p = _run_pytest("--co", "-q", cwd=author_repo)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [line for line in p.stdout.splitlines() if "::" in line or "/" in line] == ["test_mine.py::test_mine"]


def test_plugin_names_a_backend_that_does_not_load(author_repo):
    p = _run_pytest("--k3conf-backend=no_such_k3conf_module:make", cwd=author_repo)
    assert p.returncode == 4
    assert "cannot import backend module 'no_such_k3conf_module'" in p.stderr


# ------------------------------------------------------------------------------------------ the core check: values


def _digest(arrays: dict) -> str:
    """A memoriser's key: every array argument's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name in sorted(k for k, v in arrays.items() if isinstance(v, np.ndarray)):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype}:{a.shape}".encode() + a.tobytes())
    return h.hexdigest()


def _memoriser(core: str, precision: str = "fp32"):
    """The cheat: the committed goldens' outputs when the inputs are a golden's (as the run casts them), zeros of
    the right shape and dtype otherwise."""
    spec = CORE_SPECS[core]
    table = {}
    for case in select(all_cases("tiny"), [core]):
        golden = read_golden(COMMITTED_ROOT, case.name)
        inputs = {k: cast(v, precision) for k, v in golden.group("inputs").items()}
        outs = tuple(v.astype(np.float32) if v.dtype.kind == "f" else v
                     for v in (golden.tensors[f"outputs.{o}"] for o in spec.outputs))
        table[_digest(inputs)] = outs if len(outs) > 1 else outs[0]

    def make(base):
        def core_fn(**arguments):
            stored = table.get(_digest(arguments))
            return stored if stored is not None else _zeros(getattr(base, core)(**arguments))
        return core_fn
    return make


def _zeros(result):
    return tuple(np.zeros_like(r) for r in result) if isinstance(result, tuple) else np.zeros_like(result)


def _per_shape_first_answer(core: str):
    """The cheat: the answer of its first call for each input shape, forever."""
    def make(base):
        first = {}   # input shapes -> the first answer

        def core_fn(**arguments):
            key = tuple((k, np.shape(v)) for k, v in sorted(arguments.items()) if isinstance(v, np.ndarray))
            if key not in first:
                first[key] = getattr(base, core)(**arguments)
            return first[key]
        return core_fn
    return make


@pytest.mark.parametrize("core", ["mxfp4_gemv", "kda_decode"])
def test_a_memoriser_reproduces_every_golden_yet_is_refused_at_start_up(core):
    backend = _backend(**{core: _memoriser(core)})
    cores = backend.cores()
    for case in select(all_cases("tiny"), [core]):     # a judge that reads only the goldens would pass it
        golden = read_golden(COMMITTED_ROOT, case.name)
        got = getattr(cores, core)(**{k: cast(v, "fp32") for k, v in golden.group("inputs").items()}, **{
            k: v for k, v in golden.kwargs.items() if k != "kernel_entry"})
        got = got if isinstance(got, tuple) else (got,)
        for out, g in zip(CORE_SPECS[core].outputs, got, strict=True):
            assert rel_rms(g, golden.tensors[f"outputs.{out}"]) <= tol("fp32_vs_fp64"), (case.name, out)
    first_output = CORE_SPECS[core].outputs[0]
    with pytest.raises(BackendError, match=rf"core {core}: output {first_output} is no answer to its inputs: "
                                           rf"against the float64 reference .* rel RMS 1 > 0.5, .* gate row "
                                           rf"\('{core}', '\*', 'fp32'\)"):
        check_cores(backend)


@pytest.mark.parametrize("core, output", [(c, s.outputs[0]) for c, s in CORE_SPECS.items()])
def test_a_zero_returner_is_refused_at_start_up(core, output):
    backend = _backend(**{core: lambda base, core=core: lambda **a: _zeros(getattr(base, core)(**a))})
    with pytest.raises(BackendError, match=rf"core {core}: output {output} is no answer .* rel RMS 1 > 0.5, max abs"):
        check_cores(backend)      # any seed: nothing is zero on the tiny cases


@pytest.mark.parametrize("core, precision", [("rmsnorm", "fp32"), ("attnres_mix", "bf16"), ("moe_route", "fp64")])
def test_a_first_answer_cache_is_refused_at_start_up(core, precision):
    backend = _backend(precision, **{core: _per_shape_first_answer(core)})
    # the second draw of each tiny case has the first one's shapes: only its values can tell
    refused = rf"core {core}( on a tiny input .*\))?: output \w+ (is no answer|must equal)"
    with pytest.raises(BackendError, match=refused):
        check_cores(backend)


def test_a_value_error_names_core_tensor_error_bound_and_seed_and_replays():
    backend = _backend(rmsnorm=lambda base: lambda **a: -base.rmsnorm(**a))     # a sign flip: rel RMS 2
    messages = []
    for _ in range(2):
        with pytest.raises(BackendError) as info:
            check_cores(backend, seed=123)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert re.search(r"backend test-ext: core rmsnorm: output y is no answer to its inputs: .* rel RMS 2 > 0\.5, "
                     r".* gate row \('rmsnorm', '\*', 'fp32'\) caps the run at 1e-05", messages[0])
    assert "check seed 123, draw " in messages[0] and "like rmsnorm/" in messages[0]


@pytest.mark.parametrize("name", ["numpy32", "numpy64", "torch", "torch-bf16"])
def test_built_in_cores_pass_the_value_check_for_any_seed(name):
    if name.startswith("torch"):
        pytest.importorskip("torch", reason="the PyTorch baselines need torch")
    backend = backends.get_backend(name)
    for seed in (1, 2, 3, 987654321, 2 ** 31 - 2):
        check_cores(backend, seed=seed)


def test_an_inaccurate_core_passes_the_start_up_check_and_fails_the_run_with_its_report(tmp_path, capsys):
    """Off by 1e-3 is an answer to the inputs, only not a good one: the start-up check lets it through (exit 2
    would call it bad usage) and the run fails it against its gate rows (exit 1), with the report."""
    path = _write(tmp_path / "off.py", """
        import numpy as np
        from conformance import Backend

        def make():
            return Backend.from_cores("off-ext", "fp32", lambda base: base.replace(
                mxfp4_gemv=lambda **a: base.mxfp4_gemv(**a) * np.float32(1.001)))
    """)
    code = k3conf(["run", "--backend", f"{path}:make", "--cases", "mxfp4_gemv", "--no-timing",
                   "--report", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1, err
    report = json.loads((tmp_path / "report.json").read_text())
    cells = [r for r in report["results"] if r["backend"] == "off-ext"]
    assert cells and all(r["status"] == "fail" for r in cells), [(r["case"], r["status"]) for r in cells]


def test_a_sign_flip_is_refused_before_the_cases(tmp_path, capsys):
    path = _write(tmp_path / "flip.py", """
        from conformance import Backend

        def make():
            return Backend.from_cores("flip-ext", "fp32", lambda base: base.replace(
                mxfp4_gemv=lambda **a: -base.mxfp4_gemv(**a)))
    """)
    code = k3conf(["run", "--backend", f"{path}:make", "--cases", "mxfp4_gemv", "--no-timing",
                   "--report", str(tmp_path)])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 1 and report["results"] == [], out
    assert re.search(r"core mxfp4_gemv: output y is no answer to its inputs: .* rel RMS 2 > 0\.5",
                     report["first_failure"]), report["first_failure"]
