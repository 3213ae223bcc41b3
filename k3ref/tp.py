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
Rank-local head counts are H / tp for KDA and MLA; `cfg.validate_tp(tp)` must pass, and every rank must hold
at least one routed expert.

A rank computes with the same host graph as TP 1 (k3ref.cpu_forward): its `K3CpuModel` carries a `TpRank`
(the rank, its expert and vocab ranges, and a `Comm`), and the graph calls `comm.all_reduce` where the plan
puts the reductions: after each mixer's row-split o_proj, on the partial routed latent before the routed
norm, and on the vocab-split embedding lookup; the vocab-split logits are all-gathered. k3ref holds no
transport: `LoopbackGroup` runs ranks as threads of one process (tests), conformance.tp runs them as
processes over torch.distributed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import threading
from typing import NamedTuple, Protocol

import numpy as np

from .cache import kda_state_bytes_per_sequence, mla_cache_bytes_per_token
from .config import K3Config
from .weights import DTYPE_BYTES, LM_HEAD, TEXT_PREFIX, TensorSpec, inventory, is_routed_expert

SPLIT_KINDS = ("column", "row", "replicated", "expert", "vocab")
GROUPS = ("attention", "mlp", "experts", "embeddings", "norms")
GLOBAL = "globals"   # the key of layer_bytes for the tensors outside the layers (embedding, final norm, lm_head)

