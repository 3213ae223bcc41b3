"""k3ref.mxfp4: E2M1/E8M0 decoding, nibble order, OCP MX quantisation, the gemv core, checkpoint names."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3ref import mxfp4
from k3ref.fast import mxfp4 as mxfp4_fast
from tests.support.tolerances import rel_rms, tol


def _e2m1_from_bits(code: int) -> float:
    """E2M1 decoded from its fields (sign | 2 exponent bits | 1 mantissa bit, bias 1), independent of the table."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1.0 + man / 2)
    return sign * mag


def _floor_log2(a: float) -> int:
    """floor(log2 a) for a > 0, exact (math.log2 may round across a power of two; fix it with ldexp)."""
    e = math.floor(math.log2(a))
    while math.ldexp(1.0, e) > a:
        e -= 1
    while math.ldexp(1.0, e + 1) <= a:
        e += 1
    return e


def _nearest_code(v: float) -> int:
    """Brute force: the E2M1 code nearest to v (clamped to +-6), ties to the even code, sign kept."""
    mags = [_e2m1_from_bits(c) for c in range(8)]
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(mags[c] - a), c % 2))
    return best + (8 if math.copysign(1.0, v) < 0 else 0)


def test_e2m1_table_matches_bit_fields():
    want = [_e2m1_from_bits(c) for c in range(16)]
    assert mxfp4.E2M1_VALUES.dtype == np.float32
    assert mxfp4.E2M1_VALUES.tolist() == want
    assert [math.copysign(1, v) for v in mxfp4.E2M1_VALUES] == [math.copysign(1, v) for v in want]  # -0 at 8


def test_nibble_order_low_first():
    assert mxfp4.unpack_fp4(np.array([0x21], np.uint8)).tolist() == [1, 2]
    assert mxfp4.unpack_fp4(np.array([[0xF0, 0x7A]], np.uint8)).tolist() == [[0, 15, 10, 7]]
    assert mxfp4.pack_fp4(np.array([1, 2], np.uint8)).tolist() == [0x21]


