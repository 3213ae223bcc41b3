"""Weight views for the CPU host graph: checkpoint names in, module-local mappings out.

A model's weights are any Mapping from full checkpoint names (docs/spec.md section 7) to arrays: a dict
from `k3ref.weights.synthetic_weights`, or a lazy `k3ref.weights.CheckpointReader` over safetensors
shards. `ModuleView` strips a prefix so the block functions see module-local names (`q_proj.weight`),
casts float tensors to the compute dtype when used (kept in a cache only when the model keeps its float
copies: small models; a real-size model converts a tensor each time it is used and drops it after, so no
whole-model float copy exists), and leaves U8 MXFP4 bytes as they are, so a routed expert is read and
dequantised only when the router selects it.
`CheckpointWeights` is the mapping `K3CpuModel.from_checkpoint` uses: routed-expert tensors come from an
expert store (`k3ref.expert_backend`, zero-copy memmaps by default), everything else from the reader; its
`stored(name)` is the tensor as stored without a copy (a memmap view), which is what a cast reads from.
`take_rows` gathers rows of a table (the embedding, a block of lm_head) without touching the rest.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np

from . import fast
from .expert_backend import MmapExpertStore, parse_expert_name
from .fast import gemv_jit
from .ops import JIT_MAX_ROWS, linear
from .weights import LM_HEAD, TEXT_PREFIX, CheckpointReader, layer_prefix  # noqa: F401  (re-exported: one definition of the names)


class CheckpointWeights(Mapping):
    """Mapping[full name -> ndarray] over a checkpoint: routed experts through `store`, the rest through `reader`.

    `...block_sparse_moe.experts.{E}.w{1,2,3}.weight_{packed,scale}` is served by `store.tensor(...)` (a
    read-only view of the shard memmap for the mmap store; its bytes are added to `store.bytes_touched`);
    every other name by `reader[name]` (bf16 as float32). Iteration, length and membership are the reader's.
    """

    def __init__(self, reader: CheckpointReader, store: MmapExpertStore):
        self.reader = reader
        self.store = store

    def stored(self, name: str) -> np.ndarray:
        """The tensor as stored, no copy: an expert's U8 bytes from the store, any other tensor as a read-only
        view of the shard's memory map (BF16 as ml_dtypes.bfloat16)."""
        parsed = parse_expert_name(name) if name in self.reader.entries else None
        if parsed is None:
            return self.reader.view(name)
        return self.store.tensor(*parsed)

    def __getitem__(self, name: str) -> np.ndarray:
        parsed = parse_expert_name(name) if name in self.reader.entries else None
        if parsed is None:
            return self.reader[name]
        return self.store.tensor(*parsed)

    def __iter__(self) -> Iterator[str]:
        return iter(self.reader)

    def __len__(self) -> int:
        return len(self.reader)

    def __contains__(self, name) -> bool:
        return name in self.reader


def stored_tensor(weights: Mapping, name: str) -> np.ndarray:
    """weights' tensor `name` as stored (`weights.stored(name)` when the mapping has it: no copy)."""
    stored = getattr(weights, "stored", None)
    return np.asarray(stored(name) if stored is not None else weights[name])


def _is_float(arr: np.ndarray) -> bool:
    return arr.dtype.kind == "f" or gemv_jit.is_bf16(arr)   # asked per weight access: is_bf16 tests the kind first


def take_rows(weights: Mapping, name: str, rows, dtype) -> np.ndarray:
    """Rows `rows` (an index array or a slice) of the 2-D table `name`, cast to `dtype`: only those rows are
    read and converted (a memory-mapped table's other pages stay on disk). A slice of a table already stored
    in `dtype` comes back as a read-only view (a float32 model's lm_head block: no 131 MB copy per token)."""
    table = stored_tensor(weights, name)
    dtype = np.dtype(dtype)
    if isinstance(rows, slice) and table.dtype == dtype:
        view = table[rows].view()
        view.setflags(write=False)
        return view
    return np.array(table[rows], dtype=dtype)


