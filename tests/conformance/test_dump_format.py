"""The engine dump format (conformance.dumps, docs/dumps.md): writer -> reader round trips, TP merging, and a
hostile dump for each kind of damage, each refused with its named error (NaN rows are findings, not errors)."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from conformance.dumps import (
    Dump,
    DumpDtypeError,
    DumpError,
    DumpFileError,
    DumpManifestError,
    DumpMissingError,
    DumpRankError,
    DumpShapeError,
    DumpWriter,
    merge_ranks,
)
from conformance.dumps.names import num_blocks
from conformance.dumps.writer import safetensors_bytes
from k3ref.config import K3Config
from k3ref.safetensors_io import numpy_dtype, read_header

CFG = K3Config.preset("tiny")
PROMPT = [5, 17, 3, 9]
BF16 = ml_dtypes.bfloat16
STEPS = [("prefill", PROMPT, 0), ("decode", [28], 4), ("decode", [13], 5)]


def tensors_of(step: int, T: int) -> dict[str, np.ndarray]:
    """Every tensor of the format for one step, seeded by the step: bf16 activations, fp32 router weights and
    logits, int32 expert ids."""
    rng = np.random.default_rng(100 + step)
    D, k = CFG.hidden_size, CFG.num_experts_per_tok
    out: dict[str, np.ndarray] = {}
    for layer in range(CFG.num_hidden_layers):
        p = f"layers.{layer}."
        if num_blocks(CFG, layer):
            out[p + "blocks"] = rng.standard_normal((num_blocks(CFG, layer), T, D)).astype(BF16)
        for key in ("prefix", "h", "x_mixer", "a", "m", "x_mlp", "f"):
            out[p + key] = rng.standard_normal((T, D)).astype(BF16)
        if not CFG.mlp_is_dense(layer):
            out[p + "router.ids"] = rng.integers(0, CFG.n_routed_experts, (T, k)).astype(np.int32)
            out[p + "router.weights"] = rng.random((T, k)).astype(np.float32)
        if CFG.is_mla(layer):
            out[p + "mla.attn_out"] = rng.standard_normal((T, CFG.num_attention_heads, CFG.v_head_dim)).astype(BF16)
        else:
            out[p + "kda.core_out"] = rng.standard_normal((T, CFG.kda_num_heads, CFG.kda_head_dim)).astype(BF16)
    out["final.hidden"] = rng.standard_normal((T, D)).astype(BF16)
    out["logits"] = rng.standard_normal((1, CFG.vocab_size)).astype(np.float32)
    return out


FP32 = ["router.weights", "logits"]


def write_dump(path: Path, tp: int = 1, splits: dict | None = None,
               part: Callable[[str, np.ndarray, int], np.ndarray] | None = None) -> Path:
    """The reference dump; under TP, part(name, tensor, rank) is what rank `rank` holds (default: whole)."""
    writers = [DumpWriter(path, engine="test", dtype="bfloat16", config=CFG.to_json(), tp_size=tp, rank=r,
                          splits=splits, fp32=FP32) for r in range(tp)]
    for i, (kind, tokens, start) in enumerate(STEPS):
        for r, w in enumerate(writers):
            w.begin_step(kind, tokens, start)
            for name, t in tensors_of(i, len(tokens)).items():
                w.put(name, t if part is None else part(name, t, r))
            w.end_step(chosen=[28, 13, 40][i])
    for w in reversed(writers):
        w.close()
    return path


@pytest.fixture
def dump_path(tmp_path) -> Path:
    return write_dump(tmp_path / "dump")


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


# ----- round trips -----

def test_round_trip_is_exact(dump_path):
    dump = Dump.open(dump_path)
    assert (dump.engine, dump.dtype, dump.tp_size, dump.chosen) == ("test", "bfloat16", 1, [28, 13, 40])
    assert dump.layers == tuple(range(CFG.num_hidden_layers)) and dump.config == CFG
    assert [(s.kind, s.start, s.tokens.tolist()) for s in dump.steps] == [(k, st, t) for k, t, st in STEPS]
    for s in dump.steps:
        want = tensors_of(s.index, len(s.tokens))
        assert dump.names(s.index) == sorted(want)
        for name, t in want.items():
            raw = dump.raw(s.index, name)
            assert raw.dtype == t.dtype and bits(raw) == bits(t), name
            got = dump.get(s.index, name)
            assert got.dtype == (np.int64 if t.dtype.kind == "i" else np.float64)
            np.testing.assert_array_equal(got, t.astype(got.dtype))


def test_layer_input_is_blocks_and_prefix(dump_path):
    dump = Dump.open(dump_path)
    want = tensors_of(0, len(PROMPT))
    blocks, prefix = dump.layer_input(0, 0)
    assert blocks.shape == (0, len(PROMPT), CFG.hidden_size)
    blocks, prefix = dump.layer_input(0, 4)
    np.testing.assert_array_equal(blocks, want["layers.4.blocks"].astype(np.float64))
    np.testing.assert_array_equal(prefix, want["layers.4.prefix"].astype(np.float64))
    assert dump.has(1, "layers.4.a") and not dump.has(1, "layers.0.router.ids") and not dump.has(9, "logits")
    with pytest.raises(DumpMissingError, match="no tensor 'layers.0.router.ids'"):
        dump.get(1, "layers.0.router.ids")


def test_open_reads_no_tensor_data(dump_path, monkeypatch):
    def refuse(*args):
        raise AssertionError("Dump.open read tensor data")

    monkeypatch.setattr(Dump, "_read_rank", refuse)
    assert Dump.open(dump_path).shape(0, "layers.3.blocks") == (1, len(PROMPT), CFG.hidden_size)


def test_writer_refuses_an_existing_dump(dump_path):
    with pytest.raises(DumpError, match="expected no dump there"):
        DumpWriter(dump_path, engine="x", dtype="bfloat16", config=CFG.to_json())
    w = DumpWriter(dump_path, engine="again", dtype="float32", config=CFG.to_json(), overwrite=True)
    w.begin_step("prefill", [1], 0)
    for key in ("prefix", "a", "f"):
        w.put(f"layers.0.{key}", np.zeros((1, CFG.hidden_size), np.float32))
    w.end_step()
    w.close()
    dump = Dump.open(dump_path)
    assert (dump.engine, dump.layers, dump.chosen) == ("again", (0,), None)


@pytest.mark.parametrize(("name", "value", "match"), [
    ("layers.2.x", np.zeros((4, 36), BF16), "expected layers.<l>.<key>"),
    ("layers.2.a", np.zeros((4, 35), BF16), r"expected shape \[4, 36\]"),
    ("layers.2.a", np.zeros((4, 36), np.float32), "expected dtype bfloat16"),
    ("layers.0.router.ids", np.zeros((4, 2), np.int32), "no such tensor for this layer"),
    ("layers.1.router.ids", np.zeros((4, 2), BF16), "int32 or int64"),
    ("layers.0.experts.out", np.zeros((4, 2, 32), BF16), "no such tensor for this layer"),     # layer 0: dense
    ("layers.1.experts.out", np.zeros((4, 32), BF16), r"expected shape \[4, 2, 32\]"),         # [T, k, Dl]
    ("layers.1.experts.in", np.zeros((4, 2, 32), BF16), r"expected shape \[4, 32\]"),          # [T, Dl]
])
def test_writer_refuses_what_the_reader_would(tmp_path, name, value, match):
    w = DumpWriter(tmp_path / "d", engine="x", dtype="bfloat16", config=CFG.to_json())
    w.begin_step("prefill", PROMPT, 0)
    with pytest.raises(DumpError, match=match):
        w.put(name, value)


def test_writer_refuses_steps_out_of_order(tmp_path):
    w = DumpWriter(tmp_path / "d", engine="x", dtype="bfloat16", config=CFG.to_json())
    with pytest.raises(DumpError, match="expected kind 'prefill' at start 0"):
        w.begin_step("decode", [3], 0)
    w.begin_step("prefill", PROMPT, 0)
    w.end_step()
    with pytest.raises(DumpError, match="at start 4 with one token"):
        w.begin_step("decode", [3], 5)


# ----- tensor parallelism -----

def halves(name: str, t: np.ndarray, rank: int) -> np.ndarray:
    """TP-2 parts under the default splits: heads (axis 1) and vocab (last axis) halved, the rest whole."""
    if name.endswith(("kda.core_out", "mla.attn_out")):
        return np.split(t, 2, axis=1)[rank]
    if name == "logits":
        return np.array_split(t, 2, axis=-1)[rank]
    return t


def test_tp2_merges_to_tp1(tmp_path, dump_path):
    tp2 = write_dump(tmp_path / "tp2", tp=2, part=halves)
    assert Dump.open(tp2).tp_size == 2
    merged = Dump.open(merge_ranks(tp2, tmp_path / "merged"))
    one = Dump.open(dump_path)
    assert merged.tp_size == 1 and merged.chosen == one.chosen
    for s in one.steps:
        assert merged.names(s.index) == one.names(s.index)
        for name in one.names(s.index):
            assert bits(merged.raw(s.index, name)) == bits(one.raw(s.index, name)), name


def test_sum_split_adds_the_ranks(tmp_path, dump_path):
    """`a` dumped before the all-reduce: rank 0 holds a - 1, rank 1 holds 1 (exact in bf16 for these values)."""
    def partial(name, t, rank):
        if name.endswith(".a"):
            return (t.astype(np.float64) - 1).astype(BF16) if rank == 0 else np.ones_like(t)
        return halves(name, t, rank)

    tp2 = Dump.open(write_dump(tmp_path / "tp2", tp=2, splits={"a": {"how": "sum", "axis": 0}}, part=partial))
    one = Dump.open(dump_path)
    want = (one.get(0, "layers.2.a") - 1).astype(BF16).astype(np.float64) + 1
    np.testing.assert_array_equal(tp2.get(0, "layers.2.a"), want.astype(BF16).astype(np.float64))


def test_replicated_tensors_must_agree(tmp_path):
    def skewed(name, t, rank):
        if name == "layers.5.f" and rank == 1 and len(t) == len(PROMPT):
            t = t.copy()
            t[2, 7] = t[2, 7] * BF16(2)          # exact: the difference is |t[2, 7]|
        return halves(name, t, rank)

    dump = Dump.open(write_dump(tmp_path / "tp2", tp=2, part=skewed))
    dump.get(0, "layers.5.a")
    diff = abs(float(tensors_of(0, len(PROMPT))["layers.5.f"][2, 7]))
    with pytest.raises(DumpRankError, match=rf"step 0 layers.5.f: replicated.*rank 1 differs from rank 0 \(max "
                                            rf"\|diff\| {diff:.6g} at index \[2, 7\]\)"):
        dump.get(0, "layers.5.f")
    with pytest.raises(DumpRankError):
        merge_ranks(tmp_path / "tp2", tmp_path / "merged")


# ----- hostile dumps -----

def read_step(f: Path) -> dict[str, np.ndarray]:
    h = read_header(f)
    raw = f.read_bytes()
    return {n: np.frombuffer(raw[h.data_start + e.begin:h.data_start + e.end], numpy_dtype(e.dtype)).reshape(e.shape)
            for n, e in h.entries.items()}


def rewrite_step(path: Path, step: int, change: Callable[[dict], None], rank: int = 0) -> None:
    """Change step `step`'s tensors and record the new file honestly in the rank manifest."""
    f = path / f"rank{rank}" / f"step{step:04d}.safetensors"
    tensors = read_step(f)
    change(tensors)
    data = safetensors_bytes(tensors, {"step": str(step)})
    f.write_bytes(data)
    edit_json(path / f"rank{rank}" / "manifest.json",
              lambda m: m["files"].update({f.name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}))


