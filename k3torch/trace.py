"""The conformance traces through the PyTorch model, and the check that a trace golden agrees with it.

A trace (conformance.cases.traces) prefills a prompt and decodes a few tokens, teacher-forced on the golden's
tokens, recording per step and layer 1_h, 2_x_mixer, 3_a, 4_m, 5_x_mlp, 6_f, 7_cache, then the logits and
the greedy token. `run_trace` produces the same tensors from K3ForCausalLM, by the model's own wiring; in
layer-by-layer mode each layer is first given the golden's input state (AttnRes blocks + prefix, its cache).

- `TorchModelBackend` ("torch-model" fp32, "torch-model-bf16"): a backend that runs whole traces
  (`evaluate_trace`); it has no cores, so the per-block cases do not apply to it.
- `RouteForcing`: at bf16 the golden's near-tie router choices are given to the model (`K3Router.forced`),
  as the trace kind does for the core backends, and counted.
- `verify_trace_golden`: run by the trace generator before a golden is written; float64 k3ref and the
  float64 torch model must agree on every tensor within AGREEMENT_RTOL, else TraceDisagreement names the
  first tensor (step, layer, slot) where they do not.

This module is the glue between the runner and the model: it reads the case's config through
k3ref.config (the geometry as config.json spells it) and conformance helpers; the model modules do not.
"""
from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping

import numpy as np

from conformance.golden.store import GoldenError
from conformance.judge.gates import near_tie_route

RECORD = ("h", "x_mixer", "a", "m", "x_mlp", "f")
# Two float64 implementations of one model, through <= 7 layers x 6 steps with different summation orders
# (chunked vs recurrent KDA, absorbed vs expanded MLA, expert sums in another order): measured 3.1e-14
# relative RMS at worst over every trace tensor of `tiny` (step1.layer04.3_a); 1e-10 leaves three orders for
# deeper configs and longer traces. Each wiring mutant of tests/k3torch/test_torch_model.py moves a tensor by > 1e-7.
AGREEMENT_RTOL = 1e-10
_NAME = re.compile(r"step(\d+)\.(?:layer(\d+)\.(\d)_\w+|(logits|token))$")


class TraceDisagreement(GoldenError, ValueError):
    """k3ref and the torch model disagree on a trace tensor (the message names step, layer and tensor); a
    GoldenError, so `k3conf regen` reports it as the reason it wrote nothing."""


def _torch():
    import torch

    return torch


def _dtype(precision: str):
    torch = _torch()
    return {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}[precision]


def build_model(config_json: Mapping, weights: Mapping, precision: str = "fp64", wiring=None, device=None):
    """K3ForCausalLM from a config.json dict and full-name weights (numpy), loaded strictly."""
    from k3torch.configuration_k3 import K3Config
    from k3torch.loading import load_weights
    from k3torch.modeling_k3 import CORRECT, K3ForCausalLM

    model = K3ForCausalLM(K3Config.from_dict(config_json), _dtype(precision), device, wiring or CORRECT)
    load_weights(model, weights)
    return model


class GoldenFeed:
    """A layer's golden input state, from the golden's `inter.*` tensors (layer-by-layer mode)."""

    def __init__(self, inter: Mapping[str, np.ndarray], model):
        self.inter, self.model = inter, model

    def _t(self, a, dtype):
        """[T, D] numpy -> [1, T, D] tensor on the model's device."""
        return _torch().as_tensor(np.asarray(a), device=self.model.device).to(dtype)[None]

    def state(self, key: str):
        from k3torch.modeling_k3 import AttnResState

        wide = self.model.language_model.model.wide
        blocks, i = [], 0
        while f"{key}.block{i}" in self.inter:
            blocks.append(self._t(self.inter[f"{key}.block{i}"], wide))
            i += 1
        return AttnResState(blocks, self._t(self.inter[f"{key}.prefix"], wide))

    def layer_cache(self, key: str, old):
        from k3torch.modeling_k3 import KdaLayerCache, MlaLayerCache

        torch = _torch()
        if isinstance(old, MlaLayerCache):
            rows = self.inter.get(f"{key}.mla_rows")
            width = old.rows.shape[-1]
            rows = np.zeros((0, width)) if rows is None else np.asarray(rows)
            return MlaLayerCache(torch.as_tensor(rows, device=old.rows.device).to(old.rows.dtype)[None])
        f = {n: torch.as_tensor(np.asarray(self.inter[f"{key}.kda.{n}"]), device=old.recurrent.device)
             for n in ("conv_q", "conv_k", "conv_v", "recurrent")}
        return KdaLayerCache(*(f[n].to(getattr(old, n).dtype) for n in ("conv_q", "conv_k", "conv_v", "recurrent")))


