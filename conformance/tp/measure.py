"""The bytes a rank read to build its shard, as the kernel counts them, not as the reader says.

A reader that copies a whole tensor and reports only its slice would pass a self-reported count. Here the
count comes from the operating system, over the span of the shard build:
- bytes passed to read calls: `rchar` of /proc/thread-self/io (this thread only, so the collective
  transport's threads and other ranks run as threads are not counted);
- bytes of the weight files the reader mapped that are resident in this process: the `Rss` of those
  mappings in /proc/self/smaps (page granular: touching one byte of a page counts the page). Only the
  reader's own mappings are looked at, so that ranks run as threads of one process (k3ref.tp.LoopbackGroup)
  do not count each other's pages.
`MeasuredReader` copies every slice with pread and never through the mapping, so an honest rank reads
exactly its slices (plus the small padded A_log vectors it needs whole), and any read through the mapping
shows as mapped pages. `measured_shard` fails a rank whose measured bytes exceed its plan's bytes.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np

from k3ref.expert_backend import MmapExpertStore
from k3ref.safetensors_io import numpy_dtype
from k3ref.tp import TpPlan
from k3ref.tp_weights import ShardBytes, SliceReader, read_rank_shard
from k3ref.weights import HeaderEntry

THREAD_IO = Path("/proc/thread-self/io")
SMAPS = Path("/proc/self/smaps")


class OverRead(ValueError):
    """A rank read more of the weight files than its shard holds."""


@dataclasses.dataclass(frozen=True)
class ReadCounters:
    """What the kernel counted at one moment: bytes read by this thread's read calls, resident bytes of the
    mappings `spans` (address ranges)."""

    syscalls: int
    mapped: int

    @classmethod
    def before(cls, spans: list[tuple[int, int]]) -> ReadCounters:
        """The counters at the start of a span: smaps first, so reading it is not counted in the span."""
        mapped = _mapped_bytes(spans)
        return cls(_rchar(counting_this_read=True), mapped)

    @classmethod
    def after(cls, spans: list[tuple[int, int]]) -> ReadCounters:
        """The counters at the end of a span: rchar first, before reading smaps adds to it."""
        syscalls = _rchar(counting_this_read=False)
        return cls(syscalls, _mapped_bytes(spans))

    def since(self, before: ReadCounters) -> ReadCounters:
        return ReadCounters(self.syscalls - before.syscalls, max(0, self.mapped - before.mapped))

    @property
    def total(self) -> int:
        return self.syscalls + self.mapped


def measurable() -> bool:
    """True where the kernel exposes both counters (Linux)."""
    return THREAD_IO.exists() and SMAPS.exists()


def _rchar(*, counting_this_read: bool) -> int:
    """This thread's rchar. The kernel reports the value before this read of the counters file, and counts
    the text as read afterwards: counting_this_read adds it (the start of a span, so that it is not taken for
    a read within the span)."""
    raw = THREAD_IO.read_bytes()
    for line in raw.decode().splitlines():
        key, _, value = line.partition(":")
        if key == "rchar":
            return int(value) + (len(raw) if counting_this_read else 0)
    raise OSError(f"{THREAD_IO}: expected an 'rchar:' line, found none")


def _mapped_bytes(spans: list[tuple[int, int]]) -> int:
    """Resident bytes of this process's mappings that overlap the address ranges `spans`."""
    total, inside = 0, False
    for line in SMAPS.read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):   # a mapping's header line
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            inside = any(lo < end and start < hi for start, end in spans)
        elif inside and fields[:1] == ["Rss:"]:
            total += int(fields[1]) * 1024
    return total


