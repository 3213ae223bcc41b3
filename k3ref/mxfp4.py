"""MXFP4 (OCP Microscaling v1.0) as K3 stores its routed experts (docs/spec.md sections 3.5 and 7).

32 E2M1 codes share one E8M0 scale:  value = E2M1[code] * 2^(e - 127),  e = 255 is NaN.
Byte layout (compressed-tensors `mxfp4-pack-quantized`): element 2i sits in the LOW nibble of byte i,
element 2i+1 in the HIGH nibble. Not the ggml block_mxfp4 layout (which interleaves halves of a block).
K3 names `...w1.weight_packed` U8 [out, in/2] and `...w1.weight_scale` U8 [out, in/32].
"""
from __future__ import annotations

import numpy as np

from . import fast
from .checks import as_float, check_shape, require
from .fast import mxfp4 as mxfp4_fast
from .fast import mxfp4_jit

GROUP = 32          # elements per shared scale
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_EMAX = 2       # exponent of the largest E2M1 normal (6 = 1.5 * 2^2)

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
E2M1_VALUES.setflags(write=False)

# Decision points between neighbouring non-negative E2M1 magnitudes (codes 0..7).
_MIDPOINTS = (E2M1_VALUES[:7] + E2M1_VALUES[1:8]).astype(np.float64) / 2.0


def _check_u8(name: str, a) -> np.ndarray:
    a = np.asarray(a)
    require(a.dtype == np.uint8, f"{name}: expected dtype uint8, found {a.dtype}")
    require(a.ndim >= 1, f"{name}: expected an array [..., n], found a scalar")
    return a


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Codes from bytes: packed u8 [..., n/2] -> codes u8 [..., n]; codes[2i] = low nibble, codes[2i+1] = high."""
    p = _check_u8("packed", packed)
    codes = np.stack([p & 0x0F, p >> 4], axis=-1)
    return codes.reshape(p.shape[:-1] + (2 * p.shape[-1],))


# byte -> the values of its two elements [256, 2] float32, built by unpack_fp4 so the nibble order lives in one place
_BYTE_VALUES = E2M1_VALUES[unpack_fp4(np.arange(256, dtype=np.uint8)[:, None])]


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """Bytes from codes: codes u8 [..., n] (n even, values < 16) -> packed u8 [..., n/2], low nibble first."""
    c = _check_u8("codes", codes)
    require(c.shape[-1] % 2 == 0, f"codes: expected an even last dim, found shape {c.shape}")
    require(not np.any(c > 15), f"codes: expected 4-bit codes 0..15, found max {int(c.max())}")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def e8m0_to_float(scale: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes u8 [...] -> float32 2^(e - 127); e = 255 -> NaN; e = 0 -> 2^-127 (a float32 subnormal,
    exact: computed in float64 and then rounded, which is exact for every 2^k with k >= -149)."""
    s = np.asarray(scale)
    require(s.dtype == np.uint8, f"scale: expected dtype uint8, found {s.dtype}")
    v = np.ldexp(1.0, s.astype(np.int64) - E8M0_BIAS)
    return np.where(s == E8M0_NAN, np.nan, v).astype(np.float32)


_SCALE_VALUES = e8m0_to_float(np.arange(256, dtype=np.uint8))  # every E8M0 byte's value, float32 [256]

_TABLES = mxfp4_fast.LookupTables.from_values(_BYTE_VALUES, _SCALE_VALUES)   # the fast forms' lookups


def dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """W = E2M1[codes] * 2^(e - 127) per 32-group: packed u8 [..., n/2], scale u8 [..., n/32] -> float32 [..., n].

    Exact in float32 except where 6 * 2^(e-127) overflows (e = 254 -> inf); e = 255 gives NaN for its group.
    """
    p = _check_u8("packed", packed)
    s = _check_u8("scale", scale)
    n = 2 * p.shape[-1]
    require(n % GROUP == 0, f"packed: expected a last dim n/2 with n a multiple of {GROUP}, found shape {p.shape}")
    check_shape("scale", s, p.shape[:-1] + (n // GROUP,))
    # One table lookup per byte gives both of its elements; the float32 product is exact: an E2M1 value has
    # at most 2 significant bits and 2^(e-127) >= 2^-127, so nothing falls below float32's 2^-149.
    vals = np.take(_BYTE_VALUES, p, axis=0).reshape(p.shape[:-1] + (n // GROUP, GROUP))  # take: 20x faster than [p]
    return (vals * np.take(_SCALE_VALUES, s)[..., None]).reshape(p.shape[:-1] + (n,))


def _round_e2m1(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto the E2M1 grid, saturating at +-6: float64 [...] -> codes u8 [...].

    Ties go to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4);
    the sign is kept, so small negatives become code 8 (-0).
    """
    a = np.abs(v)
    lo = np.searchsorted(_MIDPOINTS, a, side="left")      # a == midpoint -> lower code
    hi = np.searchsorted(_MIDPOINTS, a, side="right")     # a == midpoint -> upper code
    mag = np.where(lo % 2 == 0, lo, hi)                   # on a tie exactly one of lo, hi = lo + 1 is even
    return (mag + 8 * np.signbit(v)).astype(np.uint8)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX v1.0 quantisation: w [..., n] (n multiple of 32, finite) -> (packed u8 [..., n/2], scale u8 [..., n/32]).

    Per 32-group: e = floor(log2(amax)) - 2 (2 = E2M1's emax), clamped to the E8M0 range [-127, 127];
    codes = RNE onto the E2M1 grid of w / 2^e, saturating at +-6. An all-zero group gets e = -127 (byte 0),
    as the OCP reference code (microxcaling) does: its amax is replaced by the smallest float32 normal
    2^-126 before the log, and -126 - 2 clamps to -127.
    """
    w = as_float("w", w).astype(np.float64)
    require(w.ndim >= 1 and w.shape[-1] % GROUP == 0,
            f"w: expected shape [..., n] with n a multiple of {GROUP}, found {w.shape}")
    g = w.reshape(w.shape[:-1] + (w.shape[-1] // GROUP, GROUP))
    amax = np.max(np.abs(g), axis=-1)
    _, e2 = np.frexp(np.where(amax > 0, amax, 2.0 ** -126))  # amax = m * 2^e2, m in [0.5, 1)
    e = np.clip(e2 - 1 - E2M1_EMAX, -E8M0_BIAS, E8M0_BIAS)   # floor(log2 amax) = e2 - 1
    codes = _round_e2m1(np.ldexp(g, -e[..., None]))
    return pack_fp4(codes.reshape(w.shape).astype(np.uint8)), (e + E8M0_BIAS).astype(np.uint8)


def mxfp4_gemv(packed: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The `mxfp4_gemv` core: y = dequantize(W) x over the last axis.

    packed: u8 [N, K/2]; scale: u8 [N, K/32]; x: [..., K] -> y [..., N], float64 for float64 x, else float32.
    """
    p = _check_u8("packed", packed)
    check_shape("packed", p, (None, None))
    x = as_float("x", x)
    require(x.ndim >= 1, "x: expected shape [..., K], found a scalar")
    K = x.shape[-1]
    require(K % GROUP == 0, f"x: expected a last dim K that is a multiple of {GROUP}, found {K}")
    check_shape("packed", p, (None, K // 2))
    s = _check_u8("scale", scale)
    check_shape("scale", s, (p.shape[0], K // GROUP))
    return mxfp4_gemv_prechecked(p, s, x)


def mxfp4_gemv_prechecked(packed: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """`mxfp4_gemv` for a caller that has checked the arguments once (a layer over all its experts): packed u8
    [N, K/2], scale u8 [N, K/32], finite float32/float64 x [..., K]. Same result, no per-call validation.

    By default the compiled dequantise-and-dot (`k3ref.fast.mxfp4_jit.gemv`: each byte read once, the same bits
    on any machine and thread count); K3_FAST=numpy: the NumPy row blocks (`k3ref.fast.mxfp4.gemv_rows`)."""
    if not fast.enabled():
        return mxfp4_fast.gemv_rows(packed, scale, x, _TABLES)
    x2 = x.reshape(-1, x.shape[-1])
    y = mxfp4_jit.gemv(np.ascontiguousarray(packed), np.ascontiguousarray(scale), x2)
    return y.reshape(x.shape[:-1] + (packed.shape[0],))


def dequantize_rows(p: np.ndarray, s: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`dequantize` of a row block into `out`: p u8 [R, K/2], s u8 [R, K/32] (checked by the caller), out float32
    [R, K] C-contiguous -> out, holding the same exact float32 products as `dequantize`
    (`k3ref.fast.mxfp4.dequantize_rows` with this module's tables)."""
    return mxfp4_fast.dequantize_rows(p, s, out, _TABLES)
