"""FP8 e4m3fn codes (k3ref.fp8): the table, round-to-nearest-even, saturation, subnormals, and torch's casts."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3ref import fp8

ALL_CODES = np.arange(256, dtype=np.uint8)
FINITE_CODES = np.array([c for c in range(256) if c not in fp8.NAN_CODES], dtype=np.uint8)


def _by_formula(code: int) -> float:
    """The OCP E4M3 value of one code, written out with math (not with the table's array arithmetic)."""
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    mag = math.ldexp(m, -9) if e == 0 else math.ldexp(8 + m, e - 10)
    return -mag if s else mag


def test_table_matches_the_format_definition():
    want = np.array([_by_formula(c) for c in range(256)])
    np.testing.assert_array_equal(fp8.decode(ALL_CODES), want)
    assert fp8.VALUES[0x7E] == fp8.MAX == 448.0
    assert fp8.VALUES[0x01] == 2.0 ** -9 and fp8.VALUES[0x08] == 2.0 ** -6     # smallest subnormal, normal
    assert np.signbit(fp8.VALUES[0x80]) and fp8.VALUES[0x80] == 0.0


def test_table_matches_ml_dtypes():
    np.testing.assert_array_equal(fp8.decode(ALL_CODES),
                                  ALL_CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float64))


def test_every_code_round_trips():
    np.testing.assert_array_equal(fp8.encode(fp8.decode(FINITE_CODES)), FINITE_CODES)
    assert set(fp8.encode(fp8.decode(np.array(fp8.NAN_CODES, np.uint8))).tolist()) == set(fp8.NAN_CODES)


@pytest.mark.parametrize("lo_code", [pytest.param(c, id=f"0x{c:02x}") for c in (0x00, 0x01, 0x06, 0x07, 0x08, 0x0F,
                                                                                 0x3A, 0x3B, 0x7C, 0x7D, 0x81, 0xBB)])
def test_ties_round_to_the_even_code(lo_code):
    lo, hi = fp8.VALUES[lo_code], fp8.VALUES[lo_code + 1]
    mid = (lo + hi) / 2
    even = lo_code if lo_code % 2 == 0 else lo_code + 1
    assert fp8.encode(np.array([mid]))[0] == even
    below, above = np.nextafter(mid, lo), np.nextafter(mid, hi)
    np.testing.assert_array_equal(fp8.encode(np.array([below, above])), [lo_code, lo_code + 1])


@pytest.mark.parametrize("x, code", [
    pytest.param(448.0, 0x7E, id="max"),
    pytest.param(463.99, 0x7E, id="below-the-next-binade-midpoint"),
    pytest.param(464.0, 0x7E, id="tie-with-the-nan-code"),
    pytest.param(1e6, 0x7E, id="far-out"),
    pytest.param(math.inf, 0x7E, id="inf"),
    pytest.param(-math.inf, 0xFE, id="-inf"),
    pytest.param(-500.0, 0xFE, id="-500"),
    pytest.param(math.nan, 0x7F, id="nan"),
    pytest.param(-0.0, 0x80, id="-0"),
    pytest.param(2.0 ** -11, 0x00, id="quarter-subnormal-to-0"),
    pytest.param(2.0 ** -10, 0x00, id="half-subnormal-ties-to-0"),
    pytest.param(3 * 2.0 ** -10, 0x02, id="1.5-subnormal-ties-to-2"),
])
def test_saturation_nan_and_subnormals(x, code):
    assert fp8.encode(np.array([x]))[0] == code


def test_bad_input_names_what_was_expected():
    with pytest.raises(ValueError, match="codes: expected uint8"):
        fp8.decode(np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="x: expected a floating array"):
        fp8.encode(np.array([1, 2]))


@given(st.lists(st.floats(-460.0, 460.0, width=32), min_size=1, max_size=64))
def test_matches_ml_dtypes_below_saturation(xs):
    x = np.array(xs, np.float32)
    np.testing.assert_array_equal(fp8.encode(x), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def _torch_codes(x: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch", reason="torch is not installed: the torch.float8_e4m3fn comparison needs it")
    return torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_matches_torch_float8_casts():
    rng = np.random.default_rng(0)
    ties = (fp8.VALUES[FINITE_CODES][:-1] + fp8.VALUES[FINITE_CODES][1:])[fp8.VALUES[FINITE_CODES][:-1] >= 0] / 2
    x = np.concatenate([
        fp8.decode(FINITE_CODES),                               # every code
        ties, -ties,                                            # every tie between neighbours
        rng.standard_normal(20000) * 10.0 ** rng.uniform(-4, 2.7, 20000),   # subnormals .. saturation
        [448.0, 463.0, 1000.0, -1e9, np.inf, -np.inf],          # saturation
    ]).astype(np.float32)
    np.testing.assert_array_equal(fp8.encode(x), _torch_codes(x))
