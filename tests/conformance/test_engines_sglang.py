"""SGLang's AttnRes code judged as its wheel ships it (conformance.backends.sglang, engine_modules, engines): the
named stubs, the argument mapping (against a stand-in with SGLang's contract, and through SGLang's own eager
reference), the Triton paths under the interpreter, and the check that tells the documented findings from a new or
changed one. Tests that need the wheel skip without it (and fail under K3_STRICT=1)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conformance.backends import engine_modules, engines, registry, sglang, sglang_kda, triton_interpreter
from conformance.backends.engine_modules import EngineModule, EngineModuleError, StubReplicatedLinear, StubRMSNorm
from conformance.cases.core_data import BUILDERS
from conformance.cases.engine_kda import SPECS
from k3ref.attnres import attnres_mix
from k3ref.cores import UnsupportedShape, reference_cores
from k3ref.ops import rmsnorm
from tests.support.strict import require_ready
from tests.support.tolerances import rel_rms, tol

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.torch


def _mix_inputs(S=3, lead=(5,), D=64, seed=0):
    inputs, kwargs = BUILDERS["attnres_mix"](np.random.default_rng(seed), S=S, lead=lead, D=D)
    return inputs, kwargs


# ------------------------------------------------------------------------------------------------ the stubs


def test_stub_rmsnorm_normalises_as_sglang_forward_native():
    import torch  # noqa: PLC0415 -- optional: marked torch

    x = torch.randn(3, 64, dtype=torch.float64)
    w = torch.rand(64, dtype=torch.float64) + 0.5
    out = StubRMSNorm(w, 1e-5)(x)
    assert out.dtype == x.dtype
    np.testing.assert_allclose(out.numpy(), rmsnorm(x.numpy(), w.numpy(), 1e-5), rtol=1e-6)
    # bf16 in, bf16 out: the product with the weight in fp32, one cast back (sglang's default order)
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    want = ((xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)) * wb.float())
    assert torch.equal(StubRMSNorm(wb, 1e-5)(xb), want.to(torch.bfloat16))


def test_stub_replicated_linear_returns_output_and_no_bias():
    import torch  # noqa: PLC0415 -- optional: marked torch

    w = torch.randn(1, 8, dtype=torch.float64)
    x = torch.randn(4, 8, dtype=torch.float64)
    out, bias = StubReplicatedLinear(w)(x)
    assert bias is None
    np.testing.assert_allclose(out.numpy(), x.numpy() @ w.numpy().T, rtol=1e-12)


@pytest.mark.parametrize("platform, true", [
    pytest.param("cpu", set(), id="cpu"),
    pytest.param("cuda", {"is_cuda"}, id="cuda"),
    pytest.param("hip", {"is_hip"}, id="hip"),
])
def test_platform_predicates(platform, true):
    answers = {name: f() for name, f in engine_modules.platform_predicates(platform).items()}
    assert set(answers) == {"is_cuda", "is_hip", "is_npu"}
    assert {name for name, a in answers.items() if a} == true
    with pytest.raises(ValueError, match="expected one of"):
        engine_modules.platform_predicates("npu")


def test_stubs_are_installed_only_while_the_module_executes(tmp_path, monkeypatch):
    kernel = tmp_path / "eng" / "kernel.py"
    kernel.parent.mkdir()
    kernel.write_text("from eng.layers import Norm\nfrom os import sep\nNORM = Norm\n")
    monkeypatch.setattr(engine_modules, "module_file", lambda dist, path: tmp_path / path)
    sentinel = object()
    monkeypatch.setitem(sys.modules, "os", sys.modules["os"])
    module = EngineModule("eng", "eng/kernel.py", {"eng.layers": {"Norm": sentinel}})
    loaded = engine_modules.load(module)
    try:
        assert loaded.NORM is sentinel
        assert "eng.layers" not in sys.modules, "a stub outlived the module's execution"
        assert loaded.__name__ == module.alias == "_k3conf_eng.eng.kernel"
        assert engine_modules.load(module) is loaded      # once per process
    finally:
        sys.modules.pop(module.alias, None)


def test_a_missing_wheel_names_the_install_command(monkeypatch):
    monkeypatch.setattr(engine_modules, "installed_version", lambda dist: None)
    with pytest.raises(EngineModuleError, match="pip install --no-deps -r requirements-engines.txt"):
        engine_modules.module_file("sglang", "sglang/srt/layers/attn_residual.py")
    assert "sglang is not installed" in sglang.refusal(triton=False)


def test_a_missing_wheel_skips_and_fails_under_strict(monkeypatch):
    """What every test that needs an engine's wheel does without it: skip with the reason, fail under K3_STRICT=1."""
    why = "sglang is not installed: pip install --no-deps -r requirements-engines.txt"
    monkeypatch.setenv("K3_STRICT", "0")
    with pytest.raises(pytest.skip.Exception, match="sglang is not installed"):
        require_ready(why)
    monkeypatch.setenv("K3_STRICT", "1")
    with pytest.raises(pytest.fail.Exception, match="K3_STRICT=1: sglang is not installed"):
        require_ready(why)
    require_ready(None)


