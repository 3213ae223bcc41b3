"""PyTorch Kimi K3 text decoder, written from docs/spec.md sections 2, 3 and 7 alone.

This is the second form of the host graph's wiring (which weight feeds which step, which norm sits where,
how the AttnRes queries are chosen, how kv_b splits per head): it shares no code with k3ref, so agreement
between the two checks both. Module and parameter names are the checkpoint's names
(`language_model.model.layers.{i}.self_attn.q_proj.weight`, ..., `language_model.lm_head.weight`), so a
checkpoint loads with `load_state_dict(..., strict=True)` (see `loading.py`).

Precision: weights stored as BF16 in the checkpoint live in `dtype`; the tensors K3 keeps in F32 (KDA conv,
A_log, dt_bias, o_norm, the router bias) and all activations live in the wide dtype (float64 for a float64
model, else float32). In a bf16 model a matmul takes bf16 operands and accumulates in fp32 (a bf16 tensor-core
MMA with fp32 output), the outputs of the norms, AttnRes mixes, SiTU products and attention cores are stored
as bf16 (`store`), and every nonlinearity, norm statistic, softmax, router score and the KDA state is
computed in fp32. float32 and float64 models compute in that dtype throughout.

`Wiring` holds the known wrong readings of the spec as switches, all off by default; the agreement tests turn
one on to show that the comparison with k3ref catches it and names the layer.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing

import torch
import torch.nn.functional as F
from torch import nn

from k3torch.configuration_k3 import K3Config
from k3torch.loading import load_checkpoint

MLA_NORM_EPS = 1e-6        # q_a_layernorm / kv_a_layernorm; every other RMSNorm uses config.rms_norm_eps
KDA_L2_EPS = 1e-6          # inside the sqrt of the q/k L2 norm
MXFP4_GROUP = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclasses.dataclass(frozen=True)
class Wiring:
    """Readings of the wiring; the defaults are docs/spec.md's. Each other value is a known wrong reading."""

    mla_gate: str = "sigmoid"                 # "silu": the MLA output gate as SiLU
    kda_gate_input_silu: bool = False         # SiLU applied to the f_a_proj output inside the KDA gate
    attnres_queries_swapped: bool = False     # the mixer's AttnRes uses the MLP's query weights and vice versa
    kv_b_layout: str = "per_head"             # "stacked": kv_b read as [all W_UK; all W_UV]
    final_norms_swapped: bool = False         # `norm` <-> `output_attn_res_norm`
    post_norm_is_input_norm: bool = False     # the MLP's norm reads input_layernorm
    mla_cache_kpe_normalised: bool = False    # the MLA cache stores k_pe RMS-normalised

    def __post_init__(self):
        if self.mla_gate not in ("sigmoid", "silu"):
            raise ValueError(f"Wiring.mla_gate: expected 'sigmoid' or 'silu', found {self.mla_gate!r}")
        if self.kv_b_layout not in ("per_head", "stacked"):
            raise ValueError(f"Wiring.kv_b_layout: expected 'per_head' or 'stacked', found {self.kv_b_layout!r}")


CORRECT = Wiring()


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of activations, states and F32 tensors: float64 for a float64 model, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T: x rounded to the weight's storage dtype (bf16 in a bf16 model), the product accumulated
    and returned in x's wide dtype."""
    return F.linear(store(x, weight.dtype), weight.to(x.dtype))


def store(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An activation as a `dtype` model stores it between steps: rounded to bf16 (held wide) in a bf16 model."""
    return t.to(torch.bfloat16).to(t.dtype) if dtype == torch.bfloat16 else t


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)


def softcap(z: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(z / cap)


def situ(g: torch.Tensor, beta: float) -> torch.Tensor:
    """SiTU_b(g) = softcap_b(g) * sigma(g)."""
    return softcap(g, beta) * torch.sigmoid(g)


class K3RMSNorm(nn.Module):
    """w * z / sqrt(mean(z^2) + eps); statistics in the wide dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """bf16: the normalised x is rounded before the weight multiply (the HF / vLLM order)."""
        d = self.weight.dtype
        return store(self.weight.to(x.dtype) * store(rms(x, self.eps), d), d)


def _linear(n_in: int, n_out: int, dtype: torch.dtype, device) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False, dtype=dtype, device=device)
    layer.weight.requires_grad_(False)
    return layer


