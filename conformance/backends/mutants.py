"""Mutants: a backend with one core replaced by a deliberately wrong one. The mutation tests prove that the
runner catches each mistake and names its block first; `k3conf run --backend mutant:<name>` runs one.

MUTANTS is the table, built here from data: the gross mistakes on numpy64, a one-percent error on each bf16
kernel core (on torch-bf16), the model traces' wrong AttnRes block boundary, and the mistakes only K3's real
sizes show (on numpy32, an fp32 kernel's precision): they pass every toy golden and fail the k3 shape sets
(tests/conformance/test_shapes_mutants.py); the engine-shaped cores' layout mistakes (mutants_kda, mutants_mla,
mutants_moe); and what a fixed case table can miss (mutants_space: sizes past a threshold, stated contracts, a
one-sided rounding).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from conformance.backends import mutants_kda, mutants_mla, mutants_moe, mutants_space
from conformance.backends.builtin import NumpyBackend
from conformance.backends.protocol import BackendBase
from conformance.cases.attnres_mutant import BoundaryOffByOneHub
from k3ref import kda, ops
from k3ref.cores import Cores, reference_cores


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A known mistake: `make(base) -> Cores` swaps one core of `base`; `block` is where it must show first.

    base: the backend whose cores are mutated and whose precision the mutant runs at ("numpy64": a gross
    mistake seen at every precision; "torch-bf16": a small one that the bf16 gates must still catch)."""

    block: str
    description: str
    make: Callable[[Cores], Cores]
    base: str = "numpy64"
    shows_on: str = "tiny"   # the smallest case set whose goldens catch it (conformance.cases.protocol.CONFIGS)


@dataclasses.dataclass
class MutantBackend(BackendBase):
    """`base`'s cores with one mutated; unavailable (with the base's reason) where the base cannot run."""

    name: str
    base: BackendBase
    make: Callable[[Cores], Cores]
    precision: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.precision = self.base.precision

    def available(self) -> tuple[bool, str]:
        ok, why = self.base.available()
        return ok, (f"mutated {why}" if ok else why)

    def cores(self) -> Cores:
        return self.make(self.base.cores())

    def time_core(self, core: str, inputs: dict) -> float | None:
        return None   # a mutant is about being caught, not about speed

    def timed_cores(self) -> frozenset[str]:
        return frozenset()   # a mutant is about being caught, not about speed


def _kda_l2_eps_1e12(base: Cores) -> Cores:
    """KDA with L2(x) = x / sqrt(sum(x^2) + 1e-12): exact otherwise (k3ref's gate and recurrence)."""
    def l2(x):
        return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-12)

    def prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
        g = kda.kda_gate(g_raw, A_log, dt_bias, lower_bound)
        return kda.kda_recurrent(l2(np.asarray(q)), l2(np.asarray(k)), v, g, ops.sigmoid(beta_raw), scale=scale,
                                 initial_state=state, use_qk_l2norm=False)

    def decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, **kw):
        o, S = prefill(*(np.asarray(a)[:, None] for a in (q, k, v, g_raw, beta_raw)), A_log, dt_bias, state, **kw)
        return o[:, 0], S

    return base.replace(kda_decode=decode, kda_prefill=prefill)


def _kda_no_lower_bound(base: Cores) -> Cores:
    def decode(*args, **kw):
        return base.kda_decode(*args, **{**kw, "lower_bound": None})

    def prefill(*args, **kw):
        return base.kda_prefill(*args, **{**kw, "lower_bound": None})

    return base.replace(kda_decode=decode, kda_prefill=prefill)


def _mla_scale_128(base: Cores) -> Cores:
    def decode(*args, **kw):
        return base.mla_decode(*args, **{**kw, "scale": 128 ** -0.5})

    return base.replace(mla_decode=decode)


