"""A conformance trace through the PyTorch model: prefill a prompt, decode the rest teacher-forced, record.

A trace records per step and layer 1_h, 2_x_mixer, 3_a, 4_m, 5_x_mlp, 6_f, 7_cache, then the logits and the
greedy token, under the names `step{s}.layer{i:02d}.{j}_{what}`, `step{s}.logits` and `step{s}.token`.
`run_trace` produces them from K3ForCausalLM by the model's own wiring. Two optional inputs come from the
caller, who owns the golden files and the rules about them:

- `GoldenFeed`: in layer-by-layer mode each layer is first given a recorded input state (AttnRes blocks +
  prefix, its cache), from the golden's `inter.*` tensors.
- `RouteForcing`: the MoE layers take expert choices handed in from outside where the caller says so (a
  reduced-precision model at a near-tie of the float64 reference); `forced` counts the tokens so routed.

The judge's side (comparing a trace with a golden, the `torch-model` backends) is conformance.backends.torch_model.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch

from k3torch.configuration_k3 import K3Config
from k3torch.loading import load_weights
from k3torch.modeling_k3 import (
    CORRECT,
    AttnResState,
    ForcedRoute,
    K3DecoderLayer,
    K3ForCausalLM,
    KdaLayerCache,
    LayerCache,
    MlaLayerCache,
    Wiring,
)

RECORD = ("h", "x_mixer", "a", "m", "x_mlp", "f")
PRECISIONS = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
KDA_CACHE_PARTS = ("conv_q", "conv_k", "conv_v", "recurrent")

# The caller's rule for one MoE layer at one step ('step1.layer04'): None (the router chooses), or
# (rows [T] bool: the tokens to force, experts [T, k] int: their experts).
RouteChooser = Callable[[str], tuple[np.ndarray, np.ndarray] | None]


def build_model(config_json: Mapping, weights: Mapping, precision: str = "fp64", wiring: Wiring | None = None,
                device: torch.device | str | None = None) -> K3ForCausalLM:
    """K3ForCausalLM from a config.json dict and full-name weights (numpy), loaded strictly.
    precision: 'fp64', 'fp32' or 'bf16'."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {sorted(PRECISIONS)}, found {precision!r}")
    model = K3ForCausalLM(K3Config.from_dict(config_json), PRECISIONS[precision], device, wiring or CORRECT)
    load_weights(model, weights)
    return model


class GoldenFeed:
    """Recorded layer inputs (layer-by-layer mode): `inter` maps '<step>.<layer>.block<i>', '.prefix',
    '.mla_rows' and '.kda.<part>' to numpy arrays, as a trace golden's `inter.*` group holds them."""

    def __init__(self, inter: Mapping[str, np.ndarray], model: K3ForCausalLM):
        self.inter, self.model = inter, model

    def _tensor(self, a, dtype: torch.dtype) -> torch.Tensor:
        """[T, D] numpy -> [1, T, D] tensor on the model's device."""
        return torch.as_tensor(np.asarray(a), device=self.model.device).to(dtype)[None]

    def state(self, key: str) -> AttnResState:
        """The AttnRes state (completed blocks and the running prefix) recorded before `key`."""
        wide = self.model.language_model.model.wide
        blocks, i = [], 0
        while f"{key}.block{i}" in self.inter:
            blocks.append(self._tensor(self.inter[f"{key}.block{i}"], wide))
            i += 1
        return AttnResState(blocks, self._tensor(self.inter[f"{key}.prefix"], wide))

    def layer_cache(self, key: str, old: LayerCache) -> LayerCache:
        """The layer's cache as recorded before `key`, in the dtypes and on the device of `old`."""
        if isinstance(old, MlaLayerCache):
            rows = self.inter.get(f"{key}.mla_rows")
            width = old.rows.shape[-1]
            rows = np.zeros((0, width)) if rows is None else np.asarray(rows)
            return MlaLayerCache(torch.as_tensor(rows, device=old.rows.device).to(old.rows.dtype)[None])
        parts = [torch.as_tensor(np.asarray(self.inter[f"{key}.kda.{n}"]), device=old.recurrent.device)
                 .to(getattr(old, n).dtype) for n in KDA_CACHE_PARTS]
        return KdaLayerCache(*parts)


