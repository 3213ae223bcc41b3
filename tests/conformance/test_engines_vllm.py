"""vLLM's AttnRes Triton kernels judged as its wheel ships them (conformance.backends.vllm): the named stubs, the
argument mapping against a stand-in with attn_res's signature, and both kernels under the interpreter. Tests that
need the wheel skip without it (and fail under K3_STRICT=1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conformance.backends import engines, registry, sglang, vllm, vllm_kda, vllm_ref
from conformance.cases.core import CORE_SPECS
from conformance.cases.core_data import BUILDERS
from conformance.cases.engine_kda import SPECS
from k3ref.attnres import attnres_mix
from k3ref.cores import UnsupportedShape, reference_cores
from tests.support.strict import require_ready
from tests.support.tolerances import rel_rms, tol

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.torch


def test_stubs_refuse_what_the_triton_path_must_not_reach():
    with pytest.raises(RuntimeError, match="vllm._custom_ops.kimi_k3_attn_res: the native ops are not loaded"):
        getattr(vllm.NoNativeOps(), "kimi_k3_attn_res")  # noqa: B009 -- the attribute access is the test
    platform = vllm.StubPlatform()
    assert platform.is_device_capability_family(100) is False
    assert platform.is_arch_support_pdl() is False
    with pytest.raises(RuntimeError, match="no FP8 output"):
        vllm.fp8_min_max()


def test_each_kernel_file_gets_only_the_stubs_its_imports_name():
    pytest.importorskip("triton", reason="the stub table re-exports the installed triton")
    nvidia, amd = vllm.attn_res_module("vllm"), vllm.attn_res_module("vllm-rocm")
    assert set(nvidia.stubs) == {"vllm", "vllm.platforms", "vllm.triton_utils"}
    assert set(amd.stubs) == {"vllm.triton_utils", "vllm.model_executor.layers.quantization.utils.quant_utils"}
    assert nvidia.path.endswith("nvidia/ops/attn_res.py") and amd.path.endswith("amd/ops/attn_res.py")


def _stand_in_attn_res(calls: list):
    """A stand-in with vLLM attn_res's signature and contract (blocks 0..num_blocks-1 then the prefix; fp32 scores
    against norm_weight * qk_weight; softmax; raw rows mixed), recording its arguments."""
    import torch  # noqa: PLC0415 -- optional: marked torch

    def attn_res(prefix, delta, blocks, norm_weight, qk_weight, output_norm_weight, num_blocks, block_write_idx,
                 eps, output_norm_eps):
        calls.append(dict(delta=delta, output_norm_weight=output_norm_weight, num_blocks=num_blocks,
                          block_write_idx=block_write_idx, eps=eps, qk_shape=tuple(qk_weight.shape)))
        rows = torch.cat([blocks[:, :num_blocks], prefix[:, None]], dim=1)
        keys = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
        return (torch.softmax(keys @ (norm_weight * qk_weight), dim=-1)[..., None] * rows).sum(1)
    return SimpleNamespace(attn_res=attn_res)


def test_mapping_matches_the_reference_through_vllm_signature():
    import torch  # noqa: PLC0415 -- optional: marked torch

    inputs, kwargs = BUILDERS["attnres_mix"](np.random.default_rng(5), S=5, lead=(3,), D=96)
    calls: list = []
    out = sglang.mix_core(vllm.kernel_run(_stand_in_attn_res(calls)), dtype=torch.float32)(**inputs, **kwargs)
    assert rel_rms(out, attnres_mix(**inputs, **kwargs)) < tol("fp32_mix_mapping")
    assert calls == [dict(delta=None, output_norm_weight=None, num_blocks=4, block_write_idx=-1, eps=kwargs["eps"],
                          qk_shape=(96,))]


VLLM_SCRIPT = """
import json
import numpy as np
import torch
from conformance.backends import sglang, triton_interpreter, vllm
from conformance.cases.core import CORE_SPECS
from conformance.cases.core_data import BUILDERS
from conformance.cases.engine_kda import SPECS
from k3ref.attnres import attnres_mix
from k3ref.cores import UnsupportedShape, reference_cores

out = {}
for name in vllm.TRITON_NAMES:
    module = vllm.load_kernel(name)
    core = sglang.mix_core(vllm.kernel_run(module), dtype=torch.bfloat16)
    for S, T in ((9, 3), (2, 5)):          # BLOCK_L 4 (decode, several blocks) and 1 (one block)
        inputs, kw = BUILDERS["attnres_mix"](np.random.default_rng(S), S=S, lead=(T,), D=203)
        ref = attnres_mix(**inputs, **kw)
        out[f"{name}-S{S}"] = float(np.linalg.norm(core(**inputs, **kw) - ref) / np.linalg.norm(ref))
    out[f"{name}-interpreted"] = triton_interpreter.interpreted(module._attn_res_kernel)