def _router_bias_in_weights(base: Cores) -> Cores:
    def route(logits, bias, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
        _, idx = base.moe_route(logits, bias, top_k, n_group=n_group, topk_group=topk_group,
                                renormalize=renormalize, scaling=scaling)
        logits = np.asarray(logits)
        choice = 1.0 / (1.0 + np.exp(-logits)) + np.asarray(bias, logits.dtype)
        w = np.take_along_axis(choice, idx, axis=-1)
        if renormalize:
            w = w / (np.sum(w, axis=-1, keepdims=True) + 1e-20)
        return (w * scaling).astype(logits.dtype), idx

    return base.replace(moe_route=route)


def _mxfp4_nibbles_swapped(base: Cores) -> Cores:
    def gemv(packed, scale, x):
        p = np.asarray(packed)
        return base.mxfp4_gemv(((p >> 4) | (p << 4)).astype(np.uint8), scale, x)

    return base.replace(mxfp4_gemv=gemv)


def _kda_decode_v_batch0(base: Cores) -> Cores:
    """kda_decode reading sequence 0's v for every sequence (v at head h instead of b*H + h): right at B = 1."""
    def decode(q, k, v, *args, **kw):
        v = np.asarray(v)
        return base.kda_decode(q, k, np.broadcast_to(v[:1], v.shape).copy(), *args, **kw)

    return base.replace(kda_decode=decode)


# split-KV of a fixed number of cache rows per split: every toy context (<= 700 rows) is one split
MLA_SPLIT_ROWS = 1024


def _mla_combine_drops_last_split(base: Cores) -> Cores:
    """mla_decode whose combine merges splits 0 .. n-2 of a sequence's n splits of MLA_SPLIT_ROWS rows: a sequence
    longer than one split attends to the rows before its last split only."""
    def decode(q_abs, kv_cache, block_table, seq_lens, **kw):
        lens = np.asarray(seq_lens)
        splits = -(-lens // MLA_SPLIT_ROWS)
        kept = np.where(splits > 1, (splits - 1) * MLA_SPLIT_ROWS, lens).astype(lens.dtype)
        return base.mla_decode(q_abs, kv_cache, block_table, kept, **kw)

    return base.replace(mla_decode=decode)


# steps of the cumulative decay a prefill keeps: every toy prefill (<= 257 tokens) is shorter
KDA_DECAY_STEPS = 1024


def _kda_prefill_decay_stops(base: Cores) -> Cores:
    """kda_prefill whose cumulative state decay is kept for KDA_DECAY_STEPS steps: from then on the state is not
    decayed (g = 0), as when a decay product over the whole sequence has underflowed and is guarded to 1."""
    def prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
        g = kda.kda_gate(g_raw, A_log, dt_bias, lower_bound)
        g[:, KDA_DECAY_STEPS:] = 0.0
        return kda.kda_chunked(q, k, v, g, ops.sigmoid(beta_raw), scale=scale, initial_state=state,
                               use_qk_l2norm=True)

    return base.replace(kda_prefill=prefill)


def _scaled_by_one_percent(core: str) -> Callable[[Cores], Cores]:
    """`core`'s floating outputs times (1 +- 1%), the sign drawn per element: 1% relative RMS error, about 3x
    what bf16 rounding costs a core (torch-bf16 measures 2e-3 .. 6e-3 on the tiny cases)."""
    def off(a):
        a = np.asarray(a)
        if a.dtype.kind != "f":
            return a
        sign = np.where(np.random.default_rng(a.size).random(a.shape) < 0.5, -1.0, 1.0)
        return (a * (1.0 + 0.01 * sign)).astype(a.dtype)

    def make(base: Cores) -> Cores:
        fn = getattr(base, core)

        def perturbed(*args, **kwargs):
            out = fn(*args, **kwargs)
            return tuple(off(o) for o in out) if isinstance(out, tuple) else off(out)

        return base.replace(**{core: perturbed})
    return make


def _attnres_boundary_off_by_one(base: Cores) -> Cores:
    return base.replace(attnres_hub=BoundaryOffByOneHub)


# A bf16 kernel one percent off must fail its block's cases and be named by the layer-by-layer trace.
BF16_MUTANT_CORES = ("rmsnorm", "situ_glu", "kda_decode", "mla_decode", "mxfp4_gemv", "attnres_mix")

# name -> Mutant, in the order `k3conf list mutants` shows them
MUTANTS: dict[str, Mutant] = {
    "kda-l2-eps-1e-12": Mutant("kda_decode", "KDA L2 norm with eps 1e-12 instead of 1e-6", _kda_l2_eps_1e12),
    "kda-no-lower-bound": Mutant("kda_decode", "KDA gate without the lower bound (Kimi Linear softplus form)",
                                 _kda_no_lower_bound),
    "mla-scale-128": Mutant("mla_decode", "MLA softmax scale 1/sqrt(128) instead of 1/sqrt(192)", _mla_scale_128),
    "router-bias-in-weights": Mutant("moe_route", "router bias also used for the routing weights",
                                     _router_bias_in_weights),
    "mxfp4-nibbles-swapped": Mutant("mxfp4_gemv", "MXFP4 element 2i read from the high nibble",
                                    _mxfp4_nibbles_swapped),
    **{f"bf16-{core.replace('_', '-')}-1pct": Mutant(
        core, f"torch-bf16 with the {core} output off by 1% relative (sign random per element)",
        _scaled_by_one_percent(core), base="torch-bf16") for core in BF16_MUTANT_CORES},
    "attnres-boundary-off-by-one": Mutant("attnres_mix",
                                          "AttnRes blocks close one layer late (at 0, then l % block_size == 1)",
                                          _attnres_boundary_off_by_one),
    "kda-decode-v-batch0": Mutant("kda_decode", "KDA decode reads sequence 0's v for every sequence",
                                  _kda_decode_v_batch0),
    "mla-combine-drops-last-split": Mutant(
        "mla_decode", f"MLA split-KV combine drops the last of a sequence's splits of {MLA_SPLIT_ROWS} rows",
        _mla_combine_drops_last_split, base="numpy32", shows_on="k3-tp8"),
    "kda-prefill-decay-stops": Mutant(
        "kda_prefill", f"KDA prefill stops decaying the state after {KDA_DECAY_STEPS} steps (decay underflow "
        "guarded to 1)", _kda_prefill_decay_stops, base="numpy32", shows_on="k3-tp8"),
    # the engine-shaped cores' layout mistakes (a slot off by one, a page size assumed, a scale applied twice)
    **{name: Mutant(*fields) for module in (mutants_kda, mutants_mla, mutants_moe)
       for name, fields in module.ENGINE_MUTANTS.items()},
    # what a fixed case table can miss: sizes past a threshold (the run's fuzz draws), stated contracts (their
    # tiny cases), a one-sided rounding (the bias rule)
    **{name: Mutant(*fields) for name, fields in mutants_space.SPACE_MUTANTS.items()},
}


def mutant_backend(name: str, mutant: Mutant, base: BackendBase) -> BackendBase:
    """The backend `name` ("mutant:<key>") that runs `mutant` on `base` (the backend called mutant.base)."""
    if mutant.base == "numpy64":
        return NumpyBackend(name, "fp64", lambda: mutant.make(reference_cores()))
    return MutantBackend(name, base, mutant.make)