class RouteForcing:
    """Expert choices given to the MoE layers from outside: `choose(key)` (see RouteChooser) says, for layer
    step `key`, which tokens take which experts; `forced` counts the tokens so routed."""

    def __init__(self, choose: RouteChooser):
        self.choose, self.forced = choose, 0

    def at(self, key: str, device: torch.device) -> ForcedRoute | None:
        """The ForcedRoute of layer step `key` ('step1.layer04'), or None where the router chooses itself."""
        chosen = self.choose(key)
        if chosen is None:
            return None
        rows, experts = chosen
        self.forced += int(np.sum(rows))
        return ForcedRoute(torch.as_tensor(experts, device=device), torch.as_tensor(rows, device=device))


def run_trace(model: K3ForCausalLM, tokens, prompt_len: int, feed: GoldenFeed | None = None,
              routes: RouteForcing | None = None, record: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Prefill tokens[:prompt_len], then decode the rest one at a time (teacher-forced); every trace tensor
    by name, as float64 numpy (batch axis dropped). `feed` gives each layer its recorded input state;
    `routes` gives the MoE layers choices from outside; `record`: the dict to record into (returned), for a
    caller that wants to see the record grow while the trace runs (a feed's source)."""
    lm = model.language_model
    tokens = [int(t) for t in tokens]
    steps = [tokens[:prompt_len]] + [[t] for t in tokens[prompt_len:]]
    cache = model.new_cache(1)
    out: dict[str, np.ndarray] = {} if record is None else record
    with torch.no_grad(), _unforced_after(model):
        for s, step_tokens in enumerate(steps):
            state = lm.model.embed(torch.tensor([step_tokens], device=model.device))
            for i, layer in enumerate(lm.model.decoder_layers()):
                key = f"step{s}.layer{i:02d}"
                if feed:
                    state = feed.state(key)
                    cache.layers[i] = feed.layer_cache(key, cache.layers[i])
                moe = layer.moe()
                if routes is not None and moe is not None:
                    moe.gate.forced = routes.at(key, model.device)
                state = _run_layer(layer, state, cache.layers[i], key, out)
            if feed:
                state = feed.state(f"step{s}.final")
            logits = lm.logits(lm.model.final_hidden(state))[0, -1]
            cache.seen_tokens += len(step_tokens)
            out[f"step{s}.logits"] = _float64(logits)
            out[f"step{s}.token"] = np.array([float(torch.argmax(logits))])
    return out


def _run_layer(layer: K3DecoderLayer, state: AttnResState, entry: LayerCache, key: str,
               out: dict[str, np.ndarray]) -> AttnResState:
    """One layer on `state`; its six intermediates and its cache contribution go into `out` under `key`."""
    before = entry.rows.shape[1] if isinstance(entry, MlaLayerCache) else 0
    record: dict[str, torch.Tensor] = {}
    state = layer(state, entry, record)
    for j, what in enumerate(RECORD, 1):
        out[f"{key}.{j}_{what}"] = _float64(record[what][0])
    # MLA: the rows this step appended; KDA: the recurrent state after the step
    out[f"{key}.7_cache"] = (_float64(entry.rows[0, before:]) if isinstance(entry, MlaLayerCache)
                             else _float64(entry.recurrent))
    return state


def _float64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


@contextlib.contextmanager
def _unforced_after(model: K3ForCausalLM) -> Iterator[None]:
    """Every router's `forced` is None again on the way out, so the model routes by itself afterwards."""
    try:
        yield
    finally:
        for layer in model.language_model.model.decoder_layers():
            moe = layer.moe()
            if moe is not None:
                moe.gate.forced = None


@contextlib.contextmanager
def cpu_threads(device: torch.device, n: int = 1) -> Iterator[None]:
    """On the CPU, run with `n` intra-op threads: a trace of the toy configs is thousands of tiny ops, where
    extra threads only add synchronisation (the tiny trace ran 25x slower with 2 threads on a loaded 2-core
    machine: 2.5 s against 0.1 s). Elsewhere nothing changes."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["RECORD", "PRECISIONS", "RouteChooser", "build_model", "GoldenFeed", "RouteForcing", "run_trace",
           "cpu_threads"]
