"""vLLM's eager SiTU-and-mul (`SituAndMul.forward_native` in vllm/model_executor/layers/activation.py: the path vLLM
runs on a CPU, and the reference its fused CUDA op `torch.ops._C.situ_and_mul` is tested against) as the `situ_glu`
core of the `vllm-ref` backend.

    SituAndMul(beta, linear_beta).forward_native(x)     x = [gate | up] along the last axis, [..., 2I]

computes beta tanh(gate / beta) sigmoid(gate) * linear_beta tanh(up / linear_beta) in fp32 and casts the result to
x's dtype (bf16 here). The core's (gate, up, beta, linear_beta) map onto it by concatenating gate and up; a
linear_beta of None skips the up cap in both.

activation.py's vLLM imports are stood in (engine_modules' rule; none is on forward_native's path):

| stub                                 | stands in for                          | what the module does with it        |
|--------------------------------------|----------------------------------------|-------------------------------------|
| `StubCustomOp`                       | vllm.model_executor.custom_op.CustomOp | base class and `register(name)`     |
| `StubCpuPlatform`, `CpuArch`         | vllm.platforms current_platform, enum  | no CUDA, no XPU: no fused op bound  |
| `vllm.ir`, `init_logger`, `LazyDict` | vLLM's IR ops, logger, lazy registry   | imported; the registries hold       |
|                                      |                                        | lambdas never called here           |
| `vllm.triton_utils`                  | vLLM's re-export of triton             | the real triton                     |
"""
from __future__ import annotations

import enum
import logging
from types import ModuleType

import numpy as np

from conformance.backends import engine_modules
from conformance.backends.engine_modules import EngineModule

ACTIVATION = "vllm/model_executor/layers/activation.py"


class CpuArch(enum.Enum):
    """vllm.platforms.CpuArchEnum's members the module reads."""

    X86 = "x86"
    ARM = "arm"
    POWERPC = "powerpc"


class StubCpuPlatform:
    """vllm.platforms.current_platform on a CPU: not CUDA-alike, not XPU (so SituAndMul binds no fused op), x86."""

    def is_cuda_alike(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def get_cpu_architecture(self) -> CpuArch:
        return CpuArch.X86


def custom_op_class():
    """vllm's CustomOp as a torch Module with `register(name)` (an identity decorator here) and the keyword its
    subclasses pass up (`compile_native`)."""
    import torch  # noqa: PLC0415 -- optional: built only where torch is

    class StubCustomOp(torch.nn.Module):
        def __init__(self, *, compile_native: bool = True, **_kwargs):
            super().__init__()

        @classmethod
        def register(cls, name: str):
            return lambda op_class: op_class

    return StubCustomOp


def activation_module() -> EngineModule:
    """vllm/model_executor/layers/activation.py with its imports stood in (the table above)."""
    import triton  # noqa: PLC0415 -- optional: the module decorates a Triton kernel as it loads
    import triton.language as tl  # noqa: PLC0415 -- optional, as above

    return EngineModule("vllm", ACTIVATION, {
        "vllm": {"ir": ModuleType("vllm.ir", "k3conf stub: vLLM's IR ops, unused by forward_native")},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.model_executor.custom_op": {"CustomOp": custom_op_class()},
        "vllm.platforms": {"CpuArchEnum": CpuArch, "current_platform": StubCpuPlatform()},
        "vllm.triton_utils": {"tl": tl, "triton": triton},
        "vllm.utils.collection_utils": {"LazyDict": dict},
    })


def situ_core(situ_and_mul_class, *, dtype):
    """The situ_glu core calling `situ_and_mul_class(beta, linear_beta).forward_native` (vLLM's class, or a
    stand-in with its contract) on [gate | up]."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    def situ_glu(gate, up, beta=4.0, linear_beta=25.0):
        x = torch.cat([torch.from_numpy(np.ascontiguousarray(a)) for a in (gate, up)], dim=-1).to(dtype)
        out = situ_and_mul_class(beta, linear_beta).forward_native(x)
        return out.detach().float().numpy()

    return situ_glu


def load_situ_and_mul():
    """vLLM's SituAndMul class from the installed wheel."""
    return engine_modules.load(activation_module()).SituAndMul