# ---------------------------------------------------------------------------------------------------
# Block AttnRes
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class AttnResState:
    """The per-token state across depth: completed block sums and the running prefix ([B, T, D] each)."""

    blocks: list[torch.Tensor]
    prefix: torch.Tensor


def attn_res(sources: list[torch.Tensor], proj: nn.Linear, norm: K3RMSNorm, eps: float) -> torch.Tensor:
    """AR(V, w): k_i = V_i / sqrt(mean(V_i^2) + eps), logit_i = sum_d k_id gamma_d w_d, out = sum_i alpha_i V_i."""
    V = torch.stack(sources)                                        # [N, B, T, D]
    query = norm.weight.to(V.dtype) * proj.weight[0].to(V.dtype)     # gamma * w
    alpha = torch.softmax(torch.sum(rms(V, eps) * query, dim=-1), dim=0)
    return store(torch.sum(alpha[..., None] * V, dim=0), norm.weight.dtype)


# ---------------------------------------------------------------------------------------------------
# caches
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class KdaLayerCache:
    """conv_{q,k,v}: [B, H*K, W-1] the last W-1 projections (oldest first); recurrent: S [B, H, K, V]."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor


@dataclasses.dataclass
class MlaLayerCache:
    """rows: [B, L, kv_lora_rank + qk_rope_head_dim], one [c | k_pe] row per cached token."""

    rows: torch.Tensor


LayerCache = KdaLayerCache | MlaLayerCache


class K3Cache:
    """One entry per layer (KdaLayerCache or MlaLayerCache) and the number of tokens seen."""

    def __init__(self, layers: list[LayerCache], seen_tokens: int = 0):
        self.layers, self.seen_tokens = layers, seen_tokens


# ---------------------------------------------------------------------------------------------------
# KDA
# ---------------------------------------------------------------------------------------------------


class K3KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention with a short causal conv and a recurrent [K, V] state per head."""

    # made by name in a loop in __init__ (one per stream)
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    q_conv1d: nn.Conv1d
    k_conv1d: nn.Conv1d
    v_conv1d: nn.Conv1d

    def __init__(self, config: K3Config, dtype: torch.dtype, device=None, wiring: Wiring = CORRECT):
        super().__init__()
        D, H, K, W = config.hidden_size, config.kda_num_heads, config.kda_head_dim, config.short_conv_kernel_size
        wide = wide_dtype(dtype)
        self.config, self.wiring, self.H, self.K, self.W = config, wiring, H, K, W
        for x in "qkv":
            setattr(self, f"{x}_proj", _linear(D, H * K, dtype, device))
            conv = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False, dtype=wide, device=device)
            conv.weight.requires_grad_(False)
            setattr(self, f"{x}_conv1d", conv)
        self.A_log = nn.Parameter(torch.zeros(config.stored_a_log_size, dtype=wide, device=device), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(H * K, dtype=wide, device=device), requires_grad=False)
        self.f_a_proj = _linear(D, K, dtype, device)
        self.f_b_proj = _linear(K, H * K, dtype, device)
        self.b_proj = _linear(D, H, dtype, device)
        if config.use_full_rank_gate:
            self.g_proj = _linear(D, H * K, dtype, device)
        else:
            self.g_a_proj = _linear(D, K, dtype, device)
            self.g_b_proj = _linear(K, H * K, dtype, device)
        self.o_norm = K3RMSNorm(K, config.rms_norm_eps, wide, device)
        self.o_proj = _linear(H * K, D, dtype, device)

    def empty_cache(self, batch: int, dtype: torch.dtype, device) -> KdaLayerCache:
        conv = lambda: torch.zeros(batch, self.H * self.K, self.W - 1, dtype=dtype, device=device)  # noqa: E731
        return KdaLayerCache(conv(), conv(), conv(), torch.zeros(batch, self.H, self.K, self.K, dtype=dtype,
                                                                 device=device))

    def _short_conv(self, x: torch.Tensor, conv: nn.Conv1d, history: torch.Tensor):
        """y_t[c] = sum_j w[c, j] x_{t-W+1+j}[c] over [history | x]; returns (SiLU(y) [B, T, C], new history)."""
        seq = torch.cat([history.to(x.dtype), x.transpose(1, 2)], dim=-1)        # [B, C, W-1+T]
        y = F.conv1d(seq, conv.weight.to(x.dtype), groups=seq.shape[1])
        return F.silu(y.transpose(1, 2)), seq[..., seq.shape[-1] - (self.W - 1):]

    def _log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """g = lb * sigma(exp(A_log_h) (W_fb W_fa x + dt_bias)) [B, T, H, K] (no bound: -exp(A_log) softplus)."""
        B, T, _ = x.shape
        f = linear(x, self.f_a_proj.weight)
        if self.wiring.kda_gate_input_silu:
            f = F.silu(f)
        z = linear(f, self.f_b_proj.weight).reshape(B, T, self.H, self.K) + self.dt_bias.to(x.dtype).reshape(
            self.H, self.K)
        a = torch.exp(self.A_log[:self.H].to(x.dtype))[:, None]
        lb = self.config.gate_lower_bound
        if lb is None:
            return -a * (torch.clamp(z, min=0) + torch.log1p(torch.exp(-torch.abs(z))))
        return lb * torch.sigmoid(a * z)

    def forward(self, x: torch.Tensor, cache: KdaLayerCache) -> torch.Tensor:
        """x: [B, T, D] (normalised) -> y [B, T, D]; the cache moves on by T tokens."""
        B, T, _ = x.shape
        H, K = self.H, self.K
        q, cache.conv_q = self._short_conv(linear(x, self.q_proj.weight), self.q_conv1d, cache.conv_q)
        k, cache.conv_k = self._short_conv(linear(x, self.k_proj.weight), self.k_conv1d, cache.conv_k)
        v, cache.conv_v = self._short_conv(linear(x, self.v_proj.weight), self.v_conv1d, cache.conv_v)
        l2 = lambda t: t / torch.sqrt(torch.sum(t * t, dim=-1, keepdim=True) + KDA_L2_EPS)  # noqa: E731
        q = l2(q.reshape(B, T, H, K)) * K ** -0.5
        k = l2(k.reshape(B, T, H, K))
        v = v.reshape(B, T, H, K)
        g = self._log_decay(x)
        beta = torch.sigmoid(linear(x, self.b_proj.weight))                       # [B, T, H]
        S = cache.recurrent.to(x.dtype)
        outs = []
        for t in range(T):
            S = torch.exp(g[:, t])[..., None] * S                                  # Diag(e^g) S
            pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)                        # S^T k
            S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], v[:, t] - pred)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))                 # S^T q
        cache.recurrent = S.to(cache.recurrent.dtype)
        o = self.o_norm(store(torch.stack(outs, dim=1), self.o_proj.weight.dtype))  # per head, shared weight
        if self.config.use_full_rank_gate:
            G = linear(x, self.g_proj.weight)
        else:
            G = linear(linear(x, self.g_a_proj.weight), self.g_b_proj.weight)
        return linear((o * torch.sigmoid(G.reshape(B, T, H, K))).reshape(B, T, H * K), self.o_proj.weight)


