"""One rank's shard of the weights, and nothing more: read from safetensors slices, or synthesised.

A tensor-parallel rank must never hold (or read) another rank's heads, experts or vocab rows. Both builders
return {full checkpoint name: array} with the rank-local shapes of `TpPlan` for exactly the tensors
`plan.holds(name, rank)`, in their storage dtype (bf16 as ml_dtypes.bfloat16, F32, U8), and count bytes:

- `read_rank_shard`: each tensor's bytes are memory-mapped and only the rank's slice is copied out (a column
  split is one contiguous byte range, a row split one range per row); `ShardBytes.read` is what was copied.
- `synthetic_rank_shard`: the rank's slice of `synthetic_weights(cfg, seed)`, element for element; a tensor
  is drawn whole (its generator is per tensor) and cut at once, and only held experts are drawn at all.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .checks import require
from .safetensors_io import numpy_dtype
from .tp import TpPlan
from .weights import HeaderEntry, inventory, stored_tensors


@dataclasses.dataclass
class ShardBytes:
    """What building one rank's shard cost: bytes copied out of the files, bytes held, tensors held."""

    read: int = 0
    resident: int = 0
    tensors: int = 0


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
                    reader: SliceReader | None = None) -> tuple[dict[str, np.ndarray], ShardBytes]:
    """Rank `rank`'s tensors from safetensors `entries` (name -> HeaderEntry; names are `prefix` + full name).

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
    return out, cost


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
    return out, cost