def edit_json(f: Path, change: Callable[[dict], object]) -> None:
    m = json.loads(f.read_text())
    change(m)
    f.write_text(json.dumps(m))


def truncate(p):
    f = p / "rank0" / "step0001.safetensors"
    f.write_bytes(f.read_bytes()[:-10])


def flip_byte(p):
    f = p / "rank0" / "step0002.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x40
    f.write_bytes(bytes(raw))


def set_top(key, value):
    return lambda p: edit_json(p / "manifest.json", lambda m: m.update({key: value}))


def drop_step(p):
    edit_json(p / "manifest.json", lambda m: m["steps"].pop(1))


def drop_tensor(name):
    return lambda p: rewrite_step(p, 1, lambda t: t.pop(name))


def set_tensor(name, value):
    return lambda p: rewrite_step(p, 1, lambda t: t.update({name: value}))


def swap_files(p):
    a, b = p / "rank0" / "step0001.safetensors", p / "rank0" / "step0002.safetensors"
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(raw_b)
    b.write_bytes(raw_a)
    edit_json(p / "rank0" / "manifest.json", lambda m: m["files"].update(
        {a.name: m["files"][b.name], b.name: m["files"][a.name]}))


def drop_last_step(p):
    edit_json(p / "manifest.json", lambda m: (m["steps"].pop(), m["chosen"].pop()))