# ---------------------------------------------------------------------------------------------------
# gated NoPE MLA
# ---------------------------------------------------------------------------------------------------


class K3GatedMLA(nn.Module):
    """Multi-head latent attention without rotary embedding, with a sigmoid output gate.

    Prefill and decode are one expanded computation over the layer's latent cache: keys W_UK,h c_j | k_pe_j
    and values W_UV,h c_j for every cached row j, causal from the cache length before the call.
    """

    def __init__(self, config: K3Config, dtype: torch.dtype, device=None, wiring: Wiring = CORRECT):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        n, r, v, R = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
        self.config, self.wiring, self.H, self.n, self.r, self.v, self.R = config, wiring, H, n, r, v, R
        self.q_a_proj = _linear(D, config.q_lora_rank, dtype, device)
        self.q_a_layernorm = K3RMSNorm(config.q_lora_rank, MLA_NORM_EPS, dtype, device)
        self.q_b_proj = _linear(config.q_lora_rank, H * (n + r), dtype, device)
        self.kv_a_proj_with_mqa = _linear(D, R + r, dtype, device)
        self.kv_a_layernorm = K3RMSNorm(R, MLA_NORM_EPS, dtype, device)
        self.kv_b_proj = _linear(R, H * (n + v), dtype, device)
        self.g_proj = _linear(D, H * v, dtype, device)
        self.o_proj = _linear(H * v, D, dtype, device)

    def empty_cache(self, batch: int, dtype: torch.dtype, device) -> MlaLayerCache:
        return MlaLayerCache(torch.zeros(batch, 0, self.R + self.r, dtype=dtype, device=device))

    def kv_b_split(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, n, R], W_UV [H, v, R]): per head, rows 0..n-1 are W_UK,h and rows n..n+v-1 are W_UV,h."""
        W = self.kv_b_proj.weight.to(dtype)
        H, n, v, R = self.H, self.n, self.v, self.R
        if self.wiring.kv_b_layout == "stacked":
            return W[:H * n].reshape(H, n, R), W[H * n:].reshape(H, v, R)
        per_head = W.reshape(H, n + v, R)
        return per_head[:, :n], per_head[:, n:]

    def forward(self, x: torch.Tensor, cache: MlaLayerCache) -> torch.Tensor:
        """x: [B, T, D] (normalised) -> y [B, T, D]; appends T rows [c | k_pe] to the cache."""
        B, T, _ = x.shape
        H, n, R = self.H, self.n, self.R
        q = linear(self.q_a_layernorm(linear(x, self.q_a_proj.weight)), self.q_b_proj.weight).reshape(B, T, H, -1)
        kv = linear(x, self.kv_a_proj_with_mqa.weight)
        c, k_pe = self.kv_a_layernorm(kv[..., :R]), kv[..., R:]
        if self.wiring.mla_cache_kpe_normalised:
            k_pe = rms(k_pe, MLA_NORM_EPS)
        start = cache.rows.shape[1]
        cache.rows = torch.cat([cache.rows, torch.cat([c, k_pe], dim=-1).to(cache.rows.dtype)], dim=1)
        rows = cache.rows.to(x.dtype)                                                # [B, L, R + r]
        W_UK, W_UV = self.kv_b_split(x.dtype)
        keys = torch.einsum("blr,hnr->blhn", rows[..., :R], W_UK)
        values = torch.einsum("blr,hvr->blhv", rows[..., :R], W_UV)
        s = (torch.einsum("bthn,blhn->bhtl", q[..., :n], keys)
             + torch.einsum("bthr,blr->bhtl", q[..., n:], rows[..., R:])) / math.sqrt(n + self.r)
        L = rows.shape[1]
        causal = torch.arange(L, device=x.device)[None, :] <= (start + torch.arange(T, device=x.device))[:, None]
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
        o = store(torch.einsum("bhtl,blhv->bthv", p, values), self.o_proj.weight.dtype).reshape(B, T, H * self.v)
        gate = linear(x, self.g_proj.weight)
        gate = F.silu(gate) if self.wiring.mla_gate == "silu" else torch.sigmoid(gate)
        return linear(o * gate, self.o_proj.weight)


# ---------------------------------------------------------------------------------------------------
# SiTU MLP and Stable LatentMoE with MXFP4 experts
# ---------------------------------------------------------------------------------------------------


class K3MLP(nn.Module):
    """SiTU-GLU: down(SiTU_beta(gate x) * softcap_linear_beta(up x))."""

    def __init__(self, config: K3Config, n_in: int, width: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.beta, self.linear_beta = config.situ_beta, config.situ_linear_beta
        self.gate_proj = _linear(n_in, width, dtype, device)
        self.up_proj = _linear(n_in, width, dtype, device)
        self.down_proj = _linear(width, n_in, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = situ(linear(x, self.gate_proj.weight), self.beta) * softcap(linear(x, self.up_proj.weight),
                                                                         self.linear_beta)
        h = store(h, self.down_proj.weight.dtype)
        return linear(h, self.down_proj.weight)


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1, dtype=torch.float64, device=device)


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 bytes -> dense [N, K]: w[2i] = E2M1[low nibble], w[2i+1] = E2M1[high nibble], times
    2^(e - 127) of its group of 32 (E8M0 e = 255: NaN). Exact in bf16, float32 and float64."""
    N, half = packed.shape
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(N, 2 * half).long()
    values = _e2m1_table(packed.device)[codes]
    e = scale.to(torch.float64)
    factor = torch.where(scale == 255, torch.full_like(e, float("nan")), torch.pow(2.0, e - 127.0))
    return (values * torch.repeat_interleave(factor, MXFP4_GROUP, dim=-1)).to(dtype)


