"""vLLM's Block AttnRes Triton kernels, as shipped in its wheel, as the `attnres_mix` core.

vLLM (PyPI `vllm`, MEASURED_VLLM) keeps K3's code under `vllm/models/kimi_k3/`; the AttnRes op is one Triton
kernel per token with an online softmax over the sources, tiled BLOCK_L at a time (4 for decode batches under 256
tokens with two or more blocks, else 1), the output RMSNorm optionally fused:

| backend     | engine code judged                                             | runs here as                        |
|-------------|----------------------------------------------------------------|-------------------------------------|
| `vllm`      | `vllm/models/kimi_k3/nvidia/ops/attn_res.py`: `attn_res`, its  | Triton under the interpreter (CPU), |
|             | Triton path (on SM100 with CUDA 13 vLLM calls a native op);    | compiled on a GPU; any H            |
|             | and its Triton KDA decode as `kda_decode_pool` (vllm_kda)      |                                     |
| `vllm-rocm` | `vllm/models/kimi_k3/amd/ops/attn_res.py`: `attn_res` (the     | the same                            |
|             | same kernel with an optional FP8 output, off here)             |                                     |

The call: `attn_res(prefix [T, H], None, blocks [T, NB, H], norm_weight [H], qk_weight [H], None, num_blocks,
-1, eps, 0.0)`: the bank layout of SGLang's (conformance.backends.sglang.mix_call: the S - 1 completed blocks
token-major, the prefix last), no pending delta, no bank write, no output norm (outside the `attnres_mix` core).

The module's vLLM imports are stood in (conformance.backends.engine_modules' named-stub rule):

| stub                                   | stands in for                          | used on the judged path            |
|----------------------------------------|----------------------------------------|------------------------------------|
| `vllm.triton_utils`: tl, triton        | vLLM's re-export of triton             | the real triton, as re-exported    |
| `vllm.platforms.current_platform`      | the platform object                    | SM100 family: no; PDL: no          |
| `vllm._custom_ops`                     | the native ops (CUDA 13 builds)        | never (reached on SM100 only)      |
| `...quant_utils.get_fp8_min_max`       | the FP8 range (ROCm kernel's FP8 out)  | never (no FP8 output asked)        |

vLLM's own eager references (the fp32 latent MoE returning every intermediate, the naive KDA recurrence) live in its
repository's tests/, not in the wheel, so no `vllm-ref` backend is built from the wheel.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable

from conformance.backends import (
    engine_modules,
    sglang,
    triton_engine_bridges,
    triton_interpreter,
    vllm_kda,
    vllm_ref,
)
from conformance.backends.engine_modules import EngineModule
from conformance.backends.sglang import EngineBackend, MixCall
from k3ref.cores import Cores

DIST = "vllm"
MEASURED_VLLM = ("0.33.0",)
TRITON_NAMES = ("vllm", "vllm-rocm")     # the backends of vLLM's Triton kernels
NAMES = (*TRITON_NAMES, "vllm-ref")
KERNEL_CORES = frozenset({"attnres_mix"})
KERNELS_OF = {"vllm": KERNEL_CORES | {"kda_decode_pool"}, "vllm-rocm": KERNEL_CORES,
              "vllm-ref": frozenset({"situ_glu"})}
FILES = {"vllm": "vllm/models/kimi_k3/nvidia/ops/attn_res.py", "vllm-rocm": "vllm/models/kimi_k3/amd/ops/attn_res.py"}


class NoNativeOps:
    """vllm._custom_ops stood in: vLLM calls its native AttnRes op only on SM100 with CUDA 13; reaching it here is a
    mapping error."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"vllm._custom_ops.{name}: the native ops are not loaded (a vLLM CUDA 13 build on SM100); "
                           "the adapter judges vLLM's Triton path")


@dataclasses.dataclass(frozen=True)
class StubPlatform:
    """vllm.platforms.current_platform for the Triton path: not the SM100 family (so the native op is not taken),
    no programmatic dependent launch (a Hopper+ CUDA feature the interpreter lacks)."""

    def is_device_capability_family(self, family: int) -> bool:
        return False

    def is_arch_support_pdl(self) -> bool:
        return False


def fp8_min_max() -> tuple[float, float]:
    """get_fp8_min_max stood in: the ROCm kernel reads it only for an FP8 output, which the adapter never asks."""
    raise RuntimeError("get_fp8_min_max: the adapter asks vLLM's AttnRes for no FP8 output")


def attn_res_module(name: str) -> EngineModule:
    """vLLM's attn_res.py for the backend `name` with its imports stood in (the table above)."""
    import triton  # noqa: PLC0415 -- optional: only a backend that runs the kernel builds this
    import triton.language as tl  # noqa: PLC0415 -- optional, as above

    stubs: dict[str, dict] = {"vllm.triton_utils": {"tl": tl, "triton": triton}}
    if name == "vllm":
        stubs["vllm"] = {"_custom_ops": NoNativeOps()}
        stubs["vllm.platforms"] = {"current_platform": StubPlatform()}
    else:
        stubs["vllm.model_executor.layers.quantization.utils.quant_utils"] = {"get_fp8_min_max": fp8_min_max}
    return EngineModule(DIST, FILES[name], stubs)


