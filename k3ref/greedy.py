"""Greedy decoding through the caches, and its independent twin: recompute the whole sequence each step.

`decode_memory` counts, before anything is allocated, every byte a greedy decode of the host graph will hold
(weights at the working dtype, caches, activations, logits, the lm_head block, the experts' pages it reads),
and `MemoryEstimate.check` refuses a run that will not fit, naming the numbers.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterable

import numpy as np

from .checks import require
from .cores import Cores
from .cpu_forward import (
    KEEP_CASTS_BYTES,
    LM_HEAD_BLOCK_BYTES,
    PRODUCTION,
    Ablation,
    K3CpuModel,
    float_weight_bytes,
    forward_prefill,
    forward_token,
)
from .weights import check_layers, inventory, inventory_totals

E8M0_NAN = 0xFF   # the MXFP4 scale byte that encodes NaN (OCP MX: E8M0 has no Inf, one NaN)


class NonFiniteLogits(ValueError):
    """The model's logits hold NaN or Inf: no token can honestly be chosen from them (argmax would pick one)."""


def check_logits(logits: np.ndarray, step: int) -> None:
    """Raise NonFiniteLogits naming the step, how many logits are not finite, and the first one."""
    bad = ~np.isfinite(logits)
    if bad.any():
        first = int(np.argmax(bad))
        raise NonFiniteLogits(f"the logits of step {step} hold {int(bad.sum())} non-finite value(s) of "
                              f"{logits.size} (first at token id {first}: {logits[first]})")


def non_finite_weight(model: K3CpuModel) -> str | None:
    """The first tensor of the model's weights (checkpoint order) holding a non-finite value, named as in the
    checkpoint with its layer and expert and the first bad element; None when every weight is finite.

    Floats are checked for NaN / Inf; MXFP4 scales (U8 E8M0) for the NaN byte 0xFF. Reads every tensor: only
    for explaining a failure.
    """
    for spec in inventory(model.cfg):
        if spec.name not in model.weights:
            continue
        arr = np.asarray(model.weights[spec.name])
        if arr.dtype == np.uint8:
            bad = arr == E8M0_NAN if spec.name.endswith("weight_scale") else np.zeros(arr.shape, bool)
        else:
            bad = ~np.isfinite(arr.astype(np.float64))
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            what = "NaN scale byte(s) 0xFF" if arr.dtype == np.uint8 else "non-finite value(s)"
            return (f"checkpoint tensor {spec.name}{_where(spec.name)} holds {int(bad.sum())} {what}, first at "
                    f"{list(first)}: {arr[first]}")
    return None


def _where(name: str) -> str:
    """' (layer L, expert E)' from a full checkpoint name; '' for a tensor of no layer."""
    parts = [f"{what} {m.group(1)}" for what, pattern in (("layer", r"\.layers\.(\d+)\."),
                                                         ("expert", r"\.experts\.(\d+)\."))
             if (m := re.search(pattern, name))]
    return f" ({', '.join(parts)})" if parts else ""


@dataclasses.dataclass
class GreedyResult:
    """tokens: the new tokens [max_new]; logits: the logits that chose each of them [max_new, vocab]."""

    tokens: list[int]
    logits: np.ndarray


def _check_prompt(model: K3CpuModel, prompt, max_new_tokens: int) -> np.ndarray:
    ids = np.asarray(prompt, dtype=np.int64)
    require(ids.ndim == 1 and ids.size >= 1, f"prompt: expected at least one token id, found shape {ids.shape}")
    require(isinstance(max_new_tokens, (int, np.integer)) and max_new_tokens >= 0,
            f"max_new_tokens: expected an int >= 0, found {max_new_tokens!r}")
    return ids


def _stack(logits: list[np.ndarray], model: K3CpuModel) -> np.ndarray:
    """[max_new, vocab] (also for max_new = 0, where np.array([]) has no vocab axis to infer)."""
    return np.array(logits).reshape(len(logits), model.cfg.vocab_size)


