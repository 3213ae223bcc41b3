"""The elementwise steps of k3ref.ops written for fewer NumPy calls give the bits of their plain statements."""
from __future__ import annotations

import numpy as np
import pytest

from k3ref import ops

SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 88.0, -88.0, 700.0, -700.0]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view(np.int32 if a.dtype == np.float32 else np.int64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigmoid_is_the_two_branch_formula_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    x = np.concatenate([np.array(SPECIALS), 30 * rng.standard_normal(50_000 - len(SPECIALS))]).astype(dtype)
    e = np.exp(-np.abs(x))
    want = np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(dtype)
    for view in (x, x.reshape(100, -1)[:, ::3], x[:7].reshape(7, 1, 1)):
        got = ops.sigmoid(view)
        assert got.dtype == dtype and got.shape == view.shape
        e = np.exp(-np.abs(view))
        assert np.array_equal(_bits(got), _bits(np.where(view >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(dtype)))
    assert np.array_equal(_bits(ops.sigmoid(x)), _bits(want))
    scalar = ops.sigmoid(dtype(-0.75))
    e = np.exp(dtype(-0.75))
    assert isinstance(scalar, np.ndarray) and scalar.shape == () and scalar.dtype == dtype and scalar == e / (1 + e)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1024), (7, 1000), (3, 5, 129), (1, 17), (4, 1), (2, 8192), (9, 0, 6)])
def test_mean_square_is_np_mean_bit_for_bit(dtype, shape):
    x = (3 * np.random.default_rng(len(shape)).standard_normal(shape)).astype(dtype)
    for view in (x, x[..., ::2], np.swapaxes(x, 0, -1)):
        got, want = ops.mean_square(view), np.mean(view * view, axis=-1, keepdims=True)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        assert np.array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_silu_and_softmax_are_their_plain_statements_bit_for_bit(dtype):
    rng = np.random.default_rng(5)
    x = np.concatenate([np.array(SPECIALS), 20 * rng.standard_normal(3 * 7 * 64 - len(SPECIALS))]).astype(dtype)
    with np.errstate(invalid="ignore"):                                 # silu(-inf) = -inf x 0 = NaN, both ways
        assert np.array_equal(_bits(ops.silu(x)), _bits(x * ops.sigmoid(x)))
    logits = (20 * rng.standard_normal((3, 7, 60))).astype(dtype)
    logits[0, 0, :5] = -np.inf                                        # weight 0
    logits[1, 2, 7] = np.nan                                          # a NaN row stays NaN
    for axis in (-1, 0, 1):
        m = np.max(logits, axis=axis, keepdims=True)
        e = np.exp(logits - m)
        want = e / np.sum(e, axis=axis, keepdims=True)
        got = ops.softmax(logits, axis=axis)
        assert got.dtype == dtype and np.array_equal(_bits(got), _bits(want)), axis
