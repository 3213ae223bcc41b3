"""`synth_checkpoint` / `k3conf synth`: a checkpoint of some layers, random MXFP4 experts with valid scales."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conformance.cli import main
from k3ref import weights as W
from k3ref.config import K3Config
from k3ref.mxfp4 import dequantize
from k3ref.weights import (
    INDEX_FILE,
    CheckpointReader,
    admit_checkpoint,
    checkpoint_layers,
    inventory,
    synth_checkpoint,
    synthetic_weights,
)

SEED = 5


@pytest.fixture(scope="module")
def tiny():
    return K3Config.preset("tiny")


@pytest.fixture(scope="module")
def sub(tiny, tmp_path_factory):
    return synth_checkpoint(tiny, tmp_path_factory.mktemp("synth") / "ckpt", layers=[2, 0], seed=SEED,
                            shard_bytes=30_000)


def test_synth_writes_exactly_the_asked_layers_and_the_globals(tiny, sub):
    reader = CheckpointReader(sub)
    assert set(reader.entries) == {s.name for s in inventory(tiny, [0, 2])}
    assert checkpoint_layers(reader.entries) == (0, 2)
    assert {s.name for s in inventory(tiny, [0, 2])} >= {W.TEXT_PREFIX + "embed_tokens.weight", W.LM_HEAD}
    index = json.loads((sub / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(reader.entries)
    assert admit_checkpoint(sub, tiny, layers=[0, 2]).ok
    full = admit_checkpoint(sub, tiny)
    assert not full.ok and {p.kind for p in full.problems} == {"missing"}
    assert checkpoint_layers(p.name for p in full.problems) == (1, 3, 4, 5, 6)


def test_synth_float_tensors_are_the_synthetic_weights(tiny, sub):
    reader, ref = CheckpointReader(sub), synthetic_weights(tiny, SEED, np.float32)
    for spec in inventory(tiny, [0, 2]):
        if spec.dtype != "U8":
            np.testing.assert_array_equal(reader[spec.name], ref[spec.name], err_msg=spec.name)


def test_synth_experts_have_valid_scales_and_unit_gain(tiny, sub):
    reader = CheckpointReader(sub)
    names = [s.name for s in inventory(tiny, [2]) if s.name.endswith("weight_packed")]
    assert len(names) == 3 * tiny.n_routed_experts
    gains = []
    for name in names:
        scale = reader[name.replace("packed", "scale")]
        assert scale.dtype == np.uint8 and scale.max() < 255           # never the E8M0 NaN byte
        w = dequantize(reader[name], scale)
        assert np.all(np.isfinite(w))
        gains.append(float(np.sqrt(np.mean(w.astype(np.float64) ** 2)) * math.sqrt(w.shape[1])))
    assert 0.5 < float(np.median(gains)) < 2.0, gains                   # W x keeps x's scale
    packed = [reader[n] for n in names]
    assert len({p.tobytes() for p in packed}) == len(packed)            # every expert drawn on its own


def test_synth_chunked_floats_equal_the_whole_draw(tiny, monkeypatch):
    spec = next(s for s in inventory(tiny) if s.name.endswith("embed_tokens.weight"))
    whole = W._round(W._float_values(spec, tiny, SEED), spec.dtype)
    parts = list(W._float_chunks(spec, tiny, SEED, chunk_elems=7 * spec.shape[1] + 3))
    assert len(parts) > 1
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_synth_refuses_to_overwrite(tiny, sub):
    before = {p.name: p.stat().st_mtime_ns for p in sub.iterdir()}
    with pytest.raises(ValueError, match="refusing to overwrite"):
        synth_checkpoint(tiny, sub, layers=[1])
    assert {p.name: p.stat().st_mtime_ns for p in sub.iterdir()} == before


def test_synth_into_an_empty_folder_and_no_partial_left(tiny, tmp_path):
    (tmp_path / "out").mkdir()
    synth_checkpoint(tiny, tmp_path / "out", layers=[1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_synth_refuses_without_disk_room_naming_the_numbers(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(W.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(ValueError, match=r"needs 0\.\d\d GiB .* has 0\.00 GiB free"):
        synth_checkpoint(tiny, tmp_path / "out", layers=[1])
    assert list(tmp_path.iterdir()) == []


def test_synth_failure_removes_the_partial_folder(tiny, tmp_path, monkeypatch):
    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(W, "_write_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        synth_checkpoint(tiny, tmp_path / "out", layers=[1])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("layers", [[], [7], [-1], ["x"]])
def test_synth_layers_are_checked(tiny, tmp_path, layers):
    with pytest.raises(ValueError, match="layers: expected"):
        synth_checkpoint(tiny, tmp_path / "out", layers=layers)


def test_k3_real_layer_sizes():
    k3 = K3Config.preset("k3")
    kda_moe = sum(s.nbytes for s in inventory(k3, [1]))
    assert 20.0 < kda_moe / 2**30 < 20.4                 # one real KDA + MoE layer with the globals
    assert sum(s.dtype == "U8" for s in inventory(k3, [1, 3])) == 2 * 6 * 896


def test_cli_synth_writes_and_refuses(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["synth", str(out), "--config", "tiny", "--layers", "1-2,5"]) == 0
    assert "layers 1,2,5" in capsys.readouterr().out
    assert checkpoint_layers(CheckpointReader(out).entries) == (1, 2, 5)
    assert main(["synth", str(out), "--config", "tiny", "--layers", "1"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert main(["synth", str(tmp_path / "b"), "--config", "tiny", "--layers", "9"]) == 2
    assert "0..6" in capsys.readouterr().err
    assert main(["synth", str(tmp_path / "c"), "--config", "tiny", "--layers", "a,b"]) == 2
    assert "comma-separated" in capsys.readouterr().err


def test_cli_admit_takes_the_layers_a_synth_checkpoint_holds(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["synth", str(out), "--config", "tiny", "--layers", "1,3"]) == 0
    capsys.readouterr()
    assert main(["admit", str(out), "--config", "tiny"]) == 1          # the whole model: other layers missing
    assert "missing" in capsys.readouterr().out
    assert main(["admit", str(out), "--config", "tiny", "--layers", "1,3"]) == 0
    assert main(["admit", str(out), "--config", "tiny", "--layers", "3"]) == 0     # layer 1 counted, ignored
    assert main(["admit", str(out), "--config", "tiny", "--layers", "2"]) == 1     # not in the checkpoint
    capsys.readouterr()
    assert main(["admit", str(out), "--config", "tiny", "--layers", "x"]) == 2
    assert "comma-separated" in capsys.readouterr().err
