"""Greedy decoding through the caches, and its independent twin: recompute the whole sequence each step."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from .checks import require
from .cores import Cores
from .cpu_forward import PRODUCTION, Ablation, K3CpuModel, forward_prefill, forward_token


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
    """
    ids = _check_prompt(model, prompt, max_new_tokens)
    total = ids.size + max_new_tokens
    pages = num_pages or -(-total // model.mla_cfg.page_size) + 1
    cache = model.new_cache(num_pages=pages)
    seq = cache.add_sequence()
    logits = forward_prefill(model, ids, cache, seq=seq, cores=cores, ablation=ablation)[-1]
    tokens, chosen = [], []
    for step in range(max_new_tokens):
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
    tokens, chosen = [], []
    for _ in range(max_new_tokens):
        cache = model.new_cache(num_pages=-(-len(ids) // 64) + 1)
        logits = forward_prefill(model, np.array(ids), cache, seq=cache.add_sequence(), cores=cores,
                                 ablation=ablation)[-1]
        tok = int(np.argmax(logits))
        tokens.append(tok)
        chosen.append(logits)
        ids.append(tok)
    return GreedyResult(tokens, _stack(chosen, model))
