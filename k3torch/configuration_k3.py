"""K3Config of the PyTorch model: the text-decoder geometry, read from a checkpoint's `config.json`.

Written for this model alone (it shares no code with k3ref's config): the published spelling is read
(the multimodal wrapper `{"text_config": {...}}` or a plain text config; `num_experts`, `num_experts_per_token`,
`num_shared_experts`, `num_expert_group`, `moe_renormalize`, `activation_situ_beta`,
`activation_situ_linear_beta`; `linear_attn_config: {full_attn_layers, num_heads, head_dim,
short_conv_kernel_size, use_full_rank_gate, gate_lower_bound}`), and so are the DeepSeek-style field names
(`n_routed_experts`, `num_experts_per_tok`, ...). Layers in `full_attn_layers` are 1-indexed, as published.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# published key -> field, for the keys whose spelling differs from the field name
_ALIASES = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
    "activation_situ_beta": "situ_beta",
    "activation_situ_linear_beta": "situ_linear_beta",
}
# keys of `linear_attn_config` -> field
_LINEAR_ATTN = {
    "full_attn_layers": "full_attn_layers",
    "num_heads": "kda_num_heads",
    "head_dim": "kda_head_dim",
    "short_conv_kernel_size": "short_conv_kernel_size",
    "use_full_rank_gate": "use_full_rank_gate",
    "gate_lower_bound": "gate_lower_bound",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class K3Config:
    """The K3 text decoder's geometry (docs/spec.md section 2). Fields without a default are required."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    full_attn_layers: tuple[int, ...]        # 1-indexed MLA layers
    first_k_dense_replace: int = 1
    intermediate_size: int
    # gated NoPE MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = True
    gate_lower_bound: float | None = -5.0
    a_log_size: int | None = None            # A_log's stored length (K3 pads 96 heads to 128); None: max(128, H)
    # Stable LatentMoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    latent_moe_use_norm: bool = True
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # SiTU and Block AttnRes
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    attn_res_block_size: int = 12

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_attn_layers", tuple(int(i) for i in self.full_attn_layers))
        a_log_size = max(128, self.kda_num_heads) if self.a_log_size is None else self.a_log_size
        object.__setattr__(self, "a_log_size", a_log_size)
        bad = [i for i in self.full_attn_layers if not 1 <= i <= self.num_hidden_layers]
        if bad:
            raise ValueError(f"config: full_attn_layers {bad} out of range 1..{self.num_hidden_layers} (1-indexed)")
        if a_log_size < self.kda_num_heads:
            raise ValueError(f"config: a_log_size={self.a_log_size} is smaller than kda_num_heads="
                             f"{self.kda_num_heads}")
        for name in ("routed_expert_hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 32:
                raise ValueError(f"config: {name}={getattr(self, name)} must be a multiple of 32 (MXFP4 group)")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"config: n_routed_experts={self.n_routed_experts} is not divisible by "
                             f"n_group={self.n_group}")

    @property
    def stored_a_log_size(self) -> int:
        """A_log's length in the checkpoint: `a_log_size` as __post_init__ resolved it (never None)."""
        return self.a_log_size or max(128, self.kda_num_heads)

    def is_mla(self, layer: int) -> bool:
        """0-indexed layer `layer` is MLA iff layer + 1 is in full_attn_layers."""
        return layer + 1 in self.full_attn_layers

    def is_dense(self, layer: int) -> bool:
        """Layers 0 .. first_k_dense_replace - 1 have the dense SiTU MLP; the rest the LatentMoE."""
        return layer < self.first_k_dense_replace

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> K3Config:
        """A config from a parsed config.json (wrapper or text config, published or flat spelling)."""
        if "text_config" in raw:
            raw = raw["text_config"]
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}

        def put(field: str, value: Any, key: str) -> None:
            if field in kwargs and kwargs[field] != value:
                raise ValueError(f"config: {key}={value!r} disagrees with {field}={kwargs[field]!r}")
            kwargs[field] = value

        for key, value in raw.items():
            if key in names:
                put(key, value, key)
            elif key in _ALIASES:
                put(_ALIASES[key], value, key)
        for key, field in _LINEAR_ATTN.items():
            if key in (raw.get("linear_attn_config") or {}):
                put(field, raw["linear_attn_config"][key], f"linear_attn_config.{key}")
        if raw.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError(f"config: moe_router_activation_func: expected 'sigmoid', found "
                             f"{raw['moe_router_activation_func']!r}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in kwargs)
        if missing:
            raise ValueError(f"config: missing field(s) {missing}")
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> K3Config:
        """Read `path` (a config.json, or a checkpoint directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"config: cannot read {path}: {e}") from e
        return cls.from_dict(raw)
