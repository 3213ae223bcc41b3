"""Single-layer bugs planted in a PyTorch K3 model (k3torch `K3ForCausalLM`): what `compare` must find.

Each function changes ONE layer's module instance of a loaded model in place (the other layers, and other
models, keep the correct code) and returns a short description. They are what the dump comparison's tests hold
it to: recorded, each must be named as the source at its layer and sublayer, later layers as carriers.

    kda_lower_bound     KDA decay gate with a wrong lower bound (config.gate_lower_bound)    -> "mixer"
    mla_softmax_scale   MLA scores scaled by 1/sqrt(qk_nope_head_dim), not 1/sqrt(nope + rope) -> "mixer"
    router_bias_dropped the router's e_score_correction_bias ignored in one MoE layer        -> "mlp"
    attnres_swapped     the mixer's AttnRes query and the MLP's swapped in one layer         -> "attnres_mixer"
    expert_scale        one routed expert's w2 MXFP4 scales decoded 1% too large             -> "mlp"
    kda_beta_sign       KDA beta = sigmoid(-b): the delta rule's write strength inverted     -> "mixer"
    mla_gate_silu       MLA output gate SiLU instead of sigmoid                              -> "mixer"
    attnres_mixer_temp  the mixer's AttnRes query scaled x2 (a softmax temperature error)    -> "attnres_mixer"
    attnres_mlp_temp    the MLP's AttnRes query scaled x2                                    -> "attnres_mlp"
    dense_situ_beta     the dense SiTU-GLU MLP's beta doubled                                -> "mlp"
    shared_expert_scale the LatentMoE's shared expert output 3% too large                    -> "mlp"
    kda_decay_decode    KDA decay halved on decode steps only (prefill correct)              -> "mixer"
    mla_scale_prefill   MLA softmax scale wrong on prefill only (decode correct)             -> "mixer"

And one that is not a layer bug but a precision recipe (what a control dump and the fingerprint name):

    kda_state_bf16      every KDA layer stores its recurrent state in bf16 between steps
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

EXPECTED_SUBLAYER = {"kda_lower_bound": "mixer", "mla_softmax_scale": "mixer", "router_bias_dropped": "mlp",
                     "attnres_swapped": "attnres_mixer", "expert_scale": "mlp", "kda_beta_sign": "mixer",
                     "mla_gate_silu": "mixer", "attnres_mixer_temp": "attnres_mixer", "attnres_mlp_temp": "attnres_mlp",
                     "dense_situ_beta": "mlp", "shared_expert_scale": "mlp", "kda_decay_decode": "mixer",
                     "mla_scale_prefill": "mixer"}
# The layer kind each bug needs (_layer checks it): kda, mla, moe, dense or any.
LAYER_KIND = {"kda_lower_bound": "kda", "mla_softmax_scale": "mla", "router_bias_dropped": "moe",
              "attnres_swapped": "any", "expert_scale": "moe", "kda_beta_sign": "kda", "mla_gate_silu": "mla",
              "attnres_mixer_temp": "any", "attnres_mlp_temp": "any", "dense_situ_beta": "dense",
              "shared_expert_scale": "moe", "kda_decay_decode": "kda", "mla_scale_prefill": "mla"}


def _layer(model: Any, layer: int, want: str) -> Any:
    """Decoder layer `layer` of a K3ForCausalLM, checked to be of kind `want` (kda, mla, moe, any)."""
    layers = model.language_model.model.decoder_layers()
    if not 0 <= layer < len(layers):
        raise ValueError(f"layer: expected 0..{len(layers) - 1}, found {layer}")
    dec, cfg = layers[layer], model.config
    kinds = {"kda": not cfg.is_mla(layer), "mla": cfg.is_mla(layer), "moe": not cfg.is_dense(layer),
             "dense": cfg.is_dense(layer), "any": True}
    if not kinds[want]:
        raise ValueError(f"layer {layer}: expected a {want.upper()} layer for this bug, found "
                         f"{'MLA' if cfg.is_mla(layer) else 'KDA'} / {'dense' if cfg.is_dense(layer) else 'MoE'}")
    return dec


def kda_lower_bound(model: Any, layer: int, bound: float = -4.0) -> str:
    """The layer's KDA reads a config whose gate_lower_bound is `bound` (the other layers keep theirs)."""
    attn = _layer(model, layer, "kda").self_attn
    old = attn.config.gate_lower_bound
    attn.config = dataclasses.replace(attn.config, gate_lower_bound=bound)
    return f"layer {layer}: KDA gate lower bound {bound} instead of {old}"


