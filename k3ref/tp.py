"""Tensor-parallel plan for K3: how every checkpoint tensor splits over `tp` ranks, and what a rank holds.

Split kinds (axis is that of the stored [out, in] weight):
- column: split the out axis (0) into tp contiguous chunks, heads kept whole and contiguous
  (KDA q/k/v/conv/dt_bias/f_b/b/g, MLA q_b/kv_b/g). A_log is split on its first H entries (the heads) and
  each rank's chunk is zero-padded back to a_log_size, so a rank's tensors have the shapes of
  `inventory(plan.local_config())`.
- row: split the in axis (1) (o_proj of both mixers): each rank's output is a partial sum (all-reduce).
- replicated: whole on every rank (norms, AttnRes, the low-rank q_a / kv_a / f_a inputs and so the MLA
  latent cache, the dense and shared MLPs, the router and the latent projections - as the users asked).
- expert: routed experts are expert-parallel: each expert whole (full widths, as the users asked) on exactly
  one rank; rank r holds experts [r c, (r+1) c) with c = ceil(E / tp). A rank sums the routed contributions of
  the experts it holds into a partial latent y_lat; the all-reduce completes y_lat before the routed norm.
- vocab: embed_tokens / lm_head rows in tp chunks of ceil(V / tp) (the last rank may hold fewer).
Rank-local head counts are H / tp for KDA and MLA; `cfg.validate_tp(tp)` must pass.
"""
from __future__ import annotations

import dataclasses
import math

from typing import NamedTuple

import numpy as np

from .config import K3Config
from .weights import DTYPE_BYTES, LM_HEAD, TEXT_PREFIX, TensorSpec, inventory, is_routed_expert

SPLIT_KINDS = ("column", "row", "replicated", "expert", "vocab")
GROUPS = ("attention", "mlp", "experts", "embeddings", "norms")

# self_attn.* local names -> split kind (anything not listed there is replicated).
_ATTN_SPLIT = {
    # KDA
    "q_proj.weight": "column", "k_proj.weight": "column", "v_proj.weight": "column",
    "q_conv1d.weight": "column", "k_conv1d.weight": "column", "v_conv1d.weight": "column",
    "A_log": "column", "dt_bias": "column", "f_b_proj.weight": "column", "b_proj.weight": "column",
    "g_b_proj.weight": "column",
    # both: per-head gate out, per-head o_proj in
    "g_proj.weight": "column", "o_proj.weight": "row",
    # MLA
    "q_b_proj.weight": "column", "kv_b_proj.weight": "column",
}


class TpEntry(NamedTuple):
    """How one tensor is split: kind, the split axis (None if not split), full and rank-0 local shapes."""

    spec: TensorSpec
    kind: str
    axis: int | None
    local_shape: tuple[int, ...]
    group: str

    @property
    def local_bytes(self) -> int:
        return math.prod(self.local_shape) * DTYPE_BYTES[self.spec.dtype]


def split_kind(name: str) -> str:
    """The split kind of a full checkpoint name (see the module docstring)."""
    if is_routed_expert(name):
        return "expert"
    if name in (TEXT_PREFIX + "embed_tokens.weight", LM_HEAD):
        return "vocab"
    if ".self_attn." in name:
        return _ATTN_SPLIT.get(name.split(".self_attn.", 1)[1], "replicated")
    return "replicated"


def group_of(name: str) -> str:
    """Memory group of a tensor: attention | mlp | experts | embeddings | norms (norms + AttnRes)."""
    if is_routed_expert(name):
        return "experts"
    if name in (TEXT_PREFIX + "embed_tokens.weight", LM_HEAD):
        return "embeddings"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name or ".block_sparse_moe." in name:
        return "mlp"
    return "norms"


