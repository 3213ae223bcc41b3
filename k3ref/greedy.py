"""Greedy decoding through the caches, and its independent twin: recompute the whole sequence each step."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from .checks import require
from .cores import Cores
from .cpu_forward import PRODUCTION, Ablation, K3CpuModel, forward_prefill, forward_token
from .weights import inventory

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
