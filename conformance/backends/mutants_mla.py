"""Mutants of the engine-shaped MLA cores: mistakes an FP8 decode or a varlen prefill kernel makes.

ENGINE_MUTANTS: name -> (block, description, make, base, shows_on), the fields of conformance.backends.mutants'
Mutant: make(base: Cores) -> Cores swaps one core of `base`; `block` is where the mistake must show first; `base`
the backend mutated ("numpy64": a gross mistake, seen at every precision); `shows_on` the smallest case set whose
goldens catch it. tests/conformance/test_engine_mla_cases.py checks that each fails its tiny cases.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from k3ref import ops
from k3ref.cores import Cores
from k3ref.engine.mla import dequantize_latent

ASSUMED_PAGE = 64   # the page size a kernel written for FlashMLA's default layout hard-codes


def _fp8_scale_twice(base: Cores) -> Cores:
    """c = code * scale * scale: a dequantisation applied once in the loader and again in the kernel."""
    def decode(q_abs, kv_fp8, kv_scale, k_pe, block_table, seq_lens, *, scale):
        kv_scale = np.asarray(kv_scale)
        return base.mla_decode_fp8(q_abs, kv_fp8, kv_scale * kv_scale, k_pe, block_table, seq_lens, scale=scale)

    return base.replace(mla_decode_fp8=decode)


def _fp8_page_size_64_assumed(base: Cores) -> Cores:
    """Token j read at flat row block_table[b, j // 64] * 64 + j % 64 of the pool, whatever its page size: right
    at page 64, rows of other tokens (or of unused slots, NaN) at pages 1 and 16. Reads wrap around the pool, as
    a kernel's reads past it would land on other memory."""
    def decode(q_abs, kv_fp8, kv_scale, k_pe, block_table, seq_lens, *, scale):
        q_abs, kv_fp8, kv_scale, k_pe = (np.asarray(a) for a in (q_abs, kv_fp8, kv_scale, k_pe))
        N, page, R = kv_fp8.shape
        flat = lambda a: a.reshape(N * page, a.shape[-1])  # noqa: E731
        dt = np.result_type(q_abs.dtype, k_pe.dtype, np.float32)
        o_lat = np.zeros(q_abs.shape[:2] + (R,), dtype=dt)
        for b, L in enumerate(np.asarray(seq_lens).tolist()):
            if L == 0:
                continue
            j = np.arange(L)
            row = (np.asarray(block_table)[b, j // ASSUMED_PAGE] * ASSUMED_PAGE + j % ASSUMED_PAGE) % (N * page)
            c = dequantize_latent(flat(kv_fp8)[row], flat(kv_scale)[row]).astype(dt)
            rows = np.concatenate([c, flat(k_pe)[row].astype(dt)], axis=-1)
            o_lat[b] = ops.softmax((q_abs[b].astype(dt) @ rows.T) * scale) @ c
        return o_lat

    return base.replace(mla_decode_fp8=decode)


def _prefill_mask_top_left(base: Cores) -> Cores:
    """New token i of a sequence sees its tokens 0 .. i (causal mask aligned top-left): the same as attending over
    the first q_n of its k_n tokens only, so right without a cached prefix and wrong with one."""
    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale):
        cu_q, cu_k = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        firsts = np.concatenate([np.arange(cu_k[n], cu_k[n] + cu_q[n + 1] - cu_q[n]) for n in range(cu_q.size - 1)])
        return base.mla_prefill(q, np.asarray(k)[firsts], np.asarray(v)[firsts], cu_q, cu_q, scale=scale)

    return base.replace(mla_prefill=prefill)


ENGINE_MUTANTS: dict[str, tuple[str, str, Callable[[Cores], Cores], str, str]] = {
    "mla-fp8-scale-twice": ("mla_decode_fp8", "FP8 latent dequantised with its scale applied twice (code * s * s)",
                            _fp8_scale_twice, "numpy64", "tiny"),
    "mla-fp8-page-size-64-assumed": ("mla_decode_fp8", f"FP8 MLA decode addresses the cache as if pages held "
                                     f"{ASSUMED_PAGE} tokens", _fp8_page_size_64_assumed, "numpy64", "tiny"),
    "mla-prefill-mask-top-left": ("mla_prefill", "prefill causal mask aligned top-left (a cached prefix is "
                                  "ignored) instead of bottom-right", _prefill_mask_top_left, "numpy64", "tiny"),
}

__all__ = ["ASSUMED_PAGE", "ENGINE_MUTANTS"]
