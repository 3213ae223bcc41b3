"""Conformance cases: what each golden holds, how it is generated, and how a backend is run on it.

A *case* is one golden file: a name `<block>/<id>` (e.g. `kda_decode/B2-H3-K16`), a config (`tiny` is
committed, `small` is generated into a cache), a seed, and the *kind* that knows how to build its data,
compute its float64 golden and run a backend on it. Kinds are registered in `KINDS` (`register_kind`);
the runner and the regeneration tool only talk to the `CaseKind` protocol, so adding model traces is
one more registered kind (docs/runner.md shows the API).

Kinds here:
- `core`: one core of `k3ref.cores.Cores` called on seeded arrays (`inputs.*`) and scalar kwargs; the
  backend's core is called with the same keyword arguments, inputs cast to its precision.
- `latent_moe`: the LatentMoE layer `k3ref.latent_moe.latent_moe_forward` over a small config, with its
  weights in the golden (`weights.*`), run on the backend's cores (router, MXFP4 GEMV, SiTU, RMSNorm).

The data is chosen to expose known bugs: a KDA head with tiny-norm q/k (the L2 eps decides its output),
gate pre-activations that saturate at the lower bound, a router bias that changes the selection while
keeping the k-th and (k+1)-th scores apart by more than bf16 rounding, random MXFP4 bytes (never nibble
symmetric), MLA pages in a shuffled order with unused slots and pages full of NaN, odd sizes everywhere.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Protocol

import ml_dtypes
import numpy as np

from k3ref.cache import paged_latent_cache
from k3ref.cores import Cores, reference_cores

GENERATOR_VERSION = "k3conf-cases/1"   # bump when the data or the way a golden is computed changes
CONFIGS = ("tiny", "small")
PLUGIN_MODULES = ("conformance.cases.traces",)   # kinds registered by other modules, imported when present
NOTES_KEY = "__notes__"   # evaluate() may return notes (a list of str) under this key, shown with the result
# evaluate() may return a dict under INFO_KEY: "kernels_ran" (the kernel cores that ran at least once; none:
# the cell is n/a), "tensor_notes" (tensor -> a line shown with its verdict), "flips" and "teacher_forced"
INFO_KEY = "__info__"
# A core case's kwarg naming the kernel entry it must exercise (case param `entry`): not passed to the core;
# the run is wrapped in k3cuda.force_entry(block, entry), which only the CUDA cores read.
ENTRY_KEY = "kernel_entry"


@dataclasses.dataclass(frozen=True)
class Case:
    """One golden: `name` = '<block>/<id>', the kind that handles it, its config, seed and parameters."""

    name: str
    kind: str
    config: str
    seed: int
    params: Mapping = dataclasses.field(default_factory=dict)

    @property
    def block(self) -> str:
        return self.name.split("/", 1)[0]


@dataclasses.dataclass
class Content:
    """What a kind generates for one case: tensors by full name and the scalar kwargs (JSON-able)."""

    tensors: dict[str, np.ndarray]
    kwargs: dict


class CaseKind(Protocol):
    """What the runner and the regeneration tool need from a kind of case."""

    name: str

    def cases(self, config: str) -> list[Case]:
        """Every case of this kind for `config` (deterministic order)."""

    def generate(self, case: Case) -> Content:
        """The float64 golden content: inputs (+ weights, inter) and outputs computed by k3ref."""

    def evaluate(self, case: Case, golden, backend) -> dict[str, np.ndarray]:
        """Run `backend` on the golden's inputs; return outputs by name (without the 'outputs.' prefix).

        May add NOTES_KEY: a list of lines the report shows with the result (e.g. cores that fell back)."""

    def block_of(self, case: Case, tensor: str) -> str:
        """The block a tensor belongs to (gate row and the name in a first-failure line)."""

    def timing(self, case: Case, golden, backend) -> tuple[float, int] | None:
        """(median seconds, bytes moved) of the backend on this case, or None when not timed."""

    def cores_of(self, case: Case) -> frozenset[str]:
        """The cores the case exercises: a backend supplying none of them itself gets "n/a (reference core)".
        Optional; a kind without it exercises every core. Also optional: is_gated(case, tensor) -> bool (False:
        reported, never failing) and gate_tensor(case, tensor) -> str (the name gate rows are looked up by)."""


KINDS: dict[str, CaseKind] = {}


def register_kind(kind: CaseKind) -> None:
    """Register a kind (replacing one of the same name); its cases join `all_cases`."""
    KINDS[kind.name] = kind


def load_plugins() -> None:
    """Import PLUGIN_MODULES (when present): they register kinds, gate rows and mutants at import time."""
    for mod in PLUGIN_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def all_cases(config: str = "tiny") -> list[Case]:
    """Every case of every registered kind for `config`, in registration order."""
    if config not in CONFIGS:
        raise ValueError(f"config: expected one of {CONFIGS}, found {config!r}")
    load_plugins()
    return [c for kind in KINDS.values() for c in kind.cases(config)]


def select(cases: list[Case], patterns: list[str] | None) -> list[Case]:
    """Cases whose name matches any glob in `patterns` (all when None/empty); a bare block name matches its cases."""
    if not patterns:
        return list(cases)
    pats = [p if any(ch in p for ch in "*?[/") else p + "/*" for p in patterns]
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in pats)]


def kind_of(case: Case) -> CaseKind:
    return KINDS[case.kind]


# --------------------------------------------------------------------------------------------------
# precision casts shared by the kinds


def cast(a: np.ndarray, precision: str) -> np.ndarray:
    """Float arrays to the backend precision (bf16: values rounded to bf16, held as float32); ints untouched."""
    a = np.asarray(a)
    if a.dtype.kind != "f":
        return a
    if precision == "fp64":
        return a.astype(np.float64)
    if precision == "fp32":
        return a.astype(np.float32)
    if precision == "bf16":
        return a.astype(ml_dtypes.bfloat16).astype(np.float32)
    raise ValueError(f"precision: expected fp64, fp32 or bf16, found {precision!r}")


# Checkpoint tensors K3 stores in F32 (DESIGN.md section 7): a bf16 backend receives them in fp32, not rounded.
F32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias", "o_norm.weight")


def cast_weights(weights: Mapping[str, np.ndarray], precision: str) -> dict[str, np.ndarray]:
    """Checkpoint weights (module-local or full names) to the backend precision; F32 tensors stay fp32 at bf16."""
    keep32 = "fp32" if precision == "bf16" else precision
    return {k: cast(v, keep32 if k.endswith(F32_SUFFIXES) else precision) for k, v in weights.items()}


def nbytes(arrays) -> int:
    return int(sum(np.asarray(a).nbytes for a in arrays))


# --------------------------------------------------------------------------------------------------
# the `core` kind: one core on seeded inputs


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
    return {n: np.asarray(v) for n, v in zip(outputs, vals)}


class CoreKind:
    """Cases that call one core directly. Case params are the keyword arguments of CoreSpec.make."""

    name = "core"

    def __init__(self, specs: Mapping[str, CoreSpec], table: Mapping[str, list[tuple[str, dict]]]):
        self.specs = dict(specs)      # block -> spec
        self.table = dict(table)      # config -> [(case name, params)]

    def cases(self, config: str) -> list[Case]:
        return [Case(name, self.name, config, _seed(name), params) for name, params in self.table.get(config, [])]

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
        keep = spec.fp32_inputs if p == "bf16" else ()
        return {k: cast(v, "fp32" if k in keep else p) for k, v in golden.group("inputs").items()}, golden.kwargs

    def evaluate(self, case: Case, golden, backend) -> dict[str, np.ndarray]:
        inputs, kwargs = self._inputs(golden, backend)
        return self._run(case, backend.cores(), inputs, kwargs)

    def block_of(self, case: Case, tensor: str) -> str:
        return case.block

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
    import k3cuda

    return k3cuda.force_entry(core, entry)


def _f64(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype.kind == "f" else a


def _seed(name: str) -> int:
    """A stable per-case seed from its name (no Python hash randomisation)."""
    return int.from_bytes(name.encode(), "little") % (2 ** 31 - 1)


def _inter(block: str, inputs: dict, kwargs: dict) -> dict[str, np.ndarray]:
    """Float64 intermediates worth keeping for `k3conf show` (not compared: cores do not return them)."""
    if block in ("kda_decode", "kda_prefill"):
        from k3ref import kda, ops

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


def _route_stable(logits, bias, kw) -> bool:
    """True when the selection survives bf16 rounding and +-0.005 noise on the logits (no near-ties)."""
    from k3ref.latent_moe import sigmoid_topk

    _, ref = sigmoid_topk(logits, bias, **kw)
    variants = [cast(logits, "bf16").astype(np.float64), cast(logits, "fp32").astype(np.float64)]
    noise = np.random.default_rng(0)
    variants += [logits + noise.uniform(-0.005, 0.005, logits.shape) for _ in range(4)]
    return all(np.array_equal(np.sort(sigmoid_topk(v, cast(bias, "bf16"), **kw)[1], -1), np.sort(ref, -1))
               for v in variants)


def _moe_route(rng, T, E, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
    from k3ref.latent_moe import sigmoid_topk

    kw = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, renormalize=renormalize, scaling=scaling)
    for _ in range(1000):
        logits = 1.5 * rng.standard_normal((T, E))
        bias = 0.2 * rng.standard_normal(E)
        # the bias must change the selection somewhere, or a bias bug would go unseen
        changed = not np.array_equal(sigmoid_topk(logits, bias, **kw)[1], sigmoid_topk(logits, 0 * bias, **kw)[1])
        if changed and _route_stable(logits, bias, kw):
            return {"logits": logits, "bias": bias}, kw
    raise RuntimeError(f"no stable routing found for T={T} E={E} k={top_k}")


def _route_canonical(out: dict) -> dict:
    """Sort each token's (index, weight) pairs by expert index: any top-k order is right."""
    order = np.argsort(out["indices"], axis=-1, kind="stable")
    return {"weights": np.take_along_axis(out["weights"], order, -1),
            "indices": np.take_along_axis(out["indices"], order, -1)}


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
    "moe_route": CoreSpec("moe_route", ("weights", "indices"), _moe_route, _route_canonical, ("logits", "bias")),
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


