"""The `core` kind: one core of `k3ref.cores.Cores` called on seeded arrays and scalar kwargs.

A core case's golden holds the arrays (`inputs.*`), the core's float64 outputs (`outputs.*`) and, for KDA, a few
float64 intermediates for `k3conf show` (`inter.*`); the backend's core is called with the same keyword
arguments, inputs cast to its precision (conformance.cases.inputs).

The data is chosen to expose known bugs: a KDA head with tiny-norm q/k (the L2 eps decides its output),
gate pre-activations that saturate at the lower bound, a router bias that changes the selection while
keeping the k-th and (k+1)-th scores apart by more than bf16 rounding, random MXFP4 bytes (never nibble
symmetric), MLA pages in a shuffled order with unused slots and pages full of NaN, odd sizes everywhere.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

import k3cuda
from conformance.cases.inputs import cast, fp32_kept, nbytes
from conformance.cases.protocol import Case, Content, Evaluation, KindBase, case_seed
from conformance.cases.routes import route_canonical, route_stable
from k3ref import kda, ops
from k3ref.cache import paged_latent_cache
from k3ref.cores import Cores, reference_cores
from k3ref.latent_moe import sigmoid_topk

# A core case's kwarg naming the kernel entry it must exercise (case param `entry`): not passed to the core;
# the run is wrapped in k3cuda.force_entry(block, entry), which only the CUDA cores read.
ENTRY_KEY = "kernel_entry"

@dataclasses.dataclass(frozen=True)
class CoreSpec:
    """How to build and read one core's cases.

    make(rng, **params) -> (inputs: name -> float64/int array, kwargs: name -> scalar); the core is called
    as core(**inputs, **kwargs). outputs: the names of the core's return values, in order.
    canonical(outputs) -> outputs: an order-free normal form (router: each row sorted by expert index).
    fp32_inputs: inputs that K3 keeps in fp32 (F32 checkpoint tensors, the fp32 KDA state, the fp32 router
    logits); a bf16 backend receives them in fp32, not rounded to bf16.
    """

    core: str
    outputs: tuple[str, ...]
    make: Callable[..., tuple[dict, dict]]
    canonical: Callable[[dict], dict] | None = None
    fp32_inputs: tuple[str, ...] = ()


def _named(outputs: tuple[str, ...], result) -> dict[str, np.ndarray]:
    vals = result if isinstance(result, tuple) else (result,)
    if len(vals) != len(outputs):
        raise ValueError(f"core returned {len(vals)} value(s), expected {len(outputs)} ({', '.join(outputs)})")
    return {n: np.asarray(v) for n, v in zip(outputs, vals, strict=True)}


class CoreKind(KindBase):
    """Cases that call one core directly. Case params are the keyword arguments of CoreSpec.make."""

    name = "core"

    def __init__(self, specs: Mapping[str, CoreSpec], table: Mapping[str, list[tuple[str, dict]]]):
        self.specs = dict(specs)      # block -> spec
        self.table = dict(table)      # config -> [(case name, params)]

    def cases(self, config: str) -> list[Case]:
        return [Case(name, self.name, config, case_seed(name), params) for name, params in self.table.get(config, [])]

    def _run(self, case: Case, cores: Cores, inputs: dict, kwargs: dict) -> dict[str, np.ndarray]:
        spec = self.specs[case.block]
        kwargs = dict(kwargs)
        with _forced_entry(spec.core, kwargs.pop(ENTRY_KEY, None)):
            out = _named(spec.outputs, getattr(cores, spec.core)(**inputs, **kwargs))
        return spec.canonical(out) if spec.canonical else out

    def generate(self, case: Case) -> Content:
        spec = self.specs[case.block]
        params = dict(case.params)
        entry = params.pop("entry", None)
        inputs, kwargs = spec.make(np.random.default_rng(case.seed), **params)
        if entry is not None:
            kwargs[ENTRY_KEY] = entry
        outputs = self._run(case, reference_cores(), inputs, kwargs)
        tensors = {f"inputs.{k}": v for k, v in inputs.items()}
        tensors.update({f"outputs.{k}": _f64(v) for k, v in outputs.items()})
        tensors.update({f"inter.{k}": v for k, v in _inter(case.block, inputs, kwargs).items()})
        return Content(tensors, kwargs)

    def _inputs(self, golden, backend) -> tuple[dict, dict]:
        spec = self.specs[golden.block]
        # a golden missing an argument of the core is a broken golden (file + regen command), not a TypeError
        params = inspect.signature(getattr(reference_cores(), spec.core)).parameters.values()
        needed = [p.name for p in params if p.default is p.empty and p.name not in golden.kwargs
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        golden.require([f"inputs.{n}" for n in needed] + [f"outputs.{o}" for o in spec.outputs])
        p = backend.precision
        return ({k: cast(v, fp32_kept(p) if k in spec.fp32_inputs else p) for k, v in golden.group("inputs").items()},
                golden.kwargs)

    def evaluate(self, case: Case, golden, backend) -> Evaluation:
        inputs, kwargs = self._inputs(golden, backend)
        return Evaluation(self._run(case, backend.cores(), inputs, kwargs))

    def cores_of(self, case: Case) -> frozenset[str]:
        return frozenset({self.specs[case.block].core})

    def timing(self, case: Case, golden, backend) -> tuple[float, int] | None:
        inputs, kwargs = self._inputs(golden, backend)
        kwargs = dict(kwargs)
        core = self.specs[case.block].core
        with _forced_entry(core, kwargs.pop(ENTRY_KEY, None)):
            seconds = backend.time_core(core, {**inputs, **kwargs})
        if seconds is None:
            return None
        outs = [cast(v, backend.precision) for v in golden.group("outputs").values()]
        # bytes moved: every input read once + every output written once (a lower bound for any kernel)
        return seconds, nbytes(inputs.values()) + nbytes(outs)


def _forced_entry(core: str, entry: str | None):
    """k3cuda.force_entry(core, entry) when a case names an entry, else a no-op context."""
    if entry is None:
        return contextlib.nullcontext()
    return k3cuda.force_entry(core, entry)


def _f64(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype.kind == "f" else a


def _inter(block: str, inputs: dict, kwargs: dict) -> dict[str, np.ndarray]:
    """Float64 intermediates worth keeping for `k3conf show` (not compared: cores do not return them)."""
    if block in ("kda_decode", "kda_prefill"):
        return {
            "g": kda.kda_gate(inputs["g_raw"], inputs["A_log"], inputs["dt_bias"], kwargs["lower_bound"]),
            "beta": ops.sigmoid(inputs["beta_raw"]),
        }
    return {}


# ---- data builders (float64, seeded). Each returns (inputs, kwargs).


def _rmsnorm(rng, T, D, eps):
    x = rng.standard_normal((T, D)) * 10.0 ** rng.uniform(-1, 1, (T, 1))
    x[0] *= 1e-3          # a row whose mean square is ~1e-6: the eps is not negligible there
    return {"x": x, "w": 1.0 + 0.1 * rng.standard_normal(D)}, {"eps": eps}


def _situ_glu(rng, shape, beta=4.0, linear_beta=25.0):
    # gate spread ~3 reaches the SiTU softcap (4); up spread ~20 reaches the linear softcap (25)
    return {"gate": 3.0 * rng.standard_normal(shape), "up": 20.0 * rng.standard_normal(shape)}, \
        {"beta": beta, "linear_beta": linear_beta}


def _kda_arrays(rng, lead: tuple, H: int, K: int, V: int):
    """q, k, v, g_raw, beta_raw with axes lead + (H, ...): one tiny-norm head, saturated gates."""
    q = rng.standard_normal(lead + (H, K))
    k = rng.standard_normal(lead + (H, K))
    q[..., H - 1, :] *= 1e-5      # sum(q^2) ~ K * 1e-10 << eps 1e-6: L2 gives ~q/1e-3, not a unit vector
    k[..., H - 1, :] *= 1e-5
    v = rng.standard_normal(lead + (H, V))
    g_raw = 2.0 * rng.standard_normal(lead + (H, K))
    g_raw[..., 0, : K // 2] = 12.0   # sigma(exp(A) * (12 + dt)) ~ 1: g sits at the lower bound
    beta_raw = rng.standard_normal(lead + (H,))
    return q, k, v, g_raw, beta_raw


def _kda_common(rng, B, H, K, V, lower_bound):
    A_log = np.log(rng.uniform(1.0, 16.0, H))
    dt_bias = 0.5 * rng.standard_normal(H * K)
    state = 0.5 * rng.standard_normal((B, H, K, V))
    return {"A_log": A_log, "dt_bias": dt_bias, "state": state}, {"lower_bound": lower_bound, "scale": None}


def _kda_decode(rng, B, H, K, V, lower_bound=-5.0):
    q, k, v, g_raw, beta_raw = _kda_arrays(rng, (B,), H, K, V)
    common, kwargs = _kda_common(rng, B, H, K, V, lower_bound)
    return {"q": q, "k": k, "v": v, "g_raw": g_raw, "beta_raw": beta_raw, **common}, kwargs


def _kda_prefill(rng, B, T, H, K, V, lower_bound=-5.0):
    q, k, v, g_raw, beta_raw = _kda_arrays(rng, (B, T), H, K, V)
    common, kwargs = _kda_common(rng, B, H, K, V, lower_bound)
    return {"q": q, "k": k, "v": v, "g_raw": g_raw, "beta_raw": beta_raw, **common}, kwargs


def _mla_decode(rng, H, R, P, seq_lens, page=64, qk_head=192, bf16_cache=False):
    """Pages of each sequence in a shuffled order; unused slots and one spare page hold NaN (never read).
    bf16_cache: the cache holds bf16 values (K3's cache dtype), so the bf16 entry computes the same math."""
    B, W = len(seq_lens), R + P
    cache, table = paged_latent_cache(rng, seq_lens, W, page)   # one spare page, one unused block-table column
    if bf16_cache:
        cache = cache.astype(ml_dtypes.bfloat16).astype(np.float64)
    q_abs = 3.0 * rng.standard_normal((B, H, W))   # peaked softmax: scores ~ 3 sqrt(W) / sqrt(192)
    return ({"q_abs": q_abs, "kv_cache": cache, "block_table": table, "seq_lens": np.asarray(seq_lens, np.int32)},
            {"scale": qk_head ** -0.5, "kv_rank": R})


def _mxfp4_gemv(rng, N, K, lead=()):
    packed = rng.integers(0, 256, (N, K // 2), dtype=np.uint8)
    packed[0, 0] = 0x71   # codes 1 (0.5) and 7 (6.0): a nibble swap changes this row for certain
    scale = rng.integers(122, 131, (N, K // 32), dtype=np.uint8)    # 2^-5 .. 2^3, never 255 (NaN)
    return {"packed": packed, "scale": scale, "x": rng.standard_normal(tuple(lead) + (K,))}, {}


def _moe_route(rng, T, E, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, renormalize=renormalize, scaling=scaling)
    for _ in range(1000):
        logits = 1.5 * rng.standard_normal((T, E))
        bias = 0.2 * rng.standard_normal(E)
        # the bias must change the selection somewhere, or a bias bug would go unseen
        changed = not np.array_equal(sigmoid_topk(logits, bias, **kw)[1], sigmoid_topk(logits, 0 * bias, **kw)[1])
        if changed and route_stable(logits, bias, kw):
            return {"logits": logits, "bias": bias}, kw
    raise RuntimeError(f"no stable routing found for T={T} E={E} k={top_k}")


def _attnres_mix(rng, S, lead, D, mix=1.0, eps=1e-5):
    scales = 10.0 ** rng.uniform(-1, 1, (S,) + (1,) * (len(lead) + 1))   # sources of very different size
    return ({"sources": scales * rng.standard_normal((S,) + tuple(lead) + (D,)),
             "proj_w": 0.5 * rng.standard_normal(D), "norm_w": 1.0 + 0.1 * rng.standard_normal(D)},
            {"mix": mix, "eps": eps})


_KDA_FP32 = ("A_log", "dt_bias", "state")  # F32 in the checkpoint; the recurrent state is fp32

CORE_SPECS: dict[str, CoreSpec] = {
    "rmsnorm": CoreSpec("rmsnorm", ("y",), _rmsnorm),
    "situ_glu": CoreSpec("situ_glu", ("h",), _situ_glu),
    "kda_decode": CoreSpec("kda_decode", ("o", "state"), _kda_decode, fp32_inputs=_KDA_FP32),
    "kda_prefill": CoreSpec("kda_prefill", ("o", "state"), _kda_prefill, fp32_inputs=_KDA_FP32),
    "mla_decode": CoreSpec("mla_decode", ("o_lat",), _mla_decode),
    "mxfp4_gemv": CoreSpec("mxfp4_gemv", ("y",), _mxfp4_gemv),
    "moe_route": CoreSpec("moe_route", ("weights", "indices"), _moe_route, route_canonical, ("logits", "bias")),
    "attnres_mix": CoreSpec("attnres_mix", ("out",), _attnres_mix),
}

# config -> [(case name, builder params)]. Odd sizes on purpose (113, 203, 239, 1), B=1, H=1, T=1/63/65,
# MLA contexts of 1, exactly one page (64), one past a page (65) and several pages.
CORE_TABLE: dict[str, list[tuple[str, dict]]] = {
    "tiny": [
        ("rmsnorm/T1-D113", dict(T=1, D=113, eps=1e-5)),
        ("rmsnorm/T7-D203", dict(T=7, D=203, eps=1e-5)),
        ("rmsnorm/T3-D239-eps1e-6", dict(T=3, D=239, eps=1e-6)),
        ("situ_glu/T1-I113", dict(shape=(1, 113))),
        ("situ_glu/T5-I203", dict(shape=(5, 203))),
        ("situ_glu/I239", dict(shape=(239,))),
        ("kda_decode/B2-H3-K16", dict(B=2, H=3, K=16, V=16)),
        ("kda_decode/B1-H1-K128", dict(B=1, H=1, K=128, V=128)),
        ("kda_decode/B3-H2-K32-V16", dict(B=3, H=2, K=32, V=16)),
        ("kda_decode/B2-H2-K16-nolb", dict(B=2, H=2, K=16, V=16, lower_bound=None)),
        ("kda_prefill/B1-T1-H1-K16", dict(B=1, T=1, H=1, K=16, V=16)),
        ("kda_prefill/B2-T63-H2-K16", dict(B=2, T=63, H=2, K=16, V=16)),
        ("kda_prefill/B1-T65-H3-K32", dict(B=1, T=65, H=3, K=32, V=32)),
        ("mla_decode/B2-H3-R32-P16-L65-1", dict(H=3, R=32, P=16, seq_lens=(65, 1))),
        ("mla_decode/B3-H1-R64-P16-L64-113-203", dict(H=1, R=64, P=16, seq_lens=(64, 113, 203))),
        ("mla_decode/B1-H2-R512-P64-L70", dict(H=2, R=512, P=64, seq_lens=(70,))),
        ("mxfp4_gemv/N113-K64", dict(N=113, K=64)),
        ("mxfp4_gemv/N1-K32", dict(N=1, K=32)),
        ("mxfp4_gemv/M3-N203-K96", dict(N=203, K=96, lead=(3,))),
        ("moe_route/T5-E16-k4", dict(T=5, E=16, top_k=4)),
        ("moe_route/T1-E8-k2", dict(T=1, E=8, top_k=2)),
        ("moe_route/T7-E32-k4-G4-g2", dict(T=7, E=32, top_k=4, n_group=4, topk_group=2)),
        ("moe_route/T3-E13-k1-norenorm-s2.5", dict(T=3, E=13, top_k=1, renormalize=False, scaling=2.5)),
        ("attnres_mix/S3-T5-D113", dict(S=3, lead=(5,), D=113)),
        ("attnres_mix/S1-T1-D64", dict(S=1, lead=(1,), D=64)),
        ("attnres_mix/S13-T2-D203-mix0.5", dict(S=13, lead=(2,), D=203, mix=0.5)),
        # K3's per-head geometry (the k3geom traces run the same widths inside the model): every entry of every
        # kernel. kda_decode's full-width entry is picked only for B*H >= 2 x the SM count, so it is forced
        # (with the softplus gate, the Kimi Linear form); B1-H1-K128 above takes the 4-way V split. MLA: the
        # bf16 cache entry (K3's cache dtype) with 17 heads (two head groups of 16) and two splits, the
        # second one row long; B1-H2-R512-P64-L70 above takes the fp32 entry over three splits.
        ("kda_decode/B1-H2-K128-nolb-full", dict(B=1, H=2, K=128, V=128, lower_bound=None,
                                                 entry="kda_decode_f32")),
        ("mla_decode/B1-H17-R512-P64-L33-bf16", dict(H=17, R=512, P=64, seq_lens=(33,), bf16_cache=True,
                                                     entry="mla_decode_split_bf16")),
        ("rmsnorm/T3-D512-eps1e-6", dict(T=3, D=512, eps=1e-6)),     # MLA kv_a norm width
        ("rmsnorm/T4-D128", dict(T=4, D=128, eps=1e-5)),               # KDA o_norm: one row per head
        ("attnres_mix/S9-T2-D256", dict(S=9, lead=(2,), D=256)),      # the kernel's most sources (K3: 8 + 1)
    ],
    "small": [
        ("rmsnorm/T16-D1024", dict(T=16, D=1024, eps=1e-5)),
        ("situ_glu/T16-I1536", dict(shape=(16, 1536))),
        ("kda_decode/B4-H8-K128", dict(B=4, H=8, K=128, V=128)),
        ("kda_prefill/B1-T257-H4-K128", dict(B=1, T=257, H=4, K=128, V=128)),
        ("mla_decode/B4-H8-R512-P64-L1-64-65-700", dict(H=8, R=512, P=64, seq_lens=(1, 64, 65, 700))),
        ("mxfp4_gemv/M4-N1024-K1536", dict(N=1024, K=1536, lead=(4,))),
        ("moe_route/T32-E128-k8", dict(T=32, E=128, top_k=8)),
        ("attnres_mix/S9-T16-D1024", dict(S=9, lead=(16,), D=1024)),
    ],
}

