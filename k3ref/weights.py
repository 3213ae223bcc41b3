"""The K3 weight inventory, synthetic weights and checkpoints, a lazy checkpoint reader, and admission.

- `inventory(cfg)`: every text tensor of the published checkpoint (docs/spec.md section 7) as
  TensorSpec(name, shape, dtype) with dtype "BF16" / "F32" / "U8"; K3 holds 497,052 of them.
- `synthetic_weights(cfg, seed)`: deterministic weights whose activations stay O(1) through the model;
  floats already rounded to what the checkpoint stores (bf16 / float32), so a checkpoint round trip is exact.
- `synthetic_checkpoint(cfg, seed, out_dir)`: sharded safetensors + index.json + config.json.
- `synth_checkpoint(cfg, out_dir, layers=...)`: a real-geometry checkpoint of some layers (plus the globals) in
  minutes: random MXFP4 bytes with valid scales instead of a quantisation pass, streamed tensor by tensor.
- `CheckpointReader(dir)`: a lazy Mapping[name -> ndarray] over the shards (bf16 returned as float32).
- `admit_checkpoint(dir, cfg)`: reads only the headers (checked by the safetensors format rules); reports
  every missing, unexpected, misshaped and mistyped tensor, and every disagreement between the index and
  the shards, in one Verdict.

A safetensors file is: 8-byte little-endian header length n, n bytes of JSON header
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data buffer
(offsets relative to byte 8 + n).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import shutil
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import ml_dtypes  # also registers numpy's 'bfloat16' dtype, which safetensors needs to read BF16
import numpy as np
from safetensors import safe_open

from . import safetensors_io
from .config import PRESETS, K3Config
from .mxfp4 import quantize

TEXT_PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_BYTES = {"BF16": 2, "F32": 4, "U8": 1}
# Every dtype a safetensors header may name, with its item size (admission reads foreign files too).
SAFETENSORS_ITEMSIZE = safetensors_io.ITEMSIZE
# admit lists every missing tensor up to this many expected ones (K3 has 497,052), whatever the shards hold
MAX_LISTED_MISSING = 2_000_000
_EXPERT_RE = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight_(packed|scale)$")


class TensorSpec(NamedTuple):
    """One checkpoint tensor: full name, shape, dtype string ("BF16", "F32", "U8"). (A NamedTuple: K3 has
    half a million of them.)"""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read (truncated, corrupt header, bad JSON); the message names it."""


def layer_prefix(layer: int) -> str:
    """Full-name prefix of layer `layer` (0-indexed): `language_model.model.layers.{layer}.`."""
    return f"{TEXT_PREFIX}layers.{layer}."


def expert_name(layer: int, expert: int, w: int, part: str) -> str:
    """Full name of a routed-expert tensor: w in {1, 2, 3}, part in {"packed", "scale"}."""
    return f"{layer_prefix(layer)}block_sparse_moe.experts.{expert}.w{w}.weight_{part}"


def is_routed_expert(name: str) -> bool:
    """True for `...block_sparse_moe.experts.{E}.w{1,2,3}.weight_{packed,scale}`."""
    return ".experts." in name and _EXPERT_RE.search(name) is not None


def parameter_count(spec: TensorSpec) -> int:
    """Logical weights in a tensor: MXFP4 packed bytes hold 2 each, E8M0 scales hold none."""
    if spec.name.endswith(".weight_packed"):
        return 2 * spec.numel
    if spec.name.endswith(".weight_scale"):
        return 0
    return spec.numel


# ----- inventory -----

def _layer_specs(cfg: K3Config, i: int, experts: bool = True) -> list[TensorSpec]:
    """The tensors of layer i, full names, in checkpoint order (norms, mixer, MLP); the routed experts
    only when `experts`."""
    return _block_specs(cfg, layer_prefix(i), cfg.is_mla(i), cfg.mlp_is_dense(i), experts, i)


def _block_specs(cfg: K3Config, p: str, mla: bool, dense: bool, experts: bool, i: int) -> list[TensorSpec]:
    """The tensors of a layer of the given kind under prefix p (layer i names the routed experts): its norms and
    AttnRes queries, its mixer (MLA or KDA), its MLP (dense or LatentMoE, with or without the routed experts)."""
    mixer = _mla_specs(cfg, p + "self_attn.") if mla else _kda_specs(cfg, p + "self_attn.")
    mlp = _dense_mlp_specs(cfg, p + "mlp.") if dense else _moe_specs(cfg, p + "block_sparse_moe.", experts, i)
    return _layer_norm_specs(cfg, p) + mixer + mlp


def _layer_norm_specs(cfg: K3Config, p: str) -> list[TensorSpec]:
    """Every layer's four RMSNorm weights and two AttnRes query projections."""
    D = cfg.hidden_size
    out = [TensorSpec(p + n, (D,), "BF16") for n in
           ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attention_res_norm.weight",
            "mlp_res_norm.weight")]
    return out + [TensorSpec(p + n, (1, D), "BF16") for n in ("self_attention_res_proj.weight", "mlp_res_proj.weight")]