# --------------------------------------------------------------------------------------------------
# the `latent_moe` kind: the whole LatentMoE layer over a small config, weights in the golden


class LatentMoeKind:
    """`latent_moe/*`: latent_moe_forward(weights, x, cfg, cores) with the backend's cores."""

    name = "latent_moe"
    TABLE: dict[str, list[tuple[str, dict]]] = {
        "tiny": [
            ("latent_moe/T5-D67-E8-k2-L32-I32-S1", dict(T=5, cfg=dict(
                hidden_size=67, num_experts=8, top_k=2, latent_size=32, moe_intermediate_size=32,
                n_shared_experts=1, shared_intermediate_size=48))),
            ("latent_moe/T3-D48-E8-k2-G2-g1-norenorm", dict(T=3, cfg=dict(
                hidden_size=48, num_experts=8, top_k=2, latent_size=64, moe_intermediate_size=32,
                n_shared_experts=2, shared_intermediate_size=16, n_group=2, topk_group=1,
                renormalize=False, routed_scaling_factor=2.5))),
        ],
        "small": [
            ("latent_moe/T8-D512-E32-k4-L256-I256-S2", dict(T=8, cfg=dict(
                hidden_size=512, num_experts=32, top_k=4, latent_size=256, moe_intermediate_size=256,
                n_shared_experts=2, shared_intermediate_size=256))),
        ],
    }

    def cases(self, config: str) -> list[Case]:
        return [Case(n, self.name, config, _seed(n), p) for n, p in self.TABLE.get(config, [])]

    @staticmethod
    def _cfg(kwargs: Mapping):
        from k3ref.latent_moe import LatentMoeConfig

        return LatentMoeConfig(**kwargs)

    def generate(self, case: Case) -> Content:
        from k3ref.latent_moe import latent_moe_forward, random_moe_weights, sigmoid_topk

        cfg = self._cfg(case.params["cfg"])
        rng = np.random.default_rng(case.seed)
        kw = dict(top_k=cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                  renormalize=cfg.renormalize, scaling=cfg.routed_scaling_factor)
        for _ in range(1000):
            weights = random_moe_weights(cfg, rng, dtype=np.float64)
            weights["gate.e_score_correction_bias"] = weights["gate.e_score_correction_bias"].astype(np.float64)
            x = rng.standard_normal((case.params["T"], cfg.hidden_size))
            logits = x @ weights["gate.weight"].T
            if _route_stable(logits, weights["gate.e_score_correction_bias"], kw):
                break
        else:
            raise RuntimeError(f"{case.name}: no stable routing found")
        y = latent_moe_forward(weights, x, cfg)
        w, idx = _route_canonical(dict(zip(("weights", "indices"),
                                           sigmoid_topk(logits, weights["gate.e_score_correction_bias"], **kw)))).values()
        tensors = {"inputs.x": x, "outputs.y": y, "inter.route_weights": w, "inter.route_indices": idx}
        tensors.update({f"weights.{k}": v for k, v in weights.items()})
        return Content(tensors, dict(case.params["cfg"]))

    def evaluate(self, case: Case, golden, backend) -> dict[str, np.ndarray]:
        from k3ref.latent_moe import latent_moe_forward

        golden.require(["inputs.x", "outputs.y"])
        weights = cast_weights(golden.group("weights"), backend.precision)
        x = cast(golden.group("inputs")["x"], backend.precision)
        return {"y": np.asarray(latent_moe_forward(weights, x, self._cfg(golden.kwargs), cores=backend.cores()))}

    def block_of(self, case: Case, tensor: str) -> str:
        return case.block

    def cores_of(self, case: Case) -> frozenset[str]:
        return frozenset({"moe_route", "mxfp4_gemv", "situ_glu", "rmsnorm"})

    def timing(self, case: Case, golden, backend) -> tuple[float, int] | None:
        return None   # a composite of many cores: the cores are timed in their own cases


register_kind(CoreKind(CORE_SPECS, CORE_TABLE))
register_kind(LatentMoeKind())
