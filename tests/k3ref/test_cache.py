"""MlaKv: page allocation, block tables, gather order, page boundaries, exhaustion, copy/free, errors."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3ref.cache import HybridCache, MlaKv
from k3ref.config import K3Config


def token_row(seq: int, pos: int, width: int) -> np.ndarray:
    """A row that names its owner: [seq, pos, seq*1000 + pos, ...] (so a misplaced row is visible)."""
    return np.full(width, 1000.0 * seq + pos)


def fill(cache: MlaKv, seq: int, n: int) -> None:
    for _ in range(n):
        pos = int(cache.seq_lens([seq])[0])
        cache.append([seq], token_row(seq, pos, cache.width)[None])


@pytest.mark.parametrize("L, pages", [
    pytest.param(1, 1, id="L1"), pytest.param(3, 1, id="L3"), pytest.param(4, 1, id="L4-exactly-one-page"),
    pytest.param(5, 2, id="L5-first-of-page2"), pytest.param(8, 2, id="L8"), pytest.param(9, 3, id="L9"),
])
def test_pages_allocated_at_boundaries(L, pages):
    cache = MlaKv(6, page_size=4, width=3)
    s = cache.add_sequence()
    fill(cache, s, L)
    assert cache.block_table([s]).tolist() == [list(range(pages))]
    assert cache.num_free_pages == 6 - pages
    assert cache.seq_lens([s]).tolist() == [L]
    assert cache.gather(s)[:, 0].tolist() == [1000.0 * s + p for p in range(L)]


def test_interleaved_sequences_block_table_and_gather():
    """A, B, C appended in an interleaved pattern (page 2): pages are handed out in first-need order, so the
    tables interleave; gather still returns each sequence's rows in token order."""
    cache = MlaKv(8, page_size=2, width=5)
    A, B, C = (cache.add_sequence() for _ in range(3))
    for batch in ([A, B], [A, B], [B], [A, C], [C, A], [A]):   # A: 5 tokens, B: 3, C: 2
        cache.append(batch, np.stack([token_row(s, int(cache.seq_lens([s])[0]), 5) for s in batch]))
    # need order: A@0 -> 0, B@0 -> 1, B@2 -> 2, A@2 -> 3, C@0 -> 4, A@4 -> 5
    assert cache.block_table([A, B, C]).tolist() == [[0, 3, 5], [1, 2, -1], [4, -1, -1]]
    assert cache.block_table([C, A], max_pages=4).tolist() == [[4, -1, -1, -1], [0, 3, 5, -1]]
    assert cache.seq_lens([C, B, A]).tolist() == [2, 3, 5]
    for s, L in ((A, 5), (B, 3), (C, 2)):
        np.testing.assert_array_equal(cache.gather(s), np.stack([token_row(s, p, 5) for p in range(L)]))
        table = cache.block_table([s])[0]
        for p in range(L):   # the table is what a kernel reads: page table[p // 2], slot p % 2
            np.testing.assert_array_equal(cache.pages[table[p // 2], p % 2], token_row(s, p, 5))


def test_pool_exhaustion_is_clear_and_atomic():
    cache = MlaKv(3, page_size=2, width=4)
    A, B = cache.add_sequence(), cache.add_sequence()
    fill(cache, A, 4)      # pages 0, 1
    fill(cache, B, 2)      # page 2: pool full
    before = (cache.pages.copy(), cache.block_table([A, B]), cache.seq_lens([A, B]))
    with pytest.raises(ValueError, match=r"page pool exhausted.*need 2 new page\(s\), 0 of 3 free"):
        cache.append([A, B], np.ones((2, 4)))
    np.testing.assert_array_equal(cache.pages, before[0])
    np.testing.assert_array_equal(cache.block_table([A, B]), before[1])
    np.testing.assert_array_equal(cache.seq_lens([A, B]), before[2])
    cache.free(A)
    cache.append([B], np.ones((1, 4)))   # now it fits, in the lowest freed page
    assert cache.block_table([B]).tolist() == [[2, 0]]


def test_free_returns_pages_refilled_and_ids_are_not_reused():
    cache = MlaKv(4, page_size=2, width=3, fill=np.nan)
    A = cache.add_sequence()
    fill(cache, A, 3)
    cache.free(A)
    assert cache.num_free_pages == 4 and np.all(np.isnan(cache.pages))
    B = cache.add_sequence()
    assert B != A and cache.sequences == (B,)
    with pytest.raises(ValueError, match=r"seq_id: expected one of the live sequences \[1\], found 0"):
        cache.gather(A)


def test_copy_is_independent():
    cache = MlaKv(4, page_size=2, width=3)
    A = cache.add_sequence()
    fill(cache, A, 3)
    twin = cache.copy()
    fill(twin, A, 2)
    twin.add_sequence()
    assert cache.seq_lens([A]).tolist() == [3] and cache.num_free_pages == 2 and cache.sequences == (A,)
    assert twin.seq_lens([A]).tolist() == [5]
    np.testing.assert_array_equal(twin.gather(A)[:3], cache.gather(A))


@pytest.mark.parametrize("width, dtype_bytes, expected", [
    pytest.param(576, 2, 1152, id="K3-bf16"),
    pytest.param(576, 1, 576, id="K3-fp8"),
    pytest.param(576, None, 576 * 8, id="K3-default-float64"),
    pytest.param(7, 4, 28, id="W7-fp32"),
])
def test_bytes_per_token(width, dtype_bytes, expected):
    assert MlaKv(1, width=width).bytes_per_token(dtype_bytes) == expected


def test_bf16_pages_round_rows():
    cache = MlaKv(1, page_size=2, width=2, dtype=ml_dtypes.bfloat16)
    s = cache.add_sequence()
    cache.append([s], np.array([[1.0 + 2.0 ** -10, 3.0]]))      # 1 + 2^-10 is not a bf16 value
    assert cache.gather(s).dtype == ml_dtypes.bfloat16
    assert cache.gather(s).astype(np.float64).tolist() == [[1.0, 3.0]]
    assert cache.bytes_per_token() == 4


@pytest.mark.parametrize("call, match", [
    pytest.param(lambda c, s: c.append([s], np.ones((1, 4))), r"rows: expected \[1, 3\]", id="rows-width"),
    pytest.param(lambda c, s: c.append([s], np.ones(3)), r"rows: expected rank 2", id="rows-rank"),
    pytest.param(lambda c, s: c.append([s, s], np.ones((2, 3))), r"seq_ids: expected distinct", id="dup-ids"),
    pytest.param(lambda c, s: c.append([s], np.array([[0.0, np.nan, 1.0]])), r"rows: expected finite", id="rows-nan"),
    pytest.param(lambda c, s: c.append([s + 7], np.ones((1, 3))), r"seq_id: expected one of", id="unknown-id"),
    pytest.param(lambda c, s: c.block_table([s], max_pages=0), r"max_pages must be an int >= 1", id="bt-too-narrow"),
    pytest.param(lambda c, s: c.bytes_per_token(0), r"dtype_bytes", id="bytes-zero"),
    pytest.param(lambda c, s: MlaKv(0), r"num_pages must be a positive int", id="no-pages"),
    pytest.param(lambda c, s: MlaKv(2, page_size=2.5), r"page_size", id="page-float"),
    pytest.param(lambda c, s: MlaKv(2, dtype=np.int32), r"dtype must be one of", id="int-dtype"),
    pytest.param(lambda c, s: MlaKv(2, dtype="no-such-type"), r"dtype must be one of .*'no-such-type'", id="bad-dtype"),
])
def test_bad_input_raises(call, match):
    cache = MlaKv(2, page_size=2, width=3)
    s = cache.add_sequence()
    fill(cache, s, 1)
    with pytest.raises(ValueError, match=match):
        call(cache, s)
    assert cache.seq_lens([s]).tolist() == [1]


@given(ops=st.lists(st.tuples(st.sets(st.integers(0, 3), min_size=1), st.booleans()), max_size=30),
       page=st.integers(1, 4))
def test_matches_a_list_model(ops, page):
    """Random interleaved appends (and frees) against a dict of lists: gather, lengths, tables, page ownership."""
    cache = MlaKv(64, page_size=page, width=2)
    ids = [cache.add_sequence() for _ in range(4)]
    model = {s: [] for s in ids}
    for batch, drop in ops:
        live = [ids[i] for i in sorted(batch) if ids[i] in model]
        if live:
            rows = np.stack([token_row(s, len(model[s]), 2) for s in live])
            cache.append(live, rows)
            for s, row in zip(live, rows, strict=True):
                model[s].append(row)
        if drop and live:
            cache.free(live[0])
            del model[live[0]]
    owned = []
    for s, rows in model.items():
        np.testing.assert_array_equal(cache.gather(s), np.array(rows).reshape(-1, 2))
        table = cache.block_table([s])[0]
        assert table.size == -(-len(rows) // page)
        owned += table.tolist()
    assert len(owned) == len(set(owned)) and cache.num_free_pages == 64 - len(owned)


# --- HybridCache ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_cfg():
    return K3Config.preset("tiny")


def test_hybrid_cache_rejects_a_page_size_decode_would_refuse(tiny_cfg):
    """mla_decode_token checks the cache against the model's MlaConfig (page 64): any other page size must be
    refused when the cache is built, not after a prefill at the first decode step."""
    with pytest.raises(ValueError, match=r"HybridCache: page_size must be the MLA config's page size 64.*found 16"):
        HybridCache(tiny_cfg, num_pages=4, page_size=16)


def test_hybrid_cache_kda_state_and_advance_errors(tiny_cfg):
    cache = HybridCache(tiny_cfg, num_pages=4)
    seq = cache.add_sequence()
    kda_layer, mla_layer = cache.kda_layers[0], cache.mla_layers[0]
    assert cache.kda_state(kda_layer, seq).recurrent.dtype == np.float64
    with pytest.raises(ValueError, match=r"layer: expected a KDA layer"):
        cache.kda_state(mla_layer, seq)
    with pytest.raises(ValueError, match=r"unknown sequence 5"):
        cache.set_kda_state(kda_layer, 5, cache.kda_state(kda_layer, seq))
    with pytest.raises(ValueError, match=r"n: expected an int >= 0"):
        cache.advance(seq, -1)
    with pytest.raises(ValueError, match=r"MLA layer \d+ holds 0 tokens of sequence 0, expected 2"):
        cache.advance(seq, 2)                    # no layer has seen the tokens: refused, length unchanged
    assert cache.seq_len(seq) == 0


def test_pop_last_undoes_an_append_across_a_page_boundary():
    kv = MlaKv(num_pages=4, page_size=2, width=3)
    a, b = kv.add_sequence(), kv.add_sequence()
    for t in range(2):
        kv.append([a, b], np.full((2, 3), float(t)))
    before = (kv.pages.copy(), kv.block_table([a, b]), kv.seq_lens([a, b]), kv.num_free_pages)
    kv.append([a, b], np.full((2, 3), 9.0))            # both cross into a new page
    kv.pop_last([a, b])
    after = (kv.pages, kv.block_table([a, b]), kv.seq_lens([a, b]), kv.num_free_pages)
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert np.array_equal(before[2], after[2]) and before[3] == after[3]
    kv.append([b], np.full((1, 3), 5.0))                # the freed page is reused, lowest id first
    assert kv.block_table([b])[0, 1] == min(set(range(4)) - {int(p) for p in kv.block_table([a])[0] if p >= 0}
                                              - {int(kv.block_table([b])[0, 0])})
    with pytest.raises(ValueError, match="hold no token"):
        kv.pop_last([kv.add_sequence()])
