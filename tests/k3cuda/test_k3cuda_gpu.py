"""GPU conformance of every k3cuda kernel against its k3ref core in float64 (marker `gpu`).

Each test draws fixed-seed random inputs (never zeros), runs the kernel with its outputs poisoned with NaN,
and compares every output with the float64 reference within the cap of the block's fp32 row of
conformance/judge/gates.py (the table `k3conf run` gates the same kernels with). The `backend` fixture runs each such
test twice: on the GPU (marker gpu; skipped with `k3cuda.available()`'s reason when there is none)
and on the C++ CPU emulation of the same .cu source (k3cuda.testing.cpu_emulation), which checks the wrappers,
the argument packing and the kernels' indexing and reductions on any machine with g++. The tests at the bottom
check the harness itself and the torch baselines (on the CPU).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import struct
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import k3cuda
from conformance.judge.compare import as_tuple, check_outputs
from conformance.judge.gates import gate_for
from k3cuda import build, kda_decode, rmsnorm, runtime, testing
from k3ref.cores import CORE_NAMES, Cores
from tests.support.strict import require


@pytest.fixture(scope="module")
def gpu():
    """Skip with the reason when kernels cannot run here; the context itself is made lazily on first launch."""
    ok, why = k3cuda.available()
    if not ok:
        pytest.skip(f"CUDA backend unavailable: {why}")
    return why


@pytest.fixture(params=[pytest.param("gpu", marks=pytest.mark.gpu), pytest.param("cpu-emu")])
def backend(request):
    """Where the kernels run: the GPU (marker gpu; skipped without one) or the C++ CPU emulation of the same .cu
    source (k3cuda.testing.cpu_emulation; needs g++), which checks wrappers, packing and kernel logic here.
    Function-scoped: the emulation patches k3cuda.runtime only for the test that asked for it."""
    if request.param == "gpu":
        request.getfixturevalue("gpu")
        yield "gpu"
        return
    require("gxx")
    with testing.cpu_emulation():
        yield "cpu-emu"


def _check_params():
    params = []
    for block in k3cuda.KERNEL_MODULES:
        try:
            cases = k3cuda.kernel_module(block).check_cases()
        except Exception:  # noqa: BLE001 - the test of this id re-raises it with the full traceback
            params.append(pytest.param(block, None, id=f"{block}-import"))
            continue
        params += [pytest.param(block, c.label, id=f"{block}-{c.label}") for c in cases]
    return params


def _case(block: str, label: str):
    mod = k3cuda.kernel_module(block)   # raises here when the wrapper does not import
    return mod, {c.label: c for c in mod.check_cases()}[label]


def _gpu_bench():
    """tools/gpu_bench.py as a module (it is a script, not part of a package); importing it needs no GPU."""
    name = "gpu_bench_for_baseline"
    if name not in sys.modules:
        script = Path(__file__).resolve().parents[2] / "tools" / "gpu_bench.py"
        spec = importlib.util.spec_from_file_location(name, script)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod                                   # dataclasses look their module up there
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _tol(block: str) -> float:
    """The cap of the block's fp32 row in conformance/judge/gates.py: the bound `k3conf run` applies to the same kernel
    (the baseline-relative part needs a baseline run, which these tests do not make)."""
    key, gate = gate_for(block, "*", "fp32")
    assert key[0] == block, (f"no fp32 gate row of its own for {block}: add one to conformance/judge/gates.py "
                             "with a reason")
    return gate.cap


@pytest.mark.parametrize("block, label", _check_params())
def test_kernel_matches_reference(backend, block, label):
    """Host function (upload, poison, launch, download) vs the float64 k3ref core on the same inputs."""
    mod, case = _case(block, label)
    inputs = case.make_inputs(np.random.default_rng(testing.case_seed(f"{block}/{label}")))
    ref = testing.reference_core(block)(**testing.to_float64(inputs))
    out = getattr(mod, block)(**inputs)
    fails = check_outputs(f"{block}[{label}]", out, ref, _tol(block))
    assert not fails, "\n".join(fails)


# device_launch variants that the host function does not pick by itself on every GPU: (block, kwargs, the
# check cases to run; the small ones, so the CPU emulation stays quick)
VARIANTS = [
    pytest.param("kda_decode", {"entry": "kda_decode_f32"}, ("B3-H5", "B2-H7-softplus"), id="kda_decode-full-width"),
    pytest.param("kda_decode", {"entry": "kda_decode_f32_split4"}, ("B1-H1", "B2-H7-softplus", "B5-H67"),
                 id="kda_decode-split4"),
    pytest.param("situ_glu", {"fused": False}, ("rows5-I203", "2x3-I1028", "rows9-I64-beta2-lb7"),
                 id="situ_glu-separate-buffers"),
]


@pytest.mark.parametrize("block, kwargs, labels", VARIANTS)
def test_variant_matches_reference(backend, block, kwargs, labels):
    """Check cases through device_launch(inputs, **kwargs); outputs in the core's return order."""
    mod = k3cuda.kernel_module(block)
    cases = [c for c in mod.check_cases() if c.label in labels]
    assert len(cases) == len(labels), f"{block}: check cases {labels} not all found"
    for case in cases:
        inputs = case.make_inputs(np.random.default_rng(testing.case_seed(f"{block}/{case.label}/variant")))
        launch = mod.device_launch(inputs, **kwargs)
        launch()
        out = tuple(launch.outputs().values())
        ref = testing.reference_core(block)(**testing.to_float64(inputs))
        fails = check_outputs(f"{block}[{case.label}] {kwargs}", out, ref, _tol(block))
        assert not fails, "\n".join(fails)