def table_matmul(weights: Mapping, name: str, x: np.ndarray, dtype, block_rows: int) -> np.ndarray:
    """x [T, D] @ table[name].T -> [T, rows] in the wider of x's dtype and `dtype`, one block of `block_rows`
    table rows at a time; a bf16 table goes through `k3ref.ops.linear` (the compiled bf16 GEMV by default: no
    float copy of any block), a float32 one times up to JIT_MAX_ROWS float32 rows through the compiled GEMV
    (`k3ref.fast.gemv_jit.linear_jit`: the same bits on any machine and thread count), any other is taken by
    `take_rows` (a view when no cast is needed) and multiplied by BLAS."""
    table = stored_tensor(weights, name)
    out_dtype = np.result_type(x.dtype, np.dtype(dtype))
    xw = np.asarray(x).astype(out_dtype, copy=False)
    out = np.empty((xw.shape[0], table.shape[0]), out_dtype)
    compiled = fast.enabled()                                        # the route is the table's, not a block's
    bf16_gemv = compiled and gemv_jit.is_bf16(table)
    f32_gemv = (compiled and table.dtype == out_dtype == np.float32 and xw.ndim == 2
                and xw.shape[0] <= JIT_MAX_ROWS)
    for lo in range(0, table.shape[0], block_rows):
        block = slice(lo, lo + block_rows)
        if bf16_gemv:
            out[:, block] = linear(xw, table[block])
        elif f32_gemv:
            out[:, block] = gemv_jit.linear_jit(xw, table[block])   # a view of the block; x unchecked: a non-finite
        else:                                                         # hidden state gives non-finite logits
            out[:, block] = xw @ take_rows(weights, name, block, dtype).T
    return out


LAZY_BF16_ELEMENTS = 1 << 20   # bf16 matrices from this size on are handed out as stored by a view without cache


def _lazy_bf16(arr: np.ndarray) -> bool:
    """True for a large stored bf16 matrix that a view without cache hands out as it is (fast paths on only):
    every consumer in the host graph multiplies it through `k3ref.ops.linear` or converts it first (as_float),
    and NumPy promotes bf16 exactly against float32 / float64 operands."""
    return gemv_jit.is_bf16(arr) and arr.ndim == 2 and arr.size >= LAZY_BF16_ELEMENTS and fast.enabled()


class ModuleView(Mapping):
    """Read-only view of `weights` under `prefix`, floats cast to `dtype`, U8 passed through.

    cache: a dict shared by the views of one model where cast float tensors are kept (a model small enough to
    keep its float copies), or None: every access converts the stored tensor anew and the caller's reference
    is the only one, so the copy is freed when the caller drops it. Without a cache and with the fast paths on
    (`k3ref.fast.enabled()`), a large bf16 matrix is handed out as stored (a read-only view, dtype bfloat16):
    `k3ref.ops.linear` multiplies it by the compiled bf16 GEMV, so no float copy of it is ever made.
    """

    def __init__(self, weights: Mapping, prefix: str, dtype, cache: dict | None = None):
        self._weights = weights
        self._prefix = prefix
        self._dtype = np.dtype(dtype)
        self._cache = cache

    def __getitem__(self, name: str) -> np.ndarray:
        full = self._prefix + name
        hit = None if self._cache is None else self._cache.get(full)
        if hit is not None:
            return hit
        try:
            arr = stored_tensor(self._weights, full)
        except KeyError:
            raise KeyError(f"weight {full!r} is missing (module view {self._prefix!r})") from None
        if self._cache is None and _lazy_bf16(arr):
            view = arr.view()             # multiplied as stored by k3ref.ops.linear: no float copy made
            view.setflags(write=False)
            return view
        if _is_float(arr):
            arr = arr.astype(self._dtype, copy=False)
            if self._cache is not None:   # experts are dequantised per use; dense floats kept when asked
                self._cache[full] = arr
        return arr

    def __iter__(self) -> Iterator[str]:
        n = len(self._prefix)
        return (k[n:] for k in self._weights if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name) -> bool:
        return (self._prefix + name) in self._weights

    def memo(self, key, build: Callable[[], object]):
        """build() kept in the shared cache under this view's prefix and `key` (built once per model: the checked
        tensors of an expert), or built anew on every call for a view without cache or over a checkpoint (its
        experts come from the store on every use, which counts them in `bytes_touched`)."""
        if self._cache is None or isinstance(self._weights, CheckpointWeights):
            return build()
        full = (self._prefix, key)
        if full not in self._cache:
            self._cache[full] = build()
        return self._cache[full]

    def sub(self, prefix: str) -> ModuleView:
        """A view one level down (e.g. `self_attn.`), sharing the cast cache."""
        return ModuleView(self._weights, self._prefix + prefix, self._dtype, self._cache)
