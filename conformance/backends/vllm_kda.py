"""vLLM's Triton KDA decode (`fused_recurrent_kda` of vllm/models/kimi_k3/nvidia/ops/third_party/kda) as the
`kda_decode_pool` core of the `vllm` backend.

vLLM decodes K3's KDA heads with

    fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                        ssm_state_indices)

on one packed time axis (B = 1, one token per sequence, cu_seqlens = 0..N), the state pool `initial_state`
[S, H, V, K] (V first) updated in place at `ssm_state_indices`; the gate and the beta sigmoid are applied in the
kernel, the L2 norms too, and the scale is fixed at K^-0.5. vLLM reserves pool slot 0 as its padding slot: the kernel
skips a sequence whose index is <= 0. The adapter keeps the core's contract by handing the kernel the pool with one
extra slot in front and every index shifted by one (a padded row, slot -1, becomes index 0):

| kda_decode_pool argument           | fused_recurrent_kda                                                       |
|------------------------------------|---------------------------------------------------------------------------|
| q, k, g_raw [B, H, K], v [B, H, V] | q, k, raw_g [1, B, H, K], v [1, B, H, V] (bf16); cu_seqlens 0, 1, .., B;  |
|                                    | q, k, v views of one [1, B, H (2K + V)] row (the kernel asserts that they |
|                                    | share the token stride, as vLLM's fused projection output does)          |
| beta_raw [B, H]                    | raw_beta [1, B, H] (the sigmoid in the kernel)                            |
| A_log [H], dt_bias [H*K] (fp32)    | A_log, dt_bias; lower_bound as given (None: Kimi Linear's softplus gate)  |
| state_pool "vk" [S, H, V, K]       | initial_state: [pad slot; the pool] (fp32), updated in place              |
| state_pool "kv" [S, H, K, V]       | the same, transposed to V first by the adapter and back                   |
| slots [B] (-1 padded)              | ssm_state_indices = slots + 1 (int32)                                     |
| scale                              | None or K^-0.5 only (vLLM fixes it); another is an UnsupportedShape       |

The model traces reach this core through k3ref.engine.kda.decode_through_pool. The module imports vLLM's own fla
fork (`vllm/third_party/flash_linear_attention/ops/op.py` and its `utils`); both packages are stood in over the
wheel's folders (engine_modules.EnginePackage) with the vLLM helpers in STUBS.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from conformance.backends import engine_modules
from conformance.backends.engine_modules import EnginePackage
from k3ref.cores import require_supported

KDA_PACKAGE = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
FLA_PACKAGE = "vllm.third_party.flash_linear_attention.ops"
STATE_LAYOUTS = ("kv", "vk")


class StubPlatform:
    """vllm.platforms.current_platform as the fla fork asks it: CUDA-alike only on a CUDA GPU, no programmatic
    dependent launch (a Hopper+ feature the interpreter lacks)."""

    def is_cuda_alike(self) -> bool:
        import torch  # noqa: PLC0415 -- optional: built only where the kernels run

        return bool(torch.cuda.is_available())

    def is_arch_support_pdl(self) -> bool:
        return False


def stubs() -> dict[str, dict]:
    """The vLLM helpers the KDA module and the fla fork import."""
    import triton  # noqa: PLC0415 -- optional: built only where the kernels run
    import triton.language as tl  # noqa: PLC0415 -- optional, as above
    import triton.language.extra.libdevice as tldevice  # noqa: PLC0415 -- optional, as above

    def cdiv(a: int, b: int) -> int:
        return -(a // -b)

    return {
        "vllm.platforms": {"current_platform": StubPlatform()},
        "vllm.triton_utils": {"tl": tl, "triton": triton, "tldevice": tldevice},
        "vllm.utils.math_utils": {"cdiv": cdiv, "next_power_of_2": triton.next_power_of_2,
                                  "RCP_LN2": 1.0 / math.log(2.0)},
    }


def load_fused_recurrent():
    """vLLM's KDA `fused_recurrent` module, its fla fork's `op` loaded first (it is imported by absolute name)."""
    stand_ins = stubs()
    engine_modules.load_from_package(EnginePackage("vllm", FLA_PACKAGE, stand_ins), "op")
    return engine_modules.load_from_package(EnginePackage("vllm", KDA_PACKAGE, stand_ins), "fused_recurrent")


def decode_pool_core(fused_recurrent_kda: Callable, *, dtype, device: str = "cpu") -> Callable:
    """The kda_decode_pool core calling `fused_recurrent_kda` (vLLM's, or a stand-in with its arguments)."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    def tensor(a, dt):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)

    def kda_decode_pool(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slots, *, lower_bound=-5.0,
                        scale=None, state_layout="kv"):
        require_supported(state_layout in STATE_LAYOUTS, f"state_layout: expected one of {STATE_LAYOUTS}, found "
                          f"{state_layout!r}")
        K = np.shape(q)[-1]
        require_supported(scale is None or math.isclose(scale, K ** -0.5),
                          f"vLLM's KDA decode fixes the scale at K^-0.5 = {K ** -0.5:.6g}; found {scale}")
        pool = tensor(state_pool, torch.float32)
        pool = pool.transpose(-1, -2) if state_layout == "kv" else pool
        padded = torch.cat([torch.zeros_like(pool[:1]), pool]).contiguous()      # vLLM's slot 0: padding
        B, H, V = np.shape(v)
        f32 = torch.float32
        # one token row holding q, k and v, as vLLM's fused projection hands them over: the kernel wants the three
        # to share their token stride
        row = torch.cat([tensor(a, dtype).reshape(B, -1) for a in (q, k, v)], dim=1)[None]
        qkv = torch.split(row, [H * K, H * K, H * V], dim=-1)
        q_, k_, v_ = (part.unflatten(-1, (H, -1)) for part in qkv)
        o, _ = fused_recurrent_kda(
            q=q_, k=k_, v=v_,
            raw_g=tensor(g_raw, dtype)[None], raw_beta=tensor(beta_raw, dtype)[None], A_log=tensor(A_log, f32),
            dt_bias=tensor(dt_bias, f32), lower_bound=lower_bound, initial_state=padded,
            cu_seqlens=torch.arange(B + 1, dtype=torch.int32, device=device),
            ssm_state_indices=tensor(np.asarray(slots) + 1, torch.int32))
        new = padded[1:]
        new = new.transpose(-1, -2) if state_layout == "kv" else new
        return o[0].detach().float().cpu().numpy(), new.detach().float().cpu().numpy()

    return kda_decode_pool
