"""The fla adapter (conformance.backends.fla) and the Triton-interpreter bridges it runs on without a GPU
(conformance.backends.triton_interpreter): the argument mapping against fla's own naive recurrence, each bridge's
failure without it and its fix with it, the version pins, which implementation the backend says it runs, and the
check that tells fla's documented findings from a new failure."""
from __future__ import annotations

import fnmatch
import importlib
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

from conformance.backends import fla, triton_interpreter
from conformance.cases.core import CORE_SPECS, CORE_TABLE
from k3ref.cores import UnsupportedShape, reference_cores
from tests.support.tolerances import rel_rms, tol

REPO = Path(__file__).resolve().parents[2]
INTERPRETER_READY = triton_interpreter.refusal() is None     # fla-core and triton installed at measured versions
# the cap of the bf16 gate rows fla's KDA cores meet (kda_decode: ('*', '*', 'bf16'); kda_prefill 5e-2): a few bf16
# ulps; fla measured at most 5e-3 on the tiny cases
FLA_BF16_CAP = 3e-2
needs_interpreter = pytest.mark.skipif(not INTERPRETER_READY, reason=f"{triton_interpreter.refusal()}")


def _run_python(script: str, tmp_path: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`script` as a file (the interpreter reads a kernel's source) run by this Python from the repository root,
    TRITON_INTERPRET=1 unless env_extra says otherwise."""
    path = tmp_path / "kernels.py"
    path.write_text(textwrap.dedent(script))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)


# ------------------------------------------------------------------------------------------ the argument mapping


def test_fla_mapping_rejects_a_bound_outside_the_safe_gate():
    pytest.importorskip("torch", reason="fla's arguments are torch tensors")
    inputs, _ = CORE_SPECS["kda_prefill"].make(np.random.default_rng(0), B=1, T=2, H=1, K=4, V=4)
    with pytest.raises(UnsupportedShape, match="lower_bound < 0, found -6"):
        fla.chunk_arguments(**inputs, lower_bound=-6.0)
    with pytest.raises(ValueError, match=r"dt_bias: expected shape \[4\], found \[1\]"):
        fla.fla_arguments(**{**inputs, "dt_bias": inputs["dt_bias"][:1]})


def _fla_naive():
    """fla's own torch reference (fla.ops.kda.naive); from its file when fla.ops cannot import (no Triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("flash-linear-attention (fla-core) is not installed: pip install --no-deps -r requirements-fla.txt")
    pytest.importorskip("torch", reason="fla's naive functions are torch")
    pytest.importorskip("einops", reason="fla's naive functions use einops (pip install einops)")
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "kda" / "naive.py"
    # from its file, not `import fla.ops.kda.naive`: importing fla.ops decorates every fla kernel in this process
    loader_spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    return module


FLA_FLAGS = {"use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "safe_gate",
             "lower_bound", "output_final_state", "scale", "state_v_first"}


def _fla_kernel_on_cpu(naive, chunk: bool):
    """A stand-in for chunk_kda / fused_recurrent_kda: what their docstrings say each argument does, with fla's
    naive recurrence for the math. Anything the docstrings do not define for K3 fails the test."""
    import torch  # noqa: PLC0415 -- optional: torch is not required to collect this module
    import torch.nn.functional as F  # noqa: PLC0415 -- optional: torch is not required to collect this module

    def kernel(*, q, k, v, g, beta, A_log, dt_bias, initial_state, **flags):
        assert set(flags) <= FLA_FLAGS, f"unexpected arguments {set(flags) - FLA_FLAGS}"
        assert ("safe_gate" in flags) == chunk, "safe_gate is chunk_kda's argument only"
        assert flags.get("state_v_first", False) == chunk, "chunk_kda takes the state V-first (FlashKDA's layout)"
        assert flags["output_final_state"] is True and initial_state.dtype == torch.float32
        assert not torch.is_grad_enabled(), "fla is called under inference_mode (FlashKDA takes no other call)"
        B, T, H, K = q.shape
        V = v.shape[-1]
        assert A_log.shape == (H,) and dt_bias.shape == (H * K,)
        assert initial_state.shape == ((B, H, V, K) if chunk else (B, H, K, V))
        state = initial_state.transpose(-1, -2) if chunk else initial_state
        if flags["use_qk_l2norm_in_kernel"]:     # fla's l2norm: eps 1e-6 inside the sqrt
            q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        if flags["use_gate_in_kernel"]:
            z = g + dt_bias.view(H, K)
            lb = flags["lower_bound"]
            if lb is not None:
                assert flags.get("safe_gate", True), "chunk_kda applies lower_bound together with safe_gate=True"
                g = lb * torch.sigmoid(A_log.exp()[:, None] * z)
            else:
                g = -A_log.exp()[:, None] * F.softplus(z)
        if flags["use_beta_sigmoid_in_kernel"]:
            beta = torch.sigmoid(beta)
        o, S = naive.naive_recurrent_kda(q, k, v, g, beta, scale=flags["scale"], initial_state=state,
                                         output_final_state=True)
        return o, (S.transpose(-1, -2) if chunk else S)
    return kernel


@pytest.mark.parametrize("case, params", [pytest.param(n, p, id=n) for n, p in CORE_TABLE["tiny"]
                                          if n.startswith(("kda_decode/", "kda_prefill/"))])
def test_fla_adapter_computes_k3_kda_with_flas_naive_recurrence(case, params):
    naive = _fla_naive()
    block = case.split("/")[0]
    # `entry` forces a CUDA kernel entry (the kind pops it before make); fla's kernels have none of their own
    builder_params = {k: v for k, v in params.items() if k != "entry"}
    inputs, kwargs = CORE_SPECS[block].make(np.random.default_rng(1), **builder_params)
    cores = fla.fla_cores(reference_cores(), _fla_kernel_on_cpu(naive, chunk=True),
                          _fla_kernel_on_cpu(naive, chunk=False), device="cpu")
    got = getattr(cores, block)(**inputs, **kwargs)
    want = getattr(reference_cores(), block)(**inputs, **kwargs)
    for out, g, w in zip(("o", "state"), got, want, strict=True):
        assert g.shape == w.shape, out
        assert rel_rms(g, w) <= tol("fp32_vs_fp64"), (out, rel_rms(g, w))


# ------------------------------------------------------------------------------------------ availability, versions


def test_fla_says_which_implementation_runs_here():
    torch = pytest.importorskip("torch", reason="the fla adapter needs torch to say more than 'no torch'")
    ok, why = fla.available()
    if importlib.util.find_spec("fla") is None:
        assert not ok and "pip install" in why
    elif torch.cuda.is_available():
        assert ok and fla.TRITON_GPU in why
    elif INTERPRETER_READY:
        assert ok and fla.TRITON_INTERPRETED in why and "not TF32" in why
        assert fla.make_backend().device == "cpu"      # its worker is forked; it runs fla under the interpreter
    else:
        assert not ok and "cannot run" in why


@pytest.mark.parametrize("versions, expect", [
    pytest.param({"fla-core": "0.5.0", "triton": "3.9.0"}, "fla-core 0.5.0 is not a version", id="old-fla"),
    pytest.param({"fla-core": "0.6.0", "triton": "3.5.1"}, r"triton 3.5.1 is outside .* \(3.7.1 to 3.9.0\)",
                 id="old-triton"),
    pytest.param({"fla-core": "0.6.0", "triton": "3.10.0"}, "triton 3.10.0 is outside", id="new-triton"),
    pytest.param({"fla-core": None, "triton": "3.9.0"}, "fla-core not installed", id="no-fla"),
    pytest.param({"fla-core": "0.6.0", "triton": "3.7.1"}, None, id="lowest-measured"),
    pytest.param({"fla-core": "0.6.0", "triton": "3.9.0+git1"}, None, id="local-build"),
])
def test_interpreter_bridges_refuse_versions_not_measured(monkeypatch, versions, expect):
    monkeypatch.setattr(triton_interpreter, "_version", versions.get)
    why = triton_interpreter.refusal()
    if expect is None:
        assert why is None
    else:
        assert why is not None and "requirements-fla.txt" in why
        assert re.search(expect, why), why


def test_fla_is_unavailable_without_a_gpu_on_versions_not_measured(monkeypatch):
    torch = pytest.importorskip("torch", reason="the fla adapter needs torch")
    if torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        pytest.skip("needs fla installed and no CUDA GPU (the interpreter path)")
    monkeypatch.setattr(triton_interpreter, "_version", {"fla-core": "0.6.0", "triton": "3.5.1"}.get)
    ok, why = fla.available()
    assert not ok and "no CUDA GPU" in why and "triton 3.5.1 is outside" in why


def test_a_bridge_refuses_to_run_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for bridge in (*triton_interpreter.TRITON_BRIDGES, triton_interpreter.bridge_gather):
        with pytest.raises(RuntimeError, match=r"expected TRITON_INTERPRET=1 .* found TRITON_INTERPRET=''"):
            bridge()


def test_flash_kda_counts_as_installed_as_fla_decides_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_kda" else real(name))
    monkeypatch.delenv("FLA_FLASH_KDA", raising=False)
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    assert fla.flash_kda_installed()
    monkeypatch.setenv("FLA_FLASH_KDA", "0")           # fla's switch for this backend
    assert not fla.flash_kda_installed()
    monkeypatch.setenv("FLA_FLASH_KDA", "1")
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")   # fla's switch for all of its dispatch
    assert not fla.flash_kda_installed()


@pytest.mark.parametrize("K, inference, expect", [
    pytest.param(128, True, fla.FLASH_KDA, id="K128"),
    pytest.param(16, True, "Triton (GPU) (FlashKDA declined: FlashKDA requires K=128, got 16)", id="K16"),
    pytest.param(128, False, "Triton (GPU) (FlashKDA declined: FlashKDA only supports inference mode)",
                 id="grad"),
])
def test_the_chunk_kda_implementation_is_the_one_flas_dispatcher_picks(monkeypatch, K, inference, expect):
    torch = pytest.importorskip("torch", reason="fla's arguments are torch tensors")
    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core is not installed: pip install --no-deps -r requirements-fla.txt")
    monkeypatch.setattr(fla, "flash_kda_installed", lambda: True)
    inputs, _ = CORE_SPECS["kda_prefill"].make(np.random.default_rng(0), B=1, T=3, H=2, K=K, V=K)
    kw = fla.chunk_arguments(**inputs, dtype=torch.bfloat16)
    with torch.inference_mode(inference):
        assert fla.chunk_kda_implementation(kw) == expect
    monkeypatch.setattr(fla, "flash_kda_installed", lambda: False)
    assert fla.chunk_kda_implementation(kw) == fla.TRITON_GPU


# ------------------------------------------------------------------------------------------ the bf16 rounding


def test_fp32_to_bf16_rounds_to_nearest_even_as_torch_does():
    torch = pytest.importorskip("torch", reason="torch's bf16 cast is the reference")
    halfway = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)], dtype=np.float32)   # ties: to even
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-40, -1e-45, 1.00390625], dtype=np.float32)
    x = np.concatenate([halfway, edges, np.random.default_rng(0).standard_normal(4096).astype(np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = triton_interpreter.fp32_to_bf16_bits(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(triton_interpreter.bf16_bits_to_fp32(got[~finite])).all()
    np.testing.assert_array_equal(triton_interpreter.bf16_bits_to_fp32(got[finite]),
                                  torch.from_numpy(want[finite].view(np.int16)).view(torch.bfloat16).float().numpy())
    truncated = (x[:2].view(np.uint32) >> 16).astype(np.uint16)
    assert (got[:2] != truncated).any(), "the halfway cases must tell rounding from truncation"


# ------------------------------------------------------------------------------------------ each bridge

# One script per bridge: a tiny kernel run under the interpreter WITHOUT the bridge (it must fail the named way),
# then with it (it must be right). A bridge, once applied, stays for the process: the scripts run in a process of
# their own (one for all five: starting torch and triton is the slow part), never in the test's.
_PRELUDE = """
import sys
import numpy as np
import torch
import triton
import triton.language as tl
from conformance.backends import triton_interpreter as ti

def outcome(fn):
    try:
        return f"ok {fn()}"
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"
"""

BRIDGE_SCRIPTS = {
    "autotuner": """
        @triton.autotune(configs=[triton.Config({"BLOCK": 4}), triton.Config({"BLOCK": 8})], key=["n"])
        @triton.jit
        def copy_block(x, y, n, BLOCK: tl.constexpr):
            o = tl.arange(0, BLOCK)
            tl.store(y + o, tl.load(x + o, mask=o < n, other=0.0) + BLOCK, mask=o < n)

        x = torch.arange(4, dtype=torch.float32)
        y = torch.zeros(4)
        run = lambda: (copy_block[(1,)](x, y, 4), y.tolist())[1]
        print("without:", outcome(run))
        ti.bridge_autotuner()
        print("with:", outcome(run))     # the first config: BLOCK 4 is added
        assert run() == [4.0, 5.0, 6.0, 7.0]
    """,
    "gather": """
        gather = tl.gather     # as fla.ops.utils.op binds it

        @triton.jit
        def take(x, i, y, N: tl.constexpr):
            o = tl.arange(0, N)
            tl.store(y + o, gather(tl.load(x + o), tl.load(i + o), axis=0))

        x = torch.tensor([10.0, 20.0, 30.0, 40.0])
        i = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
        y = torch.zeros(4)
        run = lambda: (take[(1,)](x, i, y, 4), y.tolist())[1]
        print("without:", outcome(run))
        print("changed:", ti.bridge_gather([sys.modules[__name__]]), ti.bridge_gather([sys.modules[__name__]]))
        print("with:", outcome(run))
        assert run() == [40.0, 10.0, 30.0, 20.0]
    """,
    "loop_variables": """
        @triton.jit
        def count(y, N: tl.constexpr):
            acc = tl.zeros([1], dtype=tl.int64)
            for i in range(N):
                acc += i.to(tl.int64) * 2
            for j in tl.range(1, N):
                acc += j.to(tl.int64)
            for s in tl.static_range(2):
                acc += s       # static_range stays a Python int
            tl.store(y + tl.arange(0, 1), acc)

        y = torch.zeros(1, dtype=torch.int64)
        run = lambda: (count[(1,)](y, 4), y.tolist())[1]
        print("without:", outcome(run))
        ti.bridge_loop_variables()
        print("with:", outcome(run))
        assert run() == [2 * 6 + 6 + 1]
    """,
    "bf16_dot": """
        @triton.jit
        def matmul(a, b, c, N: tl.constexpr):
            o = tl.arange(0, N)
            A = tl.load(a + o[:, None] * N + o[None, :])
            B = tl.load(b + o[:, None] * N + o[None, :])
            tl.store(c + o[:, None] * N + o[None, :], tl.dot(A, B))

        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(16, 16, generator=g).to(torch.bfloat16) for _ in range(2))
        want = a.double() @ b.double()
        c = torch.zeros(16, 16)
        def run():
            matmul[(1,)](a, b, c, 16)
            return float((c.double() - want).abs().max() / want.abs().max())
        print("without:", outcome(run))
        ti.bridge_bf16_dot()
        print("with:", outcome(run))
        assert run() < 1e-6
    """,
    "bf16_rounding": """
        @triton.jit
        def to_bf16(x, y, N: tl.constexpr):
            o = tl.arange(0, N)
            tl.store(y + o, tl.load(x + o).to(tl.bfloat16))

        x = torch.tensor([1 + 2 ** -8 + 2 ** -12, 1 + 3 * 2 ** -8, -(1 + 2 ** -7 - 2 ** -10), 0.1] * 4)
        want = x.to(torch.bfloat16)
        y = torch.zeros(16, dtype=torch.bfloat16)
        run = lambda: int((y.view(torch.int16) != want.view(torch.int16)).sum()) if not to_bf16[(1,)](x, y, 16) else -1
        print("without:", outcome(run))
        ti.bridge_bf16_rounding()
        print("with:", outcome(run))
        assert run() == 0
    """,
}

WITHOUT = {   # bridge -> what the interpreter does without it
    "autotuner": "RuntimeError: 0 active drivers",
    "gather": "_semantic",
    "loop_variables": "'int' object has no attribute 'to'",
    "bf16_dot": None,         # no error: wrong numbers (checked below)
    "bf16_rounding": None,    # no error: truncated values (checked below)
}


@pytest.fixture(scope="module")
def bridge_runs(tmp_path_factory) -> dict[str, dict[str, str]]:
    """bridge -> its script's printed lines ('without', 'with', ...): the five scripts in one process, in the
    order of BRIDGE_SCRIPTS, each bridge applied only after its own 'without' run (the others do not touch its
    kernel: no autotune, gather, loop or bf16 in another script's kernel that a later bridge would change)."""
    script = _PRELUDE + "".join(textwrap.dedent(body).replace('print("', f'print("{name} ')
                                for name, body in BRIDGE_SCRIPTS.items())
    p = _run_python(script, tmp_path_factory.mktemp("bridges"))
    assert p.returncode == 0, p.stdout + p.stderr
    runs: dict[str, dict[str, str]] = {name: {} for name in BRIDGE_SCRIPTS}
    for line in p.stdout.splitlines():
        head, _, value = line.partition(":")
        name, _, what = head.partition(" ")
        if name in runs:
            runs[name][what] = value.strip()
    return runs


@needs_interpreter
@pytest.mark.parametrize("bridge", [pytest.param(b, id=b) for b in BRIDGE_SCRIPTS])
def test_each_bridge_closes_its_gap(bridge_runs, bridge):
    lines = bridge_runs[bridge]
    without, with_ = lines["without"], lines["with"]
    assert with_.startswith("ok "), with_
    if WITHOUT[bridge] is not None:
        assert without.startswith("raised ") and WITHOUT[bridge] in without, without
    elif bridge == "bf16_dot":
        assert float(without.removeprefix("ok ")) > 1.0, f"raw bit patterns multiplied: {without}"
    else:
        assert int(without.removeprefix("ok ")) >= 4, f"truncation differs from round-to-nearest: {without}"
    if bridge == "gather":
        assert lines["changed"] == "['__main__'] []", "applied once; a second call changes nothing"


@needs_interpreter
def test_fla_backend_runs_flas_kernels_under_the_interpreter_and_says_so(tmp_path):
    """The backend as a run's worker builds it: fla's real kernels, interpreted, on one decode and one prefill
    case, within the bf16 gate's cap of K3's float64 reference; its notes name what ran and the limits."""
    p = _run_python("""
        import sys
        import numpy as np
        from conformance.backends import fla
        from conformance.cases.core import CORE_SPECS
        from conformance.cases.inputs import cast
        from k3ref.cores import reference_cores

        backend = fla.make_backend()
        assert backend.kernel_cores() == {"kda_prefill", "kda_decode"} and "fla" not in sys.modules
        cores, ref = backend.cores(), reference_cores()
        for block, params in (("kda_decode", dict(B=2, H=2, K=16, V=16)),
                              ("kda_prefill", dict(B=1, T=65, H=1, K=16, V=16))):
            inputs, kwargs = CORE_SPECS[block].make(np.random.default_rng(3), **params)
            bf16 = {k: v if k in ("A_log", "dt_bias", "state") else cast(v, "bf16") for k, v in inputs.items()}
            for out, g, w in zip(("o", "state"), getattr(cores, block)(**bf16, **kwargs),
                                 getattr(ref, block)(**inputs, **kwargs)):
                err = float(np.sqrt(np.mean((g - w) ** 2) / np.mean(w ** 2)))
                print(f"{block}.{out}: {err:.3g}")
                assert err < {cap}, (block, out, err)
        for note in backend.run_notes():
            print("note:", note)
        assert backend.run_notes() == [], "notes are handed out once"
    """.replace("{cap}", repr(FLA_BF16_CAP)), tmp_path, env_extra={"TRITON_INTERPRET": ""})
    assert p.returncode == 0, p.stdout + p.stderr
    notes = [line for line in p.stdout.splitlines() if line.startswith("note:")]
    assert any("kda_decode ran fla 0.6.0 fused_recurrent_kda: Triton under the interpreter (CPU)" in n
               for n in notes), notes
    assert any("kda_prefill ran fla 0.6.0 chunk_kda: Triton under the interpreter (CPU)" in n for n in notes), notes
    assert any("not TF32" in n for n in notes), notes


@needs_interpreter
def test_fla_imported_compiled_is_refused_rather_than_run_without_a_gpu(tmp_path):
    p = _run_python("""
        import fla.ops.kda                      # decorated as compiled kernels: TRITON_INTERPRET is unset
        from conformance.backends import triton_interpreter
        try:
            triton_interpreter.fla_kda_under_interpreter()
        except RuntimeError as e:
            print("refused:", e)
    """, tmp_path, env_extra={"TRITON_INTERPRET": ""})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "refused: fla's kernels were imported in this process before TRITON_INTERPRET=1" in p.stdout, p.stdout


# ------------------------------------------------------------------------------------------ the CI verdict


def _result(case: str, status: str, backend: str = "fla") -> dict:
    return {"case": case, "backend": backend, "status": status, "error": ""}


@pytest.mark.parametrize("results, expect", [
    pytest.param([_result("kda_decode/B2-H3-K16", "pass"), _result("fuzz/kda_prefill", "fail")], [],
                 id="as-documented"),
    pytest.param([_result("kda_prefill/B1-T1-H1-K16", "fail"), _result("fuzz/kda_prefill", "fail")],
                 ["kda_prefill/B1-T1-H1-K16: fail and not an expected finding"], id="new-failure"),
    pytest.param([_result("kda_decode/B2-H3-K16", "pass"), _result("fuzz/kda_decode", "fail")],
                 ["fuzz/kda_decode: fail and not an expected finding"], id="new-fuzz-finding"),
    pytest.param([_result("kda_decode/B2-H3-K16", "error")], ["kda_decode/B2-H3-K16: error and not an expected"],
                 id="new-error"),
    pytest.param([_result("fuzz/kda_prefill", "pass")], ["fuzz/kda_prefill: passes now, but is listed"],
                 id="fixed-finding"),
    pytest.param([_result("kda_decode_pool/B3-S5-H2-K16-vk-pad1", "n/a"), _result("x/y", "fail", "torch")],
                 ["no case was judged on fla"], id="nothing-judged"),
])
def test_ci_passes_fla_only_on_its_documented_findings(results, expect):
    problems = fla.check_findings(results)
    assert len(problems) == len(expect), problems
    for p, e in zip(problems, expect, strict=True):
        assert p.startswith(e), p


def test_every_expected_finding_has_a_reason_and_names_tiny_cases():
    from conformance.cases.catalog import all_cases  # noqa: PLC0415 -- the catalog builds every case table

    names = [c.name for c in all_cases("tiny")] + [f"fuzz/{core}" for core in fla.KERNEL_CORES]
    for pattern, why in fla.EXPECTED_FINDINGS.items():
        assert len(why) > 40, pattern
        assert fla.expected_finding(pattern) == why
        assert any(fnmatch.fnmatchcase(n, pattern) for n in names), f"{pattern} matches no tiny case or fla core"


def test_a_runs_fuzz_draws_count_as_one_cell_per_core():
    fuzz = {"results": [{"block": "kda_prefill", "backend": "fla", "status": "fail"},
                        {"block": "kda_prefill", "backend": "fla", "status": "pass"},
                        {"block": "kda_decode", "backend": "fla", "status": "pass"},
                        {"block": "kda_decode", "backend": "torch", "status": "fail"}],
            "findings": ["fla: kda_prefill: smallest failing: B=1 T=8 H=1 (region tails, ...): ...",
                         "torch: kda_decode: smallest failing: B=1 ..."]}
    cells = {c["case"]: c["status"] for c in fla.fuzz_cells(fuzz)}
    assert cells == {"fuzz/kda_prefill": "fail", "fuzz/kda_decode": "pass"}
    assert fla.fuzz_cells(None) == []


def test_the_verdict_command_reads_a_report(tmp_path):
    report = tmp_path / "report.json"
    fuzz = {"results": [{"block": "kda_prefill", "backend": "fla", "status": "fail"}],
            "findings": ["fla: kda_prefill: smallest failing: B=1 T=8 H=1 K=8 V=8 (region tails, ...): ..."]}
    report.write_text(json.dumps({"results": [_result("kda_decode/B2-H3-K16", "pass")], "fuzz": fuzz}))
    assert fla.main([str(report)]) == 0
    report.write_text(json.dumps({"results": [_result("kda_decode/B2-H3-K16", "pass")]}))
    assert fla.main([str(report)]) == 0      # a run without fuzz draws judges its cases alone
    report.write_text(json.dumps({"results": [_result("kda_decode/B2-H3-K16", "fail")]}))
    assert fla.main([str(report)]) == 1
    assert fla.main([str(tmp_path / "missing.json")]) == 2


def test_the_verdict_reports_each_kernels_error_over_the_bf16_baseline():
    """What `python -m conformance.backends.fla` prints about chunk_kda's bf16 state: the range of its error over
    torch-bf16's per tensor, per fla kernel, from the report's rows."""
    def row(case, block, multiples):
        return {"case": case, "block": block, "backend": fla.NAME, "status": "pass",
                "tensors": [{"tensor": t, "baseline_multiple": m} for t, m in multiples.items()]}

    results = [row("kda_prefill/a", "kda_prefill", {"o": 2.03, "state": 1.0}),
               row("kda_prefill/b", "kda_prefill", {"o": 1.52, "state": 1.79}),
               row("kda_decode/a", "kda_decode", {"o": 1.0, "state": None}),
               {**row("kda_prefill/c", "kda_prefill", {"o": 9.0}), "backend": "torch-bf16"}]
    lines = fla.baseline_multiples(results)
    assert lines == ["kda_decode (fused_recurrent_kda): error over torch-bf16's (fp32 state) on the same tensors: "
                     "o 1.00-1.00x",
                     "kda_prefill (chunk_kda): error over torch-bf16's (fp32 state) on the same tensors: "
                     "o 1.52-2.03x, state 1.00-1.79x"]
