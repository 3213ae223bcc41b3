"""Hostile checkpoints and configs: the safetensors format rules, index/shard agreement, dtypes checked before
decoding, named runtime faults, huge requests, field types; fuzzed shards, indexes and configs."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes  # noqa: F401  numpy's bfloat16, which safe_open's numpy tensors need
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import deserialize, safe_open

from conformance.cli import main
from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel
from k3ref.greedy import greedy_decode
from k3ref.safetensors_io import FormatError, loads_strict, parse_bytes
from k3ref.weights import (
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    admit_checkpoint,
    num_parameters,
    synthetic_checkpoint,
)

SEED = 3
L = "language_model.model.layers."
HOSTILE = settings(settings.get_profile("hostile-inputs"))


@pytest.fixture(scope="module")
def tiny() -> K3Config:
    return K3Config.preset("tiny")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny) -> Path:
    return synthetic_checkpoint(tiny, SEED, tmp_path_factory.mktemp("ckpt"), shard_bytes=40_000)


@pytest.fixture
def ckpt(pristine, tmp_path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(pristine, out)
    return out


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _join(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _rewrite(path: Path, fn) -> None:
    header, data = _split(path.read_bytes())
    header, data = fn(header, data)
    path.write_bytes(_join(header, data))


def _first(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _trailing(h, d):
    return h, d + b"\0" * 8


def _gap(h, d):   # every tensor moved 4 bytes on, 4 bytes of nothing in front
    for k, v in h.items():
        if k != "__metadata__":
            v["data_offsets"] = [v["data_offsets"][0] + 4, v["data_offsets"][1] + 4]
    return h, b"\0" * 4 + d


def _overlap(h, d):   # the second tensor starts inside the first; trailing bytes keep the sizes honest
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    b = h[names[1]]["data_offsets"]
    h[names[1]]["data_offsets"] = [b[0] - 2, b[1] - 2]
    return h, d


def _metadata_not_string(h, d):
    h["__metadata__"] = {"seed": 3}
    return h, d


def _fractional_shape(h, d):
    h[_first(h)]["shape"] = [1.5]
    return h, d


def _negative_shape(h, d):
    h[_first(h)]["shape"] = [-1, -36]
    return h, d


def _huge_shape(h, d):
    h[_first(h)]["shape"] = [2**62, 2**62, 0]
    return h, d


def _dtype_not_string(h, d):
    h[_first(h)]["dtype"] = 5
    return h, d


@pytest.mark.parametrize("damage, message", [
    pytest.param(_trailing, "trailing bytes", id="trailing-bytes"),
    pytest.param(_gap, "leaves a gap", id="gap"),
    pytest.param(_overlap, "overlaps", id="overlap"),
    pytest.param(_metadata_not_string, "__metadata__ must be an object of strings", id="metadata-not-string"),
    pytest.param(_fractional_shape, "shape must be a list of non-negative ints", id="fractional-shape"),
    pytest.param(_negative_shape, "shape must be a list of non-negative ints", id="negative-shape"),
    pytest.param(_huge_shape, "overflows", id="shape-overflows"),
    pytest.param(_dtype_not_string, "dtype must be one of", id="dtype-not-a-string"),
])
def test_admit_applies_the_safetensors_rules(ckpt, tiny, damage, message, capsys):
    victim = sorted(ckpt.glob("*.safetensors"))[1]
    _rewrite(victim, damage)
    assert not _library_loads(victim.read_bytes())   # the library refuses it too
    with pytest.raises(CheckpointError, match=message) as e:
        admit_checkpoint(ckpt, tiny)
    assert victim.name in str(e.value)
    assert main(["admit", str(ckpt)]) == 2
    assert victim.name in capsys.readouterr().err


def test_tensor_missing_from_the_index_and_wrong_total_size(ckpt, tiny):
    index = json.loads((ckpt / INDEX_FILE).read_text())
    dropped = L + "1.block_sparse_moe.gate.weight"
    del index["weight_map"][dropped]
    index["metadata"]["total_size"] += 1
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    v = admit_checkpoint(ckpt, tiny)
    problems = {(p.kind, p.name) for p in v.problems}
    assert problems == {("index", dropped), ("index", "metadata.total_size")}
    assert "absent from it" in v.summary()


@pytest.mark.parametrize("raw, message", [
    pytest.param(b"\xff\xfe{}", "not UTF-8", id="not-utf8"),
    pytest.param(b"[" * 50_000, "nested too deeply", id="deep"),
    pytest.param(b'{"weight_map": {"a": "' + b"x" * 5000 + b'.safetensors"}}', None, id="over-long-file-name"),
    pytest.param(b'{"weight_map": {}, "metadata": {"total_size": "12"}}', "total_size", id="total-size-string"),
])
def test_hostile_index_is_named(ckpt, tiny, raw, message):
    (ckpt / INDEX_FILE).write_bytes(raw)
    if message is None:   # readable, but names a shard that cannot exist: a problem, not a crash
        v = admit_checkpoint(ckpt, tiny)
        assert any(p.kind == "index" and "absent" in p.found for p in v.problems)
        return
    with pytest.raises(CheckpointError, match=message) as e:
        admit_checkpoint(ckpt, tiny)
    assert INDEX_FILE in str(e.value)


# ----- loading for decode -----

def _relabel(path: Path, name: str, dtype: str, shape=None, data=None):
    def fn(h, d):
        h[name]["dtype"] = dtype
        if shape is not None:
            h[name]["shape"] = shape
        return h, d
    _rewrite(path, fn)


def _shard_of(ckpt: Path, name: str) -> Path:
    return ckpt / json.loads((ckpt / INDEX_FILE).read_text())["weight_map"][name]


def test_decode_refuses_bf16_labelled_f16_before_computing(ckpt, capsys):
    name = L + "0.self_attn.q_proj.weight"
    _relabel(_shard_of(ckpt, name), name, "F16")
    assert main(["decode", "--checkpoint", str(ckpt), "--prompt", "1,2", "--max-new", "2"]) == 2
    err = capsys.readouterr().err
    assert "dtype" in err and name in err and "BF16" in err and "F16" in err


def test_loading_a_checkpoint_checks_dtypes(ckpt, tiny):
    name = L + "2.self_attn.kv_b_proj.weight"
    _relabel(_shard_of(ckpt, name), name, "F16")
    with pytest.raises(ValueError, match=rf"{name}: expected shape \[.*\] \(BF16\).*found \[.*\] \(F16\)"):
        K3CpuModel.from_checkpoint(ckpt, tiny)


def test_decode_refuses_f32_where_an_mxfp4_pack_belongs(ckpt, capsys):
    """Fails at load, not only when the router happens to pick that expert."""
    name = L + "1.block_sparse_moe.experts.6.w2.weight_packed"
    path = _shard_of(ckpt, name)
    header, _ = _split(path.read_bytes())
    rows, cols = header[name]["shape"]
    _relabel(path, name, "F32", [rows, cols // 4])
    assert main(["decode", "--checkpoint", str(ckpt), "--prompt", "1", "--max-new", "1"]) == 2
    err = capsys.readouterr().err
    assert name in err and "U8" in err and "F32" in err


def test_e8m0_nan_scale_names_tensor_layer_and_expert(ckpt, tiny):
    model = K3CpuModel.from_checkpoint(ckpt, tiny)
    for layer in range(1, tiny.num_hidden_layers):   # poison every expert's w1 scale of every MoE layer
        for e in range(tiny.n_routed_experts):
            name = f"{L}{layer}.block_sparse_moe.experts.{e}.w1.weight_scale"
            h = model.weights.reader.entries[name]
            with open(h.path, "r+b") as f:
                f.seek(h.begin + 1)
                f.write(b"\xff")
    model = K3CpuModel.from_checkpoint(ckpt, tiny)
    with pytest.raises(ValueError, match=r"experts\.\d+\.w1\.weight_scale: layer 1, routed expert \d+: E8M0 scale "
                                         r"byte 255 \(NaN\)"):
        greedy_decode(model, [1, 2], 1)


# ----- huge requests and options -----

@pytest.mark.parametrize("argv, message", [
    pytest.param(["--max-new", "1000000000"], "would hold about", id="max-new-huge"),
    pytest.param(["--max-new", "-1"], "--max-new", id="max-new-negative"),
    pytest.param(["--seed", "-1"], "--seed", id="seed-negative"),
    pytest.param(["--seed", str(2**70)], "--seed", id="seed-huge"),
    pytest.param(["--prompt", "1,97"], "token id(s) [97] out of range", id="token-past-vocab"),
    pytest.param(["--prompt", "-4"], "out of range", id="token-negative"),
    pytest.param(["--prompt", ","], "at least one token", id="empty-prompt"),
])
def test_decode_options_are_checked_first(argv, message, capsys):
    assert main(["decode", "--prompt", "1,2", *argv]) == 2
    assert message in capsys.readouterr().err


def _huge_experts(tmp_path: Path) -> Path:
    raw = K3Config.preset("tiny").to_json()
    raw["num_experts"] = 10**6
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_a_million_experts_is_counted_not_listed(tmp_path, capsys):
    path = _huge_experts(tmp_path)
    cfg = K3Config.from_json(path)
    base = K3Config.preset("tiny")
    per_expert = 3 * base.moe_intermediate_size * base.routed_expert_hidden_size   # w1, w2, w3 parameters
    per_expert += base.hidden_size + 1                                            # its router row and bias
    assert num_parameters(cfg) - num_parameters(base) == 6 * (10**6 - 7) * per_expert
    assert main(["model", "info", "--config", str(path)]) == 0
    assert "not planned" in capsys.readouterr().out
    assert main(["decode", "--config", str(path), "--prompt", "1"]) == 2
    assert "too large" in capsys.readouterr().err


def test_admit_refuses_a_config_far_larger_than_the_checkpoint(ckpt, tmp_path):
    cfg = K3Config.from_json(_huge_experts(tmp_path))
    with pytest.raises(CheckpointError, match="not the checkpoint's config"):
        admit_checkpoint(ckpt, cfg)


# ----- config field types -----

@pytest.mark.parametrize("key, value, message", [
    pytest.param("tie_word_embeddings", "false", "tie_word_embeddings must be a JSON bool", id="bool-as-string"),
    pytest.param("tie_word_embeddings", 0, "tie_word_embeddings must be a JSON bool", id="bool-as-int"),
    pytest.param("hidden_size", 36.0, "hidden_size must be an int", id="int-as-float"),
    pytest.param("hidden_size", True, "hidden_size must be an int", id="int-as-bool"),
    pytest.param("rms_norm_eps", "1e-5", "rms_norm_eps must be a finite number", id="float-as-string"),
    pytest.param("num_key_value_heads", "4", "num_key_value_heads", id="kv-heads-string"),
])
def test_config_fields_are_type_checked(key, value, message):
    raw = K3Config.preset("tiny").to_json()
    raw[key] = value
    with pytest.raises(ValueError, match=message) as e:
        K3Config.from_json(raw)
    assert repr(value)[:10] in str(e.value)


@pytest.mark.parametrize("value", ["36", [3, "6"], 3, [3.0, 6.0]], ids=["string", "mixed", "int", "floats"])
def test_full_attn_layers_must_be_a_list_of_ints(value):
    raw = K3Config.preset("tiny").to_json()
    raw["linear_attn_config"]["full_attn_layers"] = value
    with pytest.raises(ValueError, match="full_attn_layers must be a list of ints"):
        K3Config.from_json(raw)


# ----- fuzzed shards, indexes and configs -----

def _mutate_header(blob: bytes, data) -> bytes:
    header, body = _split(blob)
    kind = data.draw(st.sampled_from(["value", "bytes", "length", "drop", "extra"]))
    if kind == "bytes":
        b = bytearray(blob)
        for _ in range(data.draw(st.integers(1, 3))):
            b[data.draw(st.integers(0, len(b) - 1))] ^= data.draw(st.integers(1, 255))
        return bytes(b)
    if kind == "length":
        return data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little") + blob[8:]
    names = sorted(header)
    name = data.draw(st.sampled_from(names))
    if kind == "drop":
        del header[name]
    elif kind == "extra":
        body += data.draw(st.binary(min_size=1, max_size=9))
    else:
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        value = data.draw(st.one_of(
            st.integers(-2**65, 2**65), st.floats(allow_nan=False), st.text(max_size=4), st.none(),
            st.lists(st.integers(-3, 2**64), max_size=3), st.sampled_from(["BF16", "F16", "U8", "F32", "I64"])))
        if name == "__metadata__":
            header[name][field] = value
        else:
            header[name][field] = value
    return _join(header, body)


def _library_loads(blob: bytes) -> bool:
    """The safetensors library's own verdict on the format (its Rust deserializer, every tensor's bytes)."""
    try:
        deserialize(blob)
        return True
    except Exception:  # noqa: BLE001 - any refusal of the library
        return False


@HOSTILE
@given(data=st.data())
def test_fuzzed_shard_only_raises_a_named_error_and_never_passes_what_safetensors_refuses(pristine, data):
    shard = sorted(pristine.glob("*.safetensors"))[1]
    blob = _mutate_header(shard.read_bytes(), data)
    try:
        header = parse_bytes(blob, shard.name)
    except FormatError as e:
        assert shard.name in str(e)
        return
    assert _library_loads(blob), f"admitted a shard the library refuses: {sorted(header.entries)[:3]}"


@HOSTILE
@given(data=st.data())
def test_fuzzed_checkpoint_admit_and_reader(pristine, tmp_path_factory, tiny, data):
    """admit and the reader fail only with a CheckpointError naming the shard or the index, and admit never
    accepts a checkpoint that safetensors' safe_open refuses to load."""
    d = tmp_path_factory.mktemp("fz")
    for f in pristine.iterdir():
        (d / f.name).symlink_to(f)
    shard = sorted(pristine.glob("*.safetensors"))[0]
    (d / shard.name).unlink()
    (d / shard.name).write_bytes(_mutate_header(shard.read_bytes(), data))
    if data.draw(st.booleans()):
        (d / INDEX_FILE).unlink()
        index = json.loads((pristine / INDEX_FILE).read_text())
        mutate = data.draw(st.sampled_from(["weight_map", "metadata", "entry", "raw"]))
        junk = data.draw(st.one_of(st.none(), st.integers(), st.text(max_size=30), st.lists(st.integers(), max_size=2)))
        if mutate == "raw":
            (d / INDEX_FILE).write_bytes(data.draw(st.binary(max_size=40)))
        else:
            if mutate == "entry":
                index["weight_map"][data.draw(st.sampled_from(sorted(index["weight_map"])))] = junk
            else:
                index[mutate] = junk
            (d / INDEX_FILE).write_text(json.dumps(index))
    for read in (lambda: admit_checkpoint(d, tiny), lambda: CheckpointReader(d)):
        try:
            out = read()
        except CheckpointError as e:
            assert shard.name in str(e) or INDEX_FILE in str(e)
            continue
        if getattr(out, "ok", False):   # admitted: safe_open must load every tensor of every shard
            for f in d.glob("*.safetensors"):
                with safe_open(str(f), framework="numpy") as lib:
                    assert sorted(lib.keys()) == sorted(k for k in _split(f.read_bytes())[0] if k != "__metadata__")
                    for k in lib.keys():
                        lib.get_tensor(k)


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                     max_leaves=8)


