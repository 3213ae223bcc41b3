"""Strict readers for the files k3ref and the runner take from users: safetensors headers and JSON documents.

One parser per format, shared by golden files and checkpoint shards, so that every defect of a file is
reported the same way: a `FormatError` whose message names the file and, where one is to blame, the
tensor. No other exception type escapes (no OverflowError, RecursionError, UnicodeDecodeError, OSError
or the safetensors library's own error).

A safetensors file is an 8-byte little-endian header length n, n bytes of UTF-8 JSON starting with '{'
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}), then the data
buffer. The rules below are the safetensors library's (its loader refuses a file that breaks any of
them), checked here before a byte of tensor data is touched:
- n <= MAX_HEADER_BYTES and 8 + n <= file size; the header is UTF-8 JSON, an object, beginning with '{';
- each tensor: a known dtype string; a shape of non-negative ints; data_offsets [begin, end] of ints with
  end - begin == numel * itemsize (no overflow: the library computes these in 64 bits);
- the tensors, sorted by offset, tile the data buffer exactly: no gap, no overlap, no trailing bytes;
- `__metadata__` is an object of string to string.
This reader is stricter than the library where the library is lenient by accident: duplicate JSON keys,
NaN/Infinity literals, unknown entry fields and strings that are not valid Unicode are refused too.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# The safetensors library refuses a longer header (its HeaderTooLarge); a longer length field is damage.
MAX_HEADER_BYTES = 100_000_000
# Every dtype a safetensors header may name, with its item size in bytes.
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "I16": 2,
            "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
# The numpy dtype of each numeric tag that numpy has natively (little-endian on disk); BF16 via ml_dtypes.
NUMPY_DTYPES = {tag: np.dtype(name) for tag, name in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("I64", "int64"), ("I32", "int32"),
    ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
    ("BOOL", "bool"))}
# Dims and byte counts must fit a signed 64-bit index (numpy's intp; the library's usize is wider).
_INDEX_LIMIT = 2**63
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


class FormatError(ValueError):
    """A file that breaks its format. `path` is the file (a label for in-memory data), `tensor` the tensor
    at fault or None; str() reads '<path>: tensor <name>: <what>'."""

    def __init__(self, path: str | os.PathLike, what: str, tensor: str | None = None):
        self.path, self.what, self.tensor = str(path), what, tensor
        where = f"{self.path}: tensor {tensor!r}" if tensor is not None else self.path
        super().__init__(f"{where}: {what}")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a header: dtype string, shape, byte range [begin, end) relative to the data buffer."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class Header:
    """A checked safetensors header. data_start: offset of the data buffer in the file (8 + n)."""

    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int


# ----- JSON -----

def _pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice in one object")
        out[k] = v
    return out


def _constant(name: str):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def _valid_unicode(obj: Any) -> str | None:
    """The first string (key or value) that is not encodable as UTF-8 (a lone surrogate escape), or None."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return x
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return None