class MeasuredReader(SliceReader):
    """A SliceReader that copies slices with pread (the kernel counts them), never by touching the mapping;
    the mapping only gives the views their shapes and offsets."""

    def __init__(self) -> None:
        super().__init__()
        self._fds: dict[str, int] = {}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def view(self, name: str, h: HeaderEntry) -> np.ndarray:
        if name.endswith("A_log"):   # the shard pads a copy of it (k3ref.tp.shard): read the short vector whole
            raw = np.frombuffer(self._pread(str(h.path), h.begin, h.end - h.begin), np.uint8)
            return raw.view(numpy_dtype(h.dtype)).reshape(h.shape)
        return super().view(name, h)

    def copy(self, part: np.ndarray, elements: int | None = None) -> np.ndarray:
        path, offset = self._locate(part)
        out = np.empty(part.shape, part.dtype)
        flat = out.reshape(-1, part.shape[-1]) if part.ndim else out.reshape(1, 1)
        for row, start in enumerate(_row_offsets(part, offset)):
            flat[row] = np.frombuffer(self._pread(path, start, flat[row].nbytes), part.dtype)
        self.bytes_read += out.nbytes
        return out

    def _locate(self, part: np.ndarray) -> tuple[str, int]:
        """(file, byte offset in it) of the first element of a view into one of the mappings."""
        address = part.__array_interface__["data"][0]
        for path, whole in self.mappings.items():
            base = whole.__array_interface__["data"][0]
            if base <= address < base + whole.nbytes:
                return str(path), address - base
        raise ValueError("MeasuredReader.copy: expected a view of a mapped weight file, found an array of none")

    def _pread(self, path: str, offset: int, size: int) -> bytes:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        data = os.pread(self._fds[path], size, offset)
        if len(data) != size:
            raise ValueError(f"{path}: expected {size} bytes at offset {offset}, the file ends after {len(data)}")
        return data


def _row_offsets(part: np.ndarray, offset: int) -> Iterator[int]:
    """The file offset of each innermost row of `part` (a view whose last axis is contiguous)."""
    if part.ndim == 0:
        yield offset
        return
    if part.ndim and part.shape[-1] > 1 and part.strides[-1] != part.itemsize:
        raise ValueError(f"MeasuredReader.copy: expected a view with a contiguous last axis, found strides "
                         f"{part.strides} for itemsize {part.itemsize}")
    for index in np.ndindex(*part.shape[:-1]):
        yield offset + sum(i * s for i, s in zip(index, part.strides[:-1], strict=True))


def _map_files(reader: SliceReader, entries: Mapping[str, HeaderEntry]) -> list[tuple[int, int]]:
    """Map every file before the span is measured (mapping reads no weight, but the first one imports the
    mmap module, and that read of its source is not the rank's); the address ranges of the mappings."""
    first: dict[Path, tuple[str, HeaderEntry]] = {}
    for name, h in entries.items():
        if not name.endswith("A_log"):
            first.setdefault(h.path, (name, h))
    for name, h in first.values():
        reader.view(name, h)
    # the reader's own mappings, not what its view returned: a reader may hand out copies
    maps = reader.mappings.values()
    return [(m.__array_interface__["data"][0], m.__array_interface__["data"][0] + max(m.nbytes, 1)) for m in maps]


def measured_shard(plan: TpPlan, rank: int, entries: Mapping[str, HeaderEntry], *, prefix: str = "",
                   reader: SliceReader | None = None, itemsize: Callable[[str], int] | None = None,
                   experts: MmapExpertStore | None = None) -> tuple[Mapping[str, np.ndarray], ShardBytes]:
    """`read_rank_shard` with `ShardBytes.read` measured by the kernel; OverRead when the rank read more than
    its plan's bytes (`plan.rank_bytes(rank, itemsize)["total"]`). Where the kernel has no counters the
    reader's own count stays (and nothing is checked). experts: the store that serves the rank's routed
    experts from its mappings (none of their bytes is read here; see read_rank_shard)."""
    reader = reader if reader is not None else MeasuredReader()
    if not measurable():
        return read_rank_shard(plan, rank, entries, prefix=prefix, reader=reader, experts=experts)
    spans = _map_files(reader, entries)
    before = ReadCounters.before(spans)
    try:
        shard, cost = read_rank_shard(plan, rank, entries, prefix=prefix, reader=reader, experts=experts)
    finally:
        if isinstance(reader, MeasuredReader):
            reader.close()
    read = ReadCounters.after(spans).since(before)
    allowed = plan.rank_bytes(rank, itemsize)["total"]
    if read.total > allowed:
        raise OverRead(f"rank {rank}: read {read.total:,} B of the weight files ({read.syscalls:,} B by read "
                       f"calls, {read.mapped:,} B of mapped pages, as the kernel counts them), more than the "
                       f"{allowed:,} B of its shard (the reader reported {cost.read:,} B)")
    return shard, dataclasses.replace(cost, read=read.total)
