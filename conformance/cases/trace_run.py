"""Running the steps of a model trace: the host graph with a backend's cores, optionally fed the golden's state.

A trace prefills the prompt (step 0) and then decodes one token per step. `Stepper` runs the steps and records
every layer's outputs under their trace names (conformance.cases.trace_names); `GoldenFeed` replaces each
layer's input state with the golden's (the layerwise mode); `RouterTap` records the router's choices and
margins while a golden is generated and, while a backend is evaluated, gives it the golden's choice where that
choice is a near-tie at its precision; `guard_kernels` lets a kernel core fall back to the reference core on
an UnsupportedShape and counts both.
"""
from __future__ import annotations

import numpy as np

from conformance.cases.inputs import cast, fp32_kept
from conformance.cases.trace_names import CACHE_SLOT, CACHE_WHAT, RECORD, TraceName, final_key, layer_key
from conformance.judge.gates import margin_budgets, near_tie_route
from k3ref.cache import MlaKv
from k3ref.cores import CORE_NAMES, UnsupportedShape, reference_cores
from k3ref.cpu_forward import ForwardContext, K3CpuModel, embed, final_logits, forward_one_layer
from k3ref.kda import KdaState
from k3ref.latent_moe import route_weights
from k3ref.ops import sigmoid

PROMPT = (5, 17, 3, 42, 8, 1, 60)
DECODE_STEPS = 5
# The precisions at which a near-tie may be teacher-forced. At fp64 and fp32 every router choice and greedy token
# must match the golden (float32 moves a margin by ~1e-6, TIE_MARGIN keeps them 1e-4 apart): a budget there would
# hide a real flip, so it is refused however it got into the budget table.
FORCING_PRECISIONS = frozenset({"bf16"})


def forcing_budgets(precision: str, mode: str) -> dict[str, float]:
    """choice -> near-tie budget at `precision` in a trace of `mode` (gates.margin_budgets); ValueError when the
    budget table gives one to a precision that may not force."""
    budgets = margin_budgets(precision, mode)
    if precision not in FORCING_PRECISIONS and any(b > 0 for b in budgets.values()):
        raise ValueError(f"teacher forcing at {precision}: expected no near-tie budget (only "
                         f"{', '.join(sorted(FORCING_PRECISIONS))} may force), found {budgets} in "
                         "conformance.judge.gate_table.MARGIN_BUDGETS")
    return budgets


def check_forced(precision: str, forced: dict[str, int]) -> None:
    """RuntimeError when a trace at a precision that may not force was teacher-forced anyway (counts by choice)."""
    if precision not in FORCING_PRECISIONS and any(forced.values()):
        allowed = ", ".join(sorted(FORCING_PRECISIONS))
        raise RuntimeError(f"teacher forcing at {precision}: expected none (only {allowed} may force), found {forced}")


def compute_dtype(precision: str):
    """The dtype the host graph computes in at `precision` (bf16 values are held as float32)."""
    return np.float64 if precision == "fp64" else np.float32


