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

from conformance.backends import engines, registry, sglang, vllm
from conformance.cases.core_data import BUILDERS
from k3ref.attnres import attnres_mix
from tests.conformance.test_engines_sglang import needs
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
from conformance.cases.core_data import BUILDERS
from k3ref.attnres import attnres_mix

out = {}
for name in vllm.NAMES:
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
    needs(vllm.refusal())
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
        assert vllm.make_backend(name).kernel_cores() == frozenset({"attnres_mix"})
    monkeypatch.setattr(vllm.engine_modules, "installed_version", lambda dist: "0.31.0")
    assert "0.31.0 is not a version this adapter was measured on" in vllm.refusal()
