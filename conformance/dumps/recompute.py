"""The ADDED divergence of one layer: each sublayer recomputed in float64 from the engine's own input.

For every step of the dump (prefill, then decode steps, in order) and the one layer asked for:

    attnres_mixer   h   = AttnRes(blocks + [prefix])              from the dumped layer input
    mixer           a   = Mixer(x_mixer)                          x_mixer: the engine's, else RMSNorm(engine h),
                                                                  else RMSNorm(recomputed h)
    attnres_mlp     m   = AttnRes(blocks' + [prefix + engine a])  the engine's own a
    mlp             f   = MLP(x_mlp)                              x_mlp: the engine's, else RMSNorm(engine m), ...
    layer           (a, f) of the whole layer from (blocks, prefix) alone
    experts         inside the mlp row, where the dump holds experts.in / experts.out / router.ids: each slot's
                    expert output against the float64 expert on the engine's own expert input, pooled per expert
                    over the steps so far (experts.py)
    probe           inside a KDA layer's mixer row: d = a_bf16state - a, what rounding the recurrent state to
                    bf16 between steps changes in the float64 recompute, and the engine's error e = a_engine - a
                    projected on it (`Row.probe` = (<e, d>, <d, d>, sum e^2 d^2), the last for the projection's
                    standard error): pooled over steps and layers, <e, d> / <d, d>
                    is near 1 for an engine that stores its state in bf16 and near 0 for one that keeps it in
                    fp32 (precision.py)

A row is over its budget when its relative RMS is over the sublayer's budget, OR its gain (|g - 1|, see
divergence.py) is over the sublayer's gain budget, OR (mlp) an expert's pooled gain score is over the experts'
budget, or the engine made a non-finite value; `Row.over_by` says which.

The mixer's cache (KDA conv + state, MLA latent rows) is built by the recompute itself over the dumped inputs
of the earlier steps (chunked KDA / expanded MLA for the prefill, recurrent KDA / absorbed MLA for a decode
step, as k3ref does), so a step's mixer row is judged on the engine's input of that step only; the "layer"
row keeps its own cache fed by its own recomputed mixer inputs. Where the dump holds the engine's expert
choice (router.ids), a token whose choice differs from the recompute's only within a near-tie of the scores
is routed as the engine chose (routes.py). Only this layer's weights are loaded
(`K3CpuModel.from_checkpoint(..., layers=[layer])`, experts memory-mapped).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from k3ref.attnres import AttnResHub
from k3ref.cores import Cores, reference_cores
from k3ref.cpu_forward import ForwardContext, K3CpuModel, forward_one_layer, mixer_forward, mlp_forward
from k3ref.layer import MixerKind, MlpKind

from .budgets import EXPERTS_GAIN, ROUTE_TIE, Budgets, default_table, gain_key, geometry_of
from .divergence import Divergence, divergence
from .experts import KEYS as EXPERT_KEYS
from .experts import ExpertPool, ExpertsCheck, check_experts
from .format import Dump
from .routes import route_core

SUBLAYERS = ("attnres_mixer", "mixer", "attnres_mlp", "mlp")
LAYER_ROW = "layer"
PAGE = 64


@dataclasses.dataclass(frozen=True)
class Row:
    """The added divergence of one sublayer (or the whole layer) at one step, with its budgets: relative RMS
    (`budget`), gain (`gain_budget`, None: not judged) and, for an MoE mlp row, the routed experts' check."""

    step: int
    sublayer: str
    added: Divergence
    budget: float
    forced_routes: int = 0        # tokens routed as the engine chose at a near-tie (see routes.py)
    gain_budget: float | None = None
    experts: ExpertsCheck | None = None
    forced_gap: float = 0.0       # the largest choice-score gap of a route it forced (what calibrate measures)
    probe: tuple[float, float, float] | None = None   # KDA mixer: (<e, d>, <d, d>, sum e^2 d^2), see above

    @property
    def over_by(self) -> list[str]:
        """Why the row is over (empty: within every budget), one phrase per measure over."""
        why = []
        if self.added.nonfinite > 0:
            why.append(f"{self.added.nonfinite} non-finite engine values")
        if not self.added.rel_rms <= self.budget:
            why.append(f"rel RMS {self.added.rel_rms:.2e} > budget {self.budget:.2e}")
        if self.gain_budget is not None and not abs(self.added.gain) <= self.gain_budget:
            why.append(f"gain {self.added.gain:+.2e} beyond budget {self.gain_budget:.2e}")
        x = self.experts
        if x is not None and x.added.nonfinite > 0:
            why.append(f"{x.added.nonfinite} non-finite routed expert outputs")
        if x is not None and x.over and x.worst is not None and not x.worst.score <= x.gain_budget:
            w = x.worst
            why.append(f"routed expert {w.expert} gain {w.gain:+.2e} over {w.slots} slots (score {w.score:.2e} > "
                       f"budget {x.gain_budget:.2e})")
        return why

    @property
    def over(self) -> bool:
        """Over a budget, or the engine made a non-finite value."""
        return bool(self.over_by)

    def to_json(self) -> dict:
        return {"step": self.step, "sublayer": self.sublayer, "added": self.added.to_json(), "budget": self.budget,
                "forced_routes": self.forced_routes, "gain_budget": self.gain_budget,
                "experts": None if self.experts is None else self.experts.to_json(), "forced_gap": self.forced_gap,
                "probe": None if self.probe is None else list(self.probe)}

    @classmethod
    def from_json(cls, d: dict) -> Row:
        gb, x = d.get("gain_budget"), d.get("experts")
        return cls(int(d["step"]), str(d["sublayer"]), Divergence.from_json(d["added"]), float(d["budget"]),
                   int(d.get("forced_routes", 0)), None if gb is None else float(gb),
                   None if x is None else ExpertsCheck.from_json(x), float(d.get("forced_gap", 0.0)),
                   None if d.get("probe") is None else (float(d["probe"][0]), float(d["probe"][1]),
                                                        float(d["probe"][2])))

    def judged(self, budgets: Callable[[str, str], float], dtype: str) -> Row:
        """This row with every budget read again from `budgets(dtype, key)` (a result re-judged, not recomputed)."""
        x = self.experts
        return dataclasses.replace(
            self, budget=budgets(dtype, self.sublayer), gain_budget=budgets(dtype, gain_key(self.sublayer)),
            experts=None if x is None else dataclasses.replace(x, gain_budget=budgets(dtype, EXPERTS_GAIN)))