def refusal(triton: bool = True) -> str | None:
    """None when torch, the measured vllm and (triton=True: a bridged; False: any) triton are installed; else why
    not."""
    fix = "pip install --no-deps -r requirements-engines.txt"
    if sglang.importlib_missing("torch"):
        return "PyTorch is not installed (vLLM's kernels are torch + Triton): pip install torch"
    version = engine_modules.installed_version(DIST)
    if version is None:
        return f"vllm is not installed: {fix}"
    if version not in MEASURED_VLLM:
        return f"vllm {version} is not a version this adapter was measured on ({', '.join(MEASURED_VLLM)}): {fix}"
    if not triton:      # activation.py imports triton (it decorates a kernel) though the eager path never runs it
        return "triton is not installed: pip install --no-deps -r requirements-fla.txt" \
            if sglang.importlib_missing("triton") else None
    return triton_interpreter.triton_refusal()


def available() -> tuple[bool, str]:
    """(True, where vLLM's Triton kernel runs) or (False, why not)."""
    why = refusal()
    if why:
        return False, why
    version = engine_modules.installed_version(DIST)
    if version is None:
        return False, "vllm is not installed"
    if sglang._cuda():
        return True, f"vllm {version}: Triton (GPU)"
    return True, f"vllm {version}: {sglang.TRITON_INTERPRETED}; {triton_interpreter.INTERPRETER_LIMITS}"


def kernel_run(attn_res) -> sglang.MixFn:
    """vLLM's attn_res on SGLang's call layout: no delta, no bank write, no output norm."""
    def run(call: MixCall):
        qk = call.score_proj.weight.reshape(-1).contiguous()
        return attn_res.attn_res(call.prefix_sum, None, call.bank, call.score_norm.weight, qk, None, call.nvb, -1,
                                 call.score_norm.variance_epsilon, 0.0)
    return run


def load_kernel(name: str):
    """vLLM's attn_res module for `name`, under Triton's interpreter with its bridges when there is no GPU."""
    if not sglang._cuda():
        os.environ[triton_interpreter.ENV] = "1"
        for bridge in triton_interpreter.TRITON_BRIDGES:
            bridge()
    module = engine_modules.load(attn_res_module(name))
    if not sglang._cuda() and not triton_interpreter.interpreted(module._attn_res_kernel):
        raise RuntimeError("vLLM's AttnRes kernel was decorated compiled in this process before TRITON_INTERPRET=1 "
                           "was set; run the vllm backends in a fresh process")
    return module


def make_cores(base: Cores, name: str) -> Cores:
    """`base` with attnres_mix on vLLM's Triton kernel of the backend `name`, and for `vllm` kda_decode_pool on its
    Triton KDA decode (conformance.backends.vllm_kda)."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    if name == "vllm-ref":
        return base.replace(situ_glu=vllm_ref.situ_core(vllm_ref.load_situ_and_mul(), dtype=torch.bfloat16))
    device = "cuda" if sglang._cuda() else "cpu"
    core = sglang.mix_core(kernel_run(load_kernel(name)), dtype=torch.bfloat16, device=device)
    if name != "vllm":
        return base.replace(attnres_mix=core)
    fused_recurrent = vllm_kda.load_fused_recurrent()
    if device == "cpu":
        triton_engine_bridges.engine_bridges(
            m for n, m in list(sys.modules.items())
            if m is not None and n.startswith((vllm_kda.FLA_PACKAGE + ".", vllm_kda.KDA_PACKAGE + ".")))
    decode = vllm_kda.decode_pool_core(fused_recurrent.fused_recurrent_kda, dtype=torch.bfloat16, device=device)
    return base.replace(attnres_mix=core, kda_decode_pool=decode)


RAN = {"vllm": "attnres_mix ran vllm's attn_res Triton kernel (kimi_k3/nvidia/ops/attn_res.py), kda_decode_pool "
                "its fused_recurrent_kda (kimi_k3/nvidia/ops/third_party/kda)",
       "vllm-rocm": "attnres_mix ran vllm's attn_res Triton kernel (kimi_k3/amd/ops/attn_res.py)",
       "vllm-ref": "situ_glu ran vllm's SituAndMul.forward_native (eager torch, bf16)"}
# backend -> case glob -> why it fails, as measured (docs/engines.md)
EXPECTED_FINDINGS: dict[str, dict[str, str]] = {
    **{name: {} for name in TRITON_NAMES},
    "vllm-ref": {},
}


def make_backend(name: str) -> EngineBackend:
    """One of NAMES, bf16."""
    if name not in NAMES:
        raise ValueError(f"vllm backend: expected one of {NAMES}, found {name!r}")
    if name == "vllm-ref":
        return EngineBackend(name, "bf16", lambda base: make_cores(base, name), is_available=available_ref,
                             known_cores=KERNELS_OF[name], ran=RAN[name])
    device = "cuda" if not sglang.importlib_missing("torch") and sglang._cuda() else "cpu"
    ran = RAN[name] + ("" if device == "cuda" else f", {sglang.TRITON_INTERPRETED}")
    return EngineBackend(name, "bf16", lambda base: make_cores(base, name), is_available=available, device=device,
                         known_cores=KERNELS_OF[name], ran=ran)


def available_ref() -> tuple[bool, str]:
    """vllm-ref's available(): vLLM's eager torch code on the CPU."""
    why = refusal(triton=False)
    return (False, why) if why else (True, f"vllm {engine_modules.installed_version(DIST)}: its eager torch "
                                           "SituAndMul on the CPU")


def factory(name: str) -> Callable[[], EngineBackend]:
    """The registry's factory of the backend `name` (built on first use)."""
    return lambda: make_backend(name)