# ------------------------------------------------------------------------------------------------ the mapping


def _contract_stand_in(call: sglang.MixCall):
    """SGLang's mix contract written out (bank rows 0..nvb-1, then the prefix; fp32 scores against
    norm.weight * proj.weight; softmax; raw rows mixed), in the dtype of the call."""
    import torch  # noqa: PLC0415 -- optional: marked torch

    rows = torch.cat([call.bank[:, :call.nvb], call.prefix_sum[:, None]], dim=1)      # [T, R, H]
    cw = call.score_norm.weight * call.score_proj.weight[0]
    keys = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + call.score_norm.variance_epsilon)
    return (torch.softmax(keys @ cw, dim=-1)[..., None] * rows).sum(1)


@pytest.mark.parametrize("S, lead, D", [
    pytest.param(3, (5,), 113, id="S3-T5-D113"),
    pytest.param(9, (2, 3), 64, id="S9-2x3-D64"),
])
def test_mapping_matches_the_reference_through_sglang_contract(S, lead, D):
    import torch  # noqa: PLC0415 -- optional: marked torch

    inputs, kwargs = _mix_inputs(S, lead, D)
    core = sglang.mix_core(_contract_stand_in, dtype=torch.float32)
    out = core(**inputs, **kwargs)
    assert out.shape == lead + (D,)
    assert rel_rms(out, attnres_mix(**inputs, **kwargs)) < tol("fp32_mix_mapping")


def test_mapping_that_loses_the_prefix_fails():
    """The test above can fail: a stand-in that mixes the bank without the prefix errs far over its tolerance."""
    import torch  # noqa: PLC0415 -- optional: marked torch

    def bank_only(call: sglang.MixCall):
        last = call.bank[:, call.nvb - 1].contiguous()
        return _contract_stand_in(dataclasses.replace(call, prefix_sum=last, nvb=call.nvb - 1))

    inputs, kwargs = _mix_inputs(4, (5,), 64)
    out = sglang.mix_core(bank_only, dtype=torch.float32)(**inputs, **kwargs)
    assert rel_rms(out, attnres_mix(**inputs, **kwargs)) > 100 * tol("fp32_mix_mapping")


