"""The bytes between the run and a backend's worker process: length-prefixed frames over a pipe, never pickle.

A message is two frames: a JSON object (the header; `op` says what it is) and the safetensors bytes of its
arrays (empty when it carries none). Each frame is an 8-byte big-endian length and that many bytes.

    send(fd, {"op": "evaluate", ...}, {"y": array})
    header, arrays = receive(fd, deadline=time.monotonic() + 300)   # WireTimeout / WireClosed
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


def _frame(fd: int, deadline: float | None) -> bytes:
    (n,) = LENGTH.unpack(_read_exact(fd, LENGTH.size, deadline))
    if n > MAX_FRAME:
        raise WireGarbled(f"frame of {n} bytes announced, expected at most {MAX_FRAME}")
    return _read_exact(fd, n, deadline)


def receive(fd: int, deadline: float | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """One message (header, arrays); deadline: time.monotonic() by which it must have come (None: no limit)."""
    head = _frame(fd, deadline)
    blob = _frame(fd, deadline)
    try:
        header = json.loads(head)
    except ValueError as e:
        raise WireGarbled(f"header is not JSON ({e}): {head[:80]!r}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise WireGarbled(f"header is {head[:80]!r}, expected a JSON object with an 'op' string")
    try:
        arrays = decode_arrays(blob)
    except Exception as e:   # noqa: BLE001 - the library's error types are not public: any failure is garbling
        raise WireGarbled(f"arrays are not safetensors bytes: {type(e).__name__}: {e}") from None
    return header, arrays
