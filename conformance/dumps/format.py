"""Engine per-layer dumps, format version 1 (docs/dumps.md): the reader `Dump` and the writer `DumpWriter`.

`Dump.open` checks the whole dump before anything is read from it: the manifests, every file's size, sha256
and safetensors header, the required tensors of every step and layer, their dtypes and their shapes against
the config. Tensor data is read only when asked for (`get`, `raw`), one tensor at a time, so a dump of a
real-size model opens without loading it. Tensor-parallel ranks are merged on read per the manifest's splits.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from k3ref.safetensors_io import Header, numpy_dtype

from .errors import DumpFileError, DumpManifestError, DumpMissingError, DumpRankError
from .format_checks import DumpStep, Manifest, check_rank, check_step, read_manifest
from .names import Split, num_blocks, split_name

__all__ = ["Dump", "DumpStep"]


class Dump:
    """A checked dump, read lazily. See the module docstring and docs/dumps.md."""

    def __init__(self, path: Path, man: Manifest, files: list[dict[int, tuple[Path, Header]]],
                 shapes: list[dict[str, tuple[int, ...]]]):
        self.path = path
        self.manifest = man
        self.engine, self.dtype, self.config = man.engine, man.dtype, man.config
        self.raw_config = man.raw_config
        self.tp_size, self.splits, self.fp32 = man.tp_size, man.splits, man.fp32
        self.steps: list[DumpStep] = man.steps
        self.layers: tuple[int, ...] = man.layers
        self.chosen: list[int] | None = man.chosen
        self._files = files          # per rank: {step: (file, header)}
        self._shapes = shapes        # per step: {name: merged shape}

    @classmethod
    def open(cls, path: str | os.PathLike, *, verify: bool = True) -> Dump:
        """Check the dump at `path` and return it; a DumpError subclass names the first problem.

        verify=False skips the sha256 of the files (their sizes and headers are still checked)."""
        p = Path(path)
        try:
            man = read_manifest(p)
            extra = sorted(d.name for d in p.glob("rank*") if d.is_dir() and d.name[4:].isdigit()
                           and int(d.name[4:]) >= man.tp_size)
            if extra:
                raise DumpManifestError(f"{p}: the manifest says tp size {man.tp_size}, found rank directories "
                                        f"{extra}")
            files = [check_rank(p, r, len(man.steps), verify) for r in range(man.tp_size)]
        except OSError as e:   # permissions, a directory where a file belongs, a vanished file
            raise DumpFileError(f"{p}: cannot read the dump: {e}") from None
        shapes = [check_step(man, s, [f[s.index] for f in files]) for s in man.steps]
        return cls(p, man, files, shapes)

    # ----- what is there -----

    def names(self, step: int) -> list[str]:
        """The tensor names of step `step`, sorted."""
        return sorted(self._shapes[self._step(step)])

    def has(self, step: int, name: str) -> bool:
        return 0 <= step < len(self.steps) and name in self._shapes[step]

    def shape(self, step: int, name: str) -> tuple[int, ...]:
        """The merged shape of a tensor (from the headers; nothing is read)."""
        self._require(step, name)
        return self._shapes[step][name]

    def _step(self, step: int) -> int:
        if not (isinstance(step, (int, np.integer)) and 0 <= step < len(self.steps)):
            raise DumpMissingError(f"{self.path}: step {step!r}: expected one of 0..{len(self.steps) - 1}")
        return int(step)

    def _require(self, step: int, name: str) -> None:
        if name not in self._shapes[self._step(step)]:
            raise DumpMissingError(f"{self.path}: step {step}: no tensor {name!r} in this dump")

    # ----- reading -----

    def _read_rank(self, rank: int, step: int, name: str) -> np.ndarray:
        f, header = self._files[rank][step]
        e = header.entries[name]
        dtype = numpy_dtype(e.dtype).newbyteorder("<")
        count = int(np.prod(e.shape, dtype=np.int64))
        try:
            with open(f, "rb") as fh:
                fh.seek(header.data_start + e.begin)
                data = fh.read(e.end - e.begin)
        except OSError as err:
            raise DumpFileError(f"{f}: cannot read tensor {name}: {err}") from None
        if len(data) != e.end - e.begin:
            raise DumpFileError(f"{f}: tensor {name}: expected {e.end - e.begin} bytes, read {len(data)} (the file "
                                "changed since the dump was opened)")
        return np.frombuffer(data, dtype, count).reshape(e.shape).astype(dtype.newbyteorder("="), copy=True)

    def raw(self, step: int, name: str) -> np.ndarray:
        """The tensor merged over ranks, in its stored dtype (BF16 as ml_dtypes.bfloat16).

        replicated: rank 0's copy, after checking that every rank holds the same bits (else DumpRankError);
        concat: the ranks' parts in rank order; sum: the parts added in rank order in float64 and rounded once
        to the stored dtype."""
        self._require(step, name)
        parts = [self._read_rank(r, step, name) for r in range(self.tp_size)]
        if len(parts) == 1:
            return parts[0]
        split = self.splits.get(split_name(name)[1], Split("replicated"))
        if split.how == "concat":
            return np.concatenate(parts, axis=split.axis)
        if split.how == "sum":
            total = parts[0].astype(np.float64)
            for p in parts[1:]:
                total = total + p.astype(np.float64)
            return total.astype(parts[0].dtype)
        for r, p in enumerate(parts[1:], start=1):
            self._same_bits(step, name, parts[0], p, r)
        return parts[0]

    def _same_bits(self, step: int, name: str, a: np.ndarray, b: np.ndarray, rank: int) -> None:
        if a.tobytes() == b.tobytes():
            return
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        d = np.where(np.isnan(d), np.inf, d)
        at = [int(i) for i in np.unravel_index(int(np.argmax(d)), d.shape)]
        raise DumpRankError(f"{self.path}: step {step} {name}: replicated, so every rank must hold the same bits; "
                            f"rank {rank} differs from rank 0 (max |diff| {float(d.max()):.6g} at index {at})")

    def get(self, step: int, name: str) -> np.ndarray:
        """raw() widened exactly: floats to float64, ids to int64."""
        a = self.raw(step, name)
        return a.astype(np.int64) if a.dtype.kind in "iu" else a.astype(np.float64)

    def layer_input(self, step: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(blocks [N, T, D], prefix [T, D]) in float64: the AttnRes state before layer `layer` (N may be 0)."""
        prefix = self.get(step, f"layers.{layer}.prefix")
        if num_blocks(self.config, layer) == 0:
            return np.zeros((0,) + prefix.shape), prefix
        return self.get(step, f"layers.{layer}.blocks"), prefix

    def nonfinite(self) -> list[str]:
        """One finding per tensor holding NaN or Inf: 'step 2 layer 5 a: 3 NaN rows (first row 1)'. Rows are token
        positions. These are the engine's findings, not errors of the dump."""
        out = []
        for s in self.steps:
            for name in self.names(s.index):
                layer, key = split_name(name)
                a = self.raw(s.index, name)
                if a.dtype.kind in "iu":
                    continue
                a = a.astype(np.float64)
                rows = np.moveaxis(a, 1, 0) if key == "blocks" else a
                flat = rows.reshape(rows.shape[0], -1)
                where = f"step {s.index} " + (f"layer {layer} {key}" if layer is not None else key)
                for what, bad in (("NaN", np.isnan(flat).any(axis=1)), ("Inf", np.isinf(flat).any(axis=1))):
                    if bad.any():
                        n, first = int(bad.sum()), int(np.argmax(bad))
                        out.append(f"{where}: {n} {what} row{'s' if n > 1 else ''} (first row {first})")
        return out

    def __repr__(self) -> str:
        return (f"Dump({str(self.path)!r}, engine={self.engine!r}, dtype={self.dtype}, tp={self.tp_size}, "
                f"{len(self.layers)} layers, {len(self.steps)} steps)")
