"""Record a dump from k3ref's CPU host graph (float32 or float64): the whole model, or each rank of a
tensor-parallel run (every rank writes its own rank directory: a real TP engine's dump).

The host graph's `recorder(layer, hub_before, record)` callback hands over the AttnRes state before each layer
and the layer's intermediates (h, x_mixer, a, m, x_mlp, f); the logits are those of the forward call. Under TP a
rank's activations are all-reduced, so they are replicated; its logits are stored as the vocab rows the rank
holds (concatenated on read).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel, forward_prefill, forward_token
from k3ref.tp import Comm, LoopbackGroup, TpPlan

from .writer import DumpWriter

DEFAULT_REF_ENGINE = "k3ref K3CpuModel host graph"


class _StepRecorder:
    """The host graph's recorder callback, collecting one step's tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, np.ndarray] = {}

    def __call__(self, layer: int, hub: Any, record: Mapping[str, np.ndarray]) -> None:
        p = f"layers.{layer}."
        if hub.blocks:
            self.tensors[p + "blocks"] = np.stack(hub.blocks)
        self.tensors[p + "prefix"] = np.array(hub.prefix, copy=True)
        for key, value in record.items():
            self.tensors[p + key] = np.array(value, copy=True)

    def take(self) -> dict[str, np.ndarray]:
        out, self.tensors = self.tensors, {}
        return out


def record_ref(model: K3CpuModel, prompt_ids: Any, max_new: int, path: str | os.PathLike, *,
               engine: str = DEFAULT_REF_ENGINE, config: Mapping[str, Any] | None = None, logits: str = "last",
               overwrite: bool = False) -> Path:
    """Greedy-decode `prompt_ids` with `model` (prefill, then `max_new` decode steps) and write its dump at
    `path`; returns `path`. logits: "last" stores the last position's logits, "all" every position's.

    A TP rank's model (`model.tp` set) writes rank `model.tp.rank` of a `model.tp.size` dump (use
    `record_ref_tp`, which closes rank 0 after the others); `config` must then be the whole model's
    config.json dict (the model's own is the rank-local one)."""
    return _record(model, prompt_ids, max_new, path, engine=engine, config=config, logits=logits,
                   overwrite=overwrite).close()


def _record(model: K3CpuModel, prompt_ids: Any, max_new: int, path: str | os.PathLike, *, engine: str,
            config: Mapping[str, Any] | None, logits: str, overwrite: bool) -> DumpWriter:
    """record_ref's run, leaving the writer open (a TP run closes rank 0 last)."""
    if logits not in ("last", "all"):
        raise ValueError(f"logits: expected 'last' or 'all', found {logits!r}")
    tp = model.tp
    if tp is not None and config is None:
        raise ValueError("config: a TP rank's model holds the rank-local config; pass the whole model's config")
    cfg = dict(config) if config is not None else model.cfg.to_json()
    w = DumpWriter(path, engine=engine, dtype=model.dtype.name, config=cfg, tp_size=1 if tp is None else tp.size,
                   rank=0 if tp is None else tp.rank, overwrite=overwrite)
    rec = _StepRecorder()
    cache = model.new_cache()
    seq = cache.add_sequence()
    tokens = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]
    start = 0
    for step in range(max_new + 1):
        if step == 0:
            out = forward_prefill(model, tokens, cache, seq=seq, recorder=rec)
        else:
            out = forward_token(model, tokens[0], start, cache, seq=seq, recorder=rec)[None]
        chosen = int(np.argmax(out[-1]))
        w.begin_step("prefill" if step == 0 else "decode", tokens, start)
        for name, value in sorted(rec.take().items()):
            w.put(name, value)
        rows = out[-1:] if logits == "last" else out
        w.put("logits", rows if tp is None else rows[:, tp.vocab.start:tp.vocab.stop])
        w.end_step(chosen)
        start += len(tokens)
        tokens = [chosen]
    return w


def record_ref_tp(cfg_json: Mapping[str, Any], shard: Callable[[TpPlan, int], Mapping[str, np.ndarray]], tp: int,
                  prompt_ids: Any, max_new: int, path: str | os.PathLike, *, dtype: Any = np.float64,
                  engine: str = DEFAULT_REF_ENGINE, logits: str = "last", overwrite: bool = False) -> Path:
    """Run the host graph on `tp` ranks (threads, k3ref.tp.LoopbackGroup) and let every rank write its own
    rank directory of the dump at `path`. shard(plan, rank): that rank's weights (e.g.
    `lambda plan, r: k3ref.tp_weights.synthetic_rank_shard(plan, r, seed)[0]`)."""
    plan = TpPlan(K3Config.from_json(dict(cfg_json)), tp)

    def rank(r: int, comm: Comm) -> None:
        model = K3CpuModel(plan.local_config(), shard(plan, r), dtype, tp=plan.rank(r, comm))
        w = _record(model, prompt_ids, max_new, path, engine=engine, config=cfg_json, logits=logits,
                    overwrite=overwrite)
        if r != 0:
            w.close()
        comm.all_reduce(np.zeros(1))     # a barrier: every other rank's manifest is in place
        if r == 0:
            w.close()                    # rank 0 writes the top manifest last

    LoopbackGroup(tp).run(rank)
    return Path(path)