@pytest.mark.parametrize("entry", [pytest.param("kda_decode_f32", id="full-width"),
                                   pytest.param("kda_decode_f32_split4", id="split4")])
def test_kda_state_updated_in_place_over_three_steps(backend, entry):
    """The device state buffer carries the recurrence: three tokens launched on one resident state give the
    reference's o at every step and its state after the third."""
    rng = np.random.default_rng(testing.case_seed(f"kda_decode/in-place/{entry}"))
    first = kda_decode.make_inputs(rng, 3, 5)
    launch = kda_decode.device_launch(first, entry=entry)
    ref_core = testing.reference_core("kda_decode")
    state64 = first["state"].astype(np.float64)
    for step in range(3):
        token = first if step == 0 else kda_decode.make_inputs(rng, 3, 5)
        for name in ("q", "k", "v", "g_raw", "beta_raw"):
            launch.buffers[name].set(np.ascontiguousarray(token[name], np.float32))
        runtime.poison(launch.buffers["o"])
        launch()
        inputs64 = testing.to_float64({**token, "A_log": first["A_log"], "dt_bias": first["dt_bias"]})
        o_ref, state64 = ref_core(**{**inputs64, "state": state64})
        fails = check_outputs(f"kda_decode step {step} o", launch.buffers["o"].get(), o_ref,
                              _tol("kda_decode"))
        assert not fails, "\n".join(fails)
    fails = check_outputs("kda_decode state after 3 steps", launch.buffers["state"].get(), state64,
                          _tol("kda_decode"))
    assert not fails, "\n".join(fails)


def test_unlaunched_outputs_stay_poisoned(backend):
    """The harness can fail: outputs that no kernel wrote are NaN and the comparison says so."""
    inputs = rmsnorm.make_inputs(np.random.default_rng(1), (4, 64))
    launch = rmsnorm.device_launch(inputs)        # not launched
    y = launch.outputs()["y"]
    assert np.isnan(y).all()
    fails = check_outputs("rmsnorm", y, testing.reference_core("rmsnorm")(**testing.to_float64(inputs)),
                          _tol("rmsnorm"))
    assert fails and "0 of 256 passed; non-finite mismatch (nan 256)" in fails[0]


