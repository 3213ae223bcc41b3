"""Paged decode caches.

`MlaKv` is the latent cache of one MLA layer in FlashMLA's paged layout: a pool of pages
`pages [num_pages, page_size, width]` (K3: pages of 64 tokens, width 576 = [c (512) | k_pe (64)]),
a page table per sequence and a free-page list. Token i of a sequence lives at
`pages[table[i // page_size], i % page_size]`, which is what `block_table` hands to the decode core.
"""
from __future__ import annotations

import copy as _copy

import numpy as np

from .checks import as_float, check_shape, is_finite_real, is_int_value, require
from .kda import KdaState

_CACHE_DTYPES = ("float16", "bfloat16", "float32", "float64")


class MlaKv:
    """A paged pool of latent rows shared by several sequences of different lengths.

    pages: [num_pages, page_size, width] in `dtype`; unwritten slots hold `fill` (0 by default; NaN
    poisons them so a kernel that reads past seq_len shows it). Pages are handed out lowest id first,
    so a given sequence of calls always yields the same block tables.
    """

    def __init__(self, num_pages: int, page_size: int = 64, width: int = 576, dtype=np.float64,
                 *, fill: float = 0.0):
        for name, v in (("num_pages", num_pages), ("page_size", page_size), ("width", width)):
            require(is_int_value(v) and v >= 1,
                    f"MlaKv: {name} must be a positive int, found {v!r}")
        try:
            dt = np.dtype(dtype)
        except TypeError:
            dt = None
        require(dt is not None and dt.name in _CACHE_DTYPES,
                f"MlaKv: dtype must be one of {_CACHE_DTYPES}, found {repr(dtype) if dt is None else dt.name}")
        self.num_pages, self.page_size, self.width = int(num_pages), int(page_size), int(width)
        self.fill = float(fill)
        self.pages = np.full((self.num_pages, self.page_size, self.width), self.fill, dtype=dt)
        self._free: list[int] = list(range(self.num_pages))   # kept sorted: lowest id is taken first
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0

    # -- sequences -----------------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        return self.pages.dtype

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def sequences(self) -> tuple[int, ...]:
        """Live sequence ids, in the order they were added."""
        return tuple(self._tables)

    def add_sequence(self) -> int:
        """Register an empty sequence and return its id (ids are never reused)."""
        sid = self._next_id
        self._next_id += 1
        self._tables[sid], self._lens[sid] = [], 0
        return sid

    def free(self, seq_id: int) -> None:
        """Drop a sequence and return its pages (refilled with `fill`) to the pool."""
        self._known(seq_id)
        pages = self._tables.pop(seq_id)
        del self._lens[seq_id]
        self.pages[pages] = self.fill
        self._free = sorted(self._free + pages)

    # -- writing -------------------------------------------------------------------------------
    def append(self, seq_ids, rows: np.ndarray) -> None:
        """Append one token to each listed sequence: rows[b] becomes the next row of seq_ids[b].

        seq_ids: B distinct live ids; rows: [B, width] (stored in the cache dtype). A sequence that
        crosses a page boundary gets a new page. All-or-nothing: when the pool cannot hold the new
        pages nothing is written and ValueError says how many pages were needed and free.
        """
        ids = self._ids(seq_ids)
        rows = as_float("rows", rows)
        check_shape("rows", rows, (len(ids), self.width))
        new_pages = [s for s in ids if self._lens[s] == len(self._tables[s]) * self.page_size]
        require(len(new_pages) <= len(self._free),
                f"MlaKv.append: page pool exhausted: sequences {new_pages} need {len(new_pages)} new page(s), "
                f"{len(self._free)} of {self.num_pages} free; free() finished sequences or build MlaKv "
                f"with more num_pages")
        for b, s in enumerate(ids):
            if s in new_pages:
                self._tables[s].append(self._free.pop(0))
            pos = self._lens[s]
            self.pages[self._tables[s][pos // self.page_size], pos % self.page_size] = rows[b]
            self._lens[s] = pos + 1

    def pop_last(self, seq_ids) -> None:
        """Undo the last `append(seq_ids, ...)`: each listed sequence drops its last token; the slot gets the pool's
        fill again and a page that append took goes back to the free list (sorted, so later block tables are as
        if the step never ran). For callers that must leave the cache untouched when a step fails after its append."""
        ids = self._ids(seq_ids)
        empty = [s for s in ids if self._lens[s] == 0]
        require(not empty, f"MlaKv.pop_last: sequences {empty} hold no token")
        for s in ids:
            pos = self._lens[s] - 1
            page = self._tables[s][pos // self.page_size]
            self.pages[page, pos % self.page_size] = self.fill
            self._lens[s] = pos
            if pos % self.page_size == 0:
                self._tables[s].pop()
                self._free = sorted(self._free + [page])

    # -- reading -------------------------------------------------------------------------------
    def gather(self, seq_id: int) -> np.ndarray:
        """The sequence's rows in token order: [L, width] (a copy, cache dtype)."""
        self._known(seq_id)
        L = self._lens[seq_id]
        flat = self.pages[self._tables[seq_id]].reshape(-1, self.width)
        return flat[:L]            # fancy indexing above already copied

    def block_table(self, seq_ids, max_pages: int | None = None) -> np.ndarray:
        """[B, max_pages] int32: row b lists the pages of seq_ids[b] in order, unused slots -1.

        max_pages defaults to the most pages any listed sequence holds; pass a larger one for a
        fixed-width table (it must hold every listed sequence).
        """
        ids = self._ids(seq_ids)
        need = max((len(self._tables[s]) for s in ids), default=0)
        if max_pages is None:
            max_pages = need
        require(isinstance(max_pages, (int, np.integer)) and max_pages >= need,
                f"block_table: max_pages must be an int >= {need} (pages held), found {max_pages!r}")
        out = np.full((len(ids), int(max_pages)), -1, dtype=np.int32)
        for b, s in enumerate(ids):
            out[b, :len(self._tables[s])] = self._tables[s]
        return out

    def seq_lens(self, seq_ids) -> np.ndarray:
        """[B] int32: cached tokens per listed sequence."""
        return np.array([self._lens[s] for s in self._ids(seq_ids)], dtype=np.int32)

    def copy(self) -> MlaKv:
        """An independent deep copy (pages, tables, free list)."""
        return _copy.deepcopy(self)

    def bytes_per_token(self, dtype_bytes: float | None = None) -> float:
        """Cache bytes per token per layer: width * dtype_bytes (K3: 576 * 2 = 1152 in bf16).

        dtype_bytes defaults to the item size of this cache's dtype.
        """
        if dtype_bytes is None:
            dtype_bytes = self.dtype.itemsize
        require(is_finite_real(dtype_bytes) and dtype_bytes > 0,
                f"bytes_per_token: dtype_bytes must be a positive number, found {dtype_bytes!r}")
        return self.width * dtype_bytes

    # -- helpers -------------------------------------------------------------------------------
    def _known(self, seq_id) -> None:
        require(isinstance(seq_id, (int, np.integer)) and int(seq_id) in self._tables,
                f"seq_id: expected one of the live sequences {list(self._tables)}, found {seq_id!r}")

    def _ids(self, seq_ids) -> list[int]:
        ids = [seq_ids] if isinstance(seq_ids, (int, np.integer)) else list(seq_ids)
        for s in ids:
            self._known(s)
        checked = [int(s) for s in ids]
        require(len(set(checked)) == len(checked), f"seq_ids: expected distinct ids, found {checked}")
        return checked

    def __repr__(self) -> str:
        return (f"MlaKv(num_pages={self.num_pages}, page_size={self.page_size}, width={self.width}, "
                f"dtype={self.dtype.name}, sequences={dict(self._lens)}, free_pages={len(self._free)})")


def paged_latent_cache(rng: np.random.Generator, seq_lens, width: int, page: int, *, spare_pages: int = 1,
                       spare_columns: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs for the `mla_decode` core's paged cache, laid out to catch a wrong read: each sequence's pages
    in a shuffled order over a pool with `spare_pages` unused pages; the unused pages and the slots past each
    sequence's length hold NaN, so reading any of them shows in the output.

    Draws rng.permutation(N) then N(0, 1) rows [N, page, width] (in this order: goldens depend on it).
    Returns (kv_cache float64 [N, page, width], block_table int32 [B, max_pages + spare_columns]); the spare
    columns point at a NaN page.
    """
    n_pages = [-(-int(L) // page) for L in seq_lens]
    N = sum(n_pages) + spare_pages
    order = rng.permutation(N)
    cache = rng.standard_normal((N, page, width))
    cache[order[sum(n_pages):]] = np.nan
    table = np.full((len(n_pages), max(n_pages) + spare_columns), int(order[-1]), dtype=np.int32)
    nxt = 0
    for b, (L, n) in enumerate(zip(seq_lens, n_pages, strict=True)):
        table[b, :n] = order[nxt:nxt + n]
        cache[table[b, n - 1], int(L) - (n - 1) * page:] = np.nan
        nxt += n
    return cache, table


class HybridCache:
    """The decode caches of a whole K3 model for several sequences.

    Per MLA layer one paged latent cache (`MlaKv`, rows [c | k_pe], `mla_cfg.cache_width` values per token,
    pages of `page_size` tokens, which must be the MLA config's 64, one pool shared by the sequences); per KDA
    layer and sequence one `KdaState` (conv buffers [1, C, W-1] + fp32-or-wider recurrent state [1, H, K, V]).
    `lengths[seq]` counts the tokens a sequence has consumed; the forward pass checks a token's position
    against it.
    """

    def __init__(self, cfg, *, num_pages: int = 64, page_size: int = 64, dtype=np.float64,
                 kda_state_dtype=None):
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        self.kda_state_dtype = np.dtype(kda_state_dtype or np.result_type(self.dtype, np.float32))
        self._kda_cfg = cfg.kda_config()
        self._mla_cfg = cfg.mla_config()
        # mla_decode_token checks the cache against the model's MlaConfig: a cache of another page size
        # would prefill and then fail at the first decode step, so refuse it here.
        require(page_size == self._mla_cfg.page_size,
                f"HybridCache: page_size must be the MLA config's page size {self._mla_cfg.page_size} "
                f"(mla_decode_token checks the cache against it), found {page_size!r}")
        self.kda_layers, self.mla_layers = cfg.kda_layers, cfg.mla_layers
        self.mla = {i: MlaKv(num_pages, page_size, self._mla_cfg.cache_width, self.dtype) for i in self.mla_layers}
        self.kda: dict[tuple[int, int], KdaState] = {}
        self.lengths: dict[int, int] = {}
        self._next = 0

    def add_sequence(self) -> int:
        """Open a new, empty sequence in every layer's cache; returns its id."""
        seq = self._next
        self._next += 1
        for kv in self.mla.values():
            got = kv.add_sequence()
            require(got == seq, f"MLA cache sequence ids out of step: expected {seq}, found {got}")
        for layer in self.kda_layers:
            self.kda[(layer, seq)] = KdaState.zeros(self._kda_cfg, 1, self.kda_state_dtype)
        self.lengths[seq] = 0
        return seq

    def seq_len(self, seq: int) -> int:
        """Tokens consumed so far by sequence `seq`."""
        require(seq in self.lengths, f"unknown sequence {seq}; open ones: {sorted(self.lengths)}")
        return self.lengths[seq]

    def _kda_key(self, layer: int, seq: int) -> tuple[int, int]:
        require(layer in self.kda_layers, f"layer: expected a KDA layer {list(self.kda_layers)}, found {layer!r}")
        self.seq_len(seq)
        return (layer, seq)

    def kda_state(self, layer: int, seq: int):
        """The KdaState of KDA layer `layer` for sequence `seq`."""
        return self.kda[self._kda_key(layer, seq)]

    def set_kda_state(self, layer: int, seq: int, state) -> None:
        self.kda[self._kda_key(layer, seq)] = state

    def advance(self, seq: int, n: int) -> None:
        """Record that `seq` consumed n more tokens (after every layer has seen them); nothing changes on error."""
        require(is_int_value(n) and n >= 0,
                f"n: expected an int >= 0, found {n!r}")
        new_len = self.seq_len(seq) + int(n)
        for layer, kv in self.mla.items():
            got = int(kv.seq_lens([seq])[0])
            require(got == new_len, f"MLA layer {layer} holds {got} tokens of sequence {seq}, expected {new_len}")
        self.lengths[seq] = new_len

    # Memory accounting (docs/spec.md section 2.5: 576 values per token per MLA layer; fp32 KDA state per sequence).
    def mla_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Latent-cache bytes per token over all MLA layers (K3, bf16: 24 x 1152)."""
        return mla_cache_bytes_per_token(self.cfg, dtype_bytes)

    def kda_bytes_per_sequence(self, state_bytes: int = 4) -> int:
        """KDA bytes per sequence over all KDA layers: recurrent [H, K, V] + conv buffers [3 H K, W-1]."""
        return kda_state_bytes_per_sequence(self.cfg, state_bytes=state_bytes)


# The one owner of the cache byte counts: HybridCache reports them for a whole model, k3ref.tp.TpPlan per rank.
def mla_cache_bytes_per_token(cfg, dtype_bytes: int = 2) -> int:
    """Latent-cache bytes per token over all MLA layers: kv_lora_rank + qk_rope_head_dim values each
    (K3: 512 + 64 = 576; bf16: 24 x 1152). The latent cache is replicated, so this is also the per-rank count."""
    return len(cfg.mla_layers) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes


def kda_state_bytes_per_sequence(cfg, tp: int = 1, state_bytes: int = 4, conv_bytes: int | None = None) -> int:
    """KDA state per sequence over all KDA layers, per tensor-parallel rank (tp=1: the whole model): recurrent
    S [H/tp, K, V] plus the q/k/v conv buffers [3, H/tp * K, W - 1]; conv_bytes defaults to state_bytes."""
    h, K = cfg.kda_num_heads // tp, cfg.kda_head_dim
    conv_bytes = state_bytes if conv_bytes is None else conv_bytes
    recurrent = h * K * K * state_bytes
    conv = 3 * h * K * (cfg.short_conv_kernel_size - 1) * conv_bytes
    return len(cfg.kda_layers) * (recurrent + conv)
