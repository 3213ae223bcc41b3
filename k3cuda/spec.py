"""Kernel specs: what the CPU-side gates and the loader need to know about each CUDA kernel.

Each wrapper module `k3cuda/<block>.py` declares one `KernelSpec` named `KERNEL` for its source file
`k3cuda/kernels/<block>.cu`. The CPU gates (tests/test_k3cuda_gates.py) compile every spec for every
arch in `ARCHS`, check ptxas resources against `EntrySpec.max_registers` / spills, and check each PTX
`.entry` parameter list against `EntrySpec.arg_format` (PyCUDA `prepare()` format characters).
"""
from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
ARCHS = ("sm_90", "sm_121")  # H100/H200 and GB10

# PyCUDA prepare() format characters -> (size, alignment) in the packed argument buffer.
# 'P' is a device pointer (8 bytes). Struct-style native alignment, as PyCUDA packs them.
FORMAT_SIZES = {
    "P": 8, "q": 8, "Q": 8, "d": 8,
    "i": 4, "I": 4, "f": 4,
    "h": 2, "H": 2, "b": 1, "B": 1,
}


@dataclasses.dataclass(frozen=True)
class EntrySpec:
    """One `extern "C" __global__` entry point."""

    name: str               # the extern "C" symbol
    arg_format: str         # PyCUDA prepare() format, one char per parameter, in order
    block_threads: int      # threads per block the wrapper launches (== __launch_bounds__ max)
    max_registers: int      # budget: 65536 / (block_threads * min_blocks_per_sm), from __launch_bounds__

    def packed_layout(self) -> list[tuple[int, int]]:
        """(offset, size) of each parameter as the wrapper packs them (native alignment)."""
        layout, off = [], 0
        for ch in self.arg_format:
            size = FORMAT_SIZES[ch]
            off = (off + size - 1) // size * size
            layout.append((off, size))
            off += size
        assert off == struct.calcsize("@" + self.arg_format.replace("P", "Q")), "layout disagrees with struct"
        return layout


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One .cu file and its entry points."""

    block: str                       # the block name (matches k3ref, goldens, gate rows)
    source: str                      # file name under k3cuda/kernels/
    entries: tuple[EntrySpec, ...]
    defines: tuple[str, ...] = ()    # extra -D flags

    @property
    def path(self) -> Path:
        return KERNEL_DIR / self.source

    def entry(self, name: str) -> EntrySpec:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"{self.source} has no entry {name!r}; entries: {[e.name for e in self.entries]}")