def test_mutant_kernel_is_caught(backend, tmp_path, monkeypatch):
    """The comparison can fail on a real kernel bug: rmsnorm.cu with mean(x^2) over D + 1 instead of D."""
    src = rmsnorm.KERNEL.path.read_text()
    assert "ss / (float)D" in src
    (tmp_path / "rmsnorm_mutant.cu").write_text(src.replace("ss / (float)D", "ss / (float)(D + 1)"))
    mutant = dataclasses.replace(rmsnorm.KERNEL, source=str(tmp_path / "rmsnorm_mutant.cu"))
    monkeypatch.setattr(rmsnorm, "KERNEL", mutant)
    inputs = rmsnorm.make_inputs(np.random.default_rng(3), (5, 96))
    out = rmsnorm.rmsnorm(**inputs)
    fails = check_outputs("rmsnorm", out, testing.reference_core("rmsnorm")(**testing.to_float64(inputs)),
                          _tol("rmsnorm"))
    assert fails and "rel_rms" in fails[0]


@pytest.mark.gpu
def test_timers_measure_something(gpu):
    """Copy bandwidth lands between 100 GB/s and 20 TB/s; a launch times to a positive median."""
    bw = runtime.copy_bandwidth(1 << 28, warmup=2, iters=5)
    assert 1e11 < bw < 2e13, f"copy bandwidth {bw / 1e9:.1f} GB/s is implausible"
    t = runtime.time_fn(rmsnorm.device_launch(rmsnorm.make_inputs(np.random.default_rng(2), (64, 7168))), 2, 5)
    assert 0 < t < 0.1


# ---- the harness, without a GPU -----------------------------------------------------------------------------

@pytest.mark.parametrize("block", list(k3cuda.KERNEL_MODULES))
def test_every_kernel_has_an_fp32_gate_row_with_a_reason(block):
    key, gate = gate_for(block, "*", "fp32")
    assert key == (block, "*", "fp32") and gate.reason.strip() and gate.cap == _tol(block)


def test_check_outputs_names_the_worst_element_and_nan_positions():
    ref = np.arange(1.0, 7.0).reshape(2, 3)
    out = ref.copy()
    out[1, 2] += 0.5
    assert check_outputs("x", out, ref, 0.5 / np.linalg.norm(ref) * 1.01) == []
    (fail,) = check_outputs("x", out, ref, 0.5 / np.linalg.norm(ref) * 0.99)
    assert "x output 0" in fail and "worst at [1, 2]: out 6.5 vs ref 6" in fail
    out[0, 1] = np.nan
    (fail,) = check_outputs("x", out, ref, 1.0)
    assert "non-finite mismatch (nan 1) first at [0, 1]" in fail
    assert check_outputs("x", (out, ref), (ref,), 1.0) == ["x: kernel returned 2 outputs, the reference 1"]
    (fail,) = check_outputs("x", np.ones(3), np.ones(2), 1.0)
    assert "shape: expected [2], found [3]" in fail


@pytest.mark.parametrize("out, verdict", [
    pytest.param([np.inf, 1.0], "pass", id="inf-where-ref-inf"),
    pytest.param([np.nan, 1.0], "fail", id="nan-where-ref-inf"),
    pytest.param([-np.inf, 1.0], "fail", id="minus-inf-where-ref-inf"),
    pytest.param([np.inf, np.inf], "fail", id="inf-where-ref-finite"),
])
def test_one_nonfinite_rule_nan_and_each_inf_at_the_reference_positions(out, verdict):
    """The kernels follow the rule `k3conf run` applies (FlashMLA's): NaN, +Inf and -Inf each at the same
    positions as in the reference. The only verdicts it can change against a finite-or-not rule are outputs
    that are non-finite where the reference is non-finite too: the next test lists the check cases where that
    can happen."""
    fails = check_outputs("x", np.array(out), np.array([np.inf, 1.0]), 1e-5)
    assert (fails == []) == (verdict == "pass"), fails


# check cases whose float64 reference is not finite everywhere: {(block, label): {kind: count}}. Only for these
# can the one NaN/Inf rule give another verdict than the finite-or-not rule these tests applied before; the
# kernel reproduces each position's kind there (test_kernel_matches_reference on the case).
NONFINITE_REFERENCES = {("mxfp4_gemv", "N7-K64-T2-nan-scale"): {"nan": 2, "+inf": 0, "-inf": 0}}


