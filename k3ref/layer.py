"""The layer schedule of the K3 decoder: which mixer and which MLP each layer runs, and the AttnRes blocks.

Layer l (0-indexed) is MLA iff l + 1 is in `full_attn_layers` (1-indexed, as published), else KDA; its MLP
is dense iff l < first_k_dense_replace, else LatentMoE. Block AttnRes starts a new block at every l with
l % attn_res_block_size == 0 (docs/spec.md section 2.2 and 3.6). For k3: 69 KDA + 24 MLA, MLA at 3, 7, ..., 91, 92.
"""
from __future__ import annotations

import dataclasses
import enum

from .config import K3Config


class MixerKind(enum.Enum):
    """The token mixer of a layer."""

    KDA = "kda"   # Kimi Delta Attention (linear, recurrent state)
    MLA = "mla"   # gated NoPE multi-head latent attention (paged latent cache)


class MlpKind(enum.Enum):
    """The channel MLP of a layer."""

    DENSE = "dense"             # SiTU-GLU, `mlp.{gate,up,down}_proj`
    LATENT_MOE = "latent_moe"   # `block_sparse_moe.*`


@dataclasses.dataclass(frozen=True)
class K3LayerSpec:
    """One decoder layer: its 0-indexed position, mixer and MLP."""

    index: int
    mixer: MixerKind
    mlp: MlpKind


@dataclasses.dataclass(frozen=True)
class K3Graph:
    """The whole schedule: `layers` (one K3LayerSpec each) and `block_starts` (0-indexed AttnRes boundaries)."""

    layers: tuple[K3LayerSpec, ...]
    block_starts: tuple[int, ...]
    block_size: int

    @classmethod
    def from_config(cls, cfg: K3Config) -> K3Graph:
        """Build the schedule of `cfg` (see the module docstring for the rules)."""
        layers = tuple(
            K3LayerSpec(
                index=i,
                mixer=MixerKind.MLA if cfg.is_mla(i) else MixerKind.KDA,
                mlp=MlpKind.DENSE if cfg.mlp_is_dense(i) else MlpKind.LATENT_MOE,
            )
            for i in range(cfg.num_hidden_layers)
        )
        bs = cfg.attn_res_block_size
        return cls(layers=layers, block_starts=tuple(range(0, cfg.num_hidden_layers, bs)), block_size=bs)

    def __len__(self) -> int:
        return len(self.layers)

    def indices(self, mixer: MixerKind | None = None, mlp: MlpKind | None = None) -> tuple[int, ...]:
        """0-indexed layers with the given mixer and/or MLP kind."""
        return tuple(s.index for s in self.layers
                     if (mixer is None or s.mixer is mixer) and (mlp is None or s.mlp is mlp))

    def counts(self) -> dict[str, int]:
        """{'kda': n, 'mla': n, 'dense': n, 'latent_moe': n}."""
        out = {k.value: 0 for k in (*MixerKind, *MlpKind)}
        for s in self.layers:
            out[s.mixer.value] += 1
            out[s.mlp.value] += 1
        return out