class K3MxFp4Linear(nn.Module):
    """A routed-expert matrix as the checkpoint holds it: `weight_packed` U8 [out, in/2], `weight_scale` U8
    [out, in/32]; decoded on use."""

    weight_packed: torch.Tensor           # buffers, registered in __init__
    weight_scale: torch.Tensor

    def __init__(self, n_in: int, n_out: int, device=None):
        super().__init__()
        self.register_buffer("weight_packed", torch.zeros(n_out, n_in // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(n_out, n_in // MXFP4_GROUP, dtype=torch.uint8,
                                                         device=device))

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        return mxfp4_decode(self.weight_packed, self.weight_scale, dtype)


class K3Expert(nn.Module):
    """One routed expert: a SiTU-GLU in the latent width, w1 = gate, w3 = up, w2 = down (MXFP4)."""

    def __init__(self, config: K3Config, dtype: torch.dtype, device=None):
        super().__init__()
        latent, inner = config.routed_expert_hidden_size, config.moe_intermediate_size
        self.beta, self.linear_beta, self.dtype = config.situ_beta, config.situ_linear_beta, dtype
        self.w1 = K3MxFp4Linear(latent, inner, device)
        self.w2 = K3MxFp4Linear(inner, latent, device)
        self.w3 = K3MxFp4Linear(latent, inner, device)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = situ(linear(z, self.w1.weight(self.dtype)), self.beta) * softcap(linear(z, self.w3.weight(self.dtype)),
                                                                             self.linear_beta)
        return linear(h, self.w2.weight(self.dtype))


