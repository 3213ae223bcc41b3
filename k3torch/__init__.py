"""A PyTorch reading of the Kimi K3 spec written from docs/spec.md alone: the math cores and the text model.

    from k3torch import K3ForCausalLM
    model = K3ForCausalLM.from_pretrained("ckpt/", dtype=torch.float32)
    model.generate([5, 17, 3], max_new_tokens=8)

- `cores` (with `checks`): every math core of docs/interfaces.md, numpy in and out, at fp64, fp32 or bf16;
- `configuration_k3` (K3Config from config.json), `modeling_k3` (the nn.Modules, the cache, generate, the
  `Wiring` switches), `loading` (safetensors checkpoints, strict);
- `trace`: the conformance traces through the model (prefill, teacher-forced decode, every intermediate).

The package needs torch (importing it without torch raises ImportError) and imports nothing of k3ref, k3cuda
or conformance, so that its agreement with k3ref means two independent readings agree. The judge's side of
it lives in conformance.backends.pytorch and conformance.backends.torch_model. See docs/torch_model.md.
"""
from __future__ import annotations

from k3torch.bundle import TIMEABLE, all_cores, torch_core
from k3torch.configuration_k3 import K3Config
from k3torch.cores import TorchCore
from k3torch.loading import CheckpointMismatch, load_checkpoint, load_weights
from k3torch.modeling_k3 import K3ForCausalLM, Wiring
from k3torch.trace import GoldenFeed, RouteForcing, build_model, run_trace

__all__ = ["K3Config", "K3ForCausalLM", "Wiring", "load_checkpoint", "load_weights", "CheckpointMismatch",
           "TorchCore", "TIMEABLE", "torch_core", "all_cores", "build_model", "run_trace", "GoldenFeed",
           "RouteForcing"]
