"""Mutants of the engine-shaped KDA cores: the mistakes a kernel makes with a state pool, padded rows and packed
sequences. Each is the reference core with one such mistake, and each fails the `tiny` cases of its block
(tests/conformance/test_engine_kda_cases.py).

ENGINE_MUTANTS: name -> (block, description, make, base, shows_on), the fields of
conformance.backends.mutants.Mutant in order (make(base: Cores) -> Cores swaps the block's core).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from k3ref.cores import Cores


def _pool_slot_off_by_one(base: Cores) -> Cores:
    """Each row reads and writes the slot after its own (wrapping at the pool's end); padded rows stay padded."""
    def decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slots, **kw):
        slots = np.asarray(slots)
        shifted = np.where(slots >= 0, (slots + 1) % np.shape(state_pool)[0], slots).astype(slots.dtype)
        return base.kda_decode_pool(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, shifted, **kw)

    return base.replace(kda_decode_pool=decode)


def _pool_layout_transposed(base: Cores) -> Cores:
    """A "vk" pool read and written as if it were "kv": each slot's memory taken as [K, V] instead of [V, K]."""
    def decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slots, *, state_layout="kv", **kw):
        pool = np.asarray(state_pool)
        if state_layout != "vk":
            return base.kda_decode_pool(q, k, v, g_raw, beta_raw, A_log, dt_bias, pool, slots,
                                        state_layout=state_layout, **kw)
        S, H, V, K = pool.shape
        o, new_pool = base.kda_decode_pool(q, k, v, g_raw, beta_raw, A_log, dt_bias, pool.reshape(S, H, K, V), slots,
                                           state_layout="kv", **kw)
        return o, np.asarray(new_pool).reshape(S, H, V, K)

    return base.replace(kda_decode_pool=decode)


def _padded_row_writes_last_slot(base: Cores) -> Cores:
    """A padded row's slot -1 taken as a Python index: after the live rows, each padded row runs its token on
    the pool's last slot and writes it back there."""
    def decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slots, **kw):
        o, pool = base.kda_decode_pool(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, slots, **kw)
        last = np.int32(np.shape(state_pool)[0] - 1)
        for b in np.flatnonzero(np.asarray(slots) < 0):
            row = slice(b, b + 1)
            o_b, pool = base.kda_decode_pool(q[row], k[row], v[row], g_raw[row], beta_raw[row], A_log, dt_bias,
                                             pool, np.array([last]), **kw)
            o = np.array(o, copy=True)
            o[b] = o_b[0]
        return o, pool

    return base.replace(kda_decode_pool=decode)


def _conv_taps_reversed(base: Cores) -> Cores:
    """The conv taps applied in reverse: w[:, 0] on the current input, w[:, W-1] on the oldest."""
    def conv(x, weight, conv_pool, slots, **kw):
        return base.kda_conv_pool(x, np.asarray(weight)[:, ::-1], conv_pool, slots, **kw)

    return base.replace(kda_conv_pool=conv)


def _varlen_ignores_cu_seqlens(base: Cores) -> Cores:
    """Packed sequences run as one: each sequence starts from the previous one's final state instead of its own
    slot's (the first from its own), and each slot receives its sequence's final state."""
    def prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, state_pool, cu_seqlens, slots, **kw):
        pool = np.array(state_pool, copy=True)
        cu, slots = np.asarray(cu_seqlens), np.asarray(slots)
        outs = []
        for n in range(slots.size):
            if n > 0:
                pool[slots[n]] = pool[slots[n - 1]]                   # the state carried over the boundary
            tokens = slice(int(cu[n]), int(cu[n + 1]))
            seq = [np.asarray(a)[:, tokens] for a in (q, k, v, g_raw, beta_raw)]
            o, pool = base.kda_prefill_varlen(*seq, A_log, dt_bias, pool,
                                              np.array([0, cu[n + 1] - cu[n]], cu.dtype), slots[n:n + 1], **kw)
            pool = np.asarray(pool)
            outs.append(np.asarray(o))
        return np.concatenate(outs, axis=1), pool

    return base.replace(kda_prefill_varlen=prefill)


# name -> (block, description, make, base, shows_on)
ENGINE_MUTANTS: dict[str, tuple[str, str, Callable[[Cores], Cores], str, str]] = {
    "kda-pool-slot-off-by-one": ("kda_decode_pool", "KDA pool decode reads and writes slot + 1 instead of its slot",
                                 _pool_slot_off_by_one, "numpy64", "tiny"),
    "kda-pool-layout-transposed": ("kda_decode_pool", "KDA pool decode reads a [V, K] (vk) pool as [K, V]",
                                   _pool_layout_transposed, "numpy64", "tiny"),
    "kda-pool-padded-row-writes-last-slot": ("kda_decode_pool",
                                             "KDA pool decode takes a padded row's slot -1 as the pool's last slot",
                                             _padded_row_writes_last_slot, "numpy64", "tiny"),
    "kda-conv-pool-taps-reversed": ("kda_conv_pool", "KDA conv pool step applies the conv taps in reverse order",
                                    _conv_taps_reversed, "numpy64", "tiny"),
    "kda-varlen-ignores-cu-seqlens": ("kda_prefill_varlen",
                                      "KDA varlen prefill carries the state across sequence boundaries",
                                      _varlen_ignores_cu_seqlens, "numpy64", "tiny"),
}

__all__ = ["ENGINE_MUTANTS"]