print(json.dumps(out))
"""


def test_vllm_triton_kernels_under_the_interpreter(tmp_path):
    require_ready(vllm.refusal())
    script = tmp_path / "vllm_kernels.py"
    script.write_text(textwrap.dedent(VLLM_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for key, value in results.items():
        if key.endswith("interpreted"):
            assert value is True, key
        else:
            assert value < tol("bf16_mix_stand_in"), (key, value)


def test_vllm_backends_are_registered_on_request_with_their_findings(monkeypatch):
    for name in vllm.NAMES:
        assert name in registry.ON_REQUEST and name in engines.EXPECTED_FINDINGS
        assert vllm.make_backend(name).kernel_cores() == vllm.KERNELS_OF[name]
    monkeypatch.setattr(vllm.engine_modules, "installed_version", lambda dist: "0.31.0")
    assert "0.31.0 is not a version this adapter was measured on" in vllm.refusal()


# ------------------------------------------------------------------------------------------------ KDA decode


def _fused_recurrent_stand_in(shift: int = 1):
    """A stand-in for vLLM's fused_recurrent_kda with its contract: one token per sequence of cu_seqlens, the state
    at pool[ssm_state_indices[n]] ([H, V, K]), an index <= 0 skipped (vLLM's padding slot), the state updated in
    place; k3ref's decode step for the math. `shift` is the slot offset it assumes (a planted bug passes 0)."""
    import torch  # noqa: PLC0415 -- optional: marked torch

    ref = reference_cores()

    def fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                            ssm_state_indices):
        assert q.stride(1) == k.stride(1) == v.stride(1), "q, k, v share the token stride"
        o = torch.zeros(v.shape, dtype=torch.float64)
        for n in range(cu_seqlens.numel() - 1):
            index = int(ssm_state_indices[n]) + (1 - shift)
            if index <= 0:
                continue
            args = [a[0, n:n + 1].double().numpy() for a in (q, k, v, raw_g, raw_beta)]
            state = initial_state[index].transpose(-1, -2).double().numpy()[None]
            o_n, s_n = ref.kda_decode(*args, A_log.double().numpy(), dt_bias.double().numpy(), state,
                                      lower_bound=lower_bound)
            o[0, n] = torch.from_numpy(np.asarray(o_n)[0])
            initial_state[index] = torch.from_numpy(np.asarray(s_n)[0]).transpose(-1, -2).to(initial_state.dtype)
        return o, initial_state
    return fused_recurrent_kda


def _pool_inputs(layout: str):
    return SPECS["kda_decode_pool"].make(np.random.default_rng(11), B=4, S=6, H=2, K=8, V=4, padded=(1,),
                                         state_layout=layout)


@pytest.mark.parametrize("layout", [pytest.param("kv", id="kv"), pytest.param("vk", id="vk")])
def test_kda_decode_pool_mapping_through_vllm_contract(layout):
    import torch  # noqa: PLC0415 -- optional: marked torch

    inputs, kwargs = _pool_inputs(layout)
    o, pool = vllm_kda.decode_pool_core(_fused_recurrent_stand_in(), dtype=torch.float32)(**inputs, **kwargs)
    ro, rpool = reference_cores().kda_decode_pool(**inputs, **kwargs)
    live = np.asarray(inputs["slots"]) >= 0
    assert rel_rms(o[live], ro[live]) < tol("fp32_mix_mapping")
    np.testing.assert_array_equal(np.isnan(pool), np.isnan(rpool))
    assert rel_rms(np.nan_to_num(pool), np.nan_to_num(rpool)) < tol("fp32_mix_mapping")


def test_kda_decode_pool_mapping_without_vllms_padding_slot_fails():
    """The test above can fail: without the shift past vLLM's padding slot 0, the rows read their neighbours' states
    (and the one in slot 0 is skipped)."""
    import torch  # noqa: PLC0415 -- optional: marked torch

    inputs, kwargs = _pool_inputs("vk")
    core = vllm_kda.decode_pool_core(_fused_recurrent_stand_in(shift=0), dtype=torch.float32)
    o, _ = core(**inputs, **kwargs)
    ro, _ = reference_cores().kda_decode_pool(**inputs, **kwargs)
    live = np.asarray(inputs["slots"]) >= 0
    assert not rel_rms(np.nan_to_num(o[live]), ro[live]) < 100 * tol("fp32_mix_mapping")


def test_kda_decode_pool_refuses_another_scale():
    import torch  # noqa: PLC0415 -- optional: marked torch

    inputs, kwargs = _pool_inputs("vk")
    with pytest.raises(UnsupportedShape, match="fixes the scale"):
        vllm_kda.decode_pool_core(_fused_recurrent_stand_in(), dtype=torch.float32)(**inputs, **{**kwargs,
                                                                                                "scale": 0.5})


