"""The CARRIED divergence: the engine's layer inputs against a float64 run of the dump's own tokens.

The reference runs the dump's steps (the prefill, then each decode step with the token the dump feeds) one
layer at a time: every step of layer l, then layer l + 1, holding one layer's weights (plus the small globals)
at once; the AttnRes state of every step waits between layers (a few [T, D] arrays per step). At the end
the final AttnRes, norm and lm_head give the reference logits of each step's last position: whether the
engine chose the reference's token, and by how much the reference preferred its top token (the margin).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from k3ref.config import K3Config
from k3ref.cores import reference_cores
from k3ref.cpu_forward import ForwardContext, embed, final_logits, forward_one_layer
from k3ref.weights import CheckpointReader, checkpoint_layers

from .budgets import ROUTE_TIE, default_table, geometry_of
from .divergence import Divergence, divergence
from .format import Dump
from .recompute import layer_model, open_cache
from .routes import route_core


@dataclasses.dataclass(frozen=True)
class StepTokens:
    """One step's token agreement: the engine's choice (None when the dump has none), the reference's top
    token, the reference's margin top1 - top2, its gap top1 - logit[engine's choice], and the largest
    |engine logit - reference logit| at the last position (None when the dump has no logits), and the shift:
    how far the engine moved a gap between the reference's top token t and any other j, max over j of
    |(r_t - r_j) - (e_t - e_j)| (a greedy flip to j needs r_t - r_j <= that shift; None without logits)."""

    step: int
    engine: int | None
    reference: int
    margin: float
    gap: float | None
    logit_err: float | None = None
    shift: float | None = None

    @property
    def agree(self) -> bool:
        return self.engine is None or self.engine == self.reference

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> StepTokens:
        return cls(int(d["step"]), None if d["engine"] is None else int(d["engine"]), int(d["reference"]),
                   float(d["margin"]), None if d["gap"] is None else float(d["gap"]),
                   None if d.get("logit_err") is None else float(d["logit_err"]),
                   None if d.get("shift") is None else float(d["shift"]))


@dataclasses.dataclass(frozen=True)
class FreeRun:
    """carried[(step, layer)]: the worst source of the engine's layer input (a completed block or the prefix)
    vs the reference's; tokens per step."""

    carried: dict[tuple[int, int], Divergence]
    tokens: list[StepTokens]

    def to_json(self) -> dict:
        return {"carried": [{"step": s, "layer": la, "carried": d.to_json()}
                            for (s, la), d in sorted(self.carried.items())],
                "tokens": [t.to_json() for t in self.tokens]}

    @classmethod
    def from_json(cls, d: dict) -> FreeRun:
        return cls({(int(c["step"]), int(c["layer"])): Divergence.from_json(c["carried"]) for c in d["carried"]},
                   [StepTokens.from_json(t) for t in d["tokens"]])


def checkpoint_misses_layers(checkpoint: str | Path, cfg: K3Config) -> list[int]:
    """The layers of `cfg` the checkpoint does not hold (a free run needs them all)."""
    held = set(checkpoint_layers(CheckpointReader(checkpoint).entries))
    return [i for i in range(cfg.num_hidden_layers) if i not in held]


def _tokens(step: int, logits: np.ndarray, chosen: int | None, engine: np.ndarray | None) -> StepTokens:
    order = np.argsort(-logits, kind="stable")
    top1 = int(order[0])
    margin = float(logits[top1] - logits[order[1]]) if logits.size > 1 else float("inf")
    gap = None if chosen is None else float(logits[top1] - logits[chosen])
    err = shift = None
    if engine is not None:
        e = np.asarray(engine[-1], np.float64)
        err = float(np.max(np.abs(e - logits)))
        shift = float(np.max(np.abs((logits[top1] - logits) - (e[top1] - e))))
    return StepTokens(step, chosen, top1, margin, gap, err, shift)


def _carried(dump: Dump, step: int, layer: int, hub, bf16: bool) -> Divergence:
    """The worst source of the layer input (each completed block, the prefix) against the reference's: blocks
    completed before an error are exact and would dilute it in one stacked measure."""
    blocks, prefix = dump.layer_input(step, layer)
    pairs = [*zip(blocks, hub.blocks, strict=True), (prefix, hub.prefix)]
    found = [divergence(e, r, bf16=bf16) for e, r in pairs]
    return max(found, key=lambda d: (d.nonfinite, d.rel_rms))


def free_run(dump: Dump, checkpoint: str | Path, layers=None, *, route_tie: float | None = None) -> FreeRun:
    """The float64 reference of the dump's tokens; carried divergence at `layers` (default: the dumped ones).
    route_tie: as recompute_layer's (default: the committed budget of the dump's geometry and dtype)."""
    cfg = dump.config
    gone = checkpoint_misses_layers(checkpoint, cfg)
    if gone:
        raise ValueError(f"free run: expected a checkpoint with every layer 0..{cfg.num_hidden_layers - 1}, "
                         f"found layers {gone} missing (run with the free run off)")
    want = set(dump.layers if layers is None else layers)
    bf16 = dump.dtype == "bfloat16"
    tie = (default_table().row(geometry_of(cfg), dump.dtype, ROUTE_TIE).limit if route_tie is None
           else route_tie)
    cores = reference_cores()
    total = sum(len(s.tokens) for s in dump.steps)
    hubs: list = []
    model = None
    carried: dict[tuple[int, int], Divergence] = {}
    for layer in range(cfg.num_hidden_layers):
        model = layer_model(checkpoint, layer, cfg)
        if not hubs:
            for s in dump.steps:
                hub = cores.attnres_hub(cfg.attn_res_block_size, eps=cfg.rms_norm_eps)
                hub.start(embed(model, s.tokens))
                hubs.append(hub)
        cache, seq = open_cache(model, total)
        for s, hub in zip(dump.steps, hubs, strict=True):
            if layer in want and layer in dump.layers:
                carried[(s.index, layer)] = _carried(dump, s.index, layer, hub, bf16)
            ids = f"layers.{layer}.router.ids"
            forced = route_core(dump.get(s.index, ids) if layer in dump.layers and dump.has(s.index, ids) else None,
                                tie)
            ctx = ForwardContext(model, cores if forced is None else cores.replace(moe_route=forced), seq,
                                 s.kind == "prefill")
            forward_one_layer(ctx, layer, hub, cache)
            cache.advance(seq, len(s.tokens))
    assert model is not None
    ctx = ForwardContext(model, cores, 0, False)
    chosen = dump.chosen
    tokens = [_tokens(s.index, final_logits(ctx, hub)[-1], None if chosen is None else int(chosen[i]),
                      dump.get(s.index, "logits") if dump.has(s.index, "logits") else None)
              for i, (s, hub) in enumerate(zip(dump.steps, hubs, strict=True))]
    return FreeRun(carried, tokens)
