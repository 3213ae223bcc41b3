"""Serving routed experts straight from the checkpoint shards, and planning which to fetch next.

K3's routed experts are ~98% of its bytes (MXFP4, U8). `MmapExpertStore` maps each shard once
(numpy memmap) and hands out zero-copy U8 views at the data offsets of the safetensors header, so a
decode step touches only the experts the router picked; `.bytes_touched` counts what it handed out.
`PrefetchPlanner` turns router choices for upcoming tokens into an ordered, de-duplicated fetch list
(first use first) cut at a byte budget; `MmapExpertStore.prefetch` plans with it and asks the kernel to read
those experts' file pages ahead (posix_fadvise WILLNEED), so a cold decode step's expert reads overlap the
work between the router and the experts instead of faulting page by page. `kind_from_env` picks a store
backend by name.
`parse_expert_name` splits a full routed-expert tensor name into (layer, expert, w, part), so a weight
mapping (`k3ref.cpu_weights.CheckpointWeights`) can send those names to a store one tensor at a time.
"""
from __future__ import annotations

import concurrent.futures
import mmap
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from .weights import TEXT_PREFIX, CheckpointReader, HeaderEntry, expert_name

PARTS = tuple(f"w{w}_{part}" for w in (1, 2, 3) for part in ("packed", "scale"))
_FULL_EXPERT_RE = re.compile(re.escape(TEXT_PREFIX)
                             + r"layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight_(packed|scale)")


def parse_expert_name(name: str) -> tuple[int, int, int, str] | None:
    """`language_model.model.layers.{L}.block_sparse_moe.experts.{E}.w{W}.weight_{part}` -> (L, E, W, part);
    None for any other name (the inverse of `k3ref.weights.expert_name`)."""
    m = _FULL_EXPERT_RE.fullmatch(name)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)


E8M0_NAN = 255   # OCP MX v1.0: the E8M0 scale byte that encodes NaN


def _check_scale(scale: np.ndarray, name: str, layer: int, expert: int) -> None:
    """Raise ValueError when an E8M0 scale tensor holds the NaN byte (its whole 32-group would be NaN)."""
    bad = scale == E8M0_NAN
    if bad.any():
        row, group = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: layer {layer}, routed expert {expert}: E8M0 scale byte 255 (NaN) in "
                         f"{int(bad.sum())} group(s), first at row {row}, group {group} (elements "
                         f"{32 * group}..{32 * group + 31}); a checkpoint's scales are 0..254")


# Read-ahead budget per prefetch call: the 16 experts a K3 decode step picks in one layer are 280 MB, a
# 16-token prefill's up to 256 are 4.5 GB; the first GiB in order of use keeps the read ahead of the compute
# without pushing the rest of the page cache out.
PREFETCH_BUDGET_BYTES = 1 << 30
# posix_fadvise exists on Linux and most Unixes, not on macOS or Windows: there prefetch plans and counts
# nothing.
CAN_ADVISE = hasattr(os, "posix_fadvise")


