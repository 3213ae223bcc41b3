"""SGLang's Triton KDA prefill (`chunk_kda` of its vendored fla, the path of its Triton KDA backend's `extend`) as
the `kda_prefill_varlen` core of the `sglang` backend.

SGLang 0.5.23 keeps a fork of flash-linear-attention under `sglang/kernels/ops/attention/fla/`; its KDA backend
(`sglang/srt/layers/attention/linear/kernels/kda_triton.py`) prefills with

    chunk_kda(q, k, v, g, beta, initial_state=ssm_states, initial_state_indices=cache_indices,
              use_qk_l2norm_in_kernel=True, cu_seqlens=query_start_loc, A_log, dt_bias, lower_bound, beta_is_raw)

on a state pool `ssm_states` [S, H, V, K] (V first) that the kernel updates in place at each sequence's slot.

| kda_prefill_varlen argument     | chunk_kda                                                                  |
|---------------------------------|----------------------------------------------------------------------------|
| q, k, v [1, T, H, *] (bf16)     | q, k, v; use_qk_l2norm_in_kernel=True (SGLang's l2norm, eps 1e-6)          |
| g_raw [1, T, H, K]              | g, the raw gate: A_log [H] and dt_bias [H*K] given, so the kernel applies  |
|                                 | lower_bound * sigmoid(exp(A_log) (g + dt_bias)) (or, lower_bound None,     |
|                                 | -exp(A_log) softplus(g + dt_bias))                                         |
| beta_raw [1, T, H]              | beta with beta_is_raw=True (the sigmoid in the kernel)                     |
| state_pool, layout "vk"         | initial_state as is (fp32), updated in place; the returned pool is it      |
| state_pool, layout "kv"         | the adapter hands the kernel the pool transposed to V first and back       |
| cu_seqlens [N+1], slots [N]     | cu_seqlens (int64), initial_state_indices (int32)                          |

The model traces reach this core through k3ref.engine.kda.prefill_through_varlen (the host graph's kda_prefill
packed along one time axis). SGLang's Triton KDA decode (`fused_sigmoid_gating_delta_rule_update`) uses inline PTX
(`ex2.approx`) and runs on an NVIDIA GPU only: not adapted here.

The fla fork's modules import each other by absolute name and five SGLang helpers; engine_modules.EnginePackage
stands the package in over the wheel's folder and those helpers in by STUBS (none is on the judged path's math).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from conformance.backends import engine_modules
from conformance.backends.engine_modules import EnginePackage
from k3ref.cores import require_supported

PACKAGE_NAME = "sglang.kernels.ops.attention.fla"
STATE_LAYOUTS = ("kv", "vk")


class CudaGraphNames:
    """sglang.srt.model_executor.cuda_graph_config's Backend / Phase, as names only: read by the gated RMSNorm's
    CUDA-graph check, which the prefill never calls."""


def _torch_release() -> tuple[int, ...]:
    import torch  # noqa: PLC0415 -- optional: built only where the kernels run

    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def stubs() -> dict[str, dict]:
    """The SGLang helpers the fla fork imports, stood in for a CPU (or a GPU without SGLang's JIT runtime)."""
    import triton  # noqa: PLC0415 -- optional: built only where the kernels run

    def cdiv(a: int, b: int) -> int:
        return -(a // -b)

    def never(*_args, **_kwargs):
        return False

    return {
        "sglang.srt.utils.common": {"torch_release": _torch_release()},
        "sglang.srt.utils": {"cdiv": cdiv, "cpu_has_amx_support": never, "device_context": None, "is_cpu": never,
                             "is_npu": never, "next_power_of_2": triton.next_power_of_2},
        "sglang.kernels.jit.utils": {"get_jit_cuda_arch": lambda: None, "is_arch_support_pdl": never},
        "sglang.srt.batch_invariant_ops": {"is_batch_invariant_mode_enabled": never},
        "sglang.srt.model_executor.cuda_graph_config": {"Backend": CudaGraphNames, "Phase": CudaGraphNames,
                                                        "check_cuda_graph_backend": never},
    }


def load_kda():
    """SGLang's fla fork's `kda` module (chunk_kda) from the installed wheel."""
    return engine_modules.load_from_package(EnginePackage("sglang", PACKAGE_NAME, stubs()), "kda")


def varlen_core(chunk_kda: Callable, *, dtype, device: str = "cpu") -> Callable:
    """The kda_prefill_varlen core calling `chunk_kda` (SGLang's, or a stand-in with its keyword arguments)."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    def tensor(a, dt):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)

    def kda_prefill_varlen(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, cu_seqlens, slots, *,
                           lower_bound=-5.0, scale=None, state_layout="kv"):
        require_supported(state_layout in STATE_LAYOUTS, f"state_layout: expected one of {STATE_LAYOUTS}, found "
                          f"{state_layout!r}")
        pool = tensor(state_pool, torch.float32)
        pool = pool.transpose(-1, -2).contiguous() if state_layout == "kv" else pool.clone()
        f32 = torch.float32
        o = chunk_kda(q=tensor(q, dtype), k=tensor(k, dtype), v=tensor(v, dtype), g=tensor(g_raw, dtype),
                      beta=tensor(beta_raw, dtype), scale=scale, initial_state=pool,
                      initial_state_indices=tensor(slots, torch.int32), use_qk_l2norm_in_kernel=True,
                      cu_seqlens=tensor(cu_seqlens, torch.int64), A_log=tensor(A_log, f32),
                      dt_bias=tensor(dt_bias, f32), lower_bound=lower_bound, beta_is_raw=True)
        out_pool = pool.transpose(-1, -2) if state_layout == "kv" else pool
        return o.detach().float().cpu().numpy(), out_pool.detach().float().cpu().numpy()

    return kda_prefill_varlen
