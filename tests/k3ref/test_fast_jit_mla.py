"""The compiled MLA decode core (k3ref.fast.mla_jit, run by k3ref.mla.mla_decode_core when mla.COMPILED_DECODE
is set) against the readable form (k3ref.mla.mla_decode_readable): long ragged contexts at K3's latent width,
both dtypes, and the same bits whatever the thread count or the head blocking."""
from __future__ import annotations

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from k3ref import mla  # noqa: E402 -- after the numba skip
from k3ref.cache import paged_latent_cache  # noqa: E402
from k3ref.fast import mla_jit  # noqa: E402
from tests.support.tolerances import rel_rms, tol  # noqa: E402

R, P, PAGE = 512, 64, 64          # K3's latent and rope widths, FlashMLA's page
H = 64                            # K3's 96 heads split over tensor-parallel ranks: 64 is one shard's worth
# Every page boundary case: a single row, a page minus/plus one, exactly a page, ragged long, the 4096 limit.
CONTEXTS = [1, 63, 64, 65, 1000, 4096]
SCALE = mla.K3_MLA.softmax_scale


@pytest.fixture(autouse=True)
def compiled_decode(monkeypatch):
    """The compiled form is opt-in (mla.COMPILED_DECODE): every test here runs with it on."""
    monkeypatch.setattr(mla, "COMPILED_DECODE", True)


@pytest.fixture(scope="module")
def inputs():
    """Query rows and a shuffled paged cache whose unused slots and pages hold NaN (a wrong read shows)."""
    rng = np.random.default_rng(20261204)
    kv, table = paged_latent_cache(rng, CONTEXTS, R + P, PAGE)
    q = rng.standard_normal((len(CONTEXTS), H, R + P))
    return q, kv, table, np.array(CONTEXTS, np.int32)


@pytest.fixture(scope="module")
def want64(inputs):
    q, kv, table, lens = inputs
    return mla.mla_decode_readable(q, kv, table, lens, scale=SCALE, kv_rank=R)


def _per_sequence_rel(out, want) -> list[float]:
    return [rel_rms(out[b], want[b]) for b in range(len(CONTEXTS))]


def test_float64_equals_the_readable_form(inputs, want64):
    q, kv, table, lens = inputs
    out = mla.mla_decode_core(q, kv, table, lens, scale=SCALE, kv_rank=R)
    assert out.dtype == np.float64 and out.shape == (len(CONTEXTS), H, R)
    assert max(_per_sequence_rel(out, want64)) <= tol("fp64_same_math")


def test_float32_within_the_fp32_gate(inputs, want64):
    """float32 in and out; its error against float64 is of the readable float32 form's size."""
    q, kv, table, lens = inputs
    q32, kv32 = q.astype(np.float32), kv.astype(np.float32)
    out = mla.mla_decode_core(q32, kv32, table, lens, scale=SCALE, kv_rank=R)
    assert out.dtype == np.float32
    assert max(_per_sequence_rel(out, want64)) <= tol("fp32_vs_fp64")
    readable = mla.mla_decode_readable(q32, kv32, table, lens, scale=SCALE, kv_rank=R)
    assert max(_per_sequence_rel(out, readable)) <= tol("fp32_vs_fp64")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_same_bits_for_one_and_two_threads_and_any_head_block(inputs, dtype, monkeypatch):
    """Each (sequence, head) is one thread's fixed-order work: neither the thread count nor the tasks'
    head blocking may change a bit."""
    q, kv, table, lens = (a.astype(dtype) if a.dtype.kind == "f" else a for a in inputs)
    monkeypatch.setenv("K3_THREADS", "1")
    one = mla_jit.mla_decode(q, kv, table, lens, SCALE, R)[0]
    monkeypatch.setenv("K3_THREADS", "2")
    two = mla_jit.mla_decode(q, kv, table, lens, SCALE, R)[0]
    monkeypatch.setattr(mla_jit, "HEAD_BLOCK", 5)                      # 64 heads: 12 blocks of 5 and one of 4
    reblocked = mla_jit.mla_decode(q, kv, table, lens, SCALE, R)[0]
    assert np.array_equal(one, two) and np.array_equal(one, reblocked)


def test_numpy_switch_runs_the_readable_form(inputs, monkeypatch):
    """K3_FAST=numpy: the core is the readable form (the compiled kernel is not called)."""
    q, kv, table, lens = inputs

    def must_not_run(*args, **kwargs):
        raise AssertionError("the compiled MLA decode ran under K3_FAST=numpy")

    monkeypatch.setenv("K3_FAST", "numpy")
    monkeypatch.setattr(mla_jit, "mla_decode", must_not_run)
    out = mla.mla_decode_core(q[:2], kv, table[:2], lens[:2], scale=SCALE, kv_rank=R)
    assert np.array_equal(out, mla.mla_decode_readable(q[:2], kv, table[:2], lens[:2], scale=SCALE, kv_rank=R))


def test_the_readable_form_is_the_default(inputs, monkeypatch):
    """Without COMPILED_DECODE (the shipped setting: the compiled form is slower than BLAS) the core never calls the
    compiled kernel."""
    q, kv, table, lens = inputs

    def must_not_run(*args, **kwargs):
        raise AssertionError("the compiled MLA decode ran without COMPILED_DECODE")

    monkeypatch.setattr(mla, "COMPILED_DECODE", False)
    monkeypatch.setattr(mla_jit, "mla_decode", must_not_run)
    out = mla.mla_decode_core(q[:2], kv, table[:2], lens[:2], scale=SCALE, kv_rank=R)
    assert np.array_equal(out, mla.mla_decode_readable(q[:2], kv, table[:2], lens[:2], scale=SCALE, kv_rank=R))


def test_a_nan_row_read_raises_the_readable_error(inputs):
    """A NaN inside a sequence's rows (found while the kernel reads) raises the readable check's error naming the
    sequence; NaN past seq_len (the fixture's padding) is never read."""
    q, kv, table, lens = inputs
    kv = kv.copy()
    kv[table[2, 0], 10, 3] = np.nan                                  # sequence 2 (64 rows) reads row 10
    with pytest.raises(ValueError, match="kv_cache: expected finite rows for sequence 2"):
        mla.mla_decode_core(q, kv, table, lens, scale=SCALE, kv_rank=R)


def test_bad_page_id_raises_before_the_kernel(inputs):
    q, kv, table, lens = inputs
    table = table.copy()
    table[0, 0] = kv.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[0\]: expected page ids in"):
        mla.mla_decode_core(q, kv, table, lens, scale=SCALE, kv_rank=R)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_latent_width_off_the_vector_width(dtype):
    """A latent width that is no multiple of 16 (its last columns summed one at a time) and a row width that is no
    multiple of 16 (the scores' ragged tail): both dtypes against the readable form, 5 heads (one group of four
    and one head alone)."""
    rng = np.random.default_rng(7)
    rank, rope = 40, 9
    kv, table = paged_latent_cache(rng, [1, 63, 130], rank + rope, PAGE)
    q = rng.standard_normal((3, 5, rank + rope))
    lens = np.array([1, 63, 130], np.int32)
    want = mla.mla_decode_readable(q, kv, table, lens, scale=SCALE, kv_rank=rank)
    out = mla.mla_decode_core(q.astype(dtype), kv.astype(dtype), table, lens, scale=SCALE, kv_rank=rank)
    assert out.dtype == dtype and out.shape == (3, 5, rank)
    gate = tol("fp64_same_math") if dtype == np.float64 else tol("fp32_vs_fp64")
    assert max(rel_rms(out[b], want[b]) for b in range(3)) <= gate