class MmapExpertStore:
    """Routed experts per (layer, expert), served zero-copy from memory-mapped shards.

    get(layer, expert) -> {"w1_packed": u8 [I, L/2], "w1_scale": u8 [I, L/32], "w2_packed": u8 [L, I/2],
    "w2_scale": u8 [L, I/32], "w3_packed", "w3_scale"}: read-only views into the shard memmaps.
    tensor(layer, expert, w, part) -> one of those six (what a weight mapping asks for, name by name).
    Both add the bytes handed out to `.bytes_touched`; `.gets` counts get() calls.
    prefetch(layer, indices) -> asks the kernel to read the chosen experts' pages ahead, within
    `prefetch_budget` bytes per call (0: never); `.bytes_advised` and `.advised` count what it asked for.
    """

    name = "mmap"

    def __init__(self, source: str | os.PathLike | CheckpointReader, prefetch_budget: int = PREFETCH_BUDGET_BYTES):
        self.reader = source if isinstance(source, CheckpointReader) else CheckpointReader(source)
        self._maps: dict[Path, np.memmap] = {}
        self._scales_passed: set[str] = set()
        self.bytes_touched = 0
        self.gets = 0
        self.planner = PrefetchPlanner(self, prefetch_budget)
        self.bytes_advised = 0
        self.advised: list[tuple[int, int]] = []
        self._adviser: concurrent.futures.ThreadPoolExecutor | None = None
        self._adviser_pid = 0            # the process that made the adviser (a forked child has no thread)
        self._pending: list[concurrent.futures.Future] = []

    def _entry(self, layer: int, expert: int, w: int, part: str) -> tuple[str, HeaderEntry]:
        name = expert_name(layer, expert, w, part)
        h = self.reader.entries.get(name)
        if h is None:
            raise KeyError(f"routed expert tensor {name!r} is not in {self.reader.directory} "
                           f"(is layer {layer} a MoE layer, expert {expert} < n_routed_experts?)")
        if h.dtype != "U8":
            raise ValueError(f"{name}: expected U8 MXFP4 bytes, found {h.dtype}")
        return name, h

    def _entries(self, layer: int, expert: int) -> dict[str, HeaderEntry]:
        out = {}
        for p in PARTS:
            w, kind = p.split("_")
            out[p] = self._entry(layer, expert, int(w[1]), kind)[1]
        return out

    def _map(self, path: Path) -> np.memmap:
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path]

    def _read(self, name: str, h: HeaderEntry) -> np.ndarray:
        """One tensor's bytes: a view of the shard memmap (no copy)."""
        return self._map(h.path)[h.begin:h.end].reshape(h.shape)

    def tensor(self, layer: int, expert: int, w: int, part: str) -> np.ndarray:
        """One U8 tensor of a routed expert (w in {1, 2, 3}, part in {"packed", "scale"}); counts its bytes.

        A scale tensor holding the E8M0 NaN byte raises ValueError naming the tensor, layer and expert here,
        where they are known, rather than as a nameless non-finite value deep in the expert's GEMV.
        """
        name, h = self._entry(layer, expert, w, part)
        out = self._read(name, h)
        if part == "scale":
            self._checked_scale(out, name, layer, expert)
        self.bytes_touched += h.end - h.begin
        return out

    def _checked_scale(self, scale: np.ndarray, name: str, layer: int, expert: int) -> None:
        """`_check_scale` the first time a scale tensor is handed out; once it passed, not again (its scan reads
        344 KB of a K3 expert's scales, ~36 us, 591 times in a 16-token prefill's layer). The shard is mapped
        read-only and nothing here writes it, so what passed is what the kernels read (a checkpoint rewritten under
        a live store would leave its header's offsets stale as well); a failing tensor raises on every hand-out."""
        if name not in self._scales_passed:
            _check_scale(scale, name, layer, expert)
            self._scales_passed.add(name)

    def get(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """The six U8 tensors of one routed expert, as views of the shard memmap (no copy)."""
        entries = self._entries(layer, expert)   # all six checked before any is counted
        out = {}
        for p, h in entries.items():
            name = expert_name(layer, expert, int(p[1]), p.split("_")[1])
            out[p] = self._read(name, h)
            if p.endswith("scale"):
                self._checked_scale(out[p], name, layer, expert)
            self.bytes_touched += h.end - h.begin
        self.gets += 1
        return out

    def expert_bytes(self, layer: int, expert: int) -> int:
        """Bytes of one routed expert (all six tensors), from the header alone."""
        return sum(h.end - h.begin for h in self._entries(layer, expert).values())

    def prefetch(self, layer: int, indices) -> list[tuple[int, int]]:
        """Read ahead the experts the router chose for `layer`: indices [T, k] (or [k]) -> the (layer, expert)
        pairs advised, in order of first use, cut at the budget (`PrefetchPlanner`).

        For each, posix_fadvise(POSIX_FADV_WILLNEED) over its six tensors' file ranges (widened to whole
        pages, adjacent ranges merged) starts the kernel's read into the page cache; the memmap views then
        find the pages there. The calls run on one background thread (they release the GIL, and each walks
        the page cache of its range: up to ~10 ms per K3 expert measured), so this returns at once and the
        advice overlaps the caller's work; `settle()` waits for it. Counts the tensor bytes in
        `.bytes_advised` and the pairs in `.advised` when planned. Without posix_fadvise (macOS, Windows)
        nothing is advised."""
        idx = np.asarray(indices)
        if idx.ndim == 1:
            idx = idx[None]
        if not CAN_ADVISE:
            return []
        plan = self.planner.plan({int(layer): idx})
        ranges: dict[Path, list[tuple[int, int]]] = {}
        for lay, e in plan:
            for h in self._entries(lay, e).values():
                ranges.setdefault(h.path, []).append((h.begin, h.end))
                self.bytes_advised += h.end - h.begin
        if ranges:
            if self._adviser is None or self._adviser_pid != os.getpid():
                self._adviser = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expert-read-ahead")
                self._adviser_pid, self._pending = os.getpid(), []
            self._pending = [f for f in self._pending if not f.done()]
            self._pending += [self._adviser.submit(_advise_willneed, path, spans) for path, spans in ranges.items()]
        self.advised += plan
        return plan

    def settle(self) -> None:
        """Wait until every read-ahead request made so far has been handed to the kernel (its errors raise)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()


def _advise_willneed(path: Path, spans: list[tuple[int, int]]) -> None:
    """posix_fadvise WILLNEED over the [begin, end) byte ranges of file `path`, widened to whole pages (the
    kernel reads whole pages; an unaligned offset would be rounded down by it anyway), touching or overlapping
    ranges merged into one call."""
    merged: list[list[int]] = []
    for begin, end in sorted(spans):
        lo = begin - begin % mmap.PAGESIZE
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([lo, end])
    fd = os.open(path, os.O_RDONLY)
    try:
        for lo, end in merged:
            os.posix_fadvise(fd, lo, end - lo, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


class ReaderExpertStore(MmapExpertStore):
    """The same interface through CheckpointReader (safetensors copies): a baseline for the mmap store."""

    name = "reader"

    def _read(self, name: str, h: HeaderEntry) -> np.ndarray:
        return self.reader[name]


BACKENDS: dict[str, type[MmapExpertStore]] = {"mmap": MmapExpertStore, "reader": ReaderExpertStore}


def kind_from_env(var: str = "K3_EXPERT_BACKEND", default: str = "mmap") -> type[MmapExpertStore]:
    """The expert store class named by environment variable `var` (unset or empty: `default`)."""
    kind = os.environ.get(var) or default
    try:
        return BACKENDS[kind]
    except KeyError:
        raise ValueError(f"{var}={kind!r}: unknown expert backend; known: {sorted(BACKENDS)}") from None


# What a PrefetchPlanner sizes experts by: a store, a function (layer, expert) -> bytes, or one size for all.
ExpertSizes = MmapExpertStore | Callable[[int, int], int] | int | np.integer


def _size_of_expert(sizes: ExpertSizes) -> Callable[[int, int], int]:
    """PrefetchPlanner's `sizes` as one function (layer, expert) -> bytes."""
    if isinstance(sizes, (int, np.integer)):
        if sizes <= 0:
            raise ValueError(f"sizes: expected bytes per expert > 0, found {sizes}")
        n = int(sizes)
        return lambda layer, expert: n
    if isinstance(sizes, MmapExpertStore):
        return sizes.expert_bytes
    if callable(sizes):
        return sizes
    raise ValueError(f"sizes: expected a store, a callable or an int, found {type(sizes).__name__}")


class PrefetchPlanner:
    """Router choices for upcoming tokens -> ordered fetch list (first use first), cut at a byte budget.

    sizes: an expert store (its `.expert_bytes(layer, expert)`), a callable (layer, expert) -> bytes, or one
    int (every expert the same size). byte_budget: the most bytes the list may add up to.
    """

    def __init__(self, sizes: ExpertSizes, byte_budget: int):
        self._size = _size_of_expert(sizes)
        if byte_budget < 0:
            raise ValueError(f"byte_budget: expected >= 0, found {byte_budget}")
        self.byte_budget = int(byte_budget)

    def plan(self, choices: Mapping[int, np.ndarray]) -> list[tuple[int, int]]:
        """choices: {layer: indices [T, k]} for the next T tokens -> [(layer, expert), ...].

        Order of first use: token by token, within a token layer by layer (ascending), within a layer in
        router slot order. Each (layer, expert) appears once. The list stops before the first entry that
        would push the total past byte_budget (later, smaller entries are not pulled forward: the order
        is the order the decode will need them).
        """
        T = None
        arrays = {}
        for layer, idx in choices.items():
            a = np.asarray(idx)
            if a.ndim != 2 or a.dtype.kind not in "iu":
                raise ValueError(f"choices[{layer}]: expected integer indices [T, k], found {a.dtype} {a.shape}")
            if T is not None and a.shape[0] != T:
                raise ValueError(f"choices[{layer}]: expected T={T} tokens like the other layers, found {a.shape[0]}")
            T = a.shape[0]
            arrays[int(layer)] = a
        order, seen = [], set()
        for t in range(T or 0):
            for layer in sorted(arrays):
                for e in arrays[layer][t]:
                    key = (layer, int(e))
                    if key not in seen:
                        seen.add(key)
                        order.append(key)
        out, total = [], 0
        for key in order:
            size = self._size(*key)
            if total + size > self.byte_budget:
                break
            out.append(key)
            total += size
        return out