@HOSTILE
@given(data=st.data())
def test_fuzzed_config_only_raises_value_error_naming_a_field(tmp_path_factory, data):
    raw = K3Config.preset("tiny").to_json()
    keys = sorted(raw) + [f"linear_attn_config.{k}" for k in sorted(raw["linear_attn_config"])]
    key = data.draw(st.sampled_from(keys))
    value = data.draw(_JSON)
    if key.startswith("linear_attn_config."):
        raw["linear_attn_config"][key.split(".", 1)[1]] = value
    else:
        raw[key] = value
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(raw))
    try:
        K3Config.from_json(path)
    except ValueError as e:
        assert str(e).startswith("config"), str(e)


@HOSTILE
@given(raw=st.binary(max_size=64) | _JSON.map(lambda v: json.dumps(v).encode()))
def test_strict_json_only_raises_format_error(raw):
    try:
        loads_strict(raw, "f.json", "doc")
    except FormatError as e:
        assert str(e).startswith("f.json: doc: not valid JSON")


_LONG = "/tmp/" + "x" * 300   # longer than any file name may be (ENAMETOOLONG)


@pytest.mark.parametrize("argv", [
    pytest.param(["admit", _LONG], id="admit-dir"),
    pytest.param(["admit", "/tmp", "--config", _LONG], id="admit-config"),
    pytest.param(["decode", "--checkpoint", _LONG, "--prompt", "1"], id="decode-checkpoint"),
    pytest.param(["model", "info", "--config", _LONG], id="model-config"),
    pytest.param(["run", "--golden", _LONG], id="run-golden"),
    pytest.param(["run", "--report", _LONG, "--cases", "rmsnorm"], id="run-report"),
    pytest.param(["show", "rmsnorm/T1-D113", "--golden", _LONG], id="show-golden"),
    pytest.param(["regen", "--check", "--out", _LONG, "--cases", "rmsnorm"], id="regen-out"),
])
def test_an_over_long_path_is_a_usage_error_naming_it(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"k3conf {argv[0]}: ") and "xxxxxxxx" in err and "Traceback" not in err
