"""DumpWriter: one rank's side of writing a dump (format in docs/dumps.md).

Each file goes to a temp name and is renamed into place, so a reader never sees half a file; the top manifest
is written last (by rank 0's close), so a dump without one is unfinished. Tensors are stored in their own dtype
(a bf16 tensor as BF16 bytes); safetensors files are written here byte by byte (no torch.save, no pickle).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from k3ref.config import K3Config

from .errors import DumpError, DumpManifestError
from .names import (
    DTYPE_TAGS,
    FORMAT,
    INT_KEYS,
    LAYER_KEYS,
    MANIFEST,
    VERSION,
    Split,
    expected_shapes,
    parse_splits,
    split_name,
    splits_json,
    step_file,
)

# numpy dtype -> safetensors tag, for what a dump may hold.
_TAG_OF = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32",
           np.dtype(np.float64): "F64", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}
_CHUNK = 1 << 22


def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy array holding exactly the values of `tensor` (numpy, or a torch tensor on any device; a bf16
    torch tensor becomes an ml_dtypes.bfloat16 array of the same bits)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if type(tensor).__module__.startswith("torch"):
        import torch  # noqa: PLC0415 -- optional: only a torch tensor brings us here

        t = tensor.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(tensor)


def safetensors_bytes(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """The safetensors encoding of `tensors` (little-endian, C order, sorted by name, 8-byte aligned header)."""
    entries: dict[str, Any] = {}
    blobs, at = [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        raw = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        entries[name] = {"dtype": _TAG_OF[a.dtype], "shape": list(a.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    return _header_bytes(entries, metadata) + b"".join(blobs)


def _header_bytes(entries: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    head = json.dumps({"__metadata__": dict(metadata), **entries}, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


class _StepSpool:
    """One step's tensors spooled to a scratch file as they are put, so that a step of a real-size model (GBs
    at a long prefill) never sits in memory whole; `finish` writes the safetensors file around them."""

    def __init__(self, scratch: Path):
        self.scratch = scratch
        self.file = open(scratch, "w+b")  # noqa: SIM115 -- closed in finish() or discard()
        self.entries: dict[str, dict[str, Any]] = {}
        self.at = 0

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def add(self, name: str, a: np.ndarray) -> None:
        raw = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
        self.file.write(raw.data)
        self.entries[name] = {"dtype": _TAG_OF[a.dtype], "shape": list(a.shape),
                              "data_offsets": [self.at, self.at + raw.size]}
        self.at += raw.size

    def finish(self, dest: Path, metadata: Mapping[str, str]) -> dict[str, Any]:
        """Write `dest` (temp + rename); returns its rank-manifest entry {bytes, sha256}."""
        head = _header_bytes(self.entries, metadata)
        digest = hashlib.sha256(head)
        tmp = dest.with_name(dest.name + ".tmp")
        self.file.seek(0)
        with open(tmp, "wb") as out:
            out.write(head)
            while chunk := self.file.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dest)
        self.discard()
        return {"bytes": len(head) + self.at, "sha256": digest.hexdigest()}

    def discard(self) -> None:
        self.file.close()
        self.scratch.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, flush it to disk, and rename it into place."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()


class DumpWriter:
    """Writes one rank of a dump at `path`: rank{rank}/step{s:04d}.safetensors per step, the rank manifest at
    close, and (rank 0 only, at close, after the other ranks closed) the top manifest.

        w = DumpWriter(path, engine="my-engine 1.2", dtype="bfloat16", config=config_dict)
        w.begin_step("prefill", prompt_ids, start=0)
        w.put("layers.0.prefix", t) ...        # numpy arrays or torch tensors, without the batch dim
        w.end_step(chosen=next_id)
        ... one begin_step/put/end_step per decode step ...
        w.close()

    dtype: the engine's activation dtype; float tensors must have it, or float32 for the keys in `fp32`.
    splits: {key: {"how": "replicated"|"concat"|"sum", "axis": int}} beyond the defaults (docs/dumps.md).
    An existing dump at `path` is refused unless overwrite=True (then this rank's old files are removed).
    """

    def __init__(self, path: str | os.PathLike, *, engine: str, dtype: str, config: Mapping[str, Any],
                 tp_size: int = 1, rank: int = 0, splits: Mapping[str, Any] | None = None,
                 fp32: Iterable[str] = (), overwrite: bool = False):
        if dtype not in DTYPE_TAGS:
            raise DumpManifestError(f"dtype: expected one of {', '.join(DTYPE_TAGS)}, found {dtype!r}")
        if not (isinstance(tp_size, int) and tp_size >= 1 and isinstance(rank, int) and 0 <= rank < tp_size):
            raise DumpManifestError(f"tp_size/rank: expected 0 <= rank < tp_size, found rank {rank!r} of {tp_size!r}")
        fp32 = tuple(fp32)
        unknown = [k for k in fp32 if k not in LAYER_KEYS and k not in ("embed", "final.hidden", "logits")]
        if unknown:
            raise DumpManifestError(f"fp32: unknown tensor keys {unknown}")
        try:
            self.cfg = K3Config.from_json(dict(config))
        except ValueError as e:
            raise DumpManifestError(f"config: {e}") from None
        self.path, self.rank, self.tp_size = Path(path), rank, tp_size
        self.engine, self.dtype, self.config = str(engine), dtype, dict(config)
        self.splits: dict[str, Split] = parse_splits(dict(splits or {}), tp_size)
        self.fp32 = tuple(sorted(set(fp32)))
        self.rank_dir = self.path / f"rank{rank}"
        self._prepare(overwrite)
        self.steps: list[dict[str, Any]] = []
        self.chosen: list[int | None] = []
        self.files: dict[str, dict[str, Any]] = {}
        self.layers: set[int] = set()
        self._step: _StepSpool | None = None
        self._closed = False

    def _prepare(self, overwrite: bool) -> None:
        top = self.path / MANIFEST
        if not overwrite and (self.rank_dir.exists() or top.exists()):
            there = top if top.exists() else self.rank_dir
            raise DumpError(f"{self.path}: expected no dump there, found {there} (pass overwrite=True to replace it)")
        if overwrite:
            if self.rank == 0:
                top.unlink(missing_ok=True)
            shutil.rmtree(self.rank_dir, ignore_errors=True)
        self.rank_dir.mkdir(parents=True)

    # ----- steps -----

    def begin_step(self, kind: str, tokens: Any, start: int) -> None:
        """Open step len(steps): kind "prefill" (the first step, start 0) or "decode" (one token, start = the
        tokens so far)."""
        if self._closed or self._step is not None:
            raise DumpError(f"begin_step: expected a closed step and an open writer ({self._where()})")
        ids = [int(t) for t in np.asarray(to_numpy(tokens)).reshape(-1)]
        at = sum(len(s["tokens"]) for s in self.steps)
        want = "prefill" if not self.steps else "decode"
        if kind != want or start != at or not ids or (kind == "decode" and len(ids) != 1):
            raise DumpError(f"begin_step {len(self.steps)}: expected kind {want!r} at start {at} with "
                            f"{'one token' if want == 'decode' else 'at least one token'}, found {kind!r} at start "
                            f"{start} with {len(ids)} tokens")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise DumpError(f"begin_step {len(self.steps)}: expected token ids in [0, {self.cfg.vocab_size}), "
                            f"found {bad[:5]}")
        self.steps.append({"index": len(self.steps), "kind": kind, "start": start, "tokens": ids})
        self._step = _StepSpool(self.rank_dir / f".step{len(self.steps) - 1:04d}.spool")

    def put(self, name: str, tensor: Any) -> None:
        """Add tensor `name` (docs/dumps.md) to the open step; this rank's part of it under TP."""
        if self._step is None:
            raise DumpError(f"put {name!r}: expected an open step (call begin_step first) ({self._where()})")
        try:
            layer, key = split_name(name)
        except ValueError as e:
            raise DumpError(str(e)) from None
        a = np.asarray(to_numpy(tensor))
        self._check_dtype(name, key, a)
        self._check_shape(name, layer, key, a)
        if name in self._step:
            raise DumpError(f"put {name!r}: already put in step {len(self.steps) - 1}")
        self._step.add(name, a)
        if layer is not None:
            self.layers.add(layer)

    def _check_dtype(self, name: str, key: str, a: np.ndarray) -> None:
        if key in INT_KEYS:
            ok = a.dtype in (np.int32, np.int64)
            want = "int32 or int64"
        else:
            allowed = {self.dtype} | ({"float32"} if key in self.fp32 else set())
            ok = a.dtype.name in allowed
            want = " or ".join(sorted(allowed)) + ("" if key in self.fp32 else f" (list {key!r} in fp32 to allow "
                                                                              "float32)")
        if not ok:
            raise DumpError(f"put {name!r}: expected dtype {want}, found {a.dtype.name}")

    def _check_shape(self, name: str, layer: int | None, key: str, a: np.ndarray) -> None:
        T = len(self.steps[-1]["tokens"])
        shapes = expected_shapes(self.cfg, layer, key, T)
        split = self.splits.get(key, Split("replicated"))
        if self.tp_size > 1 and split.how == "concat" and shapes and a.ndim == len(shapes[0]):
            ax = split.axis % a.ndim   # this rank holds a slice along the axis: compare the other dims
            shapes = [s[:ax] + (a.shape[ax],) + s[ax + 1:] for s in shapes]
        if tuple(a.shape) not in shapes:
            want = " or ".join(str(list(s)) for s in shapes) if shapes else "no such tensor for this layer"
            raise DumpError(f"put {name!r} (step {len(self.steps) - 1}, {T} tokens): expected shape {want}, "
                            f"found {list(a.shape)}")

    def end_step(self, chosen: int | None = None) -> None:
        """Write the open step's file; `chosen`: the token the engine picked after the step (last position)."""
        if self._step is None:
            raise DumpError(f"end_step: expected an open step ({self._where()})")
        index = len(self.steps) - 1
        name = step_file(index)
        meta = {"format": FORMAT, "step": str(index), "rank": str(self.rank)}
        self.files[name] = self._step.finish(self.rank_dir / name, meta)
        self.chosen.append(None if chosen is None else int(chosen))
        self._step = None

    def close(self) -> Path:
        """Write this rank's manifest; rank 0 then writes the top manifest (call it after the other ranks'
        close). Returns the dump's path."""
        if self._step is not None:
            raise DumpError(f"close: step {len(self.steps) - 1} is still open (call end_step first)")
        if not self._closed:
            write_atomic(self.rank_dir / MANIFEST, json_bytes({"rank": self.rank, "files": self.files}))
            if self.rank == 0:
                write_atomic(self.path / MANIFEST, json_bytes(self.manifest()))
            self._closed = True
        return self.path

    def manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT, "version": VERSION, "engine": self.engine, "dtype": self.dtype, "config": self.config,
            "tp": {"size": self.tp_size, "splits": splits_json(self.splits)},
            "layers": sorted(self.layers), "steps": self.steps, "fp32": list(self.fp32)}
        if self.chosen and all(c is not None for c in self.chosen):
            out["chosen"] = self.chosen
        return out

    def _where(self) -> str:
        return f"rank {self.rank} of {self.path}"

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