def route_margin(logits, bias, top_k: int, n_group: int = 1, topk_group: int = 1) -> np.ndarray:
    """Per token, how far the router's choice is from changing, in selection-score units: the k-th minus the
    (k+1)-th score (sigma(logits) + bias) among the experts it may pick, and with n_group > 1 also the
    topk_group-th minus the next group score (the sum of a group's top 2). logits [T, E] -> [T] (float64)."""
    choice = sigmoid(np.asarray(logits, np.float64)) + np.asarray(bias, np.float64)
    T, E = choice.shape
    margin = np.full(T, np.inf)
    if n_group > 1:
        grouped = choice.reshape(T, n_group, E // n_group)
        gscore = np.sort(grouped, axis=-1)[..., ::-1][..., :2].sum(-1)          # [T, n_group]
        order = np.argsort(-gscore, axis=-1, kind="stable")
        if topk_group < n_group:
            ranked_g = np.take_along_axis(gscore, order, axis=-1)
            margin = ranked_g[:, topk_group - 1] - ranked_g[:, topk_group]
        keep = np.zeros((T, n_group), bool)
        np.put_along_axis(keep, order[:, :topk_group], True, axis=-1)
        choice = np.where(keep[..., None], grouped, -np.inf).reshape(T, E)
    ranked = -np.sort(-choice, axis=-1)
    if top_k < E:
        runner_up = ranked[:, top_k]
        gap = np.where(np.isfinite(runner_up), ranked[:, top_k - 1] - runner_up, np.inf)
        margin = np.minimum(margin, gap)
    return margin


def argmax_margin(logits) -> float:
    """Top logit minus the runner-up."""
    top2 = -np.sort(-np.asarray(logits, np.float64))[:2]
    return float(top2[0] - top2[1])


class RouterTap:
    """Wraps the moe_route core. Generating: records each (step, layer)'s choice and margin. Evaluating: where
    the golden's margin is below `budget`, gives the backend the golden's choice (weights from the backend's
    own logits, as the core would) and counts it."""

    def __init__(self, route, golden: dict | None = None, budget: float = 0.0):
        self.route, self.golden, self.budget = route, golden, budget
        self.where = ""
        self.record: dict[str, np.ndarray] = {}
        self.forced = 0

    def __call__(self, logits, bias, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
        w, idx = self.route(logits, bias, top_k, n_group=n_group, topk_group=topk_group,
                            renormalize=renormalize, scaling=scaling)
        if self.golden is None:
            self.record[f"route.{self.where}.choice"] = np.asarray(idx, np.int64)
            self.record[f"route.{self.where}.margin"] = route_margin(logits, bias, top_k, n_group, topk_group)
            return w, idx
        forced = near_tie_route(self.golden, self.where, self.budget)
        if forced is None:
            return w, idx
        near, gold = forced
        self.forced += int(near.sum())
        gw = route_weights(sigmoid(np.asarray(logits)), gold, renormalize, scaling).astype(np.asarray(w).dtype)
        return np.where(near[:, None], gw, w), np.where(near[:, None], gold, np.asarray(idx))


class Stepper:
    """Runs the steps of a trace (the prefill, then one per decoded token), optionally feeding each layer its
    golden input state."""

    def __init__(self, model: K3CpuModel, cores, feed=None, tap: RouterTap | None = None,
                 prompt_len: int = len(PROMPT)):
        self.model, self.feed, self.tap, self.prompt_len = model, feed, tap, prompt_len
        self.cores = cores if tap is None else cores.replace(moe_route=tap)
        self.cache = model.new_cache()
        self.seq = self.cache.add_sequence()

    def steps(self, tokens: np.ndarray):
        n = self.prompt_len
        yield 0, tokens[:n]
        for s in range(1, len(tokens) - n + 1):
            yield s, tokens[n + s - 1:n + s]

    def run(self, tokens: np.ndarray, snapshot: dict | None = None) -> dict[str, np.ndarray]:
        """Outputs by name (logits: float; greedy tokens: the backend's argmax, int64); `snapshot`
        (generation only) receives every layer's input state."""
        m, out = self.model, {}
        for s, toks in self.steps(tokens):
            ctx = ForwardContext(m, self.cores, self.seq, prefill=(s == 0))
            hub = self.cores.attnres_hub(m.cfg.attn_res_block_size, eps=m.cfg.rms_norm_eps)
            hub.start(embed(m, toks))
            for spec in m.graph.layers:
                layer = spec.index
                key = layer_key(s, layer)
                if self.feed:
                    hub = self.feed.hub(hub, key)
                    self.feed.layer_cache(self.cache, self.seq, s, layer)
                if snapshot is not None:
                    _snapshot_layer(snapshot, key, hub, self.cache, self.seq, layer)
                if self.tap is not None:
                    self.tap.where = key
                rows_before = _mla_len(self.cache, self.seq, layer)
                hub, self.cache, rec = forward_one_layer(ctx, layer, hub, self.cache)
                for i, what in enumerate(RECORD, 1):
                    out[str(TraceName.of_layer(s, layer, i, what))] = np.asarray(rec[what])
                cache_name = TraceName.of_layer(s, layer, CACHE_SLOT, CACHE_WHAT)
                out[str(cache_name)] = _layer_cache_after(self.cache, self.seq, layer, rows_before)
            if self.feed:
                hub = self.feed.hub(hub, final_key(s))
            if snapshot is not None:
                _snapshot_hub(snapshot, final_key(s), hub)
            logits = final_logits(ctx, hub)
            self.cache.advance(self.seq, len(toks))
            out[str(TraceName(s, "logits"))] = logits[-1]
            out[str(TraceName(s, "token"))] = np.array([np.argmax(logits[-1])], dtype=np.int64)
        return out


def _mla_len(cache, seq: int, layer: int) -> int:
    return int(cache.mla[layer].seq_lens([seq])[0]) if layer in cache.mla else 0


def _layer_cache_after(cache, seq: int, layer: int, rows_before: int) -> np.ndarray:
    if layer in cache.mla:
        return cache.mla[layer].gather(seq)[rows_before:]
    return np.asarray(cache.kda_state(layer, seq).recurrent)


def _snapshot_hub(snap: dict, key: str, hub) -> None:
    for i, b in enumerate(hub.blocks):
        snap[f"inter.{key}.block{i}"] = np.asarray(b)
    snap[f"inter.{key}.prefix"] = np.asarray(hub.prefix)


def _snapshot_layer(snap: dict, key: str, hub, cache, seq: int, layer: int) -> None:
    _snapshot_hub(snap, key, hub)
    if layer in cache.mla:
        rows = cache.mla[layer].gather(seq)
        if len(rows):
            snap[f"inter.{key}.mla_rows"] = rows
    else:
        st = cache.kda_state(layer, seq)
        for f in ("recurrent", "conv_q", "conv_k", "conv_v"):
            snap[f"inter.{key}.kda.{f}"] = np.asarray(getattr(st, f))


class GoldenFeed:
    """Replaces a layer's input state with the golden one (layer-by-layer mode)."""

    def __init__(self, inter: dict[str, np.ndarray], precision: str):
        # the KDA recurrent state is fp32 in K3 (docs/spec.md section 3.1), as in the free run and the kda cases
        keep32 = fp32_kept(precision)
        self.inter = {k: cast(v, keep32 if k.endswith(".kda.recurrent") else precision) for k, v in inter.items()
                      if k.startswith("step")}
        self.dtype = compute_dtype(precision)

    def hub(self, hub, key: str):
        blocks, i = [], 0
        while f"{key}.block{i}" in self.inter:
            blocks.append(self.inter[f"{key}.block{i}"])
            i += 1
        hub.blocks, hub.prefix = blocks, self.inter[f"{key}.prefix"]
        return hub

    def layer_cache(self, cache, seq: int, step: int, layer: int) -> None:
        key = layer_key(step, layer)
        if layer in cache.mla:
            old = cache.mla[layer]
            kv = MlaKv(old.pages.shape[0], old.pages.shape[1], old.pages.shape[2], old.pages.dtype)
            for _ in range(seq + 1):
                kv.add_sequence()
            for row in self.inter.get(f"{key}.mla_rows", np.zeros((0, old.pages.shape[2]))):
                kv.append([seq], row[None])
            cache.mla[layer] = kv
        else:
            f = {n: self.inter[f"{key}.kda.{n}"] for n in ("recurrent", "conv_q", "conv_k", "conv_v")}
            cache.set_kda_state(layer, seq, KdaState(f["conv_q"], f["conv_k"], f["conv_v"], f["recurrent"]))


def guard_kernels(cores, kernel_names):
    """The backend's cores with each of its kernel cores falling back to the reference core on UnsupportedShape;
    returns (cores, calls, fallbacks): calls[name] counts the calls of each kernel core, fallbacks[name] =
    [count, first reason] for those that fell back."""
    ref, calls, fallbacks = reference_cores(), {}, {}

    def guarded(name, fn):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            try:
                return fn(*args, **kwargs)
            except UnsupportedShape as e:
                fallbacks.setdefault(name, [0, str(e)])[0] += 1
                return getattr(ref, name)(*args, **kwargs)
        return call

    swaps = {n: guarded(n, getattr(cores, n)) for n in CORE_NAMES if n in kernel_names and n != "attnres_hub"}
    return cores.replace(**swaps), calls, fallbacks