class RouteForcing:
    """The golden's router choices at its near-ties: for each MoE layer and step where the golden's margin
    (`route.<step>.<layer>.margin`, the k-th minus the (k+1)-th selection score) is below `budget`, the
    tokens there are given the golden's experts (`route.<step>.<layer>.choice`), as the trace kind does for
    the core backends (conformance.cases.traces._RouterTap). `forced` counts the tokens so routed."""

    def __init__(self, inter: Mapping[str, np.ndarray], budget: float):
        self.inter, self.budget, self.forced = inter, budget, 0

    def at(self, key: str, device):
        """The ForcedRoute of layer step `key` ('step1.layer04'), or None where no margin is below the budget."""
        from k3torch.modeling_k3 import ForcedRoute

        forced = near_tie_route(self.inter, key, self.budget)
        if forced is None:
            return None
        near, experts = forced
        self.forced += int(near.sum())
        torch = _torch()
        return ForcedRoute(torch.as_tensor(experts, device=device), torch.as_tensor(near, device=device))


def run_trace(model, tokens, prompt_len: int, feed: GoldenFeed | None = None,
              routes: RouteForcing | None = None) -> dict[str, np.ndarray]:
    """Prefill tokens[:prompt_len], then decode the rest one at a time (teacher-forced); every trace tensor
    by name, as float64 numpy (batch axis dropped). `routes` gives the MoE layers the golden's near-tie
    router choices."""
    from k3torch.modeling_k3 import MlaLayerCache

    torch = _torch()
    lm = model.language_model
    tokens = [int(t) for t in tokens]
    steps = [tokens[:prompt_len]] + [[t] for t in tokens[prompt_len:]]
    cache = model.new_cache(1)
    out: dict[str, np.ndarray] = {}
    np64 = lambda t: t.detach().to(torch.float64).cpu().numpy()  # noqa: E731
    with torch.no_grad(), _unforced_after(model):
        for s, toks in enumerate(steps):
            ids = torch.tensor([toks], device=model.device)
            state = lm.model.embed(ids)
            for i, layer in enumerate(lm.model.layers):
                key = f"step{s}.layer{i:02d}"
                if feed:
                    state = feed.state(key)
                    cache.layers[i] = feed.layer_cache(key, cache.layers[i])
                if routes is not None and hasattr(layer, "block_sparse_moe"):
                    layer.block_sparse_moe.gate.forced = routes.at(key, model.device)
                entry = cache.layers[i]
                before = entry.rows.shape[1] if isinstance(entry, MlaLayerCache) else 0
                rec: dict = {}
                state = layer(state, entry, rec)
                for j, what in enumerate(RECORD, 1):
                    out[f"{key}.{j}_{what}"] = np64(rec[what][0])
                out[f"{key}.7_cache"] = (np64(entry.rows[0, before:]) if isinstance(entry, MlaLayerCache)
                                         else np64(entry.recurrent))
            if feed:
                state = feed.state(f"step{s}.final")
            logits = lm.logits(lm.model.final_hidden(state))[0, -1]
            cache.seen_tokens += len(toks)
            out[f"step{s}.logits"] = np64(logits)
            out[f"step{s}.token"] = np.array([float(torch.argmax(logits))])
    return out


@contextlib.contextmanager
def _unforced_after(model):
    """Every router's `forced` is None again on the way out, so the model routes by itself afterwards."""
    try:
        yield
    finally:
        for layer in model.language_model.model.layers:
            if hasattr(layer, "block_sparse_moe"):
                layer.block_sparse_moe.gate.forced = None


def _order(name: str):
    m = _NAME.match(name)
    if not m:
        return (1 << 30, 0, 0, name)
    step, layer, slot, tail = m.groups()
    return (int(step), int(layer) if layer else 1 << 20, int(slot) if slot else (0 if tail == "logits" else 1),
            name)


def describe(name: str, config_json: Mapping) -> str:
    """'step1.layer02.3_a' -> 'step 1, layer 2 (MLA layer), tensor 3_a'."""
    m = _NAME.match(name)
    if not m or not m.group(2):
        return f"tensor {name}"
    layer = int(m.group(2))
    lac = config_json.get("linear_attn_config", {})
    full = lac.get("full_attn_layers", config_json.get("full_attn_layers", ()))
    kind = "MLA" if layer + 1 in full else "KDA"
    return f"step {m.group(1)}, layer {layer} ({kind} layer), tensor {name.rsplit('.', 1)[1]}"


def first_disagreement(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray],
                       rtol: float = AGREEMENT_RTOL) -> tuple[str, float] | None:
    """(name, relative RMS error) of the first tensor (compute order) where `candidate` is off by > rtol."""
    for name in sorted(reference, key=_order):
        ref = np.asarray(reference[name], dtype=np.float64)
        got = candidate.get(name)
        if got is None or np.shape(got) != ref.shape:
            return name, float("inf")
        den = max(float(np.linalg.norm(ref)), np.finfo(np.float64).tiny)
        err = float(np.linalg.norm(np.asarray(got, dtype=np.float64) - ref) / den)
        if not err <= rtol:
            return name, err
    return None