class _Scaled:
    """A callable module stand-in: the wrapped module's output times `factor`."""

    def __init__(self, inner: Callable, factor: float):
        self.inner, self.factor = inner, factor

    def __call__(self, x):
        return self.inner(x) * self.factor


class _ScaledWhen(_Scaled):
    """Scaled only on the first call (the prefill of the one sequence a planted model runs) or only on the
    later ones (its decode steps)."""

    def __init__(self, inner: Callable, factor: float, prefill: bool):
        super().__init__(inner, factor)
        self.prefill, self.calls = prefill, 0

    def __call__(self, x):
        first, self.calls = self.calls == 0, self.calls + 1
        return self.inner(x) * (self.factor if first == self.prefill else 1.0)


def mla_softmax_scale(model: Any, layer: int) -> str:
    """Scores divided by sqrt(qk_nope_head_dim) instead of sqrt(qk_nope + qk_rope): q (used only by the scores)
    is scaled by sqrt((n + r) / n), applied to q_a_layernorm's output, which q_b_proj maps linearly."""
    attn = _layer(model, layer, "mla").self_attn
    factor = math.sqrt((attn.n + attn.r) / attn.n)
    norm = attn.q_a_layernorm
    del attn._modules["q_a_layernorm"]              # a plain attribute in its place (not a registered module)
    object.__setattr__(attn, "q_a_layernorm", _Scaled(norm, factor))
    return f"layer {layer}: MLA softmax scale 1/sqrt({attn.n}) instead of 1/sqrt({attn.n + attn.r})"


def router_bias_dropped(model: Any, layer: int) -> str:
    """The layer's router chooses on the bare sigmoid scores (its e_score_correction_bias zeroed)."""
    gate = _layer(model, layer, "moe").block_sparse_moe.gate
    gate.e_score_correction_bias.data.zero_()
    return f"layer {layer}: router e_score_correction_bias dropped"


def attnres_swapped(model: Any, layer: int) -> str:
    """The layer's mixer AttnRes uses the MLP's query (norm and projection) and the other way round."""
    dec = _layer(model, layer, "any")
    dec.wiring = dataclasses.replace(dec.wiring, attnres_queries_swapped=True)
    return f"layer {layer}: AttnRes queries of mixer and MLP swapped"


def expert_scale(model: Any, layer: int, expert: int, factor: float = 1.01) -> str:
    """Routed expert `expert` of the layer decodes its down projection (w2) with every MXFP4 scale `factor`
    too large: the decode in float64, times factor, then rounded to the model's dtype.

    Which scales: the checkpoint holds one E8M0 scale tensor per expert matrix (w1, w3, w2); this bug is on
    one of them, w2's, the smallest honest case of "a scale error in one expert" (the same error on all three
    matrices would move the output more: w3 enters it linearly too, w1 through SiTU). An E8M0
    scale itself is a power of two, so a 1% error is what a decode that applies its scales 1% off (a wrong
    conversion in a kernel) makes; in a bf16 model the scaled weights are rounded to bf16, so the error per
    weight is 0.78% (E2M1 magnitudes 0.5, 1, 2, 4) or 1.04% (1.5, 3, 6) rather than exactly 1%."""
    import torch  # noqa: PLC0415 -- torch is optional; only a torch model is ever planted

    from k3torch.modeling_k3 import mxfp4_decode  # noqa: PLC0415 -- needs torch

    moe = _layer(model, layer, "moe").block_sparse_moe
    if not 0 <= expert < len(moe.experts):
        raise ValueError(f"expert: expected 0..{len(moe.experts) - 1}, found {expert}")
    w2 = moe.experts[expert].w2

    def weight(dtype: torch.dtype) -> torch.Tensor:
        return (mxfp4_decode(w2.weight_packed, w2.weight_scale, torch.float64) * factor).to(dtype)

    object.__setattr__(w2, "weight", weight)
    return f"layer {layer}: routed expert {expert}'s w2 MXFP4 scales x{factor}"


def kda_beta_sign(model: Any, layer: int) -> str:
    """beta = sigmoid(-W_b x): the b projection negated."""
    _layer(model, layer, "kda").self_attn.b_proj.weight.data.neg_()
    return f"layer {layer}: KDA beta sign flipped"


