"""A PyTorch Kimi K3 text model written from DESIGN.md alone: the second form of the host graph's wiring.

    from k3torch import K3ForCausalLM
    model = K3ForCausalLM.from_pretrained("ckpt/", dtype=torch.float32)
    model.generate([5, 17, 3], max_new_tokens=8)

`configuration_k3` (K3Config from config.json), `modeling_k3` (the nn.Modules, the cache, generate, the
`Wiring` switches), `loading` (safetensors checkpoints, strict) import nothing of k3ref. `trace` runs the
conformance traces through the model (the `torch-model` backends) and checks a trace golden at regeneration.
Importing this package does not import torch; the names below load on first use. See docs/torch_model.md.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "K3Config": "configuration_k3",
    "K3ForCausalLM": "modeling_k3",
    "Wiring": "modeling_k3",
    "load_checkpoint": "loading",
    "load_weights": "loading",
    "CheckpointMismatch": "loading",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