def test_vllm_kda_stubs():
    pytest.importorskip("triton", reason="the stubs re-export triton")
    stubs = vllm_kda.stubs()
    assert set(stubs) == {"vllm.platforms", "vllm.triton_utils", "vllm.utils.math_utils"}
    math_utils = stubs["vllm.utils.math_utils"]
    assert math_utils["cdiv"](9, 4) == 3 and math_utils["next_power_of_2"](9) == 16
    assert math_utils["RCP_LN2"] == pytest.approx(1.4426950408889634)
    assert stubs["vllm.platforms"]["current_platform"].is_arch_support_pdl() is False


KDA_SCRIPT = """
import json, warnings
import numpy as np
warnings.simplefilter("ignore")
from conformance.backends import vllm
from conformance.cases.engine_kda import SPECS
from k3ref.cores import reference_cores

cores = vllm.make_cores(reference_cores(), "vllm")
out = {}
for layout, lb in (("vk", -5.0), ("kv", None)):
    inputs, kw = SPECS["kda_decode_pool"].make(np.random.default_rng(5), B=3, S=5, H=2, K=16, V=8, padded=(2,),
                                               state_layout=layout, lower_bound=lb)
    o, pool = cores.kda_decode_pool(**inputs, **kw)
    ro, rpool = reference_cores().kda_decode_pool(**inputs, **kw)
    live = np.asarray(inputs["slots"]) >= 0
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    out[f"o-{layout}"] = rel(o[live], ro[live])
    out[f"pool-{layout}"] = rel(np.nan_to_num(pool), np.nan_to_num(rpool))
print(json.dumps(out))
"""


def test_vllm_kda_decode_under_the_interpreter(tmp_path):
    require_ready(vllm.refusal())
    script = tmp_path / "vllm_kda.py"
    script.write_text(textwrap.dedent(KDA_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for key, err in json.loads(done.stdout.strip().splitlines()[-1]).items():
        assert err < tol("bf16_kda_stand_in"), (key, err)


# ------------------------------------------------------------------------------------------------ vllm-ref: SiTU


def test_vllm_ref_stubs_bind_no_fused_op():
    import torch  # noqa: PLC0415 -- optional: marked torch

    platform = vllm_ref.StubCpuPlatform()
    assert not platform.is_cuda_alike() and not platform.is_xpu()
    assert platform.get_cpu_architecture() is vllm_ref.CpuArch.X86
    op = vllm_ref.custom_op_class()
    assert op.register("situ_and_mul")(int) is int
    assert isinstance(op(compile_native=False), torch.nn.Module)


class _SituStandIn:
    """SituAndMul's contract: [gate | up] -> beta tanh(gate / beta) sigmoid(gate) (linear_beta tanh(up / lb))."""

    def __init__(self, beta, linear_beta, swap=False):
        self.beta, self.linear_beta, self.swap = beta, linear_beta, swap

    def forward_native(self, x):
        import torch  # noqa: PLC0415 -- optional: marked torch

        d = x.shape[-1] // 2
        gate, up = x[..., :d].double(), x[..., d:].double()
        if self.swap:
            gate, up = up, gate
        gate = self.beta * torch.tanh(gate / self.beta) * torch.sigmoid(gate)
        if self.linear_beta is not None:
            up = self.linear_beta * torch.tanh(up / self.linear_beta)
        return gate * up


@pytest.mark.parametrize("swap, within", [pytest.param(False, True, id="mapped"),
                                          pytest.param(True, False, id="halves-swapped-fails")])
def test_situ_mapping_through_vllm_contract(swap, within):
    import torch  # noqa: PLC0415 -- optional: marked torch

    inputs, kwargs = CORE_SPECS["situ_glu"].make(np.random.default_rng(13), shape=(3, 37))
    core = vllm_ref.situ_core(lambda b, lb: _SituStandIn(b, lb, swap), dtype=torch.float64)
    out = core(**inputs, **kwargs)
    assert (rel_rms(out, reference_cores().situ_glu(**inputs, **kwargs)) < tol("fp32_mix_mapping")) is within


def test_vllm_eager_situ_from_the_wheel():
    """vLLM's own SituAndMul.forward_native, loaded with the stubs, agrees with the reference at bf16 and leaves no
    vllm module behind."""
    import torch  # noqa: PLC0415 -- optional: marked torch

    require_ready(vllm.refusal(triton=False))
    inputs, kwargs = CORE_SPECS["situ_glu"].make(np.random.default_rng(14), shape=(5, 203))
    out = vllm_ref.situ_core(vllm_ref.load_situ_and_mul(), dtype=torch.bfloat16)(**inputs, **kwargs)
    assert rel_rms(out, reference_cores().situ_glu(**inputs, **kwargs)) < tol("bf16_mix_stand_in")
    assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