def test_nonfinite_references_are_the_listed_ones():
    found = {}
    for block in k3cuda.KERNEL_MODULES:
        for case in k3cuda.kernel_module(block).check_cases():
            inputs = case.make_inputs(np.random.default_rng(testing.case_seed(f"{block}/{case.label}")))
            for r in as_tuple(testing.reference_core(block)(**testing.to_float64(inputs))):
                if not np.isfinite(r).all():
                    found[(block, case.label)] = {"nan": int(np.isnan(r).sum()), "+inf": int(np.isposinf(r).sum()),
                                                  "-inf": int(np.isneginf(r).sum())}
    assert found == NONFINITE_REFERENCES


def test_available_gives_a_reason():
    ok, why = k3cuda.available()
    assert isinstance(ok, bool) and isinstance(why, str) and why


def test_cuda_cores_env_switch(monkeypatch):
    """K3_CUDA_KDA=0 keeps the base kda_decode; the other kernels are swapped in; cores without a kernel kept."""
    base = Cores(**{name: (lambda *a, _n=name, **k: _n) for name in CORE_NAMES})
    monkeypatch.setenv("K3_CUDA_KDA", "0")
    cores = k3cuda.cuda_cores(base)
    assert cores.kda_decode is base.kda_decode
    assert cores.rmsnorm is k3cuda.kernel_module("rmsnorm").rmsnorm
    assert cores.kda_prefill is base.kda_prefill and cores.moe_route is base.moe_route
    monkeypatch.setenv("K3_CUDA_RMSNORM", "0")
    monkeypatch.delenv("K3_CUDA_KDA")
    cores = k3cuda.cuda_cores(base)
    assert cores.rmsnorm is base.rmsnorm
    assert cores.kda_decode is k3cuda.kernel_module("kda_decode").kda_decode


def _all_check_cases():
    return [pytest.param(block, c.label, id=f"{block}-{c.label}")
            for block in k3cuda.KERNEL_MODULES for c in k3cuda.kernel_module(block).check_cases()]


@pytest.mark.torch
@pytest.mark.parametrize("block, label", _all_check_cases())
def test_torch_baseline_computes_the_same_function(block, label):
    """The speed baseline must do the kernel's math: tools/gpu_bench.py's torch_baseline on the CPU vs the
    float64 reference (first output), so a speedup is measured against the same function."""
    torch = pytest.importorskip("torch", reason="the torch baseline needs PyTorch")
    mod, case = _case(block, label)
    inputs = case.make_inputs(np.random.default_rng(testing.case_seed(f"{block}/{label}/torch")))
    ref = as_tuple(testing.reference_core(block)(**testing.to_float64(inputs)))
    with torch.no_grad():
        out = _gpu_bench().torch_baseline(block, inputs, device="cpu")()
    out = out[0] if isinstance(out, tuple) else out
    fails = check_outputs(f"{block}[{label}] torch", out.float().numpy(), ref[0], _tol(block))
    assert not fails, "\n".join(fails)


def _kda_bad(field, value):
    inputs = kda_decode.make_inputs(np.random.default_rng(4), 2, 3)
    return kda_decode.kda_decode, {**inputs, field: value}


def _kda_head_dim_64():
    """Consistent KDA inputs with K = V = 64 (legal for the reference, not for the kernel)."""
    inputs = kda_decode.make_inputs(np.random.default_rng(5), 1, 2)
    for name in ("q", "k", "v", "g_raw"):
        inputs[name] = inputs[name][..., :64]
    return kda_decode.kda_decode, {**inputs, "dt_bias": inputs["dt_bias"][:128],
                                   "state": inputs["state"][..., :64, :64]}