def test_mapping_refuses_a_blend_and_the_shapes_each_path_does_not_take():
    import torch  # noqa: PLC0415 -- optional: marked torch

    inputs, kwargs = _mix_inputs()
    core = sglang.mix_core(_contract_stand_in, dtype=torch.float32)
    with pytest.raises(UnsupportedShape, match="always mixes fully"):
        core(**inputs, mix=0.5, eps=kwargs["eps"])
    call = sglang.mix_call(inputs["sources"], inputs["proj_w"], inputs["norm_w"], 1.0, 1e-5, dtype=torch.float32)
    with pytest.raises(UnsupportedShape, match="chunks of 1024; H=64"):
        sglang.two_kernel_accepts(call)
    lone = sglang.mix_call(inputs["sources"][:1], inputs["proj_w"], inputs["norm_w"], 1.0, 1e-5, dtype=torch.float32)
    with pytest.raises(UnsupportedShape, match="nvb >= 1"):
        sglang.single_kernel_accepts(lambda H, nvb: True)(lone)
    with pytest.raises(UnsupportedShape, match="over budget"):
        sglang.single_kernel_accepts(lambda H, nvb: False)(call)


def test_sglang_eager_reference_through_the_mapping():
    """SGLang's own aggregate_stream_torch, loaded from the wheel with the stubs, agrees with the reference at bf16
    on a toy draw (its bf16 scores bind only at K3's magnitudes: docs/engines.md)."""
    import torch  # noqa: PLC0415 -- optional: marked torch

    require_ready(sglang.refusal(triton=False))
    attn_residual = engine_modules.load(sglang.attn_residual_module("cpu"))
    inputs, kwargs = _mix_inputs(3, (5,), 113)
    out = sglang.mix_core(sglang.eager_run(attn_residual), dtype=torch.bfloat16)(**inputs, **kwargs)
    assert rel_rms(out, attnres_mix(**inputs, **kwargs)) < tol("bf16_mix_stand_in")
    assert "sglang.srt.layers.layernorm" not in sys.modules     # the stubs are gone once the module has loaded


# ------------------------------------------------------------------------------------------------ the kernels


TRITON_SCRIPT = """
import json, sys
import numpy as np
import torch
from conformance.backends import sglang
from conformance.backends.engine_modules import StubRMSNorm
from conformance.cases.core_data import BUILDERS
from conformance.cases.engine_kda import SPECS
from k3ref.attnres import attnres_mix
from k3ref.ops import rmsnorm

attn_residual, hip = sglang.load_modules(triton=True)
inputs, kw = BUILDERS["attnres_mix"](np.random.default_rng(3), S=4, lead=(3,), D=2048)
ref = attnres_mix(**inputs, **kw)
rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
bf = torch.bfloat16
two = sglang.mix_core(sglang.two_kernel_run(attn_residual), dtype=bf, accepts=sglang.two_kernel_accepts)
one = sglang.mix_core(sglang.single_kernel_run(attn_residual, hip), dtype=bf)
ow = 1.0 + 0.1 * np.random.default_rng(4).standard_normal(2048)
norm = StubRMSNorm(torch.from_numpy(ow).to(bf), kw["eps"])
fused = sglang.mix_core(sglang.single_kernel_run(attn_residual, hip, out_norm=norm), dtype=bf)
owb = torch.from_numpy(ow).to(bf).double().numpy()
print(json.dumps({"two": rel(two(**inputs, **kw), ref), "one": rel(one(**inputs, **kw), ref),
                  "fused": rel(fused(**inputs, **kw), rmsnorm(ref, owb, kw["eps"])),
                  "interpreted": sglang.triton_interpreter.interpreted(attn_residual._combine_kernel)}))
"""