# The binding-memory plan (docs/spec.md, "Binding memory"): the F32 checkpoint tensors that get a BF16 copy on
# the device when the layer is bound to the kernels. Of the F32 tensors (section 7) only the three KDA short
# convolutions face a kernel that reads its weights in the activation dtype (the causal short-conv kernel of a
# serving engine takes x and w in one dtype: bf16); A_log and dt_bias go to the KDA kernels in fp32 (k3cuda's
# kda_decode and fla's kernels take them so), o_norm.weight to the RMSNorm in fp32 and the router's
# e_score_correction_bias to the fp32 router. The fp32 originals stay: the copies are extra bytes.
BINDING_BF16_COPIES = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
_LAYER_RE = re.compile(re.escape(TEXT_PREFIX) + r"layers\.(\d+)\.")

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
        E = cfg.n_routed_experts
        if E and self.expert_range(tp - 1)[0] >= E:
            chunk = -(-E // tp)
            raise ValueError(f"tp={tp}: {E} routed experts in chunks of {chunk} leave rank {tp - 1} without an "
                             f"expert; choose tp <= {E} with every chunk non-empty")
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
            if e.axis is None:
                raise ValueError(f"shard: {name}: a {e.kind} split needs an axis, found none")
            n = a.shape[e.axis] // self.tp
            index: tuple[slice, ...] = (slice(None),) * e.axis + (slice(rank * n, (rank + 1) * n),)
            return a[index]
        return a

    def weight_bytes_per_rank(self) -> dict[str, int]:
        """Stored bytes rank 0 holds (the largest rank), by group, plus "total"."""
        out = self.rank_bytes(0)
        del out["replicated"]
        return out

    def rank_bytes(self, rank: int, itemsize=None) -> dict[str, int]:
        """Bytes `rank` holds, by group, plus "total" and "replicated" (the part every rank holds).

        itemsize(name) -> bytes per element overrides the checkpoint dtype's (a file storing bf16 as F32).
        """
        out = {g: 0 for g in (*GROUPS, "replicated")}
        if itemsize is None:   # experts are whole and ~99% of K3's tensors: summed per expert index once
            out["experts"] = sum(self._expert_bytes[e] for e in range(*self.expert_range(rank)))
        for e in self.entries.values():
            if e.kind == "expert" and (itemsize is None or not self.holds(e.spec.name, rank)):
                continue
            n = math.prod(self.local_shape(e.spec, e.kind, rank))
            b = n * (DTYPE_BYTES[e.spec.dtype] if itemsize is None else itemsize(e.spec.name))
            out[e.group] += b
            if e.kind == "replicated":
                out["replicated"] += b
        out["total"] = sum(out[g] for g in GROUPS)
        return out

    def layer_bytes(self, rank: int) -> dict[int | str, dict[str, int]]:
        """Stored bytes `rank` holds per layer (key: the layer index; GLOBAL for the embedding, the final norm
        and lm_head), by group, plus "total"."""
        out: dict[int | str, dict[str, int]] = {}
        lo, hi = self.expert_range(rank)
        for e in self.entries.values():
            if e.kind == "expert":
                if not lo <= _expert_index(e.spec.name) < hi:
                    continue
                n = e.local_bytes
            else:
                n = math.prod(self.local_shape(e.spec, e.kind, rank)) * DTYPE_BYTES[e.spec.dtype]
            m = _LAYER_RE.match(e.spec.name)
            row = out.setdefault(int(m.group(1)) if m else GLOBAL, {g: 0 for g in (*GROUPS, "total")})
            row[e.group] += n
            row["total"] += n
        return out

    def binding_bytes(self, rank: int, copy_bytes: int = 2) -> dict[str, int]:
        """The binding-memory plan of `rank`: extra device bytes of the BF16 copies of BINDING_BF16_COPIES (its
        shard of each, over every KDA layer), by tensor, plus "total"."""
        out = {t: 0 for t in BINDING_BF16_COPIES}
        for e in self.entries.values():
            if e.kind == "column" and ".self_attn." in e.spec.name:
                local = e.spec.name.split(".self_attn.", 1)[1]
                if local in out:
                    out[local] += math.prod(self.local_shape(e.spec, e.kind, rank)) * copy_bytes
        out["total"] = sum(out[t] for t in BINDING_BF16_COPIES)
        return out

    @functools.cached_property
    def _expert_bytes(self) -> list[int]:
        """Stored bytes of routed expert e over all MoE layers, by e (counted once per plan)."""
        by = [0] * self.cfg.n_routed_experts
        for e in self.entries.values():
            if e.kind == "expert":
                by[_expert_index(e.spec.name)] += e.local_bytes
        return by

    def rank(self, rank: int, comm: Comm) -> TpRank:
        """What rank `rank` needs beside its weights to run the host graph: its ranges and `comm`."""
        if not (isinstance(rank, (int, np.integer)) and 0 <= rank < self.tp):
            raise ValueError(f"rank: expected an int in [0, {self.tp}), found {rank!r}")
        return TpRank(int(rank), self.tp, comm, range(*self.expert_range(rank)), range(*self._vocab_range(rank)),
                      -(-self.cfg.vocab_size // self.tp), self.cfg.vocab_size)

    def kda_head_slice(self, rank: int, head_dim: int | None = None) -> slice:
        """Rank `rank`'s KDA heads (or their channels, head_dim per head): whole heads, contiguous."""
        h = self.cfg.kda_num_heads // self.tp
        per = 1 if head_dim is None else head_dim
        return slice(rank * h * per, (rank + 1) * h * per)

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """MLA cache bytes per token per rank over all MLA layers: (kv_lora + rope) values each, replicated."""
        return mla_cache_bytes_per_token(self.cfg, dtype_bytes)

    def kda_state_bytes_per_sequence(self, state_bytes: int = 4, conv_bytes: int = 4) -> int:
        """KDA state per sequence per rank over all KDA layers: recurrent S [H/tp, K, V] plus the q/k/v conv
        buffers [3, H/tp * K, W - 1] (fp32 both by default; pass conv_bytes=2 for a bf16 conv state)."""
        return kda_state_bytes_per_sequence(self.cfg, self.tp, state_bytes, conv_bytes)


def _expert_index(name: str) -> int:
    """E of `...block_sparse_moe.experts.{E}.w1.weight_packed`."""
    return int(name.split(".experts.", 1)[1].split(".", 1)[0])


class Comm(Protocol):
    """The collectives of one rank's group. Every rank calls them in the same order with equal shapes."""

    def all_reduce(self, a: np.ndarray) -> np.ndarray:
        """The element-wise sum of `a` over the ranks (same shape and dtype as `a`)."""

    def all_gather(self, a: np.ndarray) -> np.ndarray:
        """[ranks, *a.shape]: every rank's `a`, in rank order."""


@dataclasses.dataclass(frozen=True)
class TpRank:
    """One rank's place in a tensor-parallel forward: its index, its routed experts and vocab rows, its comm."""

    rank: int
    size: int
    comm: Comm
    experts: range        # routed experts this rank computes (contiguous, see TpPlan.expert_range)
    vocab: range          # embedding / lm_head rows this rank holds
    vocab_chunk: int      # ceil(vocab / size): the padded width of every rank's logits slice
    vocab_size: int

    def gather_vocab(self, logits: np.ndarray) -> np.ndarray:
        """[..., len(vocab)] rank-local logits -> [..., vocab] (each rank's slice, padded to vocab_chunk)."""
        pad = np.zeros((*logits.shape[:-1], self.vocab_chunk), logits.dtype)
        pad[..., :logits.shape[-1]] = logits
        parts = self.comm.all_gather(pad)                                   # [size, ..., chunk]
        return np.concatenate(list(parts), axis=-1)[..., :self.vocab_size]


class LoopbackGroup:
    """`size` ranks as threads of one process: real collectives (every rank waits for all), no transport.

    For tests of the host graph under TP without torch; `comm(rank)` is rank `rank`'s Comm. A collective
    that waits longer than `timeout` seconds raises (a rank that died or took another path).
    """

    def __init__(self, size: int, timeout: float = 60.0):
        self.size, self.timeout = size, timeout
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list = [None] * size

    def comm(self, rank: int) -> Comm:
        return _LoopbackComm(self, rank)

    def run(self, fn) -> list:
        """[fn(rank, comm) for every rank], each on its own thread; the first rank that raises is re-raised,
        naming it (the others are released from their collectives)."""
        results, errors = [None] * self.size, {}

        def work(rank):
            try:
                results[rank] = fn(rank, self.comm(rank))
            except BaseException as e:  # noqa: BLE001 - reported below with the rank
                errors[rank] = e
                self._barrier.abort()

        threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raised = {r: e for r, e in errors.items() if not isinstance(e, threading.BrokenBarrierError)}
            first = min(raised or errors)
            raise RuntimeError(f"rank {first}: {type(errors[first]).__name__}: {errors[first]}") from errors[first]
        return results

    def _exchange(self, rank: int, a: np.ndarray) -> list[np.ndarray]:
        self._slots[rank] = np.array(a, copy=True)
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()          # nobody overwrites a slot before every rank has read them all
        return got


@dataclasses.dataclass
class _LoopbackComm:
    group: LoopbackGroup
    rank: int

    def all_reduce(self, a):
        parts = self.group._exchange(self.rank, a)
        out = parts[0].copy()
        for p in parts[1:]:
            out += p
        return out

    def all_gather(self, a):
        return np.stack(self.group._exchange(self.rank, a))