# (host function + inputs, the words the ValueError must contain); shapes are checked before any upload
BAD_INPUTS = [
    pytest.param(lambda: _kda_bad("k", np.ones((2, 3, 64), np.float32)), "k: expected [2, 3, 128]", id="kda-k-shape"),
    pytest.param(lambda: _kda_bad("state", np.ones((2, 3, 128, 64), np.float32)), "state: expected [2, 3, 128, 128]",
                 id="kda-state-shape"),
    pytest.param(lambda: _kda_bad("A_log", np.zeros(2, np.float32)), "A_log: expected at least H=3", id="kda-A_log"),
    pytest.param(lambda: _kda_bad("v", np.full((2, 3, 128), np.nan, np.float32)), "v: expected finite values",
                 id="kda-nan-input"),
    pytest.param(_kda_head_dim_64, "expected K = V = 128, found K=64, V=64", id="kda-head-dim-64"),
    # NaN is the kernel's code for "no lower bound": a NaN passed in must not silently pick the softplus gate
    pytest.param(lambda: _kda_bad("lower_bound", float("nan")), "lower_bound: expected a finite negative float",
                 id="kda-nan-lower-bound"),
    pytest.param(lambda: _kda_bad("lower_bound", 2.0), "lower_bound: expected a finite negative float",
                 id="kda-positive-lower-bound"),
    pytest.param(lambda: _kda_bad("scale", float("inf")), "scale: expected a finite float", id="kda-inf-scale"),
    pytest.param(lambda: (k3cuda.kernel_module("rmsnorm").rmsnorm,
                          {"x": np.ones((3, 8), np.float32), "w": np.ones(7, np.float32), "eps": 1e-5}),
                 "w: expected [8]", id="rmsnorm-w-shape"),
    pytest.param(lambda: (k3cuda.kernel_module("situ_glu").situ_glu,
                          {"gate": np.ones((3, 8), np.float32), "up": np.ones((3, 9), np.float32)}),
                 "up: expected [3, 8]", id="situ_glu-up-shape"),
]


@pytest.mark.parametrize("make, words", BAD_INPUTS)
def test_bad_input_is_rejected_before_any_upload(make, words):
    """Wrong shapes / non-finite inputs raise ValueError naming the argument (no GPU needed: no upload happens)."""
    fn, kwargs = make()
    with pytest.raises(ValueError, match=re.escape(words)):
        fn(**kwargs)


class _FakeDriver:
    """Just enough of pycuda.driver (names as in pycuda 2026.1) to run k3cuda.runtime's own logic on the CPU."""

    class Error(Exception):
        pass

    class device_attribute:
        MULTIPROCESSOR_COUNT, L2_CACHE_SIZE = "sms", "l2"

    def __init__(self):
        self.calls = []
        driver = self

        class Device:
            def __init__(self, i):
                driver.calls.append(("Device", i))

            def compute_capability(self):
                return (9, 0)

            def get_attribute(self, a):
                return {"sms": 132, "l2": 60 << 20}[a]

            def retain_primary_context(self):
                return types.SimpleNamespace(push=lambda: driver.calls.append(("push",)), pop=lambda: None)

        class Function:
            def __init__(self, name):
                self.name = name

            def prepare(self, fmt):
                self.fmt = fmt

            def prepared_call(self, grid, block, *args, shared_size=0):
                driver.calls.append(("launch", self.name, grid, block, struct.pack(self.fmt, *args), shared_size))

        class Event:
            def record(self):
                self.t = len(driver.calls)

            def synchronize(self):
                pass

            def time_till(self, end):   # ms: 1 per driver call recorded in between
                return float(end.t - self.t)

        self.Device, self.Event = Device, Event
        self.Context = types.SimpleNamespace(synchronize=lambda: driver.calls.append(("sync",)))
        self.init = lambda: driver.calls.append(("init",))
        self.module_from_buffer = lambda data: types.SimpleNamespace(get_function=Function)
        self.memset_d32 = lambda ptr, value, n: driver.calls.append(("memset_d32", value, n))
        self.memcpy_dtod = lambda dst, src, n: driver.calls.append(("dtod", n))
        self.mem_alloc = lambda n: types.SimpleNamespace(free=lambda: None)


