"""Engine-shaped cores: the heavy steps as serving engines hold them, in float64 reference form.

The cores of k3ref.cores follow the host graph (one sequence's state per batch row, one page size, the routed
experts one GEMV at a time). Engines lay the same math out differently, and a kernel is judged on the layout it
really has:

| core                | the engine's layout                                                              |
|---------------------|----------------------------------------------------------------------------------|
| kda_decode_pool     | KDA recurrent states in a pool indexed by slot; padded batch rows (slot -1)       |
| kda_conv_pool       | the short conv's last inputs in a pool indexed by slot, one decode step + SiLU    |
| kda_prefill_varlen  | variable-length prefill: sequences packed along one time axis (cu_seqlens)        |
| mla_decode_fp8      | absorbed MLA decode over an FP8 (e4m3) latent cache with per-group scales         |
| mla_prefill         | causal attention of the new tokens over their sequence (cu_seqlens_q / _k)        |
| moe_experts         | the routed experts fused: ids and weights -> every selected expert -> weighted sum|
| add_rmsnorm         | the residual add fused into the RMSNorm that follows it                          |

Each is written out here on its own terms and tested against the host-graph form it restates (float64, 1e-12).
The KDA cores take either state layout: "kv" ([K, V], k3ref's and fla's default) or "vk" ([V, K], FlashKDA's and
fla's transpose_state_layout). The adapters (`decode_through_pool`, `prefill_through_varlen`, `rmsnorm_through_add`)
express a host core through its engine-shaped core, so the model traces can run an engine's kernels
(conformance/cases/engine_routes.py).
"""
from k3ref.engine.kda import (
           decode_through_pool,
           kda_conv_pool,
           kda_decode_pool,
           kda_prefill_varlen,
           prefill_through_varlen,
)
from k3ref.engine.mla import mla_decode_fp8, mla_prefill
from k3ref.engine.moe import moe_experts, stack_experts
from k3ref.engine.norm import add_rmsnorm, rmsnorm_through_add

__all__ = ["add_rmsnorm", "decode_through_pool", "kda_conv_pool", "kda_decode_pool", "kda_prefill_varlen",
           "mla_decode_fp8", "mla_prefill", "moe_experts", "prefill_through_varlen", "rmsnorm_through_add",
           "stack_experts"]
