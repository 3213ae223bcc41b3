"""MmapExpertStore (zero-copy, byte counting), PrefetchPlanner (order, de-dup, budget), kind_from_env."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from k3ref.config import K3Config
from k3ref.expert_backend import (
    BACKENDS,
    PARTS,
    MmapExpertStore,
    PrefetchPlanner,
    ReaderExpertStore,
    kind_from_env,
    parse_expert_name,
)
from k3ref.weights import CheckpointReader, expert_name, synthetic_checkpoint, synthetic_weights

SEED = 3


@pytest.fixture(scope="module")
def tiny() -> K3Config:
    return K3Config.preset("tiny")


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory) -> Path:
    return synthetic_checkpoint(tiny, SEED, tmp_path_factory.mktemp("experts"), shard_bytes=50_000)


@pytest.fixture(scope="module")
def weights(tiny):
    return synthetic_weights(tiny, SEED)


def _expected(weights, layer, expert):
    return {p: weights[expert_name(layer, expert, int(p[1]), p.split("_")[1])] for p in PARTS}


def _is_view_of(a: np.ndarray, base: np.ndarray) -> bool:
    """True if `a` reaches `base` through its .base chain (a view, not a copy)."""
    while a is not None:
        if a is base:
            return True
        a = a.base
    return False


@pytest.mark.parametrize("layer, expert", [
    pytest.param(1, 0, id="L1-E0"),
    pytest.param(4, 5, id="L4-E5"),
    pytest.param(6, 3, id="L6-E3-last-layer"),
])
def test_get_is_zero_copy_and_exact(ckpt, weights, tiny, layer, expert):
    store = MmapExpertStore(ckpt)
    got = store.get(layer, expert)
    want = _expected(weights, layer, expert)
    assert set(got) == set(PARTS)
    for part, arr in got.items():
        h = store.reader.entries[expert_name(layer, expert, int(part[1]), part.split("_")[1])]
        mm = store._maps[h.path]
        assert arr.dtype == np.uint8 and np.array_equal(arr, want[part]), part
        assert np.shares_memory(arr, mm) and _is_view_of(arr, mm), f"{part} was copied"
        assert not arr.flags.writeable
    assert store.bytes_touched == sum(a.nbytes for a in want.values())


def test_bytes_touched_counts_every_get(ckpt, weights):
    store = MmapExpertStore(CheckpointReader(ckpt))
    picks = [(1, 0), (2, 5), (1, 0)]
    for layer, expert in picks:
        store.get(layer, expert)
    want = sum(a.nbytes for le in picks for a in _expected(weights, *le).values())
    assert store.bytes_touched == want and store.gets == 3
    assert store.expert_bytes(1, 0) == sum(a.nbytes for a in _expected(weights, 1, 0).values())


def test_reader_backend_copies(ckpt, weights):
    store = ReaderExpertStore(ckpt)
    got = store.get(3, 1)
    for part, arr in got.items():
        assert np.array_equal(arr, _expected(weights, 3, 1)[part])
    assert store.bytes_touched == store.expert_bytes(3, 1)


@pytest.mark.parametrize("layer, expert", [
    pytest.param(0, 0, id="dense-layer-0"),
    pytest.param(1, 7, id="expert-out-of-range"),
])
def test_get_missing_expert(ckpt, layer, expert):
    with pytest.raises(KeyError, match="not in"):
        MmapExpertStore(ckpt).get(layer, expert)


@pytest.mark.parametrize("kind", [pytest.param(MmapExpertStore, id="mmap"),
                                  pytest.param(ReaderExpertStore, id="reader")])
def test_tensor_serves_one_part_and_counts_its_bytes(ckpt, weights, kind):
    store = kind(ckpt)
    want = _expected(weights, 4, 5)
    total = 0
    for part in PARTS:
        arr = store.tensor(4, 5, int(part[1]), part.split("_")[1])
        total += want[part].nbytes
        assert arr.dtype == np.uint8 and np.array_equal(arr, want[part]), part
        assert store.bytes_touched == total, part
        if kind is MmapExpertStore:
            mm = store._maps[store.reader.entries[expert_name(4, 5, int(part[1]), part.split("_")[1])].path]
            assert _is_view_of(arr, mm) and not arr.flags.writeable, f"{part} was copied"
    assert total == store.expert_bytes(4, 5) and store.gets == 0


def test_tensor_missing_expert(ckpt):
    store = MmapExpertStore(ckpt)
    with pytest.raises(KeyError, match="not in"):
        store.tensor(0, 0, 1, "packed")
    assert store.bytes_touched == 0


@pytest.mark.parametrize("name, want", [
    pytest.param(expert_name(4, 5, 2, "scale"), (4, 5, 2, "scale"), id="expert"),
    pytest.param(expert_name(61, 383, 1, "packed"), (61, 383, 1, "packed"), id="k3-sized"),
    pytest.param("language_model.model.layers.4.block_sparse_moe.gate.weight", None, id="router"),
    pytest.param("language_model.model.layers.4.block_sparse_moe.shared_experts.gate_proj.weight", None,
                 id="shared-expert"),
    pytest.param(expert_name(4, 5, 2, "scale") + ".extra", None, id="suffix"),
    pytest.param("x." + expert_name(4, 5, 2, "scale"), None, id="prefix"),
])
def test_parse_expert_name(name, want):
    assert parse_expert_name(name) == want


# ----- planner -----

CHOICES = {  # layer: [T=2, k=2]
    2: np.array([[3, 0], [0, 4]]),
    1: np.array([[0, 1], [1, 2]]),
}
# first use: token 0 (layer 1 then layer 2), then token 1; repeats dropped
ORDER = [(1, 0), (1, 1), (2, 3), (2, 0), (1, 2), (2, 4)]


@pytest.mark.parametrize("budget, n", [
    pytest.param(10**9, 6, id="all-fit"),
    pytest.param(40, 4, id="exact-fit"),
    pytest.param(39, 3, id="one-byte-short"),
    pytest.param(0, 0, id="zero-budget"),
])
def test_planner_order_and_budget(budget, n):
    assert PrefetchPlanner(10, budget).plan(CHOICES) == ORDER[:n]


def test_planner_stops_at_first_overflow():
    sizes = {(1, 0): 10, (1, 1): 50, (2, 3): 1, (2, 0): 1, (1, 2): 1, (2, 4): 1}
    assert PrefetchPlanner(lambda layer, e: sizes[(layer, e)], 30).plan(CHOICES) == [(1, 0)]


def test_planner_with_store_sizes(ckpt):
    store = MmapExpertStore(ckpt)
    per = store.expert_bytes(1, 0)
    assert PrefetchPlanner(store, 2 * per).plan(CHOICES) == ORDER[:2]
    assert store.bytes_touched == 0, "planning reads headers only"


@pytest.mark.parametrize("sizes, match", [
    pytest.param(0, "> 0", id="zero-bytes"),
    pytest.param("10", "a store, a callable or an int", id="text"),
])
def test_planner_rejects_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        PrefetchPlanner(sizes, 10)


@pytest.mark.parametrize("choices, match", [
    pytest.param({1: np.array([0, 1])}, r"\[T, k\]", id="1-d"),
    pytest.param({1: np.zeros((2, 2)), }, "integer", id="float-indices"),
    pytest.param({1: np.zeros((2, 2), int), 2: np.zeros((3, 2), int)}, "T=2", id="ragged-T"),
])
def test_planner_rejects(choices, match):
    with pytest.raises(ValueError, match=match):
        PrefetchPlanner(1, 10).plan(choices)


# ----- backend choice -----

@pytest.mark.parametrize("value, want", [
    pytest.param(None, "mmap", id="unset"),
    pytest.param("", "mmap", id="empty"),
    pytest.param("reader", "reader", id="reader"),
])
def test_kind_from_env(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("K3_EXPERT_BACKEND", raising=False)
    else:
        monkeypatch.setenv("K3_EXPERT_BACKEND", value)
    assert kind_from_env() is BACKENDS[want]


def test_kind_from_env_unknown(monkeypatch):
    monkeypatch.setenv("K3_EXPERT_BACKEND", "nvme")
    with pytest.raises(ValueError, match=r"'nvme'.*known: \['mmap', 'reader'\]"):
        kind_from_env()