def test_sglang_triton_paths_under_the_interpreter(tmp_path):
    """Both Triton paths run under the interpreter in a fresh process and agree with the reference at bf16, the
    single kernel's fused output norm too (against rmsnorm of the reference mix: outside the attnres_mix core)."""
    require_ready(sglang.refusal(triton=True))
    script = tmp_path / "sglang_kernels.py"
    script.write_text(textwrap.dedent(TRITON_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert errors.pop("interpreted") is True
    for path, err in errors.items():
        assert err < tol("bf16_mix_stand_in"), (path, err)


# ------------------------------------------------------------------------------------------------ KDA prefill


def _chunk_kda_stand_in(slot_of=None):
    """A stand-in for SGLang's chunk_kda with its keyword contract: each sequence of cu_seqlens runs k3ref's KDA
    prefill from pool[initial_state_indices[n]] ([H, V, K], V first) and writes its final state back in place.
    slot_of(n, indices) picks the slot (a planted mapping bug passes another one)."""
    import torch  # noqa: PLC0415 -- optional: marked torch

    ref = reference_cores()

    def chunk_kda(q, k, v, g, beta, scale, initial_state, initial_state_indices, use_qk_l2norm_in_kernel,
                  cu_seqlens, A_log, dt_bias, lower_bound, beta_is_raw):
        assert use_qk_l2norm_in_kernel and beta_is_raw and q.shape[0] == 1
        pool, cu = initial_state, cu_seqlens.tolist()
        o = torch.zeros(v.shape, dtype=torch.float64)
        for n in range(len(cu) - 1):
            slot = int(initial_state_indices[n]) if slot_of is None else slot_of(n, initial_state_indices)
            t = slice(cu[n], cu[n + 1])
            args = [a[:, t].double().numpy() for a in (q, k, v, g, beta)]
            state = pool[slot].transpose(-1, -2).double().numpy()[None]
            o_n, s_n = ref.kda_prefill(*args, A_log.double().numpy(), dt_bias.double().numpy(), state,
                                       lower_bound=lower_bound, scale=scale)
            o[:, t] = torch.from_numpy(np.asarray(o_n))
            pool[slot] = torch.from_numpy(np.asarray(s_n)[0]).transpose(-1, -2).to(pool.dtype)
        return o
    return chunk_kda


def _varlen_inputs(layout: str):
    inputs, kwargs = SPECS["kda_prefill_varlen"].make(np.random.default_rng(7), lens=(5, 0, 3), S=5, H=2, K=8, V=4,
                                                      state_layout=layout)
    return inputs, kwargs


@pytest.mark.parametrize("layout", [pytest.param("kv", id="kv"), pytest.param("vk", id="vk")])
def test_kda_varlen_mapping_through_chunk_kda_contract(layout):
    import torch  # noqa: PLC0415 -- optional: marked torch

    inputs, kwargs = _varlen_inputs(layout)
    core = sglang_kda.varlen_core(_chunk_kda_stand_in(), dtype=torch.float32)
    o, pool = core(**inputs, **kwargs)
    ro, rpool = reference_cores().kda_prefill_varlen(**inputs, **kwargs)
    assert rel_rms(o, ro) < tol("fp32_mix_mapping")
    live = np.asarray(inputs["slots"])
    assert rel_rms(pool[live], rpool[live]) < tol("fp32_mix_mapping")
    untouched = np.setdiff1d(np.arange(pool.shape[0]), live)
    np.testing.assert_array_equal(pool[untouched], np.asarray(inputs["state_pool"], np.float32)[untouched])


def test_kda_varlen_mapping_that_ignores_the_slots_fails():
    """The test above can fail: a chunk_kda that takes sequence n's state from slot n errs far over it."""
    import torch  # noqa: PLC0415 -- optional: marked torch

    inputs, kwargs = _varlen_inputs("vk")
    core = sglang_kda.varlen_core(_chunk_kda_stand_in(slot_of=lambda n, indices: n), dtype=torch.float32)
    o, _ = core(**inputs, **kwargs)
    ro, _ = reference_cores().kda_prefill_varlen(**inputs, **kwargs)
    assert not rel_rms(o, ro) < 100 * tol("fp32_mix_mapping")


def test_the_fla_fork_stubs_answer_for_no_gpu():
    pytest.importorskip("triton", reason="the stubs re-export triton.next_power_of_2")
    stubs = sglang_kda.stubs()
    assert set(stubs) == {"sglang.srt.utils.common", "sglang.srt.utils", "sglang.kernels.jit.utils",
                          "sglang.srt.batch_invariant_ops", "sglang.srt.model_executor.cuda_graph_config"}
    utils = stubs["sglang.srt.utils"]
    assert utils["cdiv"](17, 8) == 3 and utils["next_power_of_2"](17) == 32
    assert not any(f() for f in (utils["is_cpu"], utils["is_npu"], utils["cpu_has_amx_support"]))
    assert stubs["sglang.kernels.jit.utils"]["is_arch_support_pdl"]() is False
    assert stubs["sglang.srt.batch_invariant_ops"]["is_batch_invariant_mode_enabled"]() is False
    assert len(stubs["sglang.srt.utils.common"]["torch_release"]) == 2


KDA_SCRIPT = """
import json, warnings
import numpy as np
warnings.simplefilter("ignore")
from conformance.backends import sglang
from conformance.cases.engine_kda import SPECS
from k3ref.cores import reference_cores

cores = sglang.make_cores(reference_cores(), "sglang")
inputs, kw = SPECS["kda_prefill_varlen"].make(np.random.default_rng(3), lens=(70, 9), S=3, H=2, K=16, V=16,
                                              state_layout="vk")
o, pool = cores.kda_prefill_varlen(**inputs, **kw)
ro, rpool = reference_cores().kda_prefill_varlen(**inputs, **kw)
live = np.asarray(inputs["slots"])
rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
print(json.dumps({"o": rel(o, ro), "state": rel(pool[live], rpool[live])}))
"""


def test_sglang_chunk_kda_under_the_interpreter(tmp_path):
    """SGLang's chunk_kda (two sequences, one over a 64-token chunk) under the interpreter with the bridges agrees
    with the reference at bf16."""
    require_ready(sglang.kda_refusal())
    script = tmp_path / "sglang_kda.py"
    script.write_text(textwrap.dedent(KDA_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    for tensor, err in errors.items():
        assert err < tol("bf16_kda_stand_in"), (tensor, err)


# ------------------------------------------------------------------------------------------------ the new bridges

BRIDGES_SCRIPT = """
import sys, torch, triton
import triton.language as tl
from triton.language.extra import libdevice
from conformance.backends import triton_engine_bridges as ti

exp = tl.exp      # as SGLang's fla fork binds it (op.py)


def outcome(fn):
    try:
        return f"ok {fn()}"
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"


@triton.jit
def scaled(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, tl.load(x + o) * 0.3)          # a bf16 tensor times a Python float


@triton.jit
def aliased(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, exp(tl.load(x + o)))


@triton.jit
def extern(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, 1.0 + libdevice.exp(tl.load(x + o)))


x = torch.linspace(-3, 3, 16).to(torch.bfloat16)
xf = x.float()
y16, y32 = torch.zeros(16, dtype=torch.bfloat16), torch.zeros(16)


def err(out, want):
    return float((out.double() - want.double()).abs().max() / want.double().abs().max())


def bf16_run():
    scaled[(1,)](x, y16, 16)
    # compiled Triton makes the float a bf16 constant and rounds the product once
    return err(y16, (xf * torch.tensor(0.3).to(torch.bfloat16).float()).to(torch.bfloat16))


def alias_run():
    aliased[(1,)](xf, y32, 16)
    return err(y32, xf.exp())


def extern_run():
    extern[(1,)](xf, y32, 16)
    return err(y32, 1 + xf.exp())


for name, run, bridges in (("bf16", bf16_run, (ti.bridge_bf16_constants, ti.bridge_bf16_arithmetic)),
                           ("alias", alias_run, (lambda: ti.bridge_bound_builtins([sys.modules[__name__]]),)),
                           ("extern", extern_run, (lambda: ti.bridge_libdevice([sys.modules[__name__]]),))):
    print(f"{name} without:", outcome(run))
    for bridge in bridges:
        bridge()
    print(f"{name} with:", outcome(run))
"""


@pytest.mark.parametrize("name, without", [
    pytest.param("bf16", ("no attribute 'get_bf16'",), id="bf16-arithmetic"),
    pytest.param("alias", ("_semantic",), id="bound-builtins"),
    pytest.param("extern", ("NoneType",), id="libdevice"),
])
def test_engine_bridges_close_their_gaps(tmp_path, name, without):
    """Each bridge the engines' fla fork needs: the interpreter's failure without it, the right numbers with it."""
    require_ready(triton_interpreter.triton_refusal())
    script = tmp_path / "bridges.py"
    script.write_text(BRIDGES_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    before, after = lines[f"{name} without"], lines[f"{name} with"]
    assert before.startswith("raised ") and any(w in before for w in without), before
    assert after.startswith("ok ") and float(after.removeprefix("ok ")) < 1e-6, after


# ------------------------------------------------------------------------------------------------ the findings


def _results(statuses: dict[tuple[str, str], str]) -> list[dict]:
    return [{"backend": b, "case": c, "status": s} for (b, c), s in statuses.items()]


FINDINGS = {"sglang-ref": {"attnres_mix/S2-*": "bf16 scores"}, "sglang": {}}


@pytest.mark.parametrize("statuses, problem", [
    pytest.param({("sglang-ref", "attnres_mix/S2-T64-D7168"): "fail", ("sglang", "attnres_mix/S2-T64-D7168"): "pass"},
                 None, id="as-documented"),
    pytest.param({("sglang-ref", "attnres_mix/S2-T64-D7168"): "pass", ("sglang", "attnres_mix/S2-T64-D7168"): "pass"},
                 "passes now", id="finding-gone"),
    pytest.param({("sglang-ref", "attnres_mix/S2-T64-D7168"): "fail", ("sglang", "attnres_mix/S2-T64-D7168"): "fail"},
                 "not an expected finding", id="new-failure"),
    pytest.param({("sglang-ref", "attnres_mix/S9-T16-D7168"): "fail", ("sglang-ref", "attnres_mix/S2-T64-D7168"):
                  "pass"}, "not an expected finding", id="finding-moved"),
    pytest.param({("sglang", "attnres_mix/S9-T16-D7168"): "skip"}, "no case was judged", id="judged-on-nothing"),
    pytest.param({("sglang-ref", "attnres_mix/S2-T64-D7168"): "error"}, None, id="error-of-a-listed-case"),
])
def test_check_findings(statuses, problem):
    problems = engines.check_findings(_results(statuses), FINDINGS)
    if problem is None:
        assert problems == []
    else:
        assert any(problem in p for p in problems), problems


def test_engines_main_exit_codes(tmp_path, capsys):
    findings = engines.EXPECTED_FINDINGS["sglang-ref"]
    listed = next(iter(findings))
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"results": [{"backend": "sglang-ref", "case": listed, "status": "fail"}]}))
    assert engines.main([str(report)]) == 0
    assert "expected finding" in capsys.readouterr().out
    report.write_text(json.dumps({"results": [{"backend": "sglang-ref", "case": listed, "status": "pass"}]}))
    assert engines.main([str(report)]) == 1
    assert engines.main([]) == 2
    (tmp_path / "bad.json").write_text("{}")
    assert engines.main([str(tmp_path / "bad.json")]) == 2


def test_every_engine_backend_is_registered_on_request_with_its_findings():
    for name in sglang.NAMES:
        assert name in registry.ON_REQUEST and name not in registry.BACKENDS
        assert name in engines.EXPECTED_FINDINGS
        backend = sglang.make_backend(name)
        assert backend.kernel_cores() == sglang.KERNELS_OF[name]      # known without loading sglang
        assert "attnres_mix" in backend.kernel_cores()
        assert backend.precision == "bf16"


def test_unmeasured_sglang_version_is_refused(monkeypatch):
    monkeypatch.setattr(engine_modules, "installed_version", lambda dist: "0.9.0")
    why = sglang.refusal(triton=False)
    assert "0.9.0 is not a version this adapter was measured on" in why
    ok, reason = sglang.available_for(False)()
    assert not ok and "0.9.0" in reason