def drop_step_file(p):
    edit_json(p / "rank0" / "manifest.json", lambda m: m["files"].pop("step0001.safetensors"))
    (p / "rank0" / "step0001.safetensors").unlink()


def garbage_header(p):
    """A file whose size and sha256 match its manifest entry, but whose header is not safetensors."""
    f = p / "rank0" / "step0001.safetensors"
    data = (40).to_bytes(8, "little") + b'{"a": [1, 2' + b" " * 29 + f.read_bytes()[48:]
    f.write_bytes(data)
    edit_json(p / "rank0" / "manifest.json", lambda m: m["files"].update(
        {f.name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}))


HOSTILE = {
    "unreadable header": (garbage_header, DumpFileError, "step0001.safetensors: bad header: not valid JSON"),
    "extra rank directory": (lambda p: (p / "rank1").mkdir(), DumpManifestError,
                             r"tp size 1, found rank directories \['rank1'\]"),
    "truncated step file": (truncate, DumpFileError, "step0001.safetensors: truncated: the rank manifest says"),
    "wrong sha256": (flip_byte, DumpFileError, "step0002.safetensors: sha256 mismatch"),
    "missing rank": (set_top("tp", {"size": 2}), DumpFileError, "rank1/manifest.json: missing"),
    "missing step file": (lambda p: (p / "rank0" / "step0002.safetensors").unlink(), DumpFileError,
                          "step0002.safetensors: missing: the rank manifest names it"),
    "rank manifest without a step": (lambda p: edit_json(p / "rank0" / "manifest.json",
                                                         lambda m: m["files"].pop("step0001.safetensors")),
                                     DumpManifestError, "does not name, but the directory holds step0001"),
    "rank manifest and directory without a step": (drop_step_file, DumpMissingError,
                                                   "step 1 is missing: the manifest names no step0001"),
    "missing step in the steps list": (drop_step, DumpMissingError, "step 1 is missing"),
    "steps list shorter than the files": (drop_last_step, DumpManifestError,
                                          "names step0002.safetensors, but the top manifest lists 2"),
    "missing layer tensor": (drop_tensor("layers.3.a"), DumpMissingError,
                             "step 1 layer 3: required tensor layers.3.a is missing"),
    "missing blocks": (drop_tensor("layers.4.blocks"), DumpMissingError, "layers.4.blocks is missing"),
    "shape vs config": (set_tensor("layers.2.f", np.zeros((1, 35), BF16)), DumpShapeError,
                        r"step 1 layers.2.f: expected shape \[1, 36\].*found \[1, 35\]"),
    "blocks count vs layer": (set_tensor("layers.4.blocks", np.zeros((1, 1, 36), BF16)), DumpShapeError,
                              r"layers.4.blocks: expected shape \[2, 1, 36\]"),
    "router on a dense layer": (set_tensor("layers.0.router.ids", np.zeros((1, 2), np.int32)), DumpShapeError,
                                "no such tensor in this layer"),
    "mixed dtypes": (set_tensor("layers.3.f", np.zeros((1, 36), np.float32)), DumpDtypeError,
                     "layers.3.f: mixed dtypes: expected BF16 for a bfloat16 dump"),
    "float expert ids": (set_tensor("layers.1.router.ids", np.zeros((1, 2), np.float32)), DumpDtypeError,
                         "expected I32 or I64 expert ids, found F32"),
    "unknown tensor": (set_tensor("layers.1.attn_out", np.zeros((1, 36), BF16)), DumpFileError,
                       "tensor name 'layers.1.attn_out'"),
    "layer not in the manifest": (set_top("layers", [0, 1, 2, 3, 4, 5]), DumpManifestError,
                                  "layer 6 is not in the manifest's layers"),
    "files swapped": (swap_files, DumpFileError, "its metadata says step 2, expected step 1"),
    "other format": (set_top("format", "sglang-dump"), DumpManifestError, "expected format 'k3-dump' version 1"),
    "other version": (set_top("version", 2), DumpManifestError, "found format 'k3-dump' version 2"),
    "unknown dtype": (set_top("dtype", "fp8"), DumpManifestError, "dtype: expected one of bfloat16"),
    "bad config": (set_top("config", {"hidden_size": "wide"}), DumpManifestError, "config: "),
    "malformed manifest": (lambda p: (p / "manifest.json").write_text('{"format": "k3-dump",'), DumpManifestError,
                           "not valid JSON"),
    "malformed rank manifest": (lambda p: (p / "rank0" / "manifest.json").write_text("[1, 2"), DumpManifestError,
                                "rank manifest: not valid JSON"),
    "no top manifest": (lambda p: (p / "manifest.json").unlink(), DumpFileError, "missing .an unfinished dump"),
    "chosen of another length": (set_top("chosen", [1]), DumpManifestError, r"chosen: expected one id .* per step"),
}


