"""The bytes between the run and a backend's worker process: length-prefixed frames over a pipe, never pickle.

A message is two frames: a JSON object (the header; `op` says what it is) and the safetensors bytes of its
arrays (empty when it carries none). Each frame is an 8-byte big-endian length and that many bytes.

    send(fd, {"op": "call", ...}, {"p0": array})
    header, arrays = receive(fd, deadline=time.monotonic() + 300)   # WireTimeout / WireClosed / WireGarbled

A value with arrays inside (a core's arguments, its outputs) travels as a JSON tree beside the arrays: `pack`
puts each array in `arrays` under a new key and leaves {"$a": key} in the tree; tuples are {"$t": [...]}, dicts
{"$d": {...}}, NumPy scalars plain numbers. `unpack` reverses it and refuses a tree that names an array the message
does not carry, nests deeper than MAX_DEPTH, or holds anything else: what comes from a worker is data, checked.
"""
from __future__ import annotations

import json
import os
import select
import struct
import time

import numpy as np
import safetensors.numpy

LENGTH = struct.Struct(">Q")
MAX_FRAME = 1 << 36   # 64 GiB: a longer length can only be a scribbled stream
MAX_HEADER = 64 << 20   # a JSON header this long can only be garbage (headers carry names, numbers, short notes)
MAX_DEPTH = 32          # nesting of a packed value: a core's arguments and outputs are a level or two deep


class WireClosed(EOFError):
    """The other end closed the pipe (its process ended) before a whole message arrived."""


class WireTimeout(TimeoutError):
    """No whole message arrived before the deadline."""


class WireGarbled(ValueError):
    """The bytes on the pipe are not a message (a frame too long, a header that is not a JSON object)."""


def _plain(value):
    """JSON for the NumPy scalars and arrays a kind puts in its notes (a flip's margin is a numpy float)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot send a {type(value).__name__} to the other process: expected JSON values or arrays")


def encode_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """safetensors bytes of `arrays` (b'' when there are none)."""
    if not arrays:
        return b""
    return safetensors.numpy.save({k: np.ascontiguousarray(v) for k, v in arrays.items()})


def decode_arrays(blob: bytes) -> dict[str, np.ndarray]:
    return safetensors.numpy.load(blob) if blob else {}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def send(fd: int, header: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
    """Write one message: the JSON header, then the arrays' safetensors bytes."""
    head = json.dumps(header, default=_plain).encode()
    blob = encode_arrays(arrays or {})
    _write_all(fd, LENGTH.pack(len(head)) + head + LENGTH.pack(len(blob)))
    _write_all(fd, blob)


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise WireTimeout(f"no message within the time limit ({n - left} of {n} bytes came)")
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise WireClosed(f"the pipe closed after {n - left} of {n} bytes")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _frame(fd: int, deadline: float | None, most: int) -> bytes:
    (n,) = LENGTH.unpack(_read_exact(fd, LENGTH.size, deadline))
    if n > most:
        raise WireGarbled(f"frame of {n} bytes announced, expected at most {most}")
    return _read_exact(fd, n, deadline)


def receive(fd: int, deadline: float | None = None, max_bytes: int = MAX_FRAME) -> tuple[dict, dict[str, np.ndarray]]:
    """One message (header, arrays); deadline: time.monotonic() by which it must have come (None: no limit);
    max_bytes: the most its arrays may take (a reply larger than its request can explain is refused unread)."""
    head = _frame(fd, deadline, MAX_HEADER)
    blob = _frame(fd, deadline, max_bytes)
    try:
        header = json.loads(head)
    except (ValueError, RecursionError) as e:
        raise WireGarbled(f"header is not JSON ({type(e).__name__}: {str(e)[:200]}): {head[:80]!r}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise WireGarbled(f"header is {head[:80]!r}, expected a JSON object with an 'op' string")
    try:
        arrays = decode_arrays(blob)
    except Exception as e:   # noqa: BLE001 - the library's error types are not public: any failure is garbling
        raise WireGarbled(f"arrays are not safetensors bytes: {type(e).__name__}: {e}") from None
    return header, arrays


class Unpackable(ValueError):
    """A packed value that is not one `pack` makes (or names an array the message lacks)."""


def pack(value, arrays: dict[str, np.ndarray]):
    """`value` as a JSON tree, its arrays moved into `arrays` (see the module docstring); TypeError for a value of
    another kind (an object, a torch tensor: the sender converts those first)."""
    if isinstance(value, np.ndarray):
        key = f"p{len(arrays)}"
        arrays[key] = value
        return {"$a": key}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):
        return {"$t": [pack(v, arrays) for v in value]}
    if isinstance(value, list):
        return [pack(v, arrays) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"$d": {k: pack(v, arrays) for k, v in value.items()}}
    raise TypeError(f"cannot send a {type(value).__module__}.{type(value).__name__} to the other process: expected "
                    "numpy arrays, numbers, strings, None, or lists, tuples and str-keyed dicts of them")


def unpack(tree, arrays: dict[str, np.ndarray], depth: int = 0):
    """The value `pack` made `tree` from; Unpackable for anything else."""
    if depth > MAX_DEPTH:
        raise Unpackable(f"a value nested deeper than {MAX_DEPTH} levels")
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    if isinstance(tree, list):
        return [unpack(v, arrays, depth + 1) for v in tree]
    if isinstance(tree, dict) and len(tree) == 1:
        (tag, body), = tree.items()
        if tag == "$a" and isinstance(body, str):
            if body not in arrays:
                raise Unpackable(f"names array {body[:80]!r}, which the message does not carry")
            return arrays[body]
        if tag == "$t" and isinstance(body, list):
            return tuple(unpack(v, arrays, depth + 1) for v in body)
        if tag == "$d" and isinstance(body, dict):
            return {str(k): unpack(v, arrays, depth + 1) for k, v in body.items()}
    raise Unpackable(f"not a packed value: {json.dumps(tree)[:120]}")