def greedy_decode(model: K3CpuModel, prompt, max_new_tokens: int, *, cores: Cores | None = None,
                  ablation: Ablation = PRODUCTION, on_token: Callable[[int], None] | None = None,
                  num_pages: int | None = None) -> GreedyResult:
    """Prefill `prompt`, then take argmax tokens one at a time through the hybrid cache.

    Ties go to the lowest token id (np.argmax). on_token(tok) is called after each new token.
    Raises NonFiniteLogits when a step's logits hold NaN or Inf (`non_finite_weight` finds a weight behind it).
    """
    ids = _check_prompt(model, prompt, max_new_tokens)
    total = ids.size + max_new_tokens
    pages = num_pages or -(-total // model.mla_cfg.page_size) + 1
    cache = model.new_cache(num_pages=pages)
    seq = cache.add_sequence()
    logits = forward_prefill(model, ids, cache, seq=seq, cores=cores, ablation=ablation)[-1]
    tokens, chosen = [], []
    for step in range(max_new_tokens):
        check_logits(logits, step)
        tok = int(np.argmax(logits))
        tokens.append(tok)
        chosen.append(logits)
        if on_token:
            on_token(tok)
        if step + 1 < max_new_tokens:
            logits = forward_token(model, tok, ids.size + step, cache, seq=seq, cores=cores, ablation=ablation)
    return GreedyResult(tokens, _stack(chosen, model))


def greedy_recompute(model: K3CpuModel, prompt, max_new_tokens: int, *, cores: Cores | None = None,
                     ablation: Ablation = PRODUCTION) -> GreedyResult:
    """The same tokens with no cache reuse: every step prefills the whole sequence from scratch."""
    ids = list(_check_prompt(model, prompt, max_new_tokens))
    tokens: list[int] = []
    chosen: list[np.ndarray] = []
    for _ in range(max_new_tokens):
        cache = model.new_cache(num_pages=-(-len(ids) // 64) + 1)
        logits = forward_prefill(model, np.array(ids), cache, seq=cache.add_sequence(), cores=cores,
                                 ablation=ablation)[-1]
        check_logits(logits, len(tokens))
        tok = int(np.argmax(logits))
        tokens.append(tok)
        chosen.append(logits)
        ids.append(tok)
    return GreedyResult(tokens, _stack(chosen, model))


# ----- memory -----

# The float64 working set of one layer's forward is a few times its widest activation: inputs, projections,
# their normed / convolved / gated forms and the output (measured on one real K3 layer; docs/measurements.md).
ACTIVATION_COPIES = 16


class NotEnoughMemory(ValueError):
    """A run that would hold more memory than is available; the message names the numbers and largest items."""


def format_bytes(n: float) -> str:
    """2.04 GiB / 61.3 MiB / 12.0 KiB: the unit that shows the number."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n / 1024:,.1f} KiB"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """What a run holds, by item, in bytes. `anonymous`: memory the run allocates (must fit what is available);
    `mapped`: pages of the checkpoint files it reads through memory maps (page cache: reclaimable, re-read
    under pressure, so reported but not refused)."""

    anonymous: dict[str, int]
    mapped: dict[str, int]

    @property
    def needed(self) -> int:
        return sum(self.anonymous.values())

    def largest(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.anonymous.items(), key=lambda kv: -kv[1])[:n]

    def summary(self) -> str:
        items = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.largest(len(self.anonymous)))
        out = f"about {format_bytes(self.needed)} allocated ({items})"
        if self.mapped:
            out += "; checkpoint pages read through memory maps: " + ", ".join(
                f"{k} {format_bytes(v)}" for k, v in self.mapped.items())
        return out

    def check(self, available: int | None = None, what: str = "this run") -> None:
        """Raise NotEnoughMemory when `needed` exceeds `available` (default: `available_memory()`; 0 = unknown,
        nothing refused), naming needed, available and the three largest items."""
        have = available_memory() if available is None else int(available)
        if have and self.needed > have:
            top = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.largest())
            raise NotEnoughMemory(f"{what} would hold about {format_bytes(self.needed)}, this machine has "
                                  f"{format_bytes(have)} available; the largest items: {top}")


def available_memory() -> int:
    """Bytes the kernel says a new allocation can get now (MemAvailable), else physical memory; 0 unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def decode_memory(cfg, *, prompt_len: int, max_new: int, dtype=np.float64, layers: Iterable[int] | None = None,
                  synthetic: bool = False, keep_casts: bool | None = None) -> MemoryEstimate:
    """Every byte a greedy decode (`greedy_decode`: prefill `prompt_len` tokens, `max_new` tokens out) of
    `cfg`'s `layers` (default all) holds, worked out from the config alone, before any of it is allocated.

    synthetic: the weights are `synthetic_weights` in memory (every tensor of the model); else a checkpoint
    read through memory maps (`K3CpuModel.from_checkpoint`), whose dense floats are converted to `dtype`
    and kept (keep_casts, None: as the model decides) or converted one tensor at a time, and whose embedding
    and lm_head are read by rows / in blocks. Anonymous items: the weights' float copies, the caches (the MLA
    pool is allocated whole for prompt + max_new tokens; a KDA state per layer), the embedding rows, one
    lm_head block, the logits (the prompt's, and every step's kept for the result), the AttnRes blocks and the
    largest layer's activations (ACTIVATION_COPIES of its widest [T, width] array, and MLA's [H, T, T] scores
    in the expanded prefill), the dequantised routed experts. Mapped: the experts' and tables' pages read.
    """
    it = np.dtype(dtype).itemsize
    run = tuple(range(cfg.num_hidden_layers)) if layers is None else check_layers(cfg, layers)
    T, total = int(prompt_len), int(prompt_len) + int(max_new)
    D, V = cfg.hidden_size, cfg.vocab_size
    anon: dict[str, int] = {}
    mapped: dict[str, int] = {}
    if synthetic:
        floats = sum(s.numel for s in inventory(cfg) if s.dtype != "U8")
        anon["synthetic weights"] = floats * it + (inventory_totals(cfg).nbytes - sum(
            s.nbytes for s in inventory(cfg) if s.dtype != "U8"))
    else:
        kept, largest = float_weight_bytes(cfg, it, run)
        keep = kept <= KEEP_CASTS_BYTES if keep_casts is None else keep_casts
        if keep:
            anon["float weights (cast, kept)"] = kept
        else:   # the converted tensor and one temporary of its size (a transposed or scanned copy)
            anon["float weights (one tensor at a time)"] = 2 * largest
        block = max(1, LM_HEAD_BLOCK_BYTES // (D * it))
        anon["lm_head block"] = min(block, V) * D * it
        mapped["embedding and lm_head"] = (1 if cfg.tie_word_embeddings else 2) * V * D * 2
    mla = [i for i in run if cfg.is_mla(i)]
    kda = [i for i in run if not cfg.is_mla(i)]
    pages = -(-total // 64) + 1
    anon["MLA cache"] = len(mla) * pages * 64 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * it
    HK = cfg.kda_num_heads * cfg.kda_head_dim
    state_it = max(it, 4)
    anon["KDA state"] = len(kda) * (HK * cfg.kda_head_dim * state_it + 3 * HK * (cfg.short_conv_kernel_size - 1) * it)
    anon["logits"] = (T + 2 * max_new) * V * it
    blocks = len({i // cfg.attn_res_block_size for i in run}) + 1
    anon["AttnRes blocks"] = 2 * (blocks + 1) * T * D * it   # the blocks and their stacked copy per mix
    anon["activations"] = _activation_bytes(cfg, run, T, it)
    moe = [i for i in run if not cfg.mlp_is_dense(i)]
    if moe:
        Di, Lt = cfg.moe_intermediate_size, cfg.routed_expert_hidden_size
        anon["routed experts (dequantised)"] = 3 * Di * Lt * 4 + T * cfg.num_experts_per_tok * (2 * Di + Lt) * it
        if not synthetic:
            touched = min(total * cfg.num_experts_per_tok, cfg.n_routed_experts)
            per_expert = 3 * Di * Lt // 2 + 3 * Di * Lt // 32
            mapped["routed experts"] = len(moe) * touched * per_expert
    return MemoryEstimate(anon, mapped)


KDA_CHUNK = 64   # the chunked KDA prefill pads T to whole chunks and forms [H, C, C] scores per chunk
KDA_SUB = 8      # ... and per-channel scores over sub-blocks of 8 rows [H, C, 8, K] (k3ref.fast.kda)


def _activation_bytes(cfg, run: tuple[int, ...], T: int, it: int) -> int:
    """The largest layer's working set at T tokens (see decode_memory)."""
    widths = [cfg.hidden_size]
    scores = 0
    if any(not cfg.is_mla(i) for i in run):
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        padded = -(-T // KDA_CHUNK) * KDA_CHUNK
        widths.append(H * K * padded // max(T, 1))      # the padded chunks, counted per token
        scores = 4 * H * KDA_CHUNK * (KDA_CHUNK + 2 * KDA_SUB * K) * it
    if any(cfg.is_mla(i) for i in run):
        H = cfg.num_attention_heads
        widths.append(H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + 2 * cfg.v_head_dim))
        scores = max(scores, 3 * H * T * T * it)
    if any(cfg.mlp_is_dense(i) for i in run):
        widths.append(cfg.intermediate_size)
    if any(not cfg.mlp_is_dense(i) for i in run):
        widths.append(cfg.n_shared_experts * cfg.moe_intermediate_size)
    return ACTIVATION_COPIES * T * max(widths) * it + scores + math.prod((T, cfg.n_routed_experts, it))
