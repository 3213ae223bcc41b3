"""`k3conf admit` on a checkpoint laid out as the released model's (docs/spec.md, "The release"): config.json with
the multimodal wrapper (`model_type: kimi_k3`, the text model under `text_config` whose inner `model_type` is
`kimi_linear`), `quantization_config` at the top, `linear_attn_config.full_attn_layers` one-based, no `a_log_size`
(A_log is stored padded to 128), every text tensor under `language_model.`, and vision-tower tensors beside them in
model.safetensors.index.json. The tiny geometry keeps the checkpoint small; the layout is the release's."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from conformance.cli import main as cli_main
from k3ref.config import K3Config
from k3ref.weights import LM_HEAD, synthetic_checkpoint

TINY = K3Config.preset("tiny")
VISION_TENSOR = "vision_tower.patch_embed.proj.weight"
# the keys of the released config.json outside text_config (values abridged: admit reads none of them)
RELEASED_WRAPPER = {
    "model_type": "kimi_k3",
    "architectures": ["KimiK3ForConditionalGeneration"],
    "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                            "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32}}}},
    "vision_config": {"model_type": "moonvit"},
}


def released_layout(ckpt: Path, cfg: K3Config) -> Path:
    """Rewrite a synthetic checkpoint's config.json in the released layout (a_log_size left out, as published)
    and add one vision-tower tensor in a shard of its own, listed in the index."""
    text = cfg.to_json()
    text.pop("a_log_size")
    (ckpt / "config.json").write_text(json.dumps({**RELEASED_WRAPPER, "text_config": text}, indent=2))
    vision = np.zeros((8, 3), np.float32)
    save_file({VISION_TENSOR: vision}, str(ckpt / "vision.safetensors"))
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][VISION_TENSOR] = "vision.safetensors"
    index["metadata"]["total_size"] += vision.nbytes
    index_path.write_text(json.dumps(index))
    return ckpt


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """tiny at A_log padded to 128 (the release's padding), in the released layout."""
    cfg = dataclasses.replace(TINY, a_log_size=128)
    return released_layout(synthetic_checkpoint(cfg, 1, tmp_path_factory.mktemp("released") / "ckpt"), cfg)


def test_the_released_config_reads_as_the_text_model_it_wraps(released):
    cfg = K3Config.from_json(released / "config.json")
    assert cfg == dataclasses.replace(TINY, a_log_size=128)     # one-based full_attn_layers kept, A_log padded
    assert cfg.mla_layers == tuple(i - 1 for i in sorted(TINY.full_attn_layers))


def test_admit_takes_the_released_layout(released, capsys):
    assert cli_main(["admit", str(released)]) == 0
    out = capsys.readouterr().out
    assert "REJECTED" not in out
    index = json.loads((released / "model.safetensors.index.json").read_text())["weight_map"]
    assert LM_HEAD in index and VISION_TENSOR in index


def test_admit_names_an_unpadded_A_log_in_the_released_layout(tmp_path, capsys):
    """The released config has no a_log_size: A_log is expected at 128, and a checkpoint that stores it unpadded
    ([heads]) is named, tensor by tensor."""
    cfg = dataclasses.replace(TINY, a_log_size=TINY.kda_num_heads)
    ckpt = released_layout(synthetic_checkpoint(cfg, 1, tmp_path / "ckpt"), cfg)
    assert cli_main(["admit", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert f"A_log: expected [128], found [{TINY.kda_num_heads}]" in out