@dataclasses.dataclass(frozen=True)
class LayerResult:
    """Every row of one layer; mixer "KDA" | "MLA", mlp "dense" | "MoE". Sent between workers as JSON."""

    layer: int
    mixer: str
    mlp: str
    rows: list[Row]

    def to_json(self) -> dict:
        return {"layer": self.layer, "mixer": self.mixer, "mlp": self.mlp, "rows": [r.to_json() for r in self.rows]}

    @classmethod
    def from_json(cls, d: dict) -> LayerResult:
        return cls(int(d["layer"]), str(d["mixer"]), str(d["mlp"]), [Row.from_json(r) for r in d["rows"]])


def layer_kinds(model: K3CpuModel, layer: int) -> tuple[str, str]:
    spec = model.graph.layers[layer]
    return ("KDA" if spec.mixer == MixerKind.KDA else "MLA", "dense" if spec.mlp == MlpKind.DENSE else "MoE")


def layer_model(checkpoint: str | Path, layer: int, cfg=None) -> K3CpuModel:
    """This layer's weights (and the small globals) only, in float64; routed experts memory-mapped."""
    return K3CpuModel.from_checkpoint(checkpoint, cfg, dtype=np.float64, layers=[layer])


def open_cache(model: K3CpuModel, total_tokens: int):
    """A one-sequence cache with room for `total_tokens` tokens: (cache, seq)."""
    cache = model.new_cache(num_pages=-(-total_tokens // PAGE) + 1)
    return cache, cache.add_sequence()


def hub_from(model: K3CpuModel, blocks: np.ndarray, prefix: np.ndarray) -> AttnResHub:
    """An AttnRes state holding the dumped layer input (blocks [N, T, D], prefix [T, D])."""
    hub = AttnResHub(model.cfg.attn_res_block_size, eps=model.cfg.rms_norm_eps)
    hub.blocks, hub.prefix = [np.asarray(b, np.float64) for b in blocks], np.asarray(prefix, np.float64)
    return hub


def _engine(dump: Dump, step: int, layer: int, name: str) -> np.ndarray | None:
    key = f"layers.{layer}.{name}"
    return dump.get(step, key) if dump.has(step, key) else None


class _LayerRecompute:
    """The state of one layer's recompute across steps: its model, the sublayer cache and the layer cache."""

    def __init__(self, dump: Dump, model: K3CpuModel, layer: int, route_tie: float | None = None):
        total = sum(len(s.tokens) for s in dump.steps)
        self.budget: Budgets = default_table().bound(geometry_of(dump.config))
        self.route_tie = self.budget(dump.dtype, ROUTE_TIE) if route_tie is None else route_tie
        self.dump, self.model, self.layer = dump, model, layer
        self.cores = reference_cores()
        self.bf16 = dump.dtype == "bfloat16"
        self.w = model.layer(layer)
        self.cache, self.seq = open_cache(model, total)
        self.whole_cache, self.whole_seq = open_cache(model, total)
        self.kda = model.graph.layers[layer].mixer == MixerKind.KDA
        self.probe_cache, self.probe_seq = open_cache(model, total)
        self.pool = ExpertPool()

    def _row(self, step: int, sublayer: str, engine: np.ndarray, ref: np.ndarray,
             forced: tuple[int, float] = (0, 0.0), experts: ExpertsCheck | None = None) -> Row:
        dtype = self.dump.dtype
        return Row(step, sublayer, divergence(engine, ref, bf16=self.bf16), self.budget(dtype, sublayer), forced[0],
                   self.budget(dtype, gain_key(sublayer)), experts, forced[1])

    def _experts(self, index: int) -> ExpertsCheck | None:
        """The routed experts' check of this step, when the dump holds what it needs (else None)."""
        z, out, ids = (_engine(self.dump, index, self.layer, k) for k in EXPERT_KEYS)
        if z is None or out is None or ids is None:
            return None
        return check_experts(self.w.sub("block_sparse_moe."), self.model.moe_cfg, self.cores, self.pool, z, ids,
                             out, bf16=self.bf16, gain_budget=self.budget(self.dump.dtype, EXPERTS_GAIN))

    def _routed(self, index: int) -> tuple[Cores, Callable[[], tuple[int, float]]]:
        """The cores for this step's MLP: the engine's expert choice at near-ties when the dump holds it; and
        what it forced (count, largest gap), asked after the MLP ran."""
        forced = route_core(_engine(self.dump, index, self.layer, "router.ids"), self.route_tie)
        if forced is None:
            return self.cores, lambda: (0, 0.0)
        return self.cores.replace(moe_route=forced), lambda: (forced.forced, forced.largest_forced_gap)

    def step(self, index: int, prefill: bool) -> list[Row]:
        dump, layer, w, eps = self.dump, self.layer, self.w, self.model.cfg.rms_norm_eps
        get = lambda name: _engine(dump, index, layer, name)  # noqa: E731
        blocks, prefix = dump.layer_input(index, layer)
        rows: list[Row] = []
        hub = hub_from(self.model, blocks, prefix)
        h = hub.mixer_input(layer, w["self_attention_res_proj.weight"], w["self_attention_res_norm.weight"],
                            cores=self.cores)
        h_e, x_e = get("h"), get("x_mixer")
        if h_e is not None:
            rows.append(self._row(index, "attnres_mixer", h_e, h))
        x = x_e if x_e is not None else self.cores.rmsnorm(h if h_e is None else h_e, w["input_layernorm.weight"], eps)
        a_e = dump.get(index, f"layers.{layer}.a")
        a = mixer_forward(ForwardContext(self.model, self.cores, self.seq, prefill), layer, x, self.cache)
        rows.append(dataclasses.replace(self._row(index, "mixer", a_e, a), probe=self._probe(prefill, x, a_e, a)))
        self.cache.advance(self.seq, x.shape[0])
        hub.add_mixer(a_e)
        m = hub.mlp_input(w["mlp_res_proj.weight"], w["mlp_res_norm.weight"], cores=self.cores)
        m_e, xm_e = get("m"), get("x_mlp")
        if m_e is not None:
            rows.append(self._row(index, "attnres_mlp", m_e, m))
        xm = xm_e if xm_e is not None else self.cores.rmsnorm(m if m_e is None else m_e,
                                                            w["post_attention_layernorm.weight"], eps)
        cores, forced = self._routed(index)
        f = mlp_forward(ForwardContext(self.model, cores, self.seq, prefill), layer, xm)
        rows.append(self._row(index, "mlp", dump.get(index, f"layers.{layer}.f"), f, forced(), self._experts(index)))
        rows.append(self._whole(index, prefill, blocks, prefix, a_e))
        return rows

    def _probe(self, prefill: bool, x: np.ndarray, a_e: np.ndarray,
               a: np.ndarray) -> tuple[float, float, float] | None:
        """KDA only: (<e, d>, <d, d>, sum e^2 d^2), e = a_e - a, d = the recompute with a bf16 state between
        steps - a."""
        if not self.kda:
            return None
        cache, seq = self.probe_cache, self.probe_seq
        a_p = mixer_forward(ForwardContext(self.model, self.cores, seq, prefill), self.layer, x, cache)
        state = cache.kda_state(self.layer, seq)
        rounded = state.recurrent.astype(ml_dtypes.bfloat16).astype(state.recurrent.dtype)
        cache.set_kda_state(self.layer, seq, dataclasses.replace(state, recurrent=rounded))
        cache.advance(seq, x.shape[0])
        e, d = (np.asarray(a_e, np.float64) - a).ravel(), (a_p - a).ravel()
        ok = np.isfinite(e)
        e, d = e[ok], d[ok]
        return float(np.dot(e, d)), float(np.dot(d, d)), float(np.dot(e * e, d * d))

    def _whole(self, index: int, prefill: bool, blocks, prefix, a_e: np.ndarray) -> Row:
        cores, forced = self._routed(index)
        ctx = ForwardContext(self.model, cores, self.whole_seq, prefill)
        _, _, rec = forward_one_layer(ctx, self.layer, hub_from(self.model, blocks, prefix), self.whole_cache)
        self.whole_cache.advance(self.whole_seq, a_e.shape[0])
        f_e = self.dump.get(index, f"layers.{self.layer}.f")
        return self._row(index, LAYER_ROW, np.stack([a_e, f_e]), np.stack([rec["a"], rec["f"]]), forced())


def recompute_layer(dump: Dump | str | Path, checkpoint: str | Path, layer: int, *,
                    route_tie: float | None = None) -> LayerResult:
    """The added divergence of every sublayer of `layer` at every step of `dump` (a Dump or its path).
    route_tie: follow the engine's route within this choice-score gap (default: the committed budget; calibrate
    passes infinity to measure the gaps of a clean engine's flips)."""
    # A path comes from compare_dump's workers after compare_dump opened and verified the dump: sizes and
    # headers are checked again here, the sha256 of every file (a full read) is not.
    dump = dump if isinstance(dump, Dump) else Dump.open(dump, verify=False)
    if layer not in dump.layers:
        raise ValueError(f"layer: expected one of the dumped layers {list(dump.layers)}, found {layer}")
    model = layer_model(checkpoint, layer, dump.config)
    run = _LayerRecompute(dump, model, layer, route_tie)
    rows: list[Row] = []
    for step in dump.steps:
        rows += run.step(step.index, step.kind == "prefill")
    mixer, mlp = layer_kinds(model, layer)
    return LayerResult(layer, mixer, mlp, rows)
