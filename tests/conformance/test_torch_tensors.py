"""Backends on device tensors (tensors="torch"): the NumPy bridge's dtype table, its checks on what comes back
and on the inputs, its timing, the built-in torch backends on it, the example backend through the CLI and the
pytest plugin (passing, and failing on a planted layout bug), and the ten-line example of the docs."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conformance import Backend  # noqa: E402
from conformance.backends import pytorch  # noqa: E402
from conformance.backends.protocol import BackendError  # noqa: E402
from conformance.backends.tensors import TensorError, TorchTensorBackend, adapt, upload_dtype  # noqa: E402
from conformance.isolation.guard import InputWritten  # noqa: E402
from k3ref.cores import reference_cores  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torch_tensor_backend.py"
DOC = REPO / "docs" / "external_backends.md"
EXACT = 1e-12     # float64 against float64: the same math in another summation order


def _tensor_backend(precision="fp32", device="cpu", **swaps) -> TorchTensorBackend:
    backend = adapt(Backend.from_cores("test-torch", precision, lambda base: base.replace(**swaps),
                                       tensors="torch", device=device))
    assert isinstance(backend, TorchTensorBackend)
    return backend


def _rmsnorm_inputs(rng=None) -> dict:
    rng = rng or np.random.default_rng(3)
    return {"x": rng.standard_normal((3, 7)).astype(np.float32), "w": rng.standard_normal(7).astype(np.float32),
            "eps": 1e-6}


def _torch_rmsnorm(x, w, eps):
    return w * x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)


def _kda_inputs(B=2, H=3, K=4, V=5) -> dict:
    rng = np.random.default_rng(5)
    f = {n: rng.standard_normal(s) for n, s in (("q", (B, H, K)), ("k", (B, H, K)), ("v", (B, H, V)),
                                                ("g_raw", (B, H, K)), ("beta_raw", (B, H)), ("A_log", (H,)),
                                                ("dt_bias", (H * K,)), ("state", (B, H, K, V)))}
    return {n: a.astype(np.float32) for n, a in f.items()}


# ------------------------------------------------------------------------------------------ declaring it


def test_tensors_must_be_numpy_or_torch():
    with pytest.raises(BackendError, match=r"tensors: expected one of \('numpy', 'torch'\), found str 'jax'"):
        Backend.from_cores("k", "fp32", lambda base: base, tensors="jax")


def test_a_foreign_backend_declaring_tensors_is_read_and_checked():
    class Foreign:
        name, precision, tensors = "foreign-torch", "fp32", 3

        def available(self):
            return True, "here"

        def cores(self):
            return reference_cores().replace(rmsnorm=_torch_rmsnorm)

        def time_core(self, core, inputs):
            return None

    with pytest.raises(BackendError, match="backend foreign-torch: tensors: expected one of .*found int 3"):
        adapt(Foreign())
    Foreign.tensors = "torch"
    backend = adapt(Foreign())
    assert isinstance(backend, TorchTensorBackend) and backend.device == "cpu"
    x = _rmsnorm_inputs()
    got = backend.cores().rmsnorm(**x)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_allclose(got, reference_cores().rmsnorm(**x), rtol=1e-5)


def test_a_device_that_is_no_torch_device_makes_the_backend_unavailable():
    ok, why = _tensor_backend(device="gpu0", rmsnorm=_torch_rmsnorm).available()
    assert not ok and "device: expected a torch device string (cpu, cuda, cuda:1), found 'gpu0'" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_a_cuda_backend_without_a_gpu_is_unavailable():
    ok, why = _tensor_backend(device="cuda", rmsnorm=_torch_rmsnorm).available()
    assert not ok and "sees no CUDA GPU" in why


# ------------------------------------------------------------------------------------------ the bridge


def _spy_kda(seen: dict):
    def kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
        seen.update({n: t.dtype for n, t in zip(("q", "k", "v", "g_raw", "beta_raw", "A_log", "dt_bias", "state"),
                                                (q, k, v, g_raw, beta_raw, A_log, dt_bias, state), strict=True)})
        return torch.zeros(v.shape, dtype=torch.float32), state.float().clone()
    return kda_decode


@pytest.mark.parametrize("precision, activation, kept", [
    pytest.param("bf16", torch.bfloat16, torch.float32, id="bf16"),
    pytest.param("fp32", torch.float32, torch.float32, id="fp32"),
    pytest.param("fp64", torch.float64, torch.float64, id="fp64"),
])
def test_inputs_reach_the_core_in_the_torch_dtype_of_the_table(precision, activation, kept):
    seen: dict = {}
    inputs = _kda_inputs()
    if precision == "fp64":
        inputs = {n: a.astype(np.float64) for n, a in inputs.items()}
    o, state = _tensor_backend(precision, kda_decode=_spy_kda(seen)).cores().kda_decode(**inputs)
    assert seen == {"q": activation, "k": activation, "v": activation, "g_raw": activation,
                    "beta_raw": activation, "A_log": kept, "dt_bias": kept, "state": kept}
    assert o.dtype == state.dtype == (np.float64 if precision == "fp64" else np.float32)
    np.testing.assert_array_equal(state, inputs["state"])   # fp32-kept: not rounded on the way


def test_integers_arrive_as_int32_bytes_as_uint8_bools_as_bool():
    seen: dict = {}

    def mla_decode(q_abs, kv_cache, block_table, seq_lens, *, scale, kv_rank):
        seen.update(block_table=block_table.dtype, seq_lens=seq_lens.dtype)
        return torch.zeros(q_abs.shape[:-1] + (kv_rank,))

    def mxfp4_gemv(packed, scale, x):
        seen.update(packed=packed.dtype, scale=scale.dtype)
        return torch.zeros(x.shape[:-1] + (packed.shape[0],))

    cores = _tensor_backend(mla_decode=mla_decode, mxfp4_gemv=mxfp4_gemv).cores()
    out = cores.mla_decode(np.zeros((1, 2, 8), np.float32), np.zeros((2, 4, 8), np.float32),
                           np.array([[0, 1]], np.int64), np.array([5], np.int64), scale=1.0, kv_rank=6)
    assert out.shape == (1, 2, 6)
    cores.mxfp4_gemv(np.zeros((3, 16), np.uint8), np.full((3, 1), 127, np.uint8), np.zeros(32, np.float32))
    assert seen == {"block_table": torch.int32, "seq_lens": torch.int32, "packed": torch.uint8, "scale": torch.uint8}
    assert upload_dtype(np.zeros(2, bool), "mask", "mla_decode", "fp32") == torch.bool   # no core takes one yet
    with pytest.raises(TensorError, match=r"core mla_decode: input block_table: integer values 0 \.\. 4294967296"):
        cores.mla_decode(np.zeros((1, 2, 8), np.float32), np.zeros((2, 4, 8), np.float32),
                         np.array([[0, 1 << 32]], np.int64), np.array([5], np.int64), scale=1.0, kv_rank=6)


@pytest.mark.parametrize("core, message", [
    pytest.param(lambda x, w, eps: _torch_rmsnorm(x, w, eps).numpy(),
                 r"core rmsnorm: output y: expected a torch\.Tensor on cpu .*found numpy\.ndarray", id="numpy"),
    pytest.param(lambda x, w, eps: torch.empty_like(x, device="meta"),
                 r"core rmsnorm: output y: expected a tensor on the backend's device cpu, found one on meta",
                 id="meta-device"),
    pytest.param(lambda x, w, eps: _torch_rmsnorm(x, w, eps).to(torch.int32),
                 r"core rmsnorm: output y: expected a floating dtype .*found torch\.int32", id="integer-y"),
])
def test_what_comes_back_is_named_when_it_is_no_tensor_of_the_interface(core, message):
    with pytest.raises(TensorError, match=message):
        _tensor_backend(rmsnorm=core).cores().rmsnorm(**_rmsnorm_inputs())


def test_float_router_indices_are_named():
    def moe_route(logits, bias, top_k, **_):
        w, i = torch.topk(torch.sigmoid(logits), top_k, dim=-1)
        return w, i.float()

    rng = np.random.default_rng(2)
    with pytest.raises(TensorError, match=r"core moe_route: output indices: expected an integer dtype"):
        _tensor_backend(moe_route=moe_route).cores().moe_route(rng.standard_normal((3, 8)).astype(np.float32),
                                                               np.zeros(8, np.float32), 2)


def test_a_write_into_an_input_tensor_raises_input_written():
    def rmsnorm(x, w, eps):
        y = _torch_rmsnorm(x, w, eps)
        w.zero_()
        return y

    with pytest.raises(InputWritten, match="core rmsnorm wrote into its input w"):
        _tensor_backend(rmsnorm=rmsnorm).cores().rmsnorm(**_rmsnorm_inputs())


def test_a_state_pool_may_be_updated_in_place_and_nan_poison_left_alone_is_no_write():
    def kda_conv_pool(x, weight, conv_pool, slots, *, layout="cw"):
        conv_pool[slots.long()] += 1.0            # IN_OUT: the pool is updated in place and returned
        return x * 2, conv_pool

    x = np.array([[1.0, np.nan]], np.float32)
    pool = np.zeros((2, 2, 3), np.float32)
    y, new_pool = _tensor_backend(kda_conv_pool=kda_conv_pool).cores().kda_conv_pool(
        x, np.ones((2, 4), np.float32), pool, np.array([1]))
    np.testing.assert_array_equal(y, [[2.0, np.nan]])
    np.testing.assert_array_equal(new_pool, np.stack([np.zeros((2, 3)), np.ones((2, 3))]))
    assert not pool.any(), "the judge's array is never the core's tensor"


def test_cores_the_backend_does_not_supply_are_the_reference_on_numpy():
    backend = _tensor_backend(rmsnorm=_torch_rmsnorm)
    assert backend.kernel_cores() == frozenset({"rmsnorm"})
    assert backend.cores().situ_glu is reference_cores().situ_glu
    assert backend.time_core("situ_glu", {"gate": np.ones(3), "up": np.ones(3)}) is None


# ------------------------------------------------------------------------------------------ timing


class _SplitCore:
    """A tensor core with prepare (outside the timed region) and compute (timed), counting the calls of each."""

    def __init__(self):
        self.prepared = self.computed = 0
        self.devices: set = set()

    def prepare(self, x, w, eps):
        self.prepared += 1
        self.devices |= {x.device, w.device}
        return {"x": x, "w": w, "eps": eps}

    def compute(self, x, w, eps):
        self.computed += 1
        return _torch_rmsnorm(x, w, eps)

    def __call__(self, *args, **kwargs):
        return self.compute(**self.prepare(*args, **kwargs))


def test_time_core_prepares_once_and_times_compute_on_device_inputs():
    core = _SplitCore()
    seconds = _tensor_backend(rmsnorm=core).time_core("rmsnorm", _rmsnorm_inputs())
    assert seconds is not None and 0 < seconds < 1.0
    assert core.prepared == 1 and core.computed > 1
    assert core.devices == {torch.device("cpu")}


# ------------------------------------------------------------------------------------------ the built-in torch backends


@pytest.mark.parametrize("name", ["torch64", "torch", "torch-bf16"])
def test_builtin_torch_backends_take_tensors_behind_the_bridge(name):
    backend = pytorch.make_backend(name, device="cpu")
    assert isinstance(backend, TorchTensorBackend) and backend.inner.tensors == "torch"
    x = _rmsnorm_inputs()
    out = backend.inner.cores().rmsnorm(torch.from_numpy(x["x"]), torch.from_numpy(x["w"]), x["eps"])
    assert isinstance(out, torch.Tensor) and out.device == torch.device("cpu")
    assert "rmsnorm" in backend.kernel_cores() and "attnres_hub" in backend.kernel_cores()


def test_torch64_through_the_bridge_agrees_with_the_reference():
    x = {k: (v.astype(np.float64) if isinstance(v, np.ndarray) else v) for k, v in _rmsnorm_inputs().items()}
    got = pytorch.make_backend("torch64", device="cpu").cores().rmsnorm(**x)
    want = reference_cores().rmsnorm(**x)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=EXACT, atol=EXACT)


# ------------------------------------------------------------------------------------------ the example backend


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra}
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _run_cli(*args, env_extra=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=REPO, env=_env(env_extra or {}),
                          capture_output=True, text=True, timeout=600)


def _run_pytest(*args, cwd, env_extra=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", *args],
                          cwd=cwd, env=_env(env_extra or {}), capture_output=True, text=True, timeout=600)


def test_example_passes_the_tiny_set_through_the_cli(tmp_path):
    p = _run_cli("run", "--backend", f"{EXAMPLE}:make", "--no-timing", "--report", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads((tmp_path / "report.json").read_text())["results"]
    judged = {r["case"].split("/")[0] for r in results if r["status"] == "pass"}
    assert {"rmsnorm", "kda_decode"} <= judged
    assert all(r["status"] in ("pass", "n/a") for r in results)


# The dt_bias layout bug errs by rel RMS ~0.4-0.55 on the start-up check's draws: on 2 seeds of 40 past its "no answer
# at all" line (0.5), so the check refuses the backend before any case runs (a fair verdict too). These tests are
# about the cases and the plugin naming it, so they replay a check seed (0) on which the check lets it through.
LAYOUT_BUG = {"K3CONF_EXAMPLE_BUG": "kda-dt-bias-kh", "K3CONF_CHECK_SEED": "0"}


def test_example_with_a_layout_bug_fails_naming_core_and_case(tmp_path):
    p = _run_cli("run", "--backend", f"{EXAMPLE}:make", "--no-timing", "--cases", "kda_decode", "rmsnorm",
                 "--report", str(tmp_path), env_extra=LAYOUT_BUG)
    assert p.returncode == 1, p.stdout + p.stderr
    assert re.match(r"FIRST FAILURE: kda_decode/B\d+-H[2-9]\S* on example-torch: outputs\.o \(block kda_decode\)",
                    p.stdout), p.stdout


def test_the_check_seed_replays_a_refusal_and_a_bad_one_is_named():
    """K3CONF_CHECK_SEED=18 (a seed on which the check refuses the layout bug) refuses it on every run (a wrong
    kernel: exit 1); a seed that is not a number is named (usage: exit 2)."""
    p = _run_cli("run", "--backend", f"{EXAMPLE}:make", "--no-timing", "--cases", "kda_decode",
                 env_extra={**LAYOUT_BUG, "K3CONF_CHECK_SEED": "18"})
    assert p.returncode == 1 and "check seed 18" in p.stdout + p.stderr, p.stdout + p.stderr
    p = _run_cli("run", "--backend", f"{EXAMPLE}:make", "--no-timing", "--cases", "kda_decode",
                 env_extra={"K3CONF_CHECK_SEED": "soon"})
    assert p.returncode == 2 and "K3CONF_CHECK_SEED: expected a non-negative integer" in p.stdout + p.stderr, (
        p.stdout + p.stderr)


def test_example_with_a_transposed_state_is_refused_at_start_up_naming_the_core():
    p = _run_cli("run", "--backend", f"{EXAMPLE}:make", "--no-timing", "--cases", "kda_decode",
                 env_extra={"K3CONF_EXAMPLE_BUG": "kda-state-vk"})
    assert p.returncode == 1, p.stdout + p.stderr
    assert re.search(r"backend example-torch: the start-up check of its cores failed: .*core kda_decode.* "
                     r"on a tiny input like kda_decode/", p.stdout + p.stderr)


@pytest.mark.parametrize("bug, returncode", [
    pytest.param("", 0, id="clean"),
    pytest.param("kda-dt-bias-kh", 1, id="dt-bias-kh"),
])
def test_example_through_the_pytest_plugin(tmp_path, bug, returncode):
    (tmp_path / "test_mine.py").write_text("def test_mine():\n    assert 1 + 1 == 2\n")
    # the cases by name: the markers kda_decode and rmsnorm also keep the traces that run those cores
    p = _run_pytest("-rA", f"--k3conf-backend={EXAMPLE}:make", "-k", "kda_decode/ or rmsnorm/", cwd=tmp_path,
                    env_extra={**LAYOUT_BUG, "K3CONF_EXAMPLE_BUG": bug})
    assert p.returncode == returncode, p.stdout + p.stderr
    passed = set(re.findall(r"^PASSED (\S+)", p.stdout, re.M))
    failed = set(re.findall(r"^FAILED (\S+)", p.stdout, re.M))
    assert any(n.startswith("rmsnorm/") for n in passed) and not any(n.startswith("rmsnorm/") for n in failed)
    if bug:
        assert failed and all(n.startswith("kda_decode/") for n in failed)
        assert re.search(r"FIRST FAILURE: kda_decode/\S+ on example-torch: outputs\.o \(block kda_decode\)", p.stdout)
    else:
        assert not failed and any(n.startswith("kda_decode/") for n in passed)


# ------------------------------------------------------------------------------------------ the docs


def _doc_example() -> str:
    section = DOC.read_text().split("## Device tensors", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, f"{DOC}: the Device tensors section has no python code block"
    return block.group(1)


def test_the_ten_line_example_of_the_docs_runs(tmp_path):
    code = _doc_example()
    assert len(code.strip().splitlines()) <= 10, code
    (tmp_path / "k3_torch_backend.py").write_text(code)
    p = _run_cli("run", "--backend", f"{tmp_path / 'k3_torch_backend.py'}:make", "--no-timing", "--cases", "rmsnorm",
                 "--report", str(tmp_path / "report"))
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads((tmp_path / "report" / "report.json").read_text())["results"]
    assert results and all(r["status"] == "pass" and r["backend"] == "my-torch" for r in results)
