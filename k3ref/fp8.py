"""FP8 e4m3fn (the OCP FP8 E4M3 format, torch.float8_e4m3fn): the codes of an FP8 latent cache, in NumPy.

A code is one byte s eeee mmm (sign, 4 exponent bits of bias 7, 3 mantissa bits):
    e = 0:          (-1)^s * m/8 * 2^-6           (subnormals, 2^-9 .. 7 * 2^-9; code 0x80 is -0)
    e = 1 .. 15:    (-1)^s * (1 + m/8) * 2^(e-7)  (up to 1.75 * 2^8 = 448)
    s 1111 111:     NaN (0x7f, 0xff). There is no infinity.
Every code's value is exact in float64 (and in float32 and bf16), so decoding is a table lookup.

Encoding rounds to the nearest code, ties to the even code (the even mantissa), and saturates: a magnitude past
448 (infinity included) becomes +-448, as torch's float32 -> float8_e4m3fn cast does (tests/k3ref/test_fp8.py
compares every case); ml_dtypes' cast gives NaN past 464 instead. Engines quantise with a scale that keeps
|x / scale| <= 448, so saturation is a guard, not a path the cache takes.
"""
from __future__ import annotations

import numpy as np

MAX = 448.0            # the largest finite magnitude (code 0x7e)
NAN_CODES = (0x7F, 0xFF)
EXP_BIAS = 7
MANT_BITS = 3


def _table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e, m = (codes >> MANT_BITS) & 0xF, codes & 0x7
    magnitude = np.where(e == 0, m / 8.0 * 2.0 ** (1 - EXP_BIAS), (1.0 + m / 8.0) * 2.0 ** (e - EXP_BIAS))
    values = sign * magnitude
    values[0x7F], values[0xFF] = np.nan, -np.nan     # the sign bit kept: 0xff decodes to a negative NaN
    values.flags.writeable = False
    return values


VALUES = _table()                     # code -> float64 value, all 256 codes
_POSITIVE = VALUES[:0x7F]             # codes 0x00 .. 0x7e: the finite non-negative values, increasing with the code


def decode(codes) -> np.ndarray:
    """uint8 e4m3fn codes [...] -> float64 values [...] (NaN for 0x7f / 0xff)."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"codes: expected uint8 e4m3fn codes, found dtype {codes.dtype}")
    return VALUES[codes]


def encode(x) -> np.ndarray:
    """Float values [...] -> uint8 e4m3fn codes [...]: round to nearest, ties to even, saturating at +-448.

    NaN becomes 0x7f (0xff when its sign bit is set); -0.0 becomes 0x80.
    """
    x = np.asarray(x)
    if x.dtype.kind != "f":
        raise ValueError(f"x: expected a floating array, found dtype {x.dtype}")
    x = x.astype(np.float64)          # every float32 / bf16 / float16 value is exact in float64
    a = np.minimum(np.abs(x), MAX)    # saturate (inf included); NaN stays NaN
    hi = np.minimum(np.searchsorted(_POSITIVE, a, side="left"), 0x7E)   # _POSITIVE[hi - 1] < a <= _POSITIVE[hi]
    lo = np.maximum(hi - 1, 0)
    mid = (_POSITIVE[lo] + _POSITIVE[hi]) / 2          # exact: e4m3 values have 4 significant bits
    code = np.where(a > mid, hi, np.where(a < mid, lo, np.where(hi % 2 == 0, hi, lo)))
    code = np.where(a == _POSITIVE[hi], hi, code)       # exact hits (0 and every code value)
    code = np.where(np.isnan(a), 0x7F, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


__all__ = ["MAX", "NAN_CODES", "VALUES", "decode", "encode"]