def _mla_specs(cfg: K3Config, a: str) -> list[TensorSpec]:
    """Gated NoPE MLA's projections and norms (no rotary tensors)."""
    D, H, qk = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    R, P, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    return [
        TensorSpec(a + "q_a_proj.weight", (cfg.q_lora_rank, D), "BF16"),
        TensorSpec(a + "q_a_layernorm.weight", (cfg.q_lora_rank,), "BF16"),
        TensorSpec(a + "q_b_proj.weight", (H * qk, cfg.q_lora_rank), "BF16"),
        TensorSpec(a + "kv_a_proj_with_mqa.weight", (R + P, D), "BF16"),
        TensorSpec(a + "kv_a_layernorm.weight", (R,), "BF16"),
        TensorSpec(a + "kv_b_proj.weight", (H * (cfg.qk_nope_head_dim + V), R), "BF16"),
        TensorSpec(a + "g_proj.weight", (H * V, D), "BF16"),
        TensorSpec(a + "o_proj.weight", (D, H * V), "BF16"),
    ]


def _kda_specs(cfg: K3Config, a: str) -> list[TensorSpec]:
    """KDA's projections, short convolutions, gate parameters and output norm (F32 where K3 keeps F32)."""
    D, H, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    HK, W = H * K, cfg.short_conv_kernel_size
    out = [TensorSpec(a + f"{x}_proj.weight", (HK, D), "BF16") for x in "qkv"]
    out += [TensorSpec(a + f"{x}_conv1d.weight", (HK, 1, W), "F32") for x in "qkv"]
    out += [
        TensorSpec(a + "A_log", (cfg.a_log_size,), "F32"),
        TensorSpec(a + "dt_bias", (HK,), "F32"),
        TensorSpec(a + "f_a_proj.weight", (K, D), "BF16"),
        TensorSpec(a + "f_b_proj.weight", (HK, K), "BF16"),
        TensorSpec(a + "b_proj.weight", (H, D), "BF16"),
    ]
    if cfg.use_full_rank_gate:
        out.append(TensorSpec(a + "g_proj.weight", (HK, D), "BF16"))
    else:
        out += [TensorSpec(a + "g_a_proj.weight", (K, D), "BF16"), TensorSpec(a + "g_b_proj.weight", (HK, K), "BF16")]
    return out + [TensorSpec(a + "o_norm.weight", (K,), "F32"), TensorSpec(a + "o_proj.weight", (D, HK), "BF16")]


def _dense_mlp_specs(cfg: K3Config, m: str) -> list[TensorSpec]:
    """The dense SiTU MLP of the first layers."""
    D, Di = cfg.hidden_size, cfg.intermediate_size
    return [TensorSpec(m + "gate_proj.weight", (Di, D), "BF16"), TensorSpec(m + "up_proj.weight", (Di, D), "BF16"),
            TensorSpec(m + "down_proj.weight", (D, Di), "BF16")]


def _moe_specs(cfg: K3Config, m: str, experts: bool, i: int) -> list[TensorSpec]:
    """Stable LatentMoE: router, latent projections and norm, the fused shared experts, and (when `experts`)
    every routed expert of layer i."""
    D, E, Lt, S = cfg.hidden_size, cfg.n_routed_experts, cfg.routed_expert_hidden_size, cfg.shared_intermediate_size
    out = [TensorSpec(m + "gate.weight", (E, D), "BF16"),
           TensorSpec(m + "gate.e_score_correction_bias", (E,), "F32"),
           TensorSpec(m + "routed_expert_down_proj.weight", (Lt, D), "BF16")]
    if cfg.latent_moe_use_norm:
        out.append(TensorSpec(m + "routed_expert_norm.weight", (Lt,), "BF16"))
    out.append(TensorSpec(m + "routed_expert_up_proj.weight", (D, Lt), "BF16"))
    if S:
        out += [TensorSpec(m + "shared_experts.gate_proj.weight", (S, D), "BF16"),
                TensorSpec(m + "shared_experts.up_proj.weight", (S, D), "BF16"),
                TensorSpec(m + "shared_experts.down_proj.weight", (D, S), "BF16")]
    for e in range(E if experts else 0):
        out += _expert_specs(cfg, i, e)
    return out