class TpPlan:
    """The tensor-parallel plan of `cfg` over `tp` ranks: `entries[name] -> TpEntry`, sizes, and shard()."""

    def __init__(self, cfg: K3Config, tp: int):
        cfg.validate_tp(tp)
        self.cfg, self.tp = cfg, tp
        self.entries: dict[str, TpEntry] = {}
        for s in inventory(cfg):
            if ".experts." in s.name and is_routed_expert(s.name):   # fast path: ~99% of K3's tensors
                self.entries[s.name] = TpEntry(s, "expert", None, s.shape, "experts")
                continue
            kind = split_kind(s.name)
            axis = {"column": 0, "row": 1, "vocab": 0}.get(kind)
            self.entries[s.name] = TpEntry(s, kind, axis, self.local_shape(s, kind, 0), group_of(s.name))

    def local_config(self) -> K3Config:
        """The config one rank computes with: H / tp KDA and MLA heads, everything else as is."""
        return dataclasses.replace(self.cfg, kda_num_heads=self.cfg.kda_num_heads // self.tp,
                                   num_attention_heads=self.cfg.num_attention_heads // self.tp)

    def local_shape(self, spec: TensorSpec, kind: str, rank: int) -> tuple[int, ...]:
        """Shape of `spec` on `rank` under split `kind`."""
        shape = list(spec.shape)
        if kind == "vocab":
            lo, hi = self._vocab_range(rank)
            shape[0] = hi - lo
        elif kind == "row":
            shape[1] //= self.tp
        elif kind == "column" and not spec.name.endswith("A_log"):
            shape[0] //= self.tp
        return tuple(shape)

    def _vocab_range(self, rank: int) -> tuple[int, int]:
        V = self.cfg.vocab_size
        chunk = -(-V // self.tp)
        return min(rank * chunk, V), min((rank + 1) * chunk, V)

    def expert_range(self, rank: int) -> tuple[int, int]:
        """Routed experts [lo, hi) that `rank` holds (contiguous chunks of ceil(E / tp); the last may be short)."""
        E = self.cfg.n_routed_experts
        chunk = -(-E // self.tp)
        return min(rank * chunk, E), min((rank + 1) * chunk, E)

    def holds(self, name: str, rank: int) -> bool:
        """Whether `rank` stores tensor `name` (every tensor but the routed experts of other ranks)."""
        e = self.entries.get(name)
        if e is None or e.kind != "expert":
            return e is not None
        lo, hi = self.expert_range(rank)
        return lo <= _expert_index(name) < hi

    def shard(self, name: str, array: np.ndarray, rank: int) -> np.ndarray:
        """Rank `rank`'s part of tensor `name` (full array in, inventory shape): a view, except A_log.

        column: rows [r n/tp, (r+1) n/tp) (whole heads); row: columns likewise; vocab: rows of the rank's
        ceil(V/tp) chunk; replicated / expert: the array itself (an expert only on the rank that holds it).
        """
        e = self.entries.get(name)
        if e is None:
            raise ValueError(f"shard: {name!r} is not a tensor of this config's inventory")
        if not (isinstance(rank, (int, np.integer)) and 0 <= rank < self.tp):
            raise ValueError(f"shard: rank must be in [0, {self.tp}), found {rank!r}")
        a = np.asarray(array)
        if a.shape != e.spec.shape:
            raise ValueError(f"shard: {name}: expected the full shape {e.spec.shape}, found {a.shape}")
        if e.kind == "vocab":
            lo, hi = self._vocab_range(rank)
            return a[lo:hi]
        if e.kind == "expert" and not self.holds(name, rank):
            raise ValueError(f"shard: rank {rank} does not hold {name} (it holds experts "
                             f"{self.expert_range(rank)[0]}..{self.expert_range(rank)[1] - 1})")
        if e.kind == "column" and name.endswith("A_log"):
            h = self.cfg.kda_num_heads // self.tp
            out = np.zeros_like(a)
            out[:h] = a[rank * h:(rank + 1) * h]
            return out
        if e.kind in ("column", "row"):
            n = a.shape[e.axis] // self.tp
            return a[(slice(None),) * e.axis + (slice(rank * n, (rank + 1) * n),)]
        return a

    def weight_bytes_per_rank(self) -> dict[str, int]:
        """Stored bytes rank 0 holds (the largest rank), by group, plus "total"."""
        out = {g: 0 for g in GROUPS}
        lo, hi = self.expert_range(0)
        for e in self.entries.values():
            if e.kind == "expert" and not lo <= _expert_index(e.spec.name) < hi:
                continue
            out[e.group] += e.local_bytes
        out["total"] = sum(out[g] for g in GROUPS)
        return out

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """MLA cache bytes per token per rank over all MLA layers: (kv_lora + rope) values each, replicated."""
        width = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim   # K3: 512 + 64 = 576
        return len(self.cfg.mla_layers) * width * dtype_bytes

    def kda_state_bytes_per_sequence(self, state_bytes: int = 4, conv_bytes: int = 4) -> int:
        """KDA state per sequence per rank over all KDA layers: recurrent S [H/tp, K, V] plus the q/k/v conv
        buffers [3, H/tp * K, W - 1] (fp32 both by default; pass conv_bytes=2 for a bf16 conv state)."""
        c = self.cfg
        h, K = c.kda_num_heads // self.tp, c.kda_head_dim
        recurrent = h * K * K * state_bytes
        conv = 3 * h * K * (c.short_conv_kernel_size - 1) * conv_bytes
        return len(c.kda_layers) * (recurrent + conv)


def _expert_index(name: str) -> int:
    """E of `...block_sparse_moe.experts.{E}.w1.weight_packed`."""
    return int(name.split(".experts.", 1)[1].split(".", 1)[0])
