"""Input checks of the torch cores: numpy arguments are validated before they reach the device.

k3torch keeps its own copy of these rules (it imports nothing of k3ref, so that agreement between the two
readings of the spec means something). The messages are the ones the reference cores give, word for word:
each names the argument, what was expected and what was found, and the tests compare the two sets.
"""
from __future__ import annotations

import math

import numpy as np

Dim = int | str | None      # an exact size, a named size (equal wherever the name recurs), or any size


def require(ok: bool, message: str) -> None:
    """Raise ValueError(message) when `ok` is false."""
    if not ok:
        raise ValueError(message)


def as_float(name: str, x, *, allow_nan: bool = False) -> np.ndarray:
    """`x` as a real floating array: float32 and float64 kept, integers, float16 and bfloat16 widened to
    float32, wider floats narrowed to float64. Bool, complex or object arrays raise; NaN/Inf raise (the
    message gives the first bad index) unless `allow_nan`."""
    a = np.asarray(x)
    if a.dtype.kind not in "fiu" and a.dtype.name != "bfloat16":
        raise ValueError(f"{name}: expected a real floating array, found dtype {a.dtype}")
    if a.dtype not in (np.float32, np.float64):
        wide = a.dtype.kind == "f" and a.dtype.itemsize >= 8
        a = a.astype(np.float64 if wide else np.float32)
    if not allow_nan:
        bad = np.argwhere(~np.isfinite(a))
        if len(bad):
            at = tuple(int(i) for i in bad[0])
            raise ValueError(f"{name}: expected finite values, found {a[at]} at index {at}")
    return a


def check_shape(name: str, a, expected: tuple[Dim, ...]) -> tuple[int, ...]:
    """`a`'s shape against `expected` (see Dim); returns the shape."""
    shape = np.shape(a)
    if len(shape) != len(expected):
        raise ValueError(f"{name}: expected rank {len(expected)} {_spelled(expected)}, found shape {shape}")
    named: dict[str, int] = {}
    for axis, (want, size) in enumerate(zip(expected, shape, strict=True)):
        if isinstance(want, str):
            first = named.setdefault(want, size)
            if first != size:
                raise ValueError(f"{name}: dim {want} is {first} and {size} in shape {shape} ({_spelled(expected)})")
        elif want is not None and want != size:
            raise ValueError(f"{name}: expected {_spelled(expected)}, found shape {shape} "
                             f"(axis {axis}: {want} != {size})")
    return shape


def check_mla_decode_args(q_abs: np.ndarray, kv_cache: np.ndarray, block_table: np.ndarray,
                          seq_lens: np.ndarray, *, scale, kv_rank) -> None:
    """The arguments of the `mla_decode` core (docs/interfaces.md): q_abs [B, H, W]; kv_cache [N_pages, page, W];
    block_table [B, max_pages] and seq_lens [B] integer, 1 <= seq_lens[b] <= max_pages * page; the pages a
    sequence reads are in [0, N_pages) and its rows are finite (slots past seq_len may hold anything)."""
    B, _, W = check_shape("q_abs", q_abs, (None, None, None))
    n_pages, page, _ = check_shape("kv_cache", kv_cache, (None, None, W))
    require(block_table.dtype.kind in "iu", f"block_table: expected an integer array, found dtype {block_table.dtype}")
    require(seq_lens.dtype.kind in "iu", f"seq_lens: expected an integer array, found dtype {seq_lens.dtype}")
    max_pages = check_shape("block_table", block_table, (B, None))[1]
    check_shape("seq_lens", seq_lens, (B,))
    require(isinstance(kv_rank, int | np.integer) and bool(1 <= kv_rank <= W),
            f"kv_rank: expected an int in [1, {W}] (cache row width), found {kv_rank!r}")
    require(isinstance(scale, int | float | np.floating) and math.isfinite(scale) and bool(scale > 0),
            f"scale: expected a positive finite float, found {scale!r}")
    for b in range(B):
        _check_sequence(b, int(seq_lens[b]), block_table[b], kv_cache, n_pages, page, max_pages)


def _check_sequence(b: int, length: int, pages_of_b: np.ndarray, kv_cache: np.ndarray, n_pages: int, page: int,
                    max_pages: int) -> None:
    """Sequence `b` of an mla_decode call: its length fits its block-table row, its pages exist, its rows are finite."""
    require(1 <= length <= max_pages * page,
            f"seq_lens[{b}]: expected 1 <= seq_len <= {max_pages * page} (rows the block table maps: "
            f"{max_pages} pages of {page}), found {length}")
    used = pages_of_b[: -(-length // page)]
    require(bool(np.all((used >= 0) & (used < n_pages))),
            f"block_table[{b}]: expected page ids in [0, {n_pages}) for the {used.size} page(s) of seq_len "
            f"{length}, found {used.tolist()}")
    rows = kv_cache[used].reshape(-1, kv_cache.shape[-1])[:length]
    finite = np.isfinite(rows if rows.dtype.kind == "f" else rows.astype(np.float32))
    require(bool(np.all(finite)), f"kv_cache: expected finite rows for sequence {b} (seq_len {length}), "
                                  f"found NaN/Inf in pages {used.tolist()}")


def _spelled(expected: tuple[Dim, ...]) -> str:
    """(None, 'H', 4) -> '[*, H, 4]'."""
    return "[" + ", ".join("*" if d is None else str(d) for d in expected) + "]"
