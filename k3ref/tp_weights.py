"""One rank's shard of the weights, and nothing more: read from safetensors slices, or synthesised.

A tensor-parallel rank must never hold (or read) another rank's heads, experts or vocab rows. Both builders
return {full checkpoint name: array} with the rank-local shapes of `TpPlan` for exactly the tensors
`plan.holds(name, rank)`, in their storage dtype (bf16 as ml_dtypes.bfloat16, F32, U8), and count bytes:

- `read_rank_shard`: each tensor's bytes are memory-mapped and only the rank's slice is copied out (a column
  split is one contiguous byte range, a row split one range per row); `ShardBytes.read` is what was copied.
  Given an expert store (`experts=`, k3ref.expert_backend.MmapExpertStore), the rank's routed experts are not
  copied at all: `ShardWeights` serves them as read-only views of the store's mappings, so a rank holds its
  dense shard and only the pages of the experts its router picks (K3 at TP8: 168 GiB of experts on rank 0
  if copied). Another rank's expert is refused by name.
- `synthetic_rank_shard`: the rank's slice of `synthetic_weights(cfg, seed)`, element for element; a tensor
  is drawn whole (its generator is per tensor) and cut at once, and only held experts are drawn at all.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from .checks import require
from .expert_backend import MmapExpertStore, parse_expert_name
from .safetensors_io import numpy_dtype
from .tp import TpPlan
from .weights import CheckpointReader, HeaderEntry, inventory, stored_tensors


@dataclasses.dataclass
class ShardBytes:
    """What building one rank's shard cost: bytes copied out of the files, bytes held (copied), tensors held
    (copied or mapped), and of the routed experts: how many tensors were copied and how many bytes are
    served from the mappings instead (`mapped`: the experts' stored bytes, touched only when routed to)."""

    read: int = 0
    resident: int = 0
    tensors: int = 0
    copied_experts: int = 0
    mapped: int = 0


class PrefixedCheckpoint(CheckpointReader):
    """The tensors of safetensors `entries` whose names start with `prefix`, under their names without it:
    a golden file's `weights.<name>` seen as a checkpoint, so an expert store can serve its routed experts."""

    def __init__(self, entries: Mapping[str, HeaderEntry], prefix: str, where: str | Path):
        # no CheckpointReader.__init__: the headers are parsed (and checked) already
        self.directory = Path(where)
        self.entries = {k[len(prefix):]: h for k, h in entries.items() if k.startswith(prefix)}
        self._handles = {}
        self.prefix = prefix

    def __getitem__(self, name: str) -> np.ndarray:
        h = self.entries.get(name)
        if h is None:
            raise KeyError(f"{self.prefix + name!r} is not in {self.directory}")
        return SliceReader().view(self.prefix + name, h)


class ShardWeights(Mapping):
    """One rank's weights: `dense` (its copied slices, full names) and the routed experts it holds, served by
    `store` as read-only views of the mapped files (nothing copied). A routed expert of another rank, or any
    name outside the shard, raises KeyError naming the rank and what it holds."""

    def __init__(self, dense: dict[str, np.ndarray], store: MmapExpertStore, plan: TpPlan, rank: int):
        self.dense, self.store, self.plan, self.rank = dense, store, plan, rank
        self.experts = [n for n, e in plan.entries.items() if e.kind == "expert" and plan.holds(n, rank)]

    def __getitem__(self, name: str) -> np.ndarray:
        hit = self.dense.get(name)
        if hit is not None:
            return hit
        parsed = parse_expert_name(name)
        if parsed is None or not self.plan.holds(name, self.rank):
            lo, hi = self.plan.expert_range(self.rank)
            raise KeyError(f"rank {self.rank}: {name!r} is not in its shard (it holds routed experts "
                           f"{lo}..{hi - 1} and its slices of the dense tensors)")
        return self.store.tensor(*parsed)

    def __iter__(self) -> Iterator[str]:
        yield from self.dense
        yield from self.experts

    def __len__(self) -> int:
        return len(self.dense) + len(self.experts)

    def __contains__(self, name) -> bool:
        return name in self.dense or name in self.experts


class SliceReader:
    """Memory-maps safetensors files once each and copies out slices of tensors, counting the bytes."""

    def __init__(self) -> None:
        self._maps: dict[Path, np.memmap] = {}
        self.bytes_read = 0

    def view(self, name: str, h: HeaderEntry) -> np.ndarray:
        """The whole tensor as a read-only view of the file mapping: nothing is read until it is sliced."""
        if h.path not in self._maps:
            self._maps[h.path] = np.memmap(h.path, dtype=np.uint8, mode="r")
        return self._maps[h.path][h.begin:h.end].view(numpy_dtype(h.dtype)).reshape(h.shape)

    @property
    def mappings(self) -> dict[Path, np.memmap]:
        """The files mapped so far, by path (a measuring reader locates its views in them)."""
        return self._maps

    def copy(self, part: np.ndarray, elements: int | None = None) -> np.ndarray:
        """Copy a slice of a view out of the mapping; `elements` (default all) is what the copy reads."""
        out = np.array(part, copy=True)
        self.bytes_read += (out.size if elements is None else elements) * out.itemsize
        return out


def _check_local(plan: TpPlan, rank: int, name: str, part: np.ndarray, local: dict) -> None:
    """The rank's model is built for the local config: a shard of another shape is a plan that split the
    tensor on the wrong axis (vocab rows are the exception: the model does not size them)."""
    want = local.get(name)
    if want is not None and plan.entries[name].kind != "vocab":
        require(part.shape == want, f"rank {rank}: {name}: the plan's shard has shape {list(part.shape)}, the "
                                    f"rank's model needs {list(want)} ({plan.entries[name].kind} split on the "
                                    "wrong axis?)")


def read_rank_shard(plan: TpPlan, rank: int, entries: Mapping[str, HeaderEntry], prefix: str = "",
                    reader: SliceReader | None = None,
                    experts: MmapExpertStore | None = None) -> tuple[Mapping[str, np.ndarray], ShardBytes]:
    """Rank `rank`'s tensors from safetensors `entries` (name -> HeaderEntry; names are `prefix` + full name).

    experts: None copies the rank's routed experts like every other tensor (a dict comes back); a store
    serves them from its mappings instead (a `ShardWeights` comes back; no expert byte is read here).
    Raises ValueError naming the rank and the tensor when a tensor the rank needs is missing or misshaped.
    """
    reader = reader or SliceReader()
    out, cost = {}, ShardBytes()
    local = {s.name: s.shape for s in inventory(plan.local_config())}
    for name, e in plan.entries.items():
        if not plan.holds(name, rank):
            continue
        h = entries.get(prefix + name)
        if h is None:
            raise ValueError(f"rank {rank}: tensor {prefix + name} of its shard is missing from the file(s) "
                             f"({len(entries)} tensors found)")
        require(tuple(h.shape) == e.spec.shape,
                f"rank {rank}: {prefix + name}: expected the full shape {list(e.spec.shape)}, found {list(h.shape)} "
                f"in {h.path}")
        if experts is not None and e.kind == "expert":
            cost.mapped += h.end - h.begin
            cost.tensors += 1
            continue
        cost.copied_experts += e.kind == "expert"
        full = reader.view(prefix + name, h)
        part = plan.shard(name, full, rank)
        _check_local(plan, rank, name, part, local)
        if e.kind == "column" and name.endswith("A_log"):   # padded copy of the rank's heads: those were read
            reader.bytes_read += (plan.cfg.kda_num_heads // plan.tp) * full.itemsize
            out[name] = part
        else:
            out[name] = reader.copy(part)
        cost.resident += out[name].nbytes
        cost.tensors += 1
    cost.read = reader.bytes_read
    return (out if experts is None else ShardWeights(out, experts, plan, rank)), cost


def synthetic_rank_shard(plan: TpPlan, rank: int, seed: int) -> tuple[dict[str, np.ndarray], ShardBytes]:
    """Rank `rank`'s slice of `k3ref.weights.synthetic_weights(plan.cfg, seed)`, in the storage dtypes."""
    held = [e.spec for name, e in plan.entries.items() if plan.holds(name, rank)]
    out, cost = {}, ShardBytes()
    local = {s.name: s.shape for s in inventory(plan.local_config())}
    for spec, full in stored_tensors(plan.cfg, seed, held):
        part = plan.shard(spec.name, full, rank)
        _check_local(plan, rank, spec.name, part, local)
        out[spec.name] = part if part is full else np.array(part, copy=True)   # drop the rest of the draw
        cost.resident += out[spec.name].nbytes
        cost.tensors += 1
        cost.copied_experts += plan.entries[spec.name].kind == "expert"
    return out, cost


GEOMETRY_LISTED = 10   # problems a geometry error lists (all are counted)


def check_geometry(plan: TpPlan, entries: Mapping[str, HeaderEntry], prefix: str = "", dtypes: bool = True) -> None:
    """Every tensor the plan shards, checked from the headers alone before any rank allocates: present, its full
    shape and (dtypes=True) its stored dtype as the inventory says, its split axis divisible by tp, and the shard
    a rank would cut the shape the rank-local model needs. ValueError listing the first GEOMETRY_LISTED problems,
    each naming the tensor, what was expected and what was found."""
    problems: list[str] = []
    local = {s.name: s.shape for s in inventory(plan.local_config())}
    for name, e in plan.entries.items():
        h = entries.get(prefix + name)
        want = f"{e.spec.dtype} {list(e.spec.shape)}"
        if h is None:
            problems.append(f"{prefix + name}: expected {want}, found no such tensor")
        elif tuple(h.shape) != e.spec.shape or (dtypes and h.dtype != e.spec.dtype):
            problems.append(f"{prefix + name}: expected {want}, found {h.dtype} {list(h.shape)} in {h.path.name}")
        elif (e.kind in ("column", "row") and e.axis is not None and e.spec.shape[e.axis] % plan.tp
              and not name.endswith("A_log")):   # A_log is padded: its heads (validate_tp) are what is split
            problems.append(f"{prefix + name}: a {e.kind} split over {plan.tp} ranks needs axis {e.axis} divisible "
                            f"by {plan.tp}, found {e.spec.shape[e.axis]}")
        elif e.kind != "vocab" and name in local and plan.local_shape(e.spec, e.kind, 0) != local[name]:
            problems.append(f"{prefix + name}: each rank's {e.kind} shard would be "
                            f"{list(plan.local_shape(e.spec, e.kind, 0))}, the rank's model needs {list(local[name])}")
    if problems:
        more = len(problems) - GEOMETRY_LISTED
        raise ValueError(f"--tp {plan.tp}: {len(problems)} tensor(s) do not fit the plan: "
                         + "; ".join(problems[:GEOMETRY_LISTED]) + (f"; and {more} more" if more > 0 else ""))