@dataclasses.dataclass(frozen=True)
class ForcedRoute:
    """Expert choices handed to a router from outside (teacher forcing at a near-tie): the tokens where
    `rows` [N] (bool) is True take the experts `experts` [N, k] instead of their own top-k; their routing
    weights still come from the router's own scores."""

    experts: torch.Tensor
    rows: torch.Tensor


class K3Router(nn.Module):
    """Sigmoid router: scores s = sigma(W_r x) in the wide dtype; the bias only selects (DeepSeek-V3 gate).

    `forced` (a ForcedRoute, None by default) overrides the choice of some tokens for the next calls: a
    reduced-precision model can flip a choice that sits within its rounding error of a tie, and a trace that
    compares it with a float64 reference gives it the reference's choice there instead."""

    def __init__(self, config: K3Config, dtype: torch.dtype, device=None):
        super().__init__()
        self.config = config
        E, D = config.n_routed_experts, config.hidden_size
        self.weight = nn.Parameter(torch.zeros(E, D, dtype=dtype, device=device), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=wide_dtype(dtype), device=device),
                                                    requires_grad=False)
        self.forced: ForcedRoute | None = None

    @staticmethod
    def _override(idx: torch.Tensor, f: ForcedRoute) -> torch.Tensor:
        if f.experts.shape != idx.shape or f.rows.shape != idx.shape[:1]:
            raise ValueError(f"K3Router.forced: expected experts {list(idx.shape)} and rows [{idx.shape[0]}] "
                             f"(tokens x num_experts_per_tok), found {list(f.experts.shape)} and {list(f.rows.shape)}")
        return torch.where(f.rows.to(torch.bool)[:, None], f.experts.to(idx), idx)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (weights [N, k], expert ids [N, k])."""
        c = self.config
        s = torch.sigmoid(F.linear(x, self.weight.to(x.dtype)))
        choice = s + self.e_score_correction_bias.to(x.dtype)
        if c.n_group > 1:
            grouped = choice.reshape(x.shape[0], c.n_group, -1)
            group_score = torch.topk(grouped, 2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
                1, torch.topk(group_score, c.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).reshape(x.shape[0], -1)
        idx = torch.topk(choice, c.num_experts_per_tok, dim=-1).indices
        if self.forced is not None:
            idx = self._override(idx, self.forced)
        w = torch.gather(s, 1, idx)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * c.routed_scaling_factor, idx


class K3LatentMoE(nn.Module):
    """Stable LatentMoE: y = W_up_lat RMSNorm(sum_k w_k E_k(W_down_lat x)) + Shared(x)."""

    def __init__(self, config: K3Config, dtype: torch.dtype, device=None):
        super().__init__()
        D, L = config.hidden_size, config.routed_expert_hidden_size
        self.config = config
        self.gate = K3Router(config, dtype, device)
        self.routed_expert_down_proj = _linear(D, L, dtype, device)
        if config.latent_moe_use_norm:
            self.routed_expert_norm = K3RMSNorm(L, config.rms_norm_eps, dtype, device)
        self.routed_expert_up_proj = _linear(L, D, dtype, device)
        if config.n_shared_experts:
            self.shared_experts = K3MLP(config, D, config.n_shared_experts * config.moe_intermediate_size, dtype,
                                        device)
        self.experts = nn.ModuleList(K3Expert(config, dtype, device) for _ in range(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.gate(x)
        z = linear(x, self.routed_expert_down_proj.weight)
        y_lat = torch.zeros_like(z)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.nonzero(idx == e, as_tuple=True)
            y_lat.index_add_(0, rows, w[rows, slot][:, None] * self.experts[e](z[rows]))  # weight after w2
        if self.config.latent_moe_use_norm:
            y_lat = self.routed_expert_norm(y_lat)
        y = linear(y_lat, self.routed_expert_up_proj.weight)
        if self.config.n_shared_experts:
            y = y + self.shared_experts(x)
        return y.reshape(shape)


# ---------------------------------------------------------------------------------------------------
# decoder
# ---------------------------------------------------------------------------------------------------


class K3DecoderLayer(nn.Module):
    """One layer: AttnRes -> input norm -> KDA / MLA -> AttnRes -> post norm -> SiTU MLP / LatentMoE."""

    def __init__(self, config: K3Config, layer_idx: int, dtype: torch.dtype, device=None,
                 wiring: Wiring = CORRECT):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.config, self.layer_idx, self.wiring = config, layer_idx, wiring
        self.input_layernorm = K3RMSNorm(D, eps, dtype, device)
        self.post_attention_layernorm = K3RMSNorm(D, eps, dtype, device)
        self.self_attention_res_norm = K3RMSNorm(D, eps, dtype, device)
        self.mlp_res_norm = K3RMSNorm(D, eps, dtype, device)
        self.self_attention_res_proj = _linear(D, 1, dtype, device)
        self.mlp_res_proj = _linear(D, 1, dtype, device)
        mixer = K3GatedMLA if config.is_mla(layer_idx) else K3KimiDeltaAttention
        self.self_attn = mixer(config, dtype, device, wiring)
        if config.is_dense(layer_idx):
            self.mlp = K3MLP(config, D, config.intermediate_size, dtype, device)
        else:
            self.block_sparse_moe = K3LatentMoE(config, dtype, device)

    def moe(self) -> K3LatentMoE | None:
        """The layer's LatentMoE (its router takes forced choices), or None for a dense layer."""
        return None if self.config.is_dense(self.layer_idx) else self.block_sparse_moe

    def forward(self, state: AttnResState, cache, record: dict | None = None) -> AttnResState:
        """Runs the layer on `state` (mutated and returned) and its cache entry; `record` (if given) receives
        h, x_mixer, a, m, x_mlp, f in compute order."""
        eps, w = self.config.rms_norm_eps, self.wiring
        attn_q = (self.self_attention_res_proj, self.self_attention_res_norm)
        mlp_q = (self.mlp_res_proj, self.mlp_res_norm)
        if w.attnres_queries_swapped:
            attn_q, mlp_q = mlp_q, attn_q
        rec = record if record is not None else {}
        rec["h"] = state.prefix if not state.blocks else attn_res(state.blocks + [state.prefix], *attn_q, eps)
        starts_block = self.layer_idx % self.config.attn_res_block_size == 0
        if starts_block:                  # the running sum becomes a completed block; this layer opens the next
            state.blocks.append(state.prefix)
        rec["x_mixer"] = self.input_layernorm(rec["h"])
        rec["a"] = self.self_attn(rec["x_mixer"], cache)
        state.prefix = rec["a"] if starts_block else state.prefix + rec["a"]
        rec["m"] = attn_res(state.blocks + [state.prefix], *mlp_q, eps)
        post = self.input_layernorm if w.post_norm_is_input_norm else self.post_attention_layernorm
        rec["x_mlp"] = post(rec["m"])
        moe = self.moe()
        rec["f"] = (self.mlp if moe is None else moe)(rec["x_mlp"])
        state.prefix = state.prefix + rec["f"]
        return state