def _expert_specs(cfg: K3Config, i: int, e: int) -> list[TensorSpec]:
    """The six MXFP4 tensors of routed expert e of layer i (w1, w3: [I, latent]; w2: [latent, I])."""
    Di, Lt, g = cfg.moe_intermediate_size, cfg.routed_expert_hidden_size, 32   # g: the MXFP4 group
    out = []
    for w, (rows, cols) in ((1, (Di, Lt)), (2, (Lt, Di)), (3, (Di, Lt))):
        out += [TensorSpec(expert_name(i, e, w, "packed"), (rows, cols // 2), "U8"),
                TensorSpec(expert_name(i, e, w, "scale"), (rows, cols // g), "U8")]
    return out


class InventoryTotals(NamedTuple):
    """Counts over inventory(cfg), computed without listing it (a config may ask for 10^6 experts)."""

    tensors: int
    parameters: int
    nbytes: int
    expert_parameters: int     # one routed expert's parameters (MXFP4: 2 per packed byte)
    moe_layers: int


@functools.lru_cache(maxsize=32)
def num_parameters(cfg: K3Config) -> int:
    """Total parameters of `inventory(cfg)`, counted arithmetically (inventory_totals).

    A parameter is one logical weight: MXFP4 packed bytes count 2 each (two E2M1 codes a byte); the
    E8M0 scales are quantisation metadata and do not count. A_log counts its padded length.
    """
    return inventory_totals(cfg).parameters


def active_parameters(cfg: K3Config) -> int:
    """Parameters one token uses: everything but the routed experts, plus top_k experts per MoE layer."""
    t = inventory_totals(cfg)
    return t.parameters - t.moe_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * t.expert_parameters


def inventory_totals(cfg: K3Config) -> InventoryTotals:
    """Tensors, parameters and stored bytes of inventory(cfg), by arithmetic: one layer of each kind
    (KDA/MLA x dense/MoE) times how many there are, one routed expert times the expert count."""
    L, mla = cfg.num_hidden_layers, set(cfg.mla_layers)
    dense = min(cfg.first_k_dense_replace, L)
    n_mla_dense = sum(1 for i in mla if i < dense)
    counts = {(True, True): n_mla_dense, (True, False): len(mla) - n_mla_dense,
              (False, True): dense - n_mla_dense, (False, False): L - dense - (len(mla) - n_mla_dense)}
    tensors = params = nbytes = 0
    for (is_mla, is_dense), n in counts.items():
        specs = _block_specs(cfg, "", is_mla, is_dense, False, 0)
        tensors += n * len(specs)
        params += n * sum(parameter_count(s) for s in specs)
        nbytes += n * sum(s.nbytes for s in specs)
    expert = _expert_specs(cfg, 0, 0)
    moe = counts[(True, False)] + counts[(False, False)]
    per_params = sum(parameter_count(s) for s in expert)
    tensors += moe * cfg.n_routed_experts * len(expert)
    params += moe * cfg.n_routed_experts * per_params
    nbytes += moe * cfg.n_routed_experts * sum(s.nbytes for s in expert)
    head = [s for s in _global_specs(cfg)]
    tensors += len(head)
    params += sum(parameter_count(s) for s in head)
    nbytes += sum(s.nbytes for s in head)
    return InventoryTotals(tensors, params, nbytes, per_params, moe)


def _global_specs(cfg: K3Config) -> list[TensorSpec]:
    """The tensors outside the layers: embedding, final norms, AttnRes output projection, lm_head (untied)."""
    D, Vb = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec(TEXT_PREFIX + "embed_tokens.weight", (Vb, D), "BF16"),
             TensorSpec(TEXT_PREFIX + "norm.weight", (D,), "BF16"),
             TensorSpec(TEXT_PREFIX + "output_attn_res_norm.weight", (D,), "BF16"),
             TensorSpec(TEXT_PREFIX + "output_attn_res_proj.weight", (1, D), "BF16")]
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec(LM_HEAD, (Vb, D), "BF16"))
    return specs


@functools.lru_cache(maxsize=8)
def _inventory(cfg: K3Config, layers: tuple[int, ...] | None = None) -> tuple[TensorSpec, ...]:
    head = _global_specs(cfg)
    specs = head[:1]
    for i in range(cfg.num_hidden_layers) if layers is None else layers:
        specs += _layer_specs(cfg, i)
    return tuple(specs + head[1:])


def inventory(cfg: K3Config, layers: Iterable[int] | None = None) -> list[TensorSpec]:
    """Every text tensor of `cfg`'s checkpoint, full names, in checkpoint order (docs/spec.md section 7).

    Globals: embed_tokens [V, D], norm [D], output_attn_res_norm [D], output_attn_res_proj [1, D], lm_head [V, D]
    (absent when tied). Per layer: 4 norms [D] + 2 AttnRes projections [1, D]; KDA (14 tensors) or MLA (8);
    dense MLP (3) or LatentMoE (8 + 6 per routed expert). K3: 497,052 tensors.
    layers: only these layers' tensors (0-indexed, checked by `check_layers`), plus every global tensor.
    """
    return list(_inventory(cfg, None if layers is None else check_layers(cfg, layers)))


def dense_inventory(cfg: K3Config, layers: Iterable[int] | None = None) -> list[TensorSpec]:
    """inventory(cfg, layers) without the routed experts (K3: 2,380 tensors instead of 497,052), same order."""
    head = _global_specs(cfg)
    specs = head[:1]
    for i in range(cfg.num_hidden_layers) if layers is None else check_layers(cfg, layers):
        specs += _layer_specs(cfg, i, experts=False)
    return specs + head[1:]


def check_layers(cfg: K3Config, layers: Iterable[int]) -> tuple[int, ...]:
    """`layers` as a sorted tuple of distinct 0-indexed layers of `cfg`; ValueError naming what is wrong."""
    try:
        out = tuple(sorted({int(i) for i in layers}))
    except (TypeError, ValueError):
        raise ValueError(f"layers: expected 0-indexed layer numbers, found {layers!r:.200}") from None
    L = cfg.num_hidden_layers
    bad = [i for i in out if not 0 <= i < L]
    if not out or bad:
        raise ValueError(f"layers: expected at least one layer in 0..{L - 1}, found "
                         f"{list(out) if not bad else bad[:10]}")
    return out


_LAYER_RE = re.compile(re.escape(TEXT_PREFIX) + r"layers\.(\d+)\.")


def checkpoint_layers(names: Iterable[str]) -> tuple[int, ...]:
    """The layers that at least one of the tensor `names` belongs to (sorted, 0-indexed)."""
    found = set()
    for name in names:
        m = _LAYER_RE.match(name)
        if m is not None:
            found.add(int(m.group(1)))
    return tuple(sorted(found))


def missing_layers(cfg: K3Config, names: Iterable[str], layers: Iterable[int] | None = None) -> str | None:
    """None when `names` hold a tensor of every layer asked for (`layers`, default all of `cfg`'s), else a
    sentence naming the missing layers and the ones the checkpoint does hold (what `--layers` could run)."""
    held = checkpoint_layers(names)
    want = range(cfg.num_hidden_layers) if layers is None else check_layers(cfg, layers)
    gone = [i for i in want if i not in set(held)]
    if not gone:
        return None
    shown = ",".join(map(str, gone[:20])) + (f",... ({len(gone)} layers)" if len(gone) > 20 else "")
    return (f"the checkpoint holds no tensor of layer(s) {shown} (it holds layer(s) "
            f"{','.join(map(str, held)) or 'none'}); run only the layers it holds, e.g. --layers "
            f"{','.join(map(str, held[:8])) or '0'}")


# ----- synthetic weights -----

def _rng(seed: int, key: str) -> np.random.Generator:
    """A generator per (seed, tensor) so every tensor is reproducible on its own, in any order."""
    return np.random.default_rng([int(seed), zlib.crc32(key.encode())])


def _normal_params(spec: TensorSpec) -> tuple[float, float] | None:
    """(std, mean) of a float tensor drawn from a normal (see synthetic_weights); None for A_log."""
    name, shape = spec.name, spec.shape
    if name.endswith("A_log"):
        return None
    if name.endswith("conv1d.weight") or name.endswith("dt_bias"):
        return 0.5, 0.0
    if name.endswith("e_score_correction_bias"):
        return 0.05, 0.0   # nonzero: it must move the top-k choice, not the weights
    if name.endswith("_res_proj.weight"):
        return 1.0 / math.sqrt(shape[-1]), 0.0   # logits ~ N(0, 1): non-uniform but unsaturated mixing
    if name.endswith("norm.weight"):
        return 0.1, 1.0
    if name.endswith("embed_tokens.weight"):
        return 1.0, 0.0
    return 1.0 / math.sqrt(shape[-1]), 0.0   # linear [out, in]: y = W x keeps unit variance


def _float_values(spec: TensorSpec, cfg: K3Config, seed: int) -> np.ndarray:
    """float32 values of a float tensor before rounding to its storage dtype (see synthetic_weights)."""
    rng = _rng(seed, spec.name)
    params = _normal_params(spec)
    if params is None:   # A_log: log U(1, 16) on the heads, zero padding
        out = np.zeros(spec.shape, np.float32)
        out[: cfg.kda_num_heads] = np.log(rng.uniform(1.0, 16.0, cfg.kda_num_heads))
        return out
    std, mean = params
    return rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(std) + np.float32(mean)


def _float_chunks(spec: TensorSpec, cfg: K3Config, seed: int, chunk_elems: int) -> Iterator[np.ndarray]:
    """The stored values of a float tensor in row blocks of about `chunk_elems` elements: the same values as
    `_round(_float_values(...))` (one generator, drawn in order), never the whole float32 tensor at once."""
    params = _normal_params(spec)
    if params is None or spec.numel <= chunk_elems or len(spec.shape) < 2:
        yield _round(_float_values(spec, cfg, seed), spec.dtype)
        return
    rng = _rng(seed, spec.name)
    std, mean = np.float32(params[0]), np.float32(params[1])
    row = math.prod(spec.shape[1:])
    step = max(1, chunk_elems // row)
    for lo in range(0, spec.shape[0], step):
        rows = min(step, spec.shape[0] - lo)
        yield _round(rng.standard_normal((rows, *spec.shape[1:]), dtype=np.float32) * std + mean, spec.dtype)


# E2M1 codes drawn uniformly have mean square (0 + .25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8 = 8.5625.
_E2M1_MEAN_SQUARE = 8.5625


def _random_mxfp4(spec: TensorSpec, seed: int) -> np.ndarray:
    """Random MXFP4 bytes of a routed-expert tensor, no quantisation pass: packed = uniform random bytes (two
    E2M1 codes each); scale = E8M0 bytes 2^(e0 + {-1, 0, 1}) with e0 chosen so that W x keeps unit variance
    (W's elements ~ 1/sqrt(in), in = 32 * scale columns). Scales are 127 +- a few: never 255 (NaN)."""
    rng = _rng(seed, spec.name)
    if spec.name.endswith("weight_packed"):
        return np.frombuffer(rng.bytes(spec.numel), np.uint8).reshape(spec.shape)
    cols = 32 * spec.shape[-1]
    e0 = round(math.log2(1.0 / math.sqrt(_E2M1_MEAN_SQUARE * cols)))
    return (127 + e0 + rng.integers(-1, 2, spec.shape)).astype(np.uint8)


def _round(values: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 values to what the checkpoint stores: bf16 (ml_dtypes, RNE) or float32."""
    if dtype == "BF16":
        return values.astype(ml_dtypes.bfloat16)
    return values.astype(np.float32)


class _ExpertQuantizer:
    """MXFP4 bytes of routed experts: one float matrix per (layer, expert, w), quantised once for both parts."""

    def __init__(self, cfg: K3Config, seed: int):
        self.cfg, self.seed = cfg, seed
        # (tensor base name, its (packed, scale)): the packed and the scale tensor come one after the other
        self._last: tuple[str, tuple[np.ndarray, np.ndarray]] | None = None

    def __call__(self, spec: TensorSpec) -> np.ndarray:
        base = spec.name.rsplit(".weight_", 1)[0]
        if self._last is None or self._last[0] != base:
            rows, cols = spec.shape[0], spec.shape[1] * (2 if spec.name.endswith("packed") else 32)
            w = _rng(self.seed, base).standard_normal((rows, cols), dtype=np.float32) / np.float32(math.sqrt(cols))
            self._last = (base, quantize(w))
        packed, scale = self._last[1]
        out = packed if spec.name.endswith("packed") else scale
        if out.shape != spec.shape or out.dtype != np.uint8:
            raise ValueError(f"{spec.name}: k3ref.mxfp4.quantize gave {out.dtype} {out.shape}, "
                             f"expected uint8 {spec.shape}")
        return out


def stored_tensors(cfg: K3Config, seed: int, specs: Iterable[TensorSpec]) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    """(spec, array in its storage dtype: bf16 / float32 / uint8) for each spec, deterministic in `seed`.

    The one generator of synthetic tensors: whole checkpoints and tensor-parallel shards both draw from it, so a
    shard holds exactly the slice of the whole tensor."""
    experts = _ExpertQuantizer(cfg, seed)
    for spec in specs:
        if spec.dtype == "U8":
            yield spec, experts(spec)
        else:
            yield spec, _round(_float_values(spec, cfg, seed), spec.dtype)


ALIGN_ELEMENTS = 16   # synthetic float tensors start on a multiple of 16 elements (64 bytes in float32) ...
PAGE_BYTES = 4096     # ... from a page-aligned buffer


def synthetic_weights(cfg: K3Config, seed: int, dtype=np.float64) -> dict[str, np.ndarray]:
    """Deterministic weights for every inventory tensor: {full name: ndarray}.

    Float tensors hold values exactly representable in their checkpoint dtype (bf16 / float32), returned
    in `dtype`; routed experts are U8 MXFP4 bytes (k3ref.mxfp4.quantize of N(0, 1/in) matrices).
    Scales keep activations O(1) through the model: linear [out, in] ~ N(0, 1/in); embeddings ~ N(0, 1);
    norms ~ 1 + 0.1 N; AttnRes proj ~ N(0, 1/D) (mixing logits ~ N(0, 1)); router bias ~ N(0, 0.05^2);
    A_log = log U(1, 16) on the heads, zero padding; conv ~ N(0, 0.5^2); dt_bias ~ N(0, 0.5^2).
    The K3 preset is far too large to materialise (use inventory / TpPlan for it).
    """
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype: expected float32 or float64, found {dtype}")
    total = sum(t.nbytes for t in inventory(cfg))
    if total > 8 << 30:
        raise ValueError(f"synthetic_weights: {num_parameters(cfg):,} parameters ({total / 2**30:.0f} GiB stored) "
                         "is too large to materialise; use a smaller config (preset 'small' or 'tiny'), or write "
                         "some of its layers to disk with synth_checkpoint (`k3conf synth`) and run those")
    specs = inventory(cfg)
    slot = [-(-spec.numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS for spec in specs]
    size = sum(n for spec, n in zip(specs, slot, strict=True) if spec.dtype != "U8")
    raw = np.empty(size + PAGE_BYTES // dtype.itemsize, dtype)
    arena = raw[(-raw.ctypes.data % PAGE_BYTES) // dtype.itemsize:][:size]   # page-aligned: no row of a
    out, at = {}, 0                                                           # 64-byte vector spans two lines
    for (spec, a), n in zip(stored_tensors(cfg, seed, specs), slot, strict=True):
        if spec.dtype == "U8":
            out[spec.name] = a
            continue
        view = arena[at:at + a.size].reshape(a.shape)   # float tensors side by side in inventory order: a decode
        view[...] = a                                   # step streams them from one buffer (a GEMV per 4 KiB page
        out[spec.name] = view                           # group reads ~15% slower from separate allocations)
        at += n
    return out


# ----- safetensors I/O -----

def _write_safetensors(path: Path, items: Iterable[tuple[TensorSpec, np.ndarray | Iterable[np.ndarray]]],
                       specs: list[TensorSpec], metadata: dict[str, str]) -> None:
    """Stream `items` (in `specs` order) into a safetensors file: temp file first, renamed into place.

    Each item's data is one array, or an iterable of row blocks written one after the other."""
    header: dict = {"__metadata__": metadata}
    off = 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # data starts 8-byte aligned, as safetensors pads it
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec, arr in items:
            if isinstance(arr, np.ndarray):
                arr = np.ascontiguousarray(arr)
                if arr.nbytes != spec.nbytes or tuple(arr.shape) != spec.shape:
                    raise ValueError(f"{spec.name}: array {arr.dtype} {arr.shape} does not match {spec}")
                f.write(arr.reshape(-1).view(np.uint8).data)
                continue
            wrote = 0   # an iterator of row blocks (synth_checkpoint's large tensors)
            for part in arr:
                part = np.ascontiguousarray(part)
                wrote += part.nbytes
                f.write(part.reshape(-1).view(np.uint8).data)
            if wrote != spec.nbytes:
                raise ValueError(f"{spec.name}: row blocks of {wrote} bytes do not match {spec} ({spec.nbytes} bytes)")
    os.replace(tmp, path)


def _plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Cut `specs` (in order) into shards of at most shard_bytes data (a bigger tensor gets its own shard)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


def synthetic_checkpoint(cfg: K3Config, seed: int, out_dir: str | os.PathLike,
                         shard_bytes: int = 1 << 30) -> Path:
    """Write `synthetic_weights(cfg, seed)` as a Hugging Face checkpoint directory; returns out_dir.

    Files: model-0000k-of-0000n.safetensors (bf16 via ml_dtypes, F32, U8 as inventoried),
    model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map": {name: file}}), config.json.
    Tensors are generated and written one at a time (the `small` checkpoint never sits in memory whole);
    each file is written to a temp name and renamed into place.
    """
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes: expected > 0, found {shard_bytes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = inventory(cfg)
    _write_shards(out, cfg, specs, stored_tensors(cfg, seed, specs), seed, shard_bytes)
    return out


def _write_shards(out: Path, cfg: K3Config, specs: list[TensorSpec], stream: Iterator, seed: int,
                  shard_bytes: int) -> None:
    """Write `stream`'s tensors (in the order of `specs`) into shards of about shard_bytes, then the index and
    config.json, each file renamed into place."""
    shards = _plan_shards(specs, shard_bytes)
    n = len(shards)
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        items = (next(stream) for _ in shard)
        _write_safetensors(out / fname, items, shard, {"format": "np", "seed": str(seed)})
        weight_map.update({s.name: fname for s in shard})
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    tmp = out / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, out / INDEX_FILE)
    cfg.save(out / "config.json")


# synth_checkpoint draws large float tensors in row blocks of this many elements (64 MiB of float32).
SYNTH_CHUNK_ELEMS = 1 << 24
# ... and wants this much disk beyond the checkpoint's bytes before it starts.
SYNTH_DISK_MARGIN = 1 << 30


def _synth_items(cfg: K3Config, seed: int,
                 specs: Iterable[TensorSpec]) -> Iterator[tuple[TensorSpec, np.ndarray | Iterator[np.ndarray]]]:
    for spec in specs:
        if spec.dtype == "U8":
            yield spec, _random_mxfp4(spec, seed)
        else:
            yield spec, _float_chunks(spec, cfg, seed, SYNTH_CHUNK_ELEMS)


def synth_checkpoint(cfg: K3Config, out_dir: str | os.PathLike, *, layers: Iterable[int] | None = None,
                     seed: int = 0, shard_bytes: int = 1 << 30) -> Path:
    """Write a checkpoint of `cfg`'s geometry holding `layers` (default: all) plus every global tensor, in the
    inventory's names (what `admit` and `K3CpuModel.from_checkpoint(..., layers=...)` expect); returns out_dir.

    Float tensors are `synthetic_weights`' values (the same generator: a synth checkpoint of every layer holds
    them bit for bit), drawn and written in row blocks; routed experts are random MXFP4 bytes with valid scales
    (`_random_mxfp4`: no quantisation pass, so one K3 MoE layer takes minutes, not hours). At most one row
    block or one expert tensor is in memory at a time. Everything is written into a temporary sibling folder
    that is renamed to out_dir at the end (removed on failure). Refuses (ValueError) an out_dir that exists
    and is not empty, and a disk without room for the checkpoint plus SYNTH_DISK_MARGIN, naming the numbers.
    """
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes: expected > 0, found {shard_bytes}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: exists and is not an empty folder; refusing to overwrite it (remove it or "
                         "choose another folder)")
    specs = inventory(cfg, layers)
    total = sum(s.nbytes for s in specs)
    parent = out.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if total + SYNTH_DISK_MARGIN > free:
        raise ValueError(f"{out}: the checkpoint needs {total / 2**30:,.2f} GiB (+ {SYNTH_DISK_MARGIN / 2**30:.0f} "
                         f"GiB margin), the disk of {parent} has {free / 2**30:,.2f} GiB free")
    partial = parent / f".{out.name}.partial-{os.getpid()}"
    partial.mkdir()
    try:
        _write_shards(partial, cfg, specs, _synth_items(cfg, seed, specs), seed, shard_bytes)
        if out.exists():
            out.rmdir()   # empty (checked above): rename needs the name free
        os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


@dataclasses.dataclass(frozen=True)
class HeaderEntry:
    """Where one tensor lives: file, dtype string, shape, absolute byte range [begin, end) in the file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: str | os.PathLike) -> dict[str, HeaderEntry]:
    """Parse and check one safetensors header; raises CheckpointError naming the file (and tensor) on any defect.

    The format's rules (k3ref.safetensors_io): the header length fits in the file; the header is UTF-8 JSON,
    an object; each entry has a known dtype, a shape of non-negative ints and data_offsets [b, e] with
    e - b = numel * itemsize; the tensors tile the data exactly (no gap, overlap or trailing bytes);
    `__metadata__` maps strings to strings.
    """
    path = Path(path)
    try:
        header = safetensors_io.read_header(path)
    except safetensors_io.FormatError as e:
        raise CheckpointError(str(e)) from None
    d0 = header.data_start
    return {name: HeaderEntry(path, e.dtype, e.shape, d0 + e.begin, d0 + e.end) for name, e in header.entries.items()}


def _shard_files(directory: Path) -> list[Path]:
    try:
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: not a directory (expected a checkpoint folder with *.safetensors)")
        files = sorted(f for f in directory.glob("*.safetensors") if f.is_file())
    except (OSError, ValueError) as e:   # a name too long, a NUL byte, an unreadable folder
        raise CheckpointError(f"{str(directory)[:300]}: cannot read the checkpoint folder: {e}") from None
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors shards found "
                              "(write one with k3ref.weights.synthetic_checkpoint)")
    return files


class CheckpointReader(Mapping):
    """Lazy Mapping[full name -> ndarray] over the safetensors shards of a checkpoint directory.

    Headers are read (and checked) up front; tensor data only on access, via safetensors `safe_open`
    (framework "numpy"). bf16 tensors come back as float32 (exact); F32 and U8 as stored.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.entries: dict[str, HeaderEntry] = {}
        for f in _shard_files(self.directory):
            for name, h in read_header(f).items():
                if name in self.entries:
                    raise CheckpointError(f"{f}: tensor {name!r} is also in {self.entries[name].path.name}")
                self.entries[name] = h
        self._handles: dict[Path, object] = {}
        self._maps: dict[Path, np.memmap] = {}

    def view(self, name: str) -> np.ndarray:
        """The tensor as stored, without a copy: a read-only view of the shard's memory map in its stored dtype
        (BF16 as ml_dtypes.bfloat16). Slicing it reads only the pages of the rows taken, so a caller gathers
        embedding rows or converts one block of a large table at a time."""
        h = self.entries.get(name)
        if h is None:
            raise KeyError(f"{name!r} is not in the checkpoint {self.directory}")
        if h.path not in self._maps:
            self._maps[h.path] = np.memmap(h.path, dtype=np.uint8, mode="r")
        return self._maps[h.path][h.begin:h.end].view(safetensors_io.numpy_dtype(h.dtype)).reshape(h.shape)

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="numpy")
        return self._handles[path]

    def __getitem__(self, name: str) -> np.ndarray:
        h = self.entries.get(name)
        if h is None:
            raise KeyError(f"{name!r} is not in the checkpoint {self.directory}")
        arr = self._handle(h.path).get_tensor(name)
        return arr.astype(np.float32) if h.dtype == "BF16" else arr

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name) -> bool:
        return name in self.entries

    def dtype_of(self, name: str) -> str:
        """The stored dtype string ("BF16", "F32", "U8", ...)."""
        return self.entries[name].dtype

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape


# ----- admission -----

@dataclasses.dataclass(frozen=True)
class Problem:
    """One admission problem. kind: missing | unexpected | shape | dtype | duplicate | index."""

    kind: str
    name: str
    expected: str = ""
    found: str = ""

    def __str__(self) -> str:
        detail = f": expected {self.expected}, found {self.found}" if self.expected or self.found else ""
        return f"{self.kind:<10} {self.name}{detail}"


PROBLEM_KINDS = ("missing", "unexpected", "shape", "dtype", "duplicate", "index")


@dataclasses.dataclass
class Verdict:
    """The outcome of admit_checkpoint: every problem found, plus what was checked."""

    directory: Path
    config_name: str
    n_expected: int
    n_found: int
    n_files: int
    n_ignored: int = 0
    problems: list[Problem] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def by_kind(self) -> dict[str, list[Problem]]:
        out: dict[str, list[Problem]] = {k: [] for k in PROBLEM_KINDS}
        for p in self.problems:
            out.setdefault(p.kind, []).append(p)
        return out

    def summary(self, limit: int = 20) -> str:
        """Human-readable verdict: the counts, then up to `limit` problems of each kind."""
        head = (f"{self.directory}: {self.n_found} text tensors in {self.n_files} shard(s), "
                f"{self.n_expected} expected for {self.config_name}")
        if self.n_ignored:
            head += f" ({self.n_ignored} non-text tensors or tensors of layers not asked for ignored)"
        if self.ok:
            return f"ADMITTED  {head}"
        groups = {k: v for k, v in self.by_kind().items() if v}
        counts = ", ".join(f"{len(v)} {k}" for k, v in groups.items())
        lines = [f"REJECTED  {head}", f"{len(self.problems)} problem(s): {counts}"]
        for probs in groups.values():
            lines += [f"  {p}" for p in probs[:limit]]
            if len(probs) > limit:
                lines.append(f"  ... and {len(probs) - limit} more {probs[0].kind}")
        return "\n".join(lines)


def _config_label(cfg: K3Config) -> str:
    for name in PRESETS:
        if cfg == K3Config.preset(name):
            return f"config {name!r}"
    return f"config ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size})"


def admit_checkpoint(directory: str | os.PathLike, cfg: K3Config, *, text_only: bool = True,
                     layers: Iterable[int] | None = None) -> Verdict:
    """Check a checkpoint directory against inventory(cfg, layers), reading only the safetensors headers.

    layers: only these layers (plus the globals) are expected; tensors of other layers are counted with the
    ignored ones (a checkpoint of layers 1 and 3 is admitted to run layer 1 alone).

    Reports, all at once: missing, unexpected, misshaped and mistyped tensors, tensors in two shards, and
    disagreements of index.json with the shards (an entry pointing at an absent shard or at a shard not
    holding the tensor, a shard tensor the index does not list, a wrong metadata.total_size). With
    text_only, tensors outside `language_model.` (the vision tower) are counted and ignored for the
    inventory (the index must still list them).
    Raises CheckpointError naming the file (and tensor) for a shard or index that breaks its format
    (k3ref.safetensors_io: the safetensors rules, strict JSON).
    """
    directory = Path(directory)
    files = _shard_files(directory)
    found: dict[str, HeaderEntry] = {}
    problems: list[Problem] = []
    ignored = 0
    shards = {f.name: read_header(f) for f in files}
    run = None if layers is None else set(check_layers(cfg, layers))
    for f in files:
        for name, h in shards[f.name].items():
            if text_only and not name.startswith("language_model."):
                ignored += 1
                continue
            if run is not None and (m := _LAYER_RE.match(name)) is not None and int(m.group(1)) not in run:
                ignored += 1
                continue
            if name in found:
                problems.append(Problem("duplicate", name, found[name].path.name, f.name))
                continue
            found[name] = h
    want = inventory_totals(cfg).tensors if layers is None else len(inventory(cfg, layers))
    if want > max(4 * len(found), MAX_LISTED_MISSING):   # listing what is missing would take longer than it helps
        raise CheckpointError(f"{directory}: {_config_label(cfg)} expects {want:,} text tensors "
                              f"({cfg.n_routed_experts:,} routed experts in {cfg.num_hidden_layers:,} layers), the "
                              f"checkpoint holds {len(found):,}: this is not the checkpoint's config")
    expected = {s.name: s for s in inventory(cfg, layers)}
    problems += _inventory_problems(expected, found)
    problems += _index_problems(directory, shards)
    return Verdict(directory, _config_label(cfg), len(expected), len(found), len(files), ignored, problems)


def _inventory_problems(expected: Mapping[str, TensorSpec], found: Mapping[str, HeaderEntry]) -> list[Problem]:
    """Each tensor the config expects against the one the shards hold (missing, shape, dtype), then every
    tensor the shards hold that the config does not expect."""
    problems: list[Problem] = []
    for name, spec in expected.items():
        h = found.get(name)
        if h is None:
            problems.append(Problem("missing", name, f"{spec.dtype} {list(spec.shape)}", "absent"))
            continue
        if h.shape != spec.shape:
            problems.append(Problem("shape", name, str(list(spec.shape)), str(list(h.shape))))
        if h.dtype != spec.dtype:
            problems.append(Problem("dtype", name, spec.dtype, h.dtype))
    problems += [Problem("unexpected", name, "absent", f"{h.dtype} {list(h.shape)} in {h.path.name}")
                 for name, h in found.items() if name not in expected]
    return problems


def _index_problems(directory: Path, shards: Mapping[str, Mapping[str, HeaderEntry]]) -> list[Problem]:
    """The index against the shards: every tensor of every shard is in `weight_map` under its own shard and
    every `weight_map` entry is in the shard it names; `metadata.total_size` (when given) is the shards'
    tensor bytes. shards: shard file name -> its header entries (every tensor, text or not).
    A malformed index (not UTF-8 JSON, not {"weight_map": {name: file}}) raises CheckpointError naming it."""
    path = directory / INDEX_FILE
    if not path.exists():
        return []
    try:
        index = safetensors_io.read_json(path, "index")
    except safetensors_io.FormatError as e:
        raise CheckpointError(str(e)) from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict):
        found = type(wm if isinstance(index, dict) else index).__name__
        raise CheckpointError(f"{path}: unreadable index: expected an object with a \"weight_map\" object "
                              f"{{tensor name: shard file}}, found {found}")
    bad = [name for name, fname in wm.items() if not isinstance(fname, str)]
    if bad:
        raise CheckpointError(f"{path}: unreadable index: weight_map[{bad[0]!r}] is {wm[bad[0]]!r:.80}, "
                              "not a shard file name")
    meta = index.get("metadata", {})
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or (total is not None and not (safetensors_io.is_int(total) and total >= 0)):
        raise CheckpointError(f"{path}: unreadable index: metadata.total_size must be an int >= 0, found "
                              f"{total if isinstance(meta, dict) else meta!r:.80}")
    where = {name: fname for fname, entries in shards.items() for name in entries}
    out = []
    absent: dict[str, int] = {}
    for name, fname in wm.items():
        if fname not in shards:
            absent[fname] = absent.get(fname, 0) + 1
        elif name not in shards[fname]:
            out.append(Problem("index", name, f"in {fname} (index.json)",
                               f"in {where[name]}" if name in where else "absent from that shard"))
    out += [Problem("index", fname[:200], "a shard file in the folder (index.json maps tensors to it)",
                    f"absent ({k} tensors)") for fname, k in sorted(absent.items())]
    out += [Problem("index", name, "listed in index.json weight_map", f"absent from it (the tensor is in {fname})")
            for name, fname in where.items() if name not in wm]
    have = sum(h.end - h.begin for entries in shards.values() for h in entries.values())
    if total is not None and total != have:
        out.append(Problem("index", "metadata.total_size", f"{have} (the bytes of every tensor in the shards)",
                           str(total)))
    return out