def verify_trace_golden(label: str, config_json: Mapping, weights: Mapping, tokens, prompt_len: int,
                        outputs: Mapping[str, np.ndarray]) -> None:
    """Raise TraceDisagreement unless the float64 torch model reproduces `outputs` (k3ref's) on `tokens`."""
    try:
        model = build_model(config_json, weights, "fp64")
    except ImportError as e:
        raise TraceDisagreement(f"{label}: cannot check the golden against the torch model ({e}); a trace "
                                "golden is written only when the independent PyTorch model agrees with it: "
                                "pip install 'k3-conformance[torch]'") from e
    with _cpu_threads(model.device):
        found = first_disagreement(outputs, run_trace(model, tokens, prompt_len))
    if found:
        name, err = found
        raise TraceDisagreement(
            f"{label}: refusing to write: the PyTorch model (k3torch) disagrees with k3ref at "
            f"{describe(name, config_json)}: relative RMS error {err:.3g} > {AGREEMENT_RTOL:g}. One of the two "
            f"reads the wiring differently there; see docs/torch_model.md")


@contextlib.contextmanager
def _cpu_threads(device, n: int = 1):
    """On the CPU, run with `n` intra-op threads: a trace of the toy configs is thousands of tiny ops, where
    extra threads only add synchronisation (the tiny trace ran 25x slower with 2 threads on a loaded 2-core
    machine: 2.5 s against 0.1 s)."""
    torch = _torch()
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class TorchModelBackend:
    """The torch model as a backend: whole traces only (`evaluate_trace`); no cores, no per-block cases.

    name: "torch-model" (float32) or "torch-model-bf16"; the device is CUDA when torch sees a GPU, else
    the CPU (override with K3CONF_TORCH_DEVICE)."""

    PRECISIONS = {"torch-model": "fp32", "torch-model-bf16": "bf16"}

    def __init__(self, name: str):
        self.name, self.precision = name, self.PRECISIONS[name]

    def _device(self):
        import os

        torch = _torch()
        return torch.device(os.environ.get("K3CONF_TORCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))

    def available(self) -> tuple[bool, str]:
        try:
            torch = _torch()
        except ImportError as e:
            return False, f"PyTorch is not installed ({e}); pip install 'k3-conformance[torch]'"
        return True, (f"k3torch.K3ForCausalLM, torch {torch.__version__} "
                      f"{str(_dtype(self.precision)).split('.')[-1]} on {self._device()}; model traces only")

    def cores(self):
        from k3ref.cores import UnsupportedShape

        raise UnsupportedShape(f"{self.name} runs whole model traces only (an eager PyTorch model, no "
                               "swappable cores): n/a for the per-block cases")

    def time_core(self, core: str, inputs: dict) -> float | None:
        return None

    def time_trace(self, case, golden, config_json: Mapping, prompt_len: int, repeats: int = 3) -> tuple[float, int]:
        """(median seconds of one whole trace after a warm-up run, 0): the model is built once, untimed.
        Bytes are not counted (a whole model: no copy-bandwidth ratio), so the report shows the time alone."""
        import statistics
        import time

        model = build_model(config_json, golden.group("weights"), self.precision, device=self._device())
        tokens = golden.group("inputs")["tokens"]
        times = []
        with _cpu_threads(self._device()):
            run_trace(model, tokens, prompt_len)
            for _ in range(repeats):
                t0 = time.perf_counter()
                run_trace(model, tokens, prompt_len)
                times.append(time.perf_counter() - t0)
        return statistics.median(times), 0

    def evaluate_trace(self, case, golden, config_json: Mapping, prompt_len: int,
                       router_budget: float = 0.0) -> dict[str, np.ndarray]:
        """The trace tensors of `golden` (a trace case of the config `config_json`, whose first `prompt_len`
        tokens are the prompt) computed by the torch model at this precision. Where the golden's router margin
        is below `router_budget` the token is given the golden's experts (RouteForcing); the count is returned
        as INFO_KEY: {"teacher_forced": {"router": n}}."""
        from conformance.cases.core import INFO_KEY

        golden.require(["inputs.tokens"])
        model = build_model(config_json, golden.group("weights"), self.precision, device=self._device())
        feed = None
        if golden.kwargs.get("mode") == "layerwise":
            feed = GoldenFeed(golden.group("inter"), model)
            if self.precision == "bf16":   # the golden's inputs as a bf16 run holds them; KDA state stays fp32
                from conformance.cases.core import cast

                feed.inter = {k: cast(v, "fp32" if k.endswith(".kda.recurrent") else "bf16")
                              for k, v in feed.inter.items()}
        routes = RouteForcing(golden.group("inter"), router_budget)
        with _cpu_threads(self._device()):
            out = run_trace(model, golden.group("inputs")["tokens"], prompt_len, feed, routes)
        out[INFO_KEY] = {"teacher_forced": {"router": routes.forced}}
        return out