@given(st.lists(st.integers(0, 15), min_size=1, max_size=40).map(lambda c: c + c[:1] if len(c) % 2 else c))
def test_pack_unpack_round_trip(codes):
    c = np.array(codes, np.uint8)
    packed = mxfp4.pack_fp4(c)
    assert packed.shape == (len(codes) // 2,)
    assert mxfp4.unpack_fp4(packed).tolist() == codes


@pytest.mark.parametrize("byte, want", [
    pytest.param(127, 1.0, id="e127-one"),
    pytest.param(128, 2.0, id="e128-two"),
    pytest.param(120, 2.0 ** -7, id="e120"),
    pytest.param(254, 2.0 ** 127, id="e254-max"),
    pytest.param(1, 2.0 ** -126, id="e1-min-normal"),
    pytest.param(0, 2.0 ** -127, id="e0-subnormal"),
])
def test_e8m0_values(byte, want):
    got = mxfp4.e8m0_to_float(np.array([byte], np.uint8))
    assert got.dtype == np.float32
    assert float(got[0]) == want


def test_e8m0_255_is_nan():
    got = mxfp4.e8m0_to_float(np.array([255, 127], np.uint8))
    assert math.isnan(got[0]) and got[1] == 1.0


def test_dequantize_hand_example():
    codes = np.zeros((2, 64), np.uint8)
    codes[0, :16] = np.arange(16)
    codes[1, 32:48] = np.arange(16)
    scale = np.array([[127, 130], [125, 129]], np.uint8)            # 1, 8 ; 1/4, 4
    got = mxfp4.dequantize(mxfp4.pack_fp4(codes), scale)
    assert got.shape == (2, 64) and got.dtype == np.float32
    table = [_e2m1_from_bits(c) for c in range(16)]
    assert got[0, :16].tolist() == table and not got[0, 16:].any()
    assert got[1, 32:48].tolist() == [4.0 * v for v in table] and not got[1, :32].any()


def test_dequantize_nan_scale_poisons_only_its_group():
    packed = mxfp4.pack_fp4(np.full((1, 64), 2, np.uint8))
    got = mxfp4.dequantize(packed, np.array([[255, 127]], np.uint8))
    assert np.isnan(got[0, :32]).all() and (got[0, 32:] == 1.0).all()


@pytest.mark.parametrize("packed, scale, needle", [
    pytest.param(np.zeros((2, 16), np.float32), np.zeros((2, 1), np.uint8), "packed", id="packed-float"),
    pytest.param(np.zeros((2, 16), np.uint8), np.zeros((2, 1), np.int8), "scale", id="scale-int8"),
    pytest.param(np.zeros((2, 16), np.uint8), np.zeros((2, 2), np.uint8), "scale", id="scale-too-wide"),
    pytest.param(np.zeros((2, 16), np.uint8), np.zeros((3, 1), np.uint8), "scale", id="scale-rows"),
    pytest.param(np.zeros((2, 15), np.uint8), np.zeros((2, 1), np.uint8), "packed", id="n-not-32k"),
])
def test_dequantize_rejects_bad_input(packed, scale, needle):
    with pytest.raises(ValueError, match=needle):
        mxfp4.dequantize(packed, scale)


@pytest.mark.parametrize("amax, byte", [
    pytest.param(5.0, 127, id="5-e0"),
    pytest.param(6.0, 127, id="6-e0"),
    pytest.param(8.0, 128, id="8-e1"),
    pytest.param(7.999, 127, id="just-below-8"),
    pytest.param(0.3, 123, id="0.3-e-4"),
    pytest.param(1e-45, 0, id="tiny-clamped-low"),
    pytest.param(1e300, 254, id="huge-clamped-high"),
])
def test_quantize_exponent(amax, byte):
    w = np.zeros(32)
    w[5] = -amax
    _, scale = mxfp4.quantize(w)
    assert scale.tolist() == [byte]


def test_quantize_all_zero_group_gets_byte_0():
    packed, scale = mxfp4.quantize(np.zeros((1, 64)))
    assert scale.tolist() == [[0, 0]] and not packed.any()


@given(st.floats(min_value=1e-30, max_value=1e30, allow_nan=False, allow_infinity=False))
def test_quantize_exponent_is_floor_log2_amax_minus_2(amax):
    _, scale = mxfp4.quantize(np.full(32, amax))
    assert int(scale[0]) == _floor_log2(amax) - 2 + 127


@pytest.mark.parametrize("v, want", [
    pytest.param(0.25, 0.0, id="0.25-to-0"), pytest.param(0.75, 1.0, id="0.75-to-1"),
    pytest.param(1.25, 1.0, id="1.25-to-1"), pytest.param(1.75, 2.0, id="1.75-to-2"),
    pytest.param(2.5, 2.0, id="2.5-to-2"), pytest.param(3.5, 4.0, id="3.5-to-4"),
    pytest.param(5.0, 4.0, id="5-to-4"), pytest.param(7.0, 6.0, id="7-saturates"),
    pytest.param(-3.5, -4.0, id="neg-3.5-to-neg-4"), pytest.param(0.26, 0.5, id="0.26-to-0.5"),
])
def test_quantize_rounds_to_nearest_even(v, want):
    w = np.zeros(32)
    w[0], w[1] = 6.0, v                                   # amax 6 (or 7) pins e = 0
    got = mxfp4.dequantize(*mxfp4.quantize(w))
    assert float(got[1]) == want


@given(st.integers(0, 2 ** 32 - 1))
def test_quantize_matches_brute_force_nearest(seed):
    r = np.random.default_rng(seed)
    w = r.standard_normal(64) * np.exp(r.uniform(-3, 3, size=64))
    packed, scale = mxfp4.quantize(w)
    codes = mxfp4.unpack_fp4(packed)
    for g in range(2):
        e = int(scale[g]) - 127
        want = [_nearest_code(math.ldexp(v, -e)) for v in w[32 * g: 32 * g + 32]]
        assert codes[32 * g: 32 * g + 32].tolist() == want


@pytest.mark.parametrize("shape", [
    pytest.param((32,), id="n32"), pytest.param((3, 96), id="3x96"), pytest.param((2, 3, 64), id="2x3x64"),
])
def test_round_trip_exact_on_representable_values(rng, shape):
    codes = rng.integers(0, 16, size=shape).astype(np.uint8)
    groups = codes.reshape(-1, 32)
    rows = np.arange(groups.shape[0])
    groups[rows, rng.integers(0, 32, size=len(rows))] = rng.choice([6, 7, 14, 15], size=len(rows))  # |.| 4 or 6
    e = rng.integers(-120, 121, size=shape[:-1] + (shape[-1] // 32,))
    w = mxfp4.E2M1_VALUES[codes].astype(np.float64) * np.repeat(np.ldexp(1.0, e), 32, axis=-1)
    packed, scale = mxfp4.quantize(w)
    assert (scale.astype(int) - 127 == e).all()
    assert (mxfp4.unpack_fp4(packed) == codes).all()
    assert (mxfp4.dequantize(packed, scale) == w).all()


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="w"):
        mxfp4.quantize(np.zeros((2, 48)))
    with pytest.raises(ValueError, match="w"):
        mxfp4.quantize(np.full(32, np.nan))


def _gemv_loop(packed, scale, x):
    W = mxfp4.dequantize(packed, scale).astype(np.float64)
    xs = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    out = np.array([[sum(W[n, j] * row[j] for j in range(W.shape[1])) for n in range(W.shape[0])] for row in xs])
    return out.reshape(x.shape[:-1] + (W.shape[0],))


@pytest.mark.parametrize("N, K, batch", [
    pytest.param(1, 32, (), id="N1-K32"),
    pytest.param(7, 64, (3,), id="N7-K64-B3"),
    pytest.param(5, 96, (2, 2), id="N5-K96-B2x2"),
])
def test_mxfp4_gemv_matches_loop_float64(rng, N, K, batch):
    packed, scale = mxfp4.quantize(rng.standard_normal((N, K)))
    x = rng.standard_normal(batch + (K,))
    y = mxfp4.mxfp4_gemv(packed, scale, x)
    assert y.shape == batch + (N,) and y.dtype == np.float64
    assert rel_rms(y, _gemv_loop(packed, scale, x)) <= tol("fp64_same_math")


def test_row_block_dequantisation_equals_dequantize(rng):
    """The gemv's two-bytes-per-lookup table gives dequantize's exact float32 values, NaN scale (255) and the
    subnormal scale 2^-127 (byte 0) included."""
    packed = rng.integers(0, 256, (5, 48), dtype=np.uint8)
    scale = rng.integers(0, 256, (5, 3), dtype=np.uint8)
    scale[0, 0], scale[1, 2], scale[2, 1] = 255, 0, 254
    out = np.empty((5, 96), np.float32)
    with np.errstate(over="ignore"):                                  # byte 254: 6 * 2^127 is inf in both
        got, want = mxfp4.dequantize_rows(packed, scale, out), mxfp4.dequantize(packed, scale)
    assert np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("batch", [pytest.param((), id="one-token"), pytest.param((3,), id="T3")])
def test_mxfp4_gemv_in_row_blocks_matches_loop(rng, monkeypatch, batch):
    """Blocks of 3 rows over N = 11 (the last block short) give the loop's result."""
    monkeypatch.setattr(mxfp4_fast, "GEMV_BLOCK_BYTES", 3 * 64 * 4)
    packed, scale = mxfp4.quantize(rng.standard_normal((11, 64)))
    x = rng.standard_normal(batch + (64,))
    assert rel_rms(mxfp4.mxfp4_gemv(packed, scale, x), _gemv_loop(packed, scale, x)) <= tol("fp64_same_math")


@pytest.mark.parametrize("dtype", [
    pytest.param(np.float32, id="f32"), pytest.param(ml_dtypes.bfloat16, id="bf16"),
])
def test_mxfp4_gemv_low_precision_is_float32(rng, dtype):
    packed, scale = mxfp4.quantize(rng.standard_normal((9, 64)))
    x = rng.standard_normal((4, 64)).astype(dtype)
    y = mxfp4.mxfp4_gemv(packed, scale, x)
    assert y.dtype == np.float32
    assert rel_rms(y, _gemv_loop(packed, scale, x.astype(np.float64))) <= tol("fp32_vs_fp64")


@pytest.mark.parametrize("x_shape, needle", [
    pytest.param((4, 48), "x", id="K-not-32k"),
    pytest.param((4, 96), "packed", id="K-mismatch"),
])
def test_mxfp4_gemv_rejects_bad_shapes(rng, x_shape, needle):
    packed, scale = mxfp4.quantize(rng.standard_normal((3, 64)))
    with pytest.raises(ValueError, match=needle):
        mxfp4.mxfp4_gemv(packed, scale, np.ones(x_shape))