def mla_gate_silu(model: Any, layer: int) -> str:
    attn = _layer(model, layer, "mla").self_attn
    attn.wiring = dataclasses.replace(attn.wiring, mla_gate="silu")
    return f"layer {layer}: MLA output gate SiLU instead of sigmoid"


def attnres_mixer_temp(model: Any, layer: int, factor: float = 2.0) -> str:
    """The mixer's AttnRes query (self_attention_res_proj) times `factor`: its softmax over blocks sharper."""
    _layer(model, layer, "any").self_attention_res_proj.weight.data.mul_(factor)
    return f"layer {layer}: mixer AttnRes query x{factor}"


def attnres_mlp_temp(model: Any, layer: int, factor: float = 2.0) -> str:
    _layer(model, layer, "any").mlp_res_proj.weight.data.mul_(factor)
    return f"layer {layer}: MLP AttnRes query x{factor}"


def dense_situ_beta(model: Any, layer: int, factor: float = 2.0) -> str:
    mlp = _layer(model, layer, "dense").mlp
    mlp.beta = mlp.beta * factor
    return f"layer {layer}: dense SiTU-GLU beta x{factor}"


def shared_expert_scale(model: Any, layer: int, factor: float = 1.03) -> str:
    """The shared expert's down projection times `factor` (its output that much too large)."""
    moe = _layer(model, layer, "moe").block_sparse_moe
    shared = moe.shared_experts
    del moe._modules["shared_experts"]
    object.__setattr__(moe, "shared_experts", _Scaled(shared, factor))
    return f"layer {layer}: shared expert output x{factor}"


def kda_decay_decode(model: Any, layer: int, factor: float = 0.5) -> str:
    """The log-decay g times `factor` on decode steps (one token) only: a decode kernel's bug."""
    attn = _layer(model, layer, "kda").self_attn
    attn._log_decay = _ScaledWhen(attn._log_decay, factor, prefill=False)
    return f"layer {layer}: KDA decay x{factor} on decode steps only"


def mla_scale_prefill(model: Any, layer: int) -> str:
    """mla_softmax_scale on prefill calls only (the decode path correct)."""
    attn = _layer(model, layer, "mla").self_attn
    factor = math.sqrt((attn.n + attn.r) / attn.n)
    norm = attn.q_a_layernorm
    del attn._modules["q_a_layernorm"]
    object.__setattr__(attn, "q_a_layernorm", _ScaledWhen(norm, factor, prefill=True))
    return f"layer {layer}: MLA softmax scale 1/sqrt({attn.n}) on prefill only"


def kda_state_bf16(model: Any) -> str:
    """Every KDA layer keeps its recurrent state in bf16 between steps (within a step it stays fp32), as an
    engine that stores the state pool in bf16 does. A precision recipe, not a layer bug."""
    import torch  # noqa: PLC0415 -- torch is optional; only a torch model is ever planted

    n = 0
    for dec in model.language_model.model.decoder_layers():
        attn = dec.self_attn
        if hasattr(attn, "b_proj"):
            inner = attn.empty_cache

            def empty(batch, dtype, device, inner=inner):
                cache = inner(batch, dtype, device)
                cache.recurrent = cache.recurrent.to(torch.bfloat16)
                return cache
            attn.empty_cache = empty
            n += 1
    return f"{n} KDA layers: recurrent state stored in bf16"


PLANTS: dict[str, Callable[..., str]] = {
    "kda_lower_bound": kda_lower_bound, "mla_softmax_scale": mla_softmax_scale,
    "router_bias_dropped": router_bias_dropped, "attnres_swapped": attnres_swapped, "expert_scale": expert_scale,
    "kda_beta_sign": kda_beta_sign, "mla_gate_silu": mla_gate_silu, "attnres_mixer_temp": attnres_mixer_temp,
    "attnres_mlp_temp": attnres_mlp_temp, "dense_situ_beta": dense_situ_beta,
    "shared_expert_scale": shared_expert_scale, "kda_decay_decode": kda_decay_decode,
    "mla_scale_prefill": mla_scale_prefill}


def plant(model: Any, name: str, layer: int, **kwargs: Any) -> str:
    """Apply the planted bug `name` to `layer` of `model`; returns its description."""
    if name not in PLANTS:
        raise ValueError(f"planted bug: expected one of {sorted(PLANTS)}, found {name!r}")
    return PLANTS[name](model, layer, **kwargs)