@pytest.mark.parametrize("damage", list(HOSTILE))
def test_hostile_dump_gets_its_named_error(dump_path, damage):
    change, error, match = HOSTILE[damage]
    Dump.open(dump_path)
    change(dump_path)
    with pytest.raises(error, match=match) as got:
        Dump.open(dump_path)
    assert isinstance(got.value, DumpError) and isinstance(got.value, ValueError)


def test_verify_false_skips_only_the_hash(dump_path):
    flip_byte(dump_path)
    Dump.open(dump_path, verify=False)
    truncate(dump_path)
    with pytest.raises(DumpFileError, match="truncated"):
        Dump.open(dump_path, verify=False)


def test_nan_rows_are_findings_not_errors(dump_path):
    def plant(t):
        a = t["layers.2.a"].copy()
        a[0, 3] = np.nan
        t["layers.2.a"] = a
        b = t["layers.5.blocks"].copy()
        b[1, 0, :] = np.inf
        t["layers.5.blocks"] = b

    assert Dump.open(dump_path).nonfinite() == []
    rewrite_step(dump_path, 1, plant)
    dump = Dump.open(dump_path)
    assert dump.nonfinite() == ["step 1 layer 2 a: 1 NaN row (first row 0)",
                                "step 1 layer 5 blocks: 1 Inf row (first row 0)"]
    assert np.isnan(dump.get(1, "layers.2.a")[0, 3])