class K3Model(nn.Module):
    """Embedding, the decoder layers and the final AttnRes + norm (`language_model.model.*`)."""

    def __init__(self, config: K3Config, dtype: torch.dtype, device=None, wiring: Wiring = CORRECT):
        super().__init__()
        D = config.hidden_size
        self.config, self.wiring, self.wide = config, wiring, wide_dtype(dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, D, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i, dtype, device, wiring)
                                    for i in range(config.num_hidden_layers))
        self.norm = K3RMSNorm(D, config.rms_norm_eps, dtype, device)
        self.output_attn_res_norm = K3RMSNorm(D, config.rms_norm_eps, dtype, device)
        self.output_attn_res_proj = _linear(D, 1, dtype, device)

    def decoder_layers(self) -> list[K3DecoderLayer]:
        """The layers in order, as their own type (iterating the ModuleList gives plain Modules)."""
        return [typing.cast(K3DecoderLayer, layer) for layer in self.layers]

    def embed(self, input_ids: torch.Tensor) -> AttnResState:
        """The state before layer 0: no blocks, prefix = the embeddings [B, T, D] (wide)."""
        return AttnResState([], self.embed_tokens(input_ids).to(self.wide))

    def final_hidden(self, state: AttnResState) -> torch.Tensor:
        """RMSNorm(AR(blocks + [prefix], w_out); norm.weight): the lm_head's input."""
        ar_norm, final_norm = self.output_attn_res_norm, self.norm
        if self.wiring.final_norms_swapped:
            ar_norm, final_norm = final_norm, ar_norm
        return final_norm(attn_res(state.blocks + [state.prefix], self.output_attn_res_proj, ar_norm,
                                   self.config.rms_norm_eps))

    def forward(self, input_ids: torch.Tensor, cache: K3Cache, records: dict | None = None) -> torch.Tensor:
        state = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            rec = None if records is None else records.setdefault(i, {})
            state = layer(state, cache.layers[i], rec)
        return self.final_hidden(state)


