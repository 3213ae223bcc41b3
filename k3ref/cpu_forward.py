"""The K3 host graph on the CPU: one layer, one token, a prefill — written once against `Cores`.

Layer l (docs/spec.md section 3.7), with the per-token Block AttnRes state `hub` (completed blocks + prefix):

    h = hub.mixer_input(l)              # AttnRes over blocks + [prefix]; opens a block at l % block_size == 0
    a = Mixer(RMSNorm(h))               # KDA or gated NoPE MLA
    m = hub.mlp_input()  after prefix += a
    f = MLP(RMSNorm(m))                 # dense SiTU MLP (layer 0) or Stable LatentMoE
    prefix += f
    logits = lm_head(RMSNorm(AttnRes over blocks + [prefix]))   # after the last layer

Prefill (T tokens of one sequence) runs KDA in the chunked form and MLA in the expanded form; decode runs
the recurrent KDA step and absorbed MLA over the paged cache. The two paths are independent forms of the
same model, so greedy decode == recomputing the whole sequence checks both.
Every heavy step goes through `cores`, so the runner can swap one kernel in at a time.

At K3's real size (one layer's dense floats are 2.5 GB in float32, the embedding and lm_head 2.35 GB each in
bf16) nothing is cast whole: the embedding is gathered by rows, lm_head applied in blocks of vocab rows, and a
model too large to keep its float copies converts each weight when used (`K3CpuModel`'s `keep_casts`); a model
may run some of its layers only (`layers`: a checkpoint written by `k3conf synth --layers`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from . import fast, mla  # mla called as mla.<step>: a test that patches one step of the module sees it used here
from .cache import HybridCache
from .checks import is_finite_real, require
from .config import K3Config
from .cores import Cores, reference_cores
from .cpu_weights import LM_HEAD, TEXT_PREFIX, CheckpointWeights, ModuleView, layer_prefix, table_matmul, take_rows
from .expert_backend import MmapExpertStore, kind_from_env
from .kda import kda_decode_token, kda_prefill
from .latent_moe import latent_moe_forward
from .layer import K3Graph, MixerKind, MlpKind
from .situ import situ_glu_vec
from .threads import fixed_blas
from .weights import CheckpointReader, check_layers, dense_inventory, inventory, missing_layers, synthetic_weights


@dataclasses.dataclass(frozen=True)
class Ablation:
    """Levers that change the model on purpose (for ablation studies; production = the defaults).

    attnres_mix: 1 = Block AttnRes as trained, 0 = the plain residual stream (sum of the sources).
    """

    attnres_mix: float = 1.0

    def __post_init__(self):
        require(is_finite_real(self.attnres_mix), f"attnres_mix: expected a finite number, found {self.attnres_mix}")


PRODUCTION = Ablation()


# A model whose dense float weights (at the working dtype, embedding and lm_head excluded) stay under this
# keeps its cast copies for the run; a larger one converts each tensor when used and drops it after.
KEEP_CASTS_BYTES = 1 << 30
# lm_head is applied in blocks of vocab rows of about this many bytes at the working dtype.
LM_HEAD_BLOCK_BYTES = 64 << 20
EMBED = TEXT_PREFIX + "embed_tokens.weight"


def float_weight_bytes(cfg, itemsize: int, layers=None) -> tuple[int, int]:
    """(total, largest) bytes of the dense float tensors of `layers` (default all) and the small globals at
    `itemsize` bytes an element: what a model keeping its casts holds, and what converting one at a time
    holds at most. The embedding and lm_head are excluded: they are only ever read by rows."""
    sizes = [s.numel * itemsize for s in dense_inventory(cfg, layers)
             if s.dtype != "U8" and s.name not in (EMBED, LM_HEAD)]
    return sum(sizes), max(sizes, default=0)


def _span(layers: tuple[int, ...]) -> str:
    return ",".join(map(str, layers[:12])) + (f",... ({len(layers)} layers)" if len(layers) > 12 else "")


class K3CpuModel:
    """A K3 config plus its weights (any Mapping of full checkpoint names), computing in `dtype`.

    `expert_store`: the store serving the routed experts (its `bytes_touched` counts what the forward read)
    when the weights have one (`from_checkpoint`: a `CheckpointWeights`), else None.
    `tp`: None for the whole model; one rank of a tensor-parallel group otherwise (a `k3ref.tp.TpRank`):
    `cfg` is then the plan's local config and `weights` that rank's shard, and the graph calls the rank's
    collectives where the plan puts them (see k3ref.tp).
    `layers`: the 0-indexed layers the forward runs (default all); the others are skipped (their weights need
    not exist), so a checkpoint of a few real-size layers runs on its own.
    `keep_casts`: keep every dense float weight cast to `dtype` for the run (fast for a small model), or
    convert each when used and drop it after (no whole-model float copy: a real-size model); None decides by
    size (kept when `float_weight_bytes` is at most KEEP_CASTS_BYTES). The embedding is always gathered by
    rows and lm_head applied in blocks of vocab rows, never cast whole.
    """

    def __init__(self, cfg, weights: Mapping, dtype=np.float64, tp=None, *, layers=None,
                 keep_casts: bool | None = None):
        require(np.dtype(dtype) in (np.float32, np.float64), f"dtype: expected float32 or float64, found {dtype}")
        self.cfg = cfg
        self.tp = tp
        self.weights = weights
        # Only checkpoint weights route experts through a store; in-memory weights have none to count.
        self.expert_store: MmapExpertStore | None = weights.store if isinstance(weights, CheckpointWeights) else None
        self.dtype = np.dtype(dtype)
        self.graph = K3Graph.from_config(cfg)
        self.layers: tuple[int, ...] = (tuple(range(cfg.num_hidden_layers)) if layers is None
                                        else check_layers(cfg, layers))
        self.kda_cfg = cfg.kda_config()
        self.mla_cfg = cfg.mla_config()
        self.moe_cfg = cfg.moe_config()
        if keep_casts is None:
            keep_casts = float_weight_bytes(cfg, self.dtype.itemsize, layers)[0] <= KEEP_CASTS_BYTES
        self.keep_casts = bool(keep_casts)
        self._cast: dict | None = {} if self.keep_casts else None

    @classmethod
    def synthetic(cls, cfg, seed: int = 0, dtype=np.float64) -> K3CpuModel:
        """Deterministic synthetic weights (k3ref.weights.synthetic_weights)."""
        return cls(cfg, synthetic_weights(cfg, seed, dtype), dtype)

    @classmethod
    def from_checkpoint(cls, path, cfg=None, dtype=np.float32, expert_store=None, *, layers=None,
                        keep_casts: bool | None = None) -> K3CpuModel:
        """Lazy weights from a Hugging Face style checkpoint directory (config: `cfg` or its config.json).

        layers: run only these layers (the checkpoint needs only their tensors and the globals); a checkpoint
        missing a layer asked for (default: every layer) raises ValueError naming the missing layers and the
        ones it holds. keep_casts: see the class.

        Routed experts are served by an expert store (`model.expert_store`): the class `expert_store`, or by
        default the one environment variable K3_EXPERT_BACKEND names (`kind_from_env`: unset = "mmap",
        zero-copy memmaps of the shards; "reader" = safetensors copies); an unknown name raises its
        ValueError. Every other tensor is read through CheckpointReader (`CheckpointWeights`).
        Raises ValueError when the headers do not hold every tensor of `cfg` in its shape and dtype (say a
        config that does not belong to the checkpoint, or BF16 bytes labelled F16); `k3conf admit DIR` lists
        every such problem.
        """
        store_kind = expert_store if expert_store is not None else kind_from_env()
        cfg = cfg if cfg is not None else K3Config.from_json(Path(path) / "config.json")
        reader = CheckpointReader(path)
        gone = missing_layers(cfg, reader.entries, layers)
        require(gone is None, f"checkpoint {path}: {gone}")
        for spec in inventory(cfg, layers):
            found = reader.entries.get(spec.name)
            require(found is not None and found.shape == spec.shape and found.dtype == spec.dtype,
                    f"checkpoint {path}: {spec.name}: expected shape {list(spec.shape)} ({spec.dtype}) for this "
                    f"config, found {'no such tensor' if found is None else f'{list(found.shape)} ({found.dtype})'}; "
                    f"run `k3conf admit {path}`")
        return cls(cfg, CheckpointWeights(reader, store_kind(reader)), dtype, layers=layers, keep_casts=keep_casts)

    def layer(self, i: int) -> ModuleView:
        if i not in self.layers:                 # (asked per layer and token: the message is built on failure only)
            raise ValueError(f"layer: expected one of the layers this model runs ({_span(self.layers)}), found {i}")
        return ModuleView(self.weights, layer_prefix(i), self.dtype, self._cast)

    def globals(self) -> ModuleView:
        return ModuleView(self.weights, TEXT_PREFIX, self.dtype, self._cast)

    @property
    def lm_head_name(self) -> str:
        """`language_model.lm_head.weight`, or the embedding table's name when tie_word_embeddings."""
        return EMBED if self.cfg.tie_word_embeddings else LM_HEAD

    def lm_head(self) -> np.ndarray:
        """[vocab, D] whole, in the model's dtype (for tests; the forward applies it in blocks)."""
        return self.table_rows(self.lm_head_name, slice(None))

    def table_rows(self, name: str, rows) -> np.ndarray:
        """Rows (index array or slice) of the table `name` (embedding or lm_head) in the model's dtype."""
        return take_rows(self.weights, name, rows, self.dtype)

    def lm_head_block_rows(self) -> int:
        """Vocab rows per lm_head block: about LM_HEAD_BLOCK_BYTES at the model's dtype."""
        return max(1, LM_HEAD_BLOCK_BYTES // (self.cfg.hidden_size * self.dtype.itemsize))

    def apply_lm_head(self, x: np.ndarray) -> np.ndarray:
        """x [T, D] -> x @ lm_head.T [T, rows held], one block of vocab rows at a time (a bf16 table through the
        compiled bf16 GEMV, never converted; see `table_matmul`)."""
        return table_matmul(self.weights, self.lm_head_name, x, self.dtype, self.lm_head_block_rows())

    def new_cache(self, num_pages: int = 64) -> HybridCache:
        """An empty HybridCache in the model's dtype; `num_pages` pages of the MLA config's page size (64).

        Only the layers this model runs get caches (a KDA state is allocated per layer and sequence)."""
        cache = HybridCache(self.cfg, num_pages=num_pages, page_size=self.mla_cfg.page_size, dtype=self.dtype)
        if len(self.layers) < self.cfg.num_hidden_layers:
            cache.kda_layers = tuple(i for i in cache.kda_layers if i in self.layers)
            cache.mla_layers = tuple(i for i in cache.mla_layers if i in self.layers)
            cache.mla = {i: kv for i, kv in cache.mla.items() if i in self.layers}
        return cache


@dataclasses.dataclass
class ForwardContext:
    """What every layer of one forward call shares: the model, the cores, the mode and the sequence."""

    model: K3CpuModel
    cores: Cores
    seq: int = 0
    prefill: bool = False
    ablation: Ablation = PRODUCTION


def embed(model: K3CpuModel, tokens) -> np.ndarray:
    """Token ids [T] -> embeddings [T, D] (in the model's dtype).

    Under TP each rank holds a vocab slice of the table: it looks up the ids it holds (zero rows elsewhere)
    and the all-reduce assembles the rows."""
    ids = np.asarray(tokens)
    require(ids.ndim == 1 and ids.dtype.kind in "iu",
            f"tokens: expected a 1-D integer array, found {ids.dtype} {ids.shape}")
    V = model.cfg.vocab_size
    require(bool(np.all((ids >= 0) & (ids < V))), f"tokens: expected ids in [0, {V}), found {ids.min()}..{ids.max()}")
    if model.tp is None:
        return model.table_rows(EMBED, ids)
    lo, hi = model.tp.vocab.start, model.tp.vocab.stop
    mine = (ids >= lo) & (ids < hi)
    rows = np.zeros((len(ids), model.cfg.hidden_size), model.dtype)
    rows[mine] = model.table_rows(EMBED, ids[mine] - lo)
    return model.tp.comm.all_reduce(rows)


def all_reduce(model: K3CpuModel, partial: np.ndarray) -> np.ndarray:
    """The sum of `partial` over the model's TP ranks (the identity for a whole model)."""
    return partial if model.tp is None else model.tp.comm.all_reduce(partial)


def mixer_forward(ctx: ForwardContext, layer: int, x: np.ndarray, cache: HybridCache) -> np.ndarray:
    """KDA or MLA over x [T, D] for sequence ctx.seq; updates that layer's cache.

    Public because the tensor-parallel blame replays one layer's mixer on recorded inputs."""
    m, w = ctx.model, ctx.model.layer(layer).sub("self_attn.")
    if m.graph.layers[layer].mixer == MixerKind.KDA:
        state = cache.kda_state(layer, ctx.seq)
        if ctx.prefill:
            y, state = kda_prefill(w, x[None], state, m.kda_cfg, cores=ctx.cores)
            y = y[0]
        else:
            y, state = kda_decode_token(w, x, state, m.kda_cfg, cores=ctx.cores)
        cache.set_kda_state(layer, ctx.seq, state)
        return y
    kv = cache.mla[layer]
    if not ctx.prefill:
        return mla.mla_decode_token(w, x, kv, [ctx.seq], m.mla_cfg, cores=ctx.cores)
    require(int(kv.seq_lens([ctx.seq])[0]) == 0,
            f"prefill of sequence {ctx.seq} at layer {layer}: expected an empty cache (continue with decode steps)")
    _, _, c, k_pe, _ = mla.mla_project(w, x, m.mla_cfg, cores=ctx.cores)
    for row in np.concatenate([c, k_pe], axis=-1):
        kv.append([ctx.seq], row[None])
    return mla.gated_mla_attend(w, x, m.mla_cfg, cores=ctx.cores)


def _reading_ahead(ctx: ForwardContext, layer: int) -> Cores:
    """ctx.cores with a router that, once it has chosen, asks the model's expert store to read the chosen
    experts' pages ahead (`MmapExpertStore.prefetch`; under TP only the experts this rank holds), so the
    read overlaps the work before the experts run. Unchanged cores for in-memory weights (no store)."""
    store, route = ctx.model.expert_store, ctx.cores.moe_route
    if store is None:
        return ctx.cores
    held = ctx.model.tp.experts if ctx.model.tp is not None else None

    def route_then_read_ahead(*args, **kwargs):
        weights, indices = route(*args, **kwargs)
        order = np.asarray(indices).reshape(-1)                      # token by token, router slot order
        if held is not None:
            order = np.array([e for e in order if int(e) in held], order.dtype)
        if order.dtype.kind in "iu":                                  # other indices: the MoE layer names them
            store.prefetch(layer, order[None])
        return weights, indices

    return ctx.cores.replace(moe_route=route_then_read_ahead)


def mlp_forward(ctx: ForwardContext, layer: int, x: np.ndarray) -> np.ndarray:
    """Dense SiTU MLP or Stable LatentMoE over x [T, D] -> [T, D].

    Public because the dump comparison recomputes one layer's MLP on an engine's recorded input."""
    m, w = ctx.model, ctx.model.layer(layer)
    if m.graph.layers[layer].mlp == MlpKind.DENSE:
        d = w.sub("mlp.")
        return situ_glu_vec(x, d["gate_proj.weight"], d["up_proj.weight"], d["down_proj.weight"],
                            beta=m.cfg.situ_beta, linear_beta=m.cfg.situ_linear_beta, cores=ctx.cores)
    cores = _reading_ahead(ctx, layer)
    if m.tp is None:
        return latent_moe_forward(w.sub("block_sparse_moe."), x, m.moe_cfg, cores=cores)
    return latent_moe_forward(w.sub("block_sparse_moe."), x, m.moe_cfg, cores=cores, experts=m.tp.experts,
                              all_reduce=m.tp.comm.all_reduce)


def forward_one_layer(ctx: ForwardContext, layer: int, hidden, cache: HybridCache, cores: Cores | None = None):
    """Run layer `layer` on the AttnRes state `hidden` (an AttnResHub over [T, D] arrays).

    Updates `hidden` and `cache` in place and returns (hidden, cache, record); record holds the layer's
    intermediates in the order they are computed (h, x_mixer, a, m, x_mlp, f), which is how the runner
    names the first tensor (and so the first block) that goes wrong.
    """
    if cores is not None:
        ctx = dataclasses.replace(ctx, cores=cores)
    w, eps, mix = ctx.model.layer(layer), ctx.model.cfg.rms_norm_eps, ctx.ablation.attnres_mix
    rec: dict[str, np.ndarray] = {}
    rec["h"] = hidden.mixer_input(layer, w["self_attention_res_proj.weight"], w["self_attention_res_norm.weight"],
                                  mix=mix, cores=ctx.cores)
    rec["x_mixer"] = ctx.cores.rmsnorm(rec["h"], w["input_layernorm.weight"], eps)
    # Under TP the mixer's row-split o_proj leaves a partial sum on each rank.
    rec["a"] = all_reduce(ctx.model, mixer_forward(ctx, layer, rec["x_mixer"], cache))
    hidden.add_mixer(rec["a"])
    rec["m"] = hidden.mlp_input(w["mlp_res_proj.weight"], w["mlp_res_norm.weight"], mix=mix, cores=ctx.cores)
    rec["x_mlp"] = ctx.cores.rmsnorm(rec["m"], w["post_attention_layernorm.weight"], eps)
    rec["f"] = mlp_forward(ctx, layer, rec["x_mlp"])
    hidden.add_mlp(rec["f"])
    return hidden, cache, rec


def final_logits(ctx: ForwardContext, hidden) -> np.ndarray:
    """logits = lm_head(RMSNorm(AttnRes over blocks + [prefix]; norm.weight)) -> [T, vocab]."""
    g = ctx.model.globals()
    out = hidden.final_input(g["output_attn_res_proj.weight"], g["output_attn_res_norm.weight"],
                             mix=ctx.ablation.attnres_mix, cores=ctx.cores)
    normed = ctx.cores.rmsnorm(out, g["norm.weight"], ctx.model.cfg.rms_norm_eps)
    logits = ctx.model.apply_lm_head(np.asarray(normed))
    return logits if ctx.model.tp is None else ctx.model.tp.gather_vocab(logits)


@fixed_blas
def forward_tokens(model: K3CpuModel, tokens, cache: HybridCache, *, seq: int = 0, prefill: bool,
                   cores: Cores | None = None, ablation: Ablation = PRODUCTION, recorder=None) -> np.ndarray:
    """Run `tokens` [T] of sequence `seq` through every layer; returns logits [T, vocab].

    prefill=True needs an empty sequence (chunked KDA, expanded MLA); prefill=False takes one token
    (recurrent KDA, absorbed MLA). recorder(layer, hub_before, record), if given, sees every layer.
    """
    cores = cores or reference_cores()
    tokens = np.atleast_1d(np.asarray(tokens))
    require(prefill or tokens.shape == (1,), f"decode step: expected one token, found {tokens.shape[0]}")
    require(not prefill or cache.seq_len(seq) == 0,
            f"prefill: expected an empty sequence {seq}, found {cache.seq_len(seq)} cached tokens")
    ctx = ForwardContext(model, cores, seq, prefill, ablation)
    with fast.held():                                  # K3_FAST read once for the whole forward
        hub = cores.attnres_hub(model.cfg.attn_res_block_size, eps=model.cfg.rms_norm_eps)
        hub.start(embed(model, tokens))
        for spec in model.graph.layers:
            if spec.index not in model.layers:
                continue
            before = hub.copy() if recorder else None
            hub, cache, rec = forward_one_layer(ctx, spec.index, hub, cache)
            if recorder:
                recorder(spec.index, before, rec)
        cache.advance(seq, len(tokens))
        return final_logits(ctx, hub)


def forward_token(model: K3CpuModel, token: int, pos: int, cache: HybridCache, *, seq: int = 0,
                  cores: Cores | None = None, ablation: Ablation = PRODUCTION, recorder=None) -> np.ndarray:
    """One decode step: token at position `pos` (must equal the tokens already cached) -> logits [vocab]."""
    have = cache.seq_len(seq)
    require(pos == have, f"pos: expected {have} (tokens already cached for sequence {seq}), found {pos}")
    return forward_tokens(model, [token], cache, seq=seq, prefill=False, cores=cores, ablation=ablation,
                          recorder=recorder)[0]


def forward_prefill(model: K3CpuModel, tokens, cache: HybridCache, *, seq: int = 0, cores: Cores | None = None,
                    ablation: Ablation = PRODUCTION, recorder=None) -> np.ndarray:
    """Prefill an empty sequence with `tokens` [T] -> logits [T, vocab]."""
    return forward_tokens(model, tokens, cache, seq=seq, prefill=True, cores=cores, ablation=ablation,
                          recorder=recorder)