def loads_strict(raw: bytes | memoryview | str, where: str | os.PathLike, what: str = "JSON") -> Any:
    """Parse UTF-8 JSON strictly: no duplicate keys, no NaN/Infinity, valid Unicode.

    Any defect raises FormatError('<where>: <what>: not valid JSON (...)').
    """
    try:
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(where, f"{what}: not valid JSON: not UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant)
    except RecursionError:   # the C scanner stops deep nesting with this, before the stack runs out
        raise FormatError(where, f"{what}: not valid JSON: nested too deeply") from None
    except ValueError as e:   # JSONDecodeError, a duplicate key, NaN/Infinity, an int of too many digits
        raise FormatError(where, f"{what}: not valid JSON ({e})") from None
    bad = _valid_unicode(obj)
    if bad is not None:
        raise FormatError(where, f"{what}: not valid JSON: string {bad!r} is not valid Unicode")
    return obj


def read_json(path: str | os.PathLike, what: str) -> Any:
    """loads_strict of a file; a file that cannot be read (absent, a directory, a name too long) is a FormatError."""
    try:
        raw = Path(path).read_bytes()
    except (OSError, ValueError) as e:   # ValueError: a path with a NUL byte
        raise FormatError(path, f"cannot read {what}: {e}") from None
    return loads_strict(raw, path, what)


def numpy_dtype(tag: str) -> np.dtype:
    """The numpy dtype that holds a tensor stored as `tag` (BF16: ml_dtypes.bfloat16); ValueError naming the
    tags it knows when numpy has none (the FP8 tags)."""
    if tag == "BF16":
        return np.dtype(ml_dtypes.bfloat16)
    if tag not in NUMPY_DTYPES:
        raise ValueError(f"dtype: expected one of BF16, {', '.join(NUMPY_DTYPES)}, found {tag}")
    return NUMPY_DTYPES[tag]


def is_int(x: Any) -> bool:
    """A JSON integer (bool is not one, though Python says so)."""
    return isinstance(x, int) and not isinstance(x, bool)


# ----- safetensors -----

def header_length(first8: bytes, file_size: int, where: str | os.PathLike) -> int:
    """The header length n from the first 8 bytes, checked against the file size."""
    if len(first8) < 8 or file_size < 8:
        raise FormatError(where, f"truncated: {file_size} bytes, a safetensors file starts with an 8-byte header "
                                 "length")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise FormatError(where, f"bad header length {n}: the file holds {file_size} bytes (truncated, or not a "
                                 f"safetensors file; headers are at most {MAX_HEADER_BYTES} bytes)")
    return n


def _entry(name: str, info: Any, where, dtypes: Mapping[str, int]) -> Entry:
    def bad(what: str) -> FormatError:
        return FormatError(where, what, name)

    if not isinstance(info, dict):
        raise bad(f"header entry must be an object with dtype, shape, data_offsets, found {info!r:.80}")
    if set(info) != _ENTRY_KEYS:
        raise bad(f"header entry must have exactly the keys {sorted(_ENTRY_KEYS)}, found {sorted(info)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in dtypes:
        raise bad(f"dtype must be one of {sorted(dtypes)}, found {dtype!r:.80}")
    if not (isinstance(shape, list) and all(is_int(d) and 0 <= d < _INDEX_LIMIT for d in shape)):
        raise bad(f"shape must be a list of non-negative ints, found {shape!r:.80}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) and 0 <= o < _INDEX_LIMIT
                                                                      for o in offsets)):
        raise bad(f"data_offsets must be [begin, end] of non-negative ints, found {offsets!r:.80}")
    begin, end = offsets
    if begin > end:
        raise bad(f"data_offsets {offsets} run backwards")
    nbytes = dtypes[dtype]
    for d in shape:   # the library multiplies left to right in 64 bits: a product that overflows is refused
        nbytes *= d
        if nbytes >= _INDEX_LIMIT:
            raise bad(f"shape {shape} of {dtype} overflows a 64-bit byte count")
    if end - begin != nbytes:
        raise bad(f"data_offsets {offsets} hold {end - begin} bytes, {dtype} {shape} needs {nbytes}")
    return Entry(dtype, tuple(shape), begin, end)


def parse_header(raw: bytes | memoryview, data_size: int, where: str | os.PathLike,
                 dtypes: Mapping[str, int] = ITEMSIZE) -> tuple[dict[str, Entry], dict[str, str]]:
    """Check the JSON header `raw` (n bytes) against a data buffer of `data_size` bytes.

    Returns (entries by name, metadata). dtypes: the dtype strings accepted (a reader may accept fewer).
    """
    if raw[:1] != b"{":
        raise FormatError(where, f"bad header: not valid JSON (a header starts with '{{', found {bytes(raw[:8])!r})")
    header = loads_strict(raw, where, "bad header")
    if not isinstance(header, dict):   # unreachable after the '{' check, kept for clarity of the contract
        raise FormatError(where, f"bad header: expected a JSON object, found {type(header).__name__}")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise FormatError(where, f"bad header: __metadata__ must be an object of strings, found {meta!r:.120}")
    entries = {name: _entry(name, info, where, dtypes) for name, info in header.items()}
    at = 0
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.end > data_size:
            raise FormatError(where, f"data ends at byte {e.end} of the data buffer, past the end of the file "
                                     f"({data_size} data bytes): truncated", name)
        if e.begin != at:
            what = "overlaps the tensor before it" if e.begin < at else f"leaves a gap of {e.begin - at} bytes"
            raise FormatError(where, f"data_offsets [{e.begin}, {e.end}] {what} (the data must be contiguous "
                                     f"from byte {at})", name)
        at = e.end
    if at != data_size:
        raise FormatError(where, f"{data_size - at} trailing bytes after the last tensor (data buffer "
                                 f"{data_size} bytes, tensors end at {at})")
    return entries, meta


def parse_bytes(blob: bytes, where: str | os.PathLike, dtypes: Mapping[str, int] = ITEMSIZE) -> Header:
    """Check a whole safetensors file held in memory."""
    n = header_length(blob[:8], len(blob), where)
    entries, meta = parse_header(memoryview(blob)[8:8 + n], len(blob) - 8 - n, where, dtypes)
    return Header(entries, meta, 8 + n)


def read_header(path: str | os.PathLike, dtypes: Mapping[str, int] = ITEMSIZE) -> Header:
    """Check a safetensors file's header, reading only the header bytes."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = header_length(f.read(8), size, path)
            raw = f.read(n)
    except (OSError, ValueError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(path, f"cannot read: {e}") from None
    if len(raw) != n:
        raise FormatError(path, f"truncated while reading: header of {n} bytes, read {len(raw)}")
    entries, meta = parse_header(raw, size - 8 - n, path, dtypes)
    return Header(entries, meta, 8 + n)
