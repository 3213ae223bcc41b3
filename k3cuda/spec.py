"""Kernel specs: what the CPU-side gates and the loader need to know about each CUDA kernel.

Each wrapper module `k3cuda/<block>.py` declares one `KernelSpec` named `KERNEL` for its source file
`k3cuda/kernels/<block>.cu`. The CPU gates (tests/k3cuda/test_k3cuda_gates.py) compile every spec for every
arch in `ARCHS`, check ptxas resources against `EntrySpec.max_registers` / spills, and check each PTX
`.entry` parameter list against `EntrySpec.arg_format` (PyCUDA `prepare()` format characters).
"""
from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
ARCHS = ("sm_90", "sm_100", "sm_121")  # H100/H200, B200 and GB10

# PyCUDA prepare() format characters -> (size, alignment) in the packed argument buffer.
# 'P' is a device pointer (8 bytes). Struct-style native alignment, as PyCUDA packs them.
FORMAT_SIZES = {
    "P": 8, "q": 8, "Q": 8, "d": 8,
    "i": 4, "I": 4, "f": 4,
    "h": 2, "H": 2, "b": 1, "B": 1,
}
# 'Ns' is an N-byte blob (a by-value struct; 1-aligned, as PyCUDA's struct packing places it) and 'x' a
# pad byte (no parameter): a struct parameter with 8-byte alignment after an int is packed as 'i4x16s'.
MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_SM = 65536


def register_budget(block_threads: int, min_blocks: int) -> int:
    """Registers per thread that __launch_bounds__(block_threads, min_blocks) leaves: 65536 / (T * M), <= 255,
    rounded down to the allocation granule of 8."""
    return min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // (block_threads * min_blocks) // 8 * 8)


def parse_format(arg_format: str) -> list[tuple[str, int]]:
    """Split a prepare() format into parameters: [(char, size)]; pad bytes 'x' come out as ('x', n).

    'PPi' -> [('P', 8), ('P', 8), ('i', 4)]; '4x16s' -> [('x', 4), ('s', 16)]; '2f' -> [('f', 4), ('f', 4)].
    """
    out, count = [], ""
    for ch in arg_format:
        if ch.isdigit():
            count += ch
            continue
        n = int(count) if count else 1
        count = ""
        if ch in "sx":
            out.append((ch, n))
        elif ch in FORMAT_SIZES:
            out.extend([(ch, FORMAT_SIZES[ch])] * n)
        else:
            raise ValueError(f"arg_format {arg_format!r}: unknown character {ch!r}; expected one of "
                             f"{''.join(FORMAT_SIZES)}, 'Ns' or 'x'")
    if count:
        raise ValueError(f"arg_format {arg_format!r}: trailing count {count!r} without a type character")
    return out


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
        for ch, size in parse_format(self.arg_format):
            align = 1 if ch in "sx" else size
            off = (off + align - 1) // align * align
            if ch != "x":
                layout.append((off, size))
            off += size
        native = struct.calcsize("@" + self.arg_format.replace("P", "Q"))
        if off != native:
            raise ValueError(f"{self.name}: argument format {self.arg_format!r} packs to {off} bytes here but "
                             f"{native} bytes by the host's native struct layout; fix parse_format's sizes")
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


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The fewest bytes a kernel must move through device memory and the FLOPs it must do.

    Built term by term in each wrapper's `traffic()` (one comment per term, FlashMLA-style).
    """

    bytes: int
    flops: int


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One timed configuration of a kernel for the GPU speed gates (tools/gpu_bench.py).

    make_inputs(rng) -> dict of numpy arrays/scalars, the core's keyword arguments (fresh random data);
    traffic: what the kernel must move for these shapes; target_bw_ratio: the speed gate on achieved
    bytes/s over the copy bandwidth measured in the same run (None = report only).
    """

    label: str
    make_inputs: object
    traffic: Traffic
    target_bw_ratio: float | None = None


@dataclasses.dataclass(frozen=True)
class CheckCase:
    """One correctness configuration of a kernel for the GPU tests (tests/k3cuda/test_k3cuda_gpu.py).

    make_inputs(rng) -> dict, the core's keyword arguments (small, awkward sizes; fresh random data).
    """

    label: str
    make_inputs: object
