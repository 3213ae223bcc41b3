"""Mutants that a fixed case table can miss: mistakes past a size threshold, breaches of a stated contract, a
rounding that is systematically one-sided, and precision bugs of the size of a lower precision's rounding. Each is
a core of the reference (or of a precision's baseline) with one such mistake; tests/conformance/test_fuzz.py proves
each fails a default `k3conf run` (the contract and precision ones on the tiny goldens too, the size ones on the
run's fuzz draws) with a shrunk reproducer that names the threshold, and the biased ones by the bias rule.

SPACE_MUTANTS: name -> (block, description, make, base, shows_on), the fields of
conformance.backends.mutants.Mutant in order; shows_on "fuzz": only the fuzz draws of a run reach it.
"""
from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

from conformance.backends.recipes import recipe_cores
from k3ref.cores import Cores, reference_cores

HEAD_LIMIT = 64        # a kernel written for at most 64 heads, whose head index wraps past it
SPLIT_K = 2048         # a split-K GEMV over chunks of 2048 that forgets the partial last chunk
BATCH_LIMIT = 32       # a decode kernel whose batch index wraps past 32 rows


def _heads_past_64(base: Cores) -> Cores:
    """KDA decode reading A_log[h - 64] (and its dt_bias) for heads h >= 64: right at H <= 64."""
    def decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, **kw):
        A = np.array(A_log, copy=True)
        dt = np.array(dt_bias, copy=True)
        H = A.shape[0]
        if H > HEAD_LIMIT:
            K = dt.shape[0] // H
            A[HEAD_LIMIT:] = A[np.arange(HEAD_LIMIT, H) - HEAD_LIMIT]
            dt = dt.reshape(H, K)
            dt[HEAD_LIMIT:] = dt[np.arange(HEAD_LIMIT, H) - HEAD_LIMIT]
            dt = dt.reshape(-1)
        return base.kda_decode(q, k, v, g_raw, beta_raw, A, dt, state, **kw)

    return base.replace(kda_decode=decode)