def test_runtime_logic_against_a_fake_pycuda(monkeypatch):
    """runtime's lazy context, cubin choice, prepare/prepared_call packing, NaN poisoning and timers, run
    against a stand-in pycuda (no GPU): a typo in these paths would otherwise surface only on the GPU."""
    fake = _FakeDriver()
    gpuarray = types.SimpleNamespace(
        to_gpu=lambda a: types.SimpleNamespace(gpudata=1000, dtype=a.dtype, size=a.size, get=a.copy),
        empty=lambda shape, dtype: types.SimpleNamespace(gpudata=2000, dtype=np.dtype(dtype),
                                                         size=int(np.prod(shape)), get=lambda: None))
    pkg = types.ModuleType("pycuda")
    pkg.driver, pkg.gpuarray = fake, gpuarray
    monkeypatch.setitem(sys.modules, "pycuda", pkg)
    monkeypatch.setitem(sys.modules, "pycuda.driver", fake)
    monkeypatch.setitem(sys.modules, "pycuda.gpuarray", gpuarray)
    monkeypatch.setattr(runtime, "_ctx", None)
    monkeypatch.setattr(runtime, "_modules", {})
    monkeypatch.setattr(runtime, "atexit", types.SimpleNamespace(register=lambda fn: None))
    compiled = []
    monkeypatch.setattr(runtime, "nvcc_compile", lambda spec, arch, kind: compiled.append((spec.block, arch, kind)))

    launch = rmsnorm.device_launch(rmsnorm.make_inputs(np.random.default_rng(6), (3, 8)))
    launch()
    launch()
    assert compiled == [("rmsnorm", "sm_90", "cubin")]                  # loaded once, for the device's arch
    assert [c for c in fake.calls if c[0] in ("init", "push")] == [("init",), ("push",)]   # one lazy context
    assert ("memset_d32", runtime.NAN_F32_BITS, 24) in fake.calls      # y poisoned before any launch
    launches = [c for c in fake.calls if c[0] == "launch"]
    assert len(launches) == 2
    _, name, grid, block, buf, shared = launches[0]
    assert (name, grid, block, shared) == ("rmsnorm_f32", (3, 1, 1), (256, 1, 1), 0)
    assert struct.unpack("PPPif", buf)[:4] == (1000, 1000, 2000, 8)   # x, w, y pointers, then D

    monkeypatch.setenv("K3CUDA_SYNC", "1")
    rmsnorm.device_launch(rmsnorm.make_inputs(np.random.default_rng(7), (2, 4)))()
    assert fake.calls[-1] == ("sync",)
    assert runtime.time_fn(launch, warmup=1, iters=3) == pytest.approx(1e-3)   # one call between the events
    assert runtime.copy_bandwidth(1 << 20, warmup=0, iters=2) == pytest.approx(2 * (1 << 20) / 1e-3)
    assert runtime.multiprocessor_count() == 132


def test_available_with_a_fake_pycuda(monkeypatch):
    """available() answers (True, device) through the driver, and a bad K3CUDA_DEVICE gives (False, why), not a
    traceback (runtime.driver() raises the same ValueError)."""
    fake = _FakeDriver()
    fake.Device.count = staticmethod(lambda: 1)
    fake.Device.name = lambda self: "Fake H200"
    pkg = types.ModuleType("pycuda")
    pkg.driver = fake
    monkeypatch.setitem(sys.modules, "pycuda", pkg)
    monkeypatch.setitem(sys.modules, "pycuda.driver", fake)
    monkeypatch.setattr(build, "nvcc_path", lambda: "/usr/bin/nvcc")
    assert k3cuda.available() == (True, "Fake H200 (sm_90), 1 device(s)")
    monkeypatch.setenv("K3CUDA_DEVICE", "gpu1")
    ok, why = k3cuda.available()
    assert not ok and why == "K3CUDA_DEVICE: expected a device index (0, 1, ...), found 'gpu1'"
    monkeypatch.setattr(runtime, "_ctx", None)
    with pytest.raises(ValueError, match="K3CUDA_DEVICE: expected a device index"):
        runtime.driver()
