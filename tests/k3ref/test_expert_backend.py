"""MmapExpertStore (zero-copy, byte counting), PrefetchPlanner (order, de-dup, budget), kind_from_env."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from k3ref import expert_backend
from k3ref.config import K3Config
from k3ref.cores import reference_cores
from k3ref.cpu_forward import ForwardContext, K3CpuModel, _reading_ahead, forward_prefill, forward_token
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
    link: np.ndarray | None = a
    while link is not None:
        if link is base:
            return True
        link = link.base
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


def test_a_scale_is_scanned_once_it_passed_and_a_bad_one_raises_every_time(ckpt, tmp_path, monkeypatch):
    """The E8M0 NaN scan runs on a scale tensor's first hand-out; one that passed is not scanned again (the
    shard is mapped read-only), one that failed raises on every hand-out."""
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in ckpt.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    h = CheckpointReader(copy).entries[expert_name(1, 2, 3, "scale")]
    with open(h.path, "r+b") as f:
        f.seek(h.begin + 5)
        f.write(b"\xff")
    scanned = []
    check = expert_backend._check_scale
    monkeypatch.setattr(expert_backend, "_check_scale", lambda scale, name, *a: (scanned.append(name),
                                                                               check(scale, name, *a)))
    store = MmapExpertStore(copy)
    store.get(1, 0)
    assert len(scanned) == 3                                       # w1, w2, w3 scales
    store.get(1, 0)
    store.tensor(1, 0, 2, "scale")
    assert len(scanned) == 3 and store.gets == 2
    for _ in range(2):
        with pytest.raises(ValueError, match=r"experts\.2\.w3\.weight_scale: layer 1, routed expert 2: E8M0"):
            store.get(1, 2)
        with pytest.raises(ValueError, match="E8M0 scale byte 255"):
            store.tensor(1, 2, 3, "scale")


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


# ----- read-ahead -----

needs_fadvise = pytest.mark.skipif(not expert_backend.CAN_ADVISE, reason="no os.posix_fadvise on this platform")


def _recording_fadvise(monkeypatch) -> list[tuple[str, int, int]]:
    """Replace os.posix_fadvise by a recorder of (file, offset, length) for WILLNEED calls."""
    calls: list[tuple[str, int, int]] = []

    def fadvise(fd, offset, length, advice):
        assert advice == os.POSIX_FADV_WILLNEED
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return calls


@needs_fadvise
def test_prefetch_advises_exactly_the_planned_experts(ckpt, monkeypatch):
    """Every byte of each planned expert's six tensors lies in an advised page-aligned range of its shard, and
    the advised ranges hold nothing else but the rounding down to a page start; the counts say so."""
    calls = _recording_fadvise(monkeypatch)
    store = MmapExpertStore(ckpt)
    plan = store.prefetch(1, np.array([[3, 1], [1, 0]]))
    store.settle()
    assert plan == [(1, 3), (1, 1), (1, 0)] == store.advised
    assert store.bytes_advised == sum(store.expert_bytes(*p) for p in plan)
    spans = [(str(Path(h.path).resolve()), h.begin, h.end) for p in plan for h in store._entries(*p).values()]
    page = expert_backend.mmap.PAGESIZE
    assert calls and all(offset % page == 0 for _, offset, _ in calls)
    for path, begin, end in spans:                                   # covered
        assert any(p == path and off <= begin and end <= off + n for p, off, n in calls), (path, begin, end)
    for path, off, n in calls:                                       # nothing but planned bytes (and rounding)
        inside = sorted((b, e) for p, b, e in spans if p == path and off <= b < off + n)
        assert inside and inside[0][0] - off < page and max(e for _, e in inside) == off + n
        assert all(b2 <= e1 for (_, e1), (b2, _) in zip(inside, inside[1:], strict=False)), "a gap was advised"
    assert store.bytes_touched == 0, "read-ahead hands nothing out"


@needs_fadvise
def test_prefetch_stays_within_the_budget(ckpt, monkeypatch):
    calls = _recording_fadvise(monkeypatch)
    per = MmapExpertStore(ckpt).expert_bytes(1, 0)
    store = MmapExpertStore(ckpt, prefetch_budget=2 * per)
    assert store.prefetch(1, [5, 2, 0]) == [(1, 5), (1, 2)]
    store.settle()
    page = expert_backend.mmap.PAGESIZE
    assert store.bytes_advised == 2 * per and sum(n for _, _, n in calls) < 2 * (per + len(PARTS) * page)
    off = MmapExpertStore(ckpt, prefetch_budget=0)
    assert off.prefetch(1, [5, 2]) == [] and off.bytes_advised == 0


@needs_fadvise
def test_prefetch_really_advises(ckpt):
    """The real system call over a real shard (no recorder): it runs and counts."""
    store = MmapExpertStore(ckpt)
    assert store.prefetch(4, [[0, 1]]) == [(4, 0), (4, 1)]
    store.settle()
    assert store.bytes_advised == store.expert_bytes(4, 0) + store.expert_bytes(4, 1)


@needs_fadvise
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_forward_reads_ahead_the_experts_the_router_chose(tiny, ckpt, step):
    """The host graph asks the store for each MoE layer's chosen experts, in router order, right after routing:
    exactly those the router returned (recorded by wrapping the reference router)."""
    chosen: list[np.ndarray] = []

    def recording_route(*args, **kwargs):
        w, idx = reference_cores().moe_route(*args, **kwargs)
        chosen.append(np.asarray(idx))
        return w, idx

    model = K3CpuModel.from_checkpoint(ckpt, dtype=np.float64)
    cores = reference_cores().replace(moe_route=recording_route)
    cache = model.new_cache(num_pages=4)
    seq = cache.add_sequence()
    forward_prefill(model, np.arange(5), cache, seq=seq, cores=cores)
    if step == "decode":
        chosen.clear()
        model.expert_store.advised.clear()
        forward_token(model, 7, 5, cache, seq=seq, cores=cores)
    moe_layers = [spec.index for spec in model.graph.layers if spec.mlp.value != "dense"]
    assert len(chosen) == len(moe_layers)
    want = []
    for layer, idx in zip(moe_layers, chosen, strict=True):
        want += PrefetchPlanner(model.expert_store, expert_backend.PREFETCH_BUDGET_BYTES).plan({layer: idx})
    assert want and model.expert_store.advised == want


def test_in_memory_weights_read_nothing_ahead(tiny):
    """No store, no read-ahead: the cores the MoE layer gets are the caller's own."""
    model = K3CpuModel.synthetic(tiny, SEED)
    ctx = ForwardContext(model, reference_cores())
    assert model.expert_store is None and _reading_ahead(ctx, 1) is ctx.cores


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