def _split_k_tail(base: Cores) -> Cores:
    """The MXFP4 GEMV summed over chunks of 2048 along K, the partial last chunk dropped (K % 2048 != 0, K > 2048)."""
    def gemv(packed, scale, x):
        x = np.asarray(x)
        K = x.shape[-1]
        if K <= SPLIT_K or K % SPLIT_K == 0:
            return base.mxfp4_gemv(packed, scale, x)
        keep = K // SPLIT_K * SPLIT_K
        return base.mxfp4_gemv(np.asarray(packed)[:, :keep // 2], np.asarray(scale)[:, :keep // 32], x[..., :keep])

    return base.replace(mxfp4_gemv=gemv)


def _batch_past_32(base: Cores) -> Cores:
    """MLA decode rows b >= 32 reading row b - 32's pages and length (a batch index that wraps at 32)."""
    def decode(q_abs, kv_cache, block_table, seq_lens, **kw):
        table, lens = np.array(block_table, copy=True), np.array(seq_lens, copy=True)
        B = lens.shape[0]
        if B > BATCH_LIMIT:
            table[BATCH_LIMIT:] = table[np.arange(BATCH_LIMIT, B) - BATCH_LIMIT]
            lens[BATCH_LIMIT:] = lens[np.arange(BATCH_LIMIT, B) - BATCH_LIMIT]
        return base.mla_decode(q_abs, kv_cache, table, lens, **kw)

    return base.replace(mla_decode=decode)


def _ties_to_higher(base: Cores) -> Cores:
    """The router breaking ties to the higher expert id (spec 3.4 says the lower): the same choice everywhere else."""
    def route(logits, bias, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
        logits, bias = np.asarray(logits), np.asarray(bias)
        E = logits.shape[-1]
        flipped_w, flipped_i = base.moe_route(logits[:, ::-1], bias[::-1], top_k, n_group=n_group,
                                              topk_group=topk_group, renormalize=renormalize, scaling=scaling)
        return flipped_w, (E - 1 - np.asarray(flipped_i)).astype(np.asarray(flipped_i).dtype)

    return base.replace(moe_route=route)


def _repeat_counted_once(base: Cores) -> Cores:
    """Fused experts merging a token's repeated expert into one term (spec 3.4: an expert chosen twice counts twice)."""
    def experts(x, weights, indices, *args, **kw) -> np.ndarray:
        w = np.array(weights, copy=True)
        idx = np.asarray(indices)
        for t in range(idx.shape[0]):
            seen: set[int] = set()
            for j, e in enumerate(idx[t]):
                if int(e) in seen:
                    w[t, j] = 0.0
                seen.add(int(e))
        return base.moe_experts(x, w, idx, *args, **kw)

    return base.replace(moe_experts=experts)


def _scale_ignored(base: Cores) -> Cores:
    """KDA decode ignoring an explicit `scale` (always 1/sqrt(K), the default)."""
    def decode(*args, scale=None, **kw):
        return base.kda_decode(*args, **kw)

    return base.replace(kda_decode=decode)


def truncated(a: np.ndarray) -> np.ndarray:
    """`a` rounded to bf16 toward zero (its low 16 bits dropped), held as float32: a rounding biased toward zero.
    Integer arrays (router indices) pass through."""
    if np.asarray(a).dtype.kind != "f":
        return a
    bits = np.asarray(a, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def _bf16_truncated(base: Cores) -> Cores:
    """rmsnorm computed in float32 on the bf16 inputs, its output rounded to bf16 toward zero instead of to the
    nearest: within bf16's own rounding error in size, but every element pulled toward zero."""
    ref = reference_cores()

    def rmsnorm(x, w, eps):
        y = ref.rmsnorm(np.asarray(x, np.float32), np.asarray(w, np.float32), eps)
        return truncated(y)

    return base.replace(rmsnorm=rmsnorm)


def _bf16_all_truncated(base: Cores) -> Cores:
    """Every core as recipe:bf16-f32-math computes it (float32 on the bf16 inputs), each output K3 stores in bf16
    rounded toward zero instead of to the nearest: the outputs of a kernel that drops low bits to store bf16."""
    return recipe_cores(np.float32, truncated)


def _state_in_bf16(base: Cores) -> Cores:
    """KDA decode returning its recurrent state rounded to bf16 (K3 keeps it in fp32, docs/spec.md 1.4): the
    next step starts from a state a bf16 ulp off."""
    def decode(*args, **kw):
        o, state = base.kda_decode(*args, **kw)
        return o, bf16_nearest(state)

    return base.replace(kda_decode=decode)


def _mxfp4_bf16_partial_sums(base: Cores) -> Cores:
    """The MXFP4 GEMV keeping its running sum in bf16, rounded after each group of 32 products (a split
    accumulator stored at the activations' precision)."""
    ref = reference_cores()

    def gemv(packed, scale, x):
        x = np.asarray(x, np.float32)
        K = x.shape[-1]
        total = np.zeros(x.shape[:-1] + (np.asarray(packed).shape[0],), np.float32)
        for g in range(K // 32):
            part = ref.mxfp4_gemv(np.asarray(packed)[:, 16 * g:16 * (g + 1)], np.asarray(scale)[:, g:g + 1],
                                  x[..., 32 * g:32 * (g + 1)])
            total = bf16_nearest(total + np.asarray(part, np.float32))
        return total

    return base.replace(mxfp4_gemv=gemv)


def bf16_nearest(a: np.ndarray) -> np.ndarray:
    """`a` rounded to the nearest bf16, held as float32 (the correct rounding the truncating mutant breaks)."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


SPACE_MUTANTS: dict[str, tuple[str, str, Callable[[Cores], Cores], str, str]] = {
    "kda-heads-past-64": ("kda_decode", "KDA decode reads A_log and dt_bias of head h - 64 for heads h >= 64",
                          _heads_past_64, "numpy64", "fuzz"),
    "mxfp4-split-k-drops-tail": ("mxfp4_gemv", "MXFP4 GEMV over chunks of 2048 along K drops the partial last one",
                                 _split_k_tail, "numpy64", "fuzz"),
    "mla-batch-past-32": ("mla_decode", "MLA decode rows b >= 32 read row b - 32's pages and length",
                          _batch_past_32, "numpy64", "fuzz"),
    "router-ties-to-higher": ("moe_route", "the router breaks ties to the higher expert id", _ties_to_higher,
                              "numpy64", "tiny"),
    "experts-repeat-counted-once": ("moe_experts", "fused experts count a token's repeated expert once",
                                    _repeat_counted_once, "numpy64", "tiny"),
    "kda-scale-ignored": ("kda_decode", "KDA decode ignores an explicit scale (always 1/sqrt(K))", _scale_ignored,
                          "numpy64", "tiny"),
    "bf16-rmsnorm-truncated": ("rmsnorm", "rmsnorm in float32, its output rounded to bf16 toward zero",
                               _bf16_truncated, "torch-bf16", "tiny"),
    "bf16-outputs-truncated": ("rmsnorm", "every core in float32, each bf16 output rounded toward zero",
                               _bf16_all_truncated, "torch-bf16", "tiny"),
    # precision bugs of the size of a lower precision's rounding, at fp32 and at bf16
    "fp32-kda-state-in-bf16": ("kda_decode", "fp32 KDA decode returns its state rounded to bf16", _state_in_bf16,
                               "numpy32", "tiny"),
    "fp32-mxfp4-bf16-partial-sums": ("mxfp4_gemv", "fp32 MXFP4 GEMV keeps its running sum in bf16 (per group of 32)",
                                     _mxfp4_bf16_partial_sums, "numpy32", "tiny"),
    "bf16-kda-state-in-bf16": ("kda_decode", "bf16 KDA decode returns its state rounded to bf16, not kept in fp32",
                               _state_in_bf16, "torch-bf16", "tiny"),
}

__all__ = ["SPACE_MUTANTS", "bf16_nearest", "truncated"]
