"""Loading a checkpoint directory into K3ForCausalLM: safetensors only, read lazily, strict names and shapes.

A directory holds `model.safetensors.index.json` (`{"weight_map": {name: shard}}`) and its shards, or one
`model.safetensors`. Each tensor is read on its own through `safe_open` (no pickle anywhere) and the whole
set goes through `load_state_dict(..., strict=True)`, so a missing, extra or misshaped tensor is an error
that names it. Tensors outside the text model (the published shards also carry the vision tower) are not
the text model's and are skipped by prefix.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

TEXT_PREFIX = "language_model."
INDEX_FILE = "model.safetensors.index.json"


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors are not the model's: names every missing, extra, misshaped or mistyped one."""


def checkpoint_files(path) -> dict[str, Path]:
    """{tensor name: shard file} of a checkpoint directory (index + shards, or one model.safetensors)."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: path / shard for name, shard in weight_map.items()}
    elif (path / "model.safetensors").is_file():
        with safe_open(path / "model.safetensors", framework="pt") as f:
            files = {name: path / "model.safetensors" for name in f.keys()}
    else:
        raise FileNotFoundError(f"checkpoint {path}: expected {INDEX_FILE} or model.safetensors there")
    absent = sorted({str(f) for f in files.values() if not f.is_file()})
    if absent:
        raise FileNotFoundError(f"checkpoint {path}: the index names shard(s) that are not there: {absent}")
    return files


def read_checkpoint(path) -> dict[str, torch.Tensor]:
    """Every text tensor of the checkpoint as stored (bf16, float32, uint8), one safe_open read each."""
    by_shard: dict[Path, list[str]] = {}
    for name, shard in checkpoint_files(path).items():
        if name.startswith(TEXT_PREFIX):
            by_shard.setdefault(shard, []).append(name)
    out = {}
    for shard, names in by_shard.items():
        with safe_open(shard, framework="pt") as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out


def load_weights(model: nn.Module, tensors: Mapping[str, torch.Tensor | np.ndarray], where: str = "weights") -> None:
    """Copy `tensors` (torch tensors or numpy arrays, full checkpoint names) into `model`, strictly.

    Float tensors are converted to each parameter's dtype; U8 (MXFP4 bytes and scales) must stay U8.
    Raises CheckpointMismatch naming every missing, extra, misshaped or mistyped tensor."""
    own = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    for name, given in tensors.items():
        t = torch.from_numpy(np.ascontiguousarray(given)) if isinstance(given, np.ndarray) else given
        if name in own and (t.dtype == torch.uint8) != (own[name].dtype == torch.uint8):
            problems.append(f"{name}: expected {own[name].dtype}, found {t.dtype}")
        state[name] = t
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    shapes = [f"{n}: expected shape {list(own[n].shape)}, found {list(state[n].shape)}"
              for n in sorted(set(own) & set(state)) if tuple(own[n].shape) != tuple(state[n].shape)]
    problems = ([f"missing: {n}" for n in missing] + [f"unexpected: {n}" for n in extra] + shapes + problems)
    if problems:
        head = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise CheckpointMismatch(f"{where}: {len(problems)} tensor(s) do not match the model:\n  {head}")
    model.load_state_dict(state, strict=True)


def load_checkpoint(model: nn.Module, path) -> None:
    """Load the checkpoint directory `path` into `model` (see load_weights)."""
    load_weights(model, read_checkpoint(path), where=f"checkpoint {path}")