class K3LanguageModel(nn.Module):
    """`language_model.`: the decoder (`model`) and the untied `lm_head`."""

    def __init__(self, config: K3Config, dtype: torch.dtype, device=None, wiring: Wiring = CORRECT):
        super().__init__()
        self.model = K3Model(config, dtype, device, wiring)
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, dtype, device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.model.config.tie_word_embeddings else self.lm_head
        return linear(hidden, head.weight)


class K3ForCausalLM(nn.Module):
    """The K3 text model with a hybrid cache (KDA conv + state, MLA latent rows) and greedy generation.

        model = K3ForCausalLM.from_pretrained("ckpt/", dtype=torch.float32)
        new_tokens = model.generate([5, 17, 3], max_new_tokens=8)
    """

    def __init__(self, config: K3Config, dtype: torch.dtype = torch.float32, device=None,
                 wiring: Wiring = CORRECT):
        super().__init__()
        if dtype not in (torch.float64, torch.float32, torch.bfloat16):
            raise ValueError(f"dtype: expected torch.float64, torch.float32 or torch.bfloat16, found {dtype}")
        self.config, self.dtype, self.wiring = config, dtype, wiring
        self.language_model = K3LanguageModel(config, dtype, device, wiring)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32, device=None,
                        wiring: Wiring = CORRECT) -> K3ForCausalLM:
        """Config from `path`/config.json, weights from the safetensors shards (strict names and shapes)."""
        model = cls(K3Config.from_json(path), dtype, device, wiring)
        load_checkpoint(model, path)
        return model

    @property
    def device(self) -> torch.device:
        return self.language_model.model.embed_tokens.weight.device

    def new_cache(self, batch: int = 1) -> K3Cache:
        wide = wide_dtype(self.dtype)
        layers: list[LayerCache] = []
        for layer in self.language_model.model.decoder_layers():
            if isinstance(layer.self_attn, K3GatedMLA):
                layers.append(layer.self_attn.empty_cache(batch, self.dtype if self.dtype == torch.bfloat16
                                                          else wide, self.device))
            else:
                layers.append(layer.self_attn.empty_cache(batch, wide, self.device))
        return K3Cache(layers)

    @torch.no_grad()
    def forward(self, input_ids, cache: K3Cache | None = None, records: dict | None = None) -> torch.Tensor:
        """input_ids [B, T] (or [T]) after cache.seen_tokens cached ones -> logits [B, T, vocab] (wide dtype).

        `cache` (new when None) moves on by T tokens; `records` (if given) receives {layer: intermediates}."""
        ids = torch.as_tensor(input_ids, device=self.device)
        if ids.dim() == 1:
            ids = ids[None]
        V = self.config.vocab_size
        if ids.dtype not in (torch.int64, torch.int32) or ids.numel() == 0 or bool(((ids < 0) | (ids >= V)).any()):
            found = f"{ids.min().item()}..{ids.max().item()}" if ids.numel() else "none"
            raise ValueError(f"input_ids: expected integer ids in [0, {V}), found {ids.dtype} ids {found}")
        cache = cache if cache is not None else self.new_cache(ids.shape[0])
        hidden = self.language_model.model(ids, cache, records)
        cache.seen_tokens += ids.shape[1]
        return self.language_model.logits(hidden)

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: prefill the prompt, then one token at a time through the cache.
        input_ids [B, T] or [T] -> new tokens [B, max_new_tokens] (ties go to the lowest id)."""
        ids = torch.as_tensor(input_ids, device=self.device)
        ids = ids[None] if ids.dim() == 1 else ids
        cache = self.new_cache(ids.shape[0])
        logits = self(ids, cache)[:, -1]
        new = []
        for step in range(max_new_tokens):
            tok = torch.argmax(logits, dim=-1)
            new.append(tok)
            if step + 1 < max_new_tokens:
                logits = self(tok[:, None], cache)[:, -1]
        return torch.stack(new, dim=1) if new else ids.new_zeros(ids.shape[0], 0)
