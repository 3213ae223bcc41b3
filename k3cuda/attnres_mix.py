"""attnres_mix: the Block AttnRes softmax mix over depth sources on the GPU (kernel k3cuda/kernels/attnres_mix.cu).

Same signature as k3ref.attnres.attnres_mix: (sources [S, ..., D], proj_w [D] or [1, D], norm_w [D], mix=1.0,
eps=1e-5) -> [..., D]; S <= 9 sources, fp32 math, one block per token.
"""
from __future__ import annotations

import math

import numpy as np

from k3ref.checks import as_float, check_shape, require
from k3ref.cores import require_supported

from . import runtime
from .spec import BenchCase, CheckCase, EntrySpec, KernelSpec, Traffic, register_budget

MAX_SOURCES = 9              # AR_MAX_S: K3 (93 layers, block size 12) has at most 8 completed blocks + the prefix
THREADS, MIN_BLOCKS = 256, 2
ENTRY = "attnres_mix_f32"
CHOOSABLE_ENTRIES: tuple[str, ...] = ()   # one entry: nothing for k3cuda.force_entry to choose
ARGS = ("sources", "proj_w", "norm_w", "out", "S", "T", "D", "mix", "eps")
ARG_FORMAT = "PPPPiiiff"
K3_HIDDEN = 7168

KERNEL = KernelSpec(
    block="attnres_mix",
    source="attnres_mix.cu",
    entries=(EntrySpec(ENTRY, ARG_FORMAT, THREADS, register_budget(THREADS, MIN_BLOCKS)),),
)


def check_inputs(sources, proj_w, norm_w, mix, eps):
    """Validate; return (V f32 [S, T, D], proj_w f32 [D], norm_w f32 [D], lead shape, mix, eps)."""
    V = as_float("sources", sources)
    require(V.ndim >= 2, f"sources: expected shape [S, ..., D], found {V.shape}")
    S, D = V.shape[0], V.shape[-1]
    require_supported(1 <= S <= MAX_SOURCES,
            f"sources: expected 1 <= S <= {MAX_SOURCES} depth sources (the kernel's limit), found S={S}")
    pw = as_float("proj_w", proj_w)
    require(pw.shape in ((D,), (1, D)), f"proj_w: expected shape [{D}] or [1, {D}], found {pw.shape}")
    nw = as_float("norm_w", norm_w)
    check_shape("norm_w", nw, (D,))
    require(isinstance(mix, (int, float, np.floating)) and math.isfinite(mix),
            f"mix: expected a finite float, found {mix!r}")
    require(isinstance(eps, (int, float, np.floating)) and math.isfinite(eps) and eps > 0,
            f"eps: expected a positive finite float, found {eps!r}")
    lead = V.shape[1:-1]
    T = int(np.prod(lead, dtype=np.int64))
    require(T < 2**31 and S * T * D < 2**62, f"sources: too many tokens for one grid, found shape {V.shape}")
    V3 = np.ascontiguousarray(V.reshape(S, T, D), np.float32)
    return (V3, np.ascontiguousarray(pw.reshape(D), np.float32), np.ascontiguousarray(nw, np.float32), lead,
            float(mix), float(eps))


def grid(T: int) -> tuple[int]:
    """One block per token."""
    return (T,)


def device_launch(inputs: dict) -> runtime.Launch:
    """Upload the sources and weights once; the Launch writes 'out' [T, D] float32 (poisoned with NaN here)."""
    V, pw, nw, _, mix, eps = check_inputs(inputs["sources"], inputs["proj_w"], inputs["norm_w"],
                                          inputs.get("mix", 1.0), inputs.get("eps", 1e-5))
    S, T, D = V.shape
    bufs = dict(sources=runtime.to_device(V), proj_w=runtime.to_device(pw), norm_w=runtime.to_device(nw),
                out=runtime.empty_poisoned((T, D)))
    if T == 0 or D == 0:
        return runtime.Launch(lambda: None, bufs, ("out",))
    scalars = dict(S=np.int32(S), T=np.int32(T), D=np.int32(D), mix=np.float32(mix), eps=np.float32(eps))
    args = tuple(runtime.ptr(bufs[n]) if n in bufs else scalars[n] for n in ARGS)
    return runtime.Launch(runtime.bind(KERNEL, ENTRY, grid(T), args), bufs, ("out",))


def attnres_mix(sources, proj_w, norm_w, mix=1.0, eps=1e-5):
    """Block AttnRes mix on the GPU; the k3ref.attnres.attnres_mix contract.

    sources V: [S, ..., D] (S <= 9); proj_w: [D] or [1, D]; norm_w: [D].
      logit_i = sum_d V_id / sqrt(mean(V_i^2) + eps) * norm_w_d * proj_w_d;  alpha = softmax_i(logit)
      out = (1 - mix) sum_i V_i + mix sum_i alpha_i V_i                    -> [..., D] float32
    """
    launch = device_launch(dict(sources=sources, proj_w=proj_w, norm_w=norm_w, mix=mix, eps=eps))  # validates first
    launch()
    out = launch.outputs()["out"]
    return out.reshape(*np.shape(sources)[1:-1], out.shape[-1])


def traffic(S: int, T: int, D: int) -> Traffic:
    """Bytes and FLOPs of one mix over S sources of T tokens x D."""
    nbytes = (
        S * T * D * 4        # sources read once (the kernel's second pass re-reads them, from L2 when it hits)
        + 2 * D * 4          # proj_w, norm_w
        + T * D * 4          # out written
    )
    flops = (
        T * D                # norm_w * proj_w (per token: the kernel recomputes it)
        + 2 * S * T * D      # sum V^2
        + 2 * S * T * D      # sum V * (norm_w proj_w)
        + 2 * S * T * D      # out = sum coef_i V_i
    )
    return Traffic(bytes=nbytes, flops=flops)


def make_inputs(rng: np.random.Generator, S: int, lead: tuple, D: int, mix: float = 1.0,
                amplitude: float = 1.0) -> dict:
    """Sources with different scales per depth (as the residual stream grows), weights near 1 and ~1/sqrt(D).

    amplitude scales every source (amplitude ~3e-3 puts mean(V^2) near eps = 1e-5, so eps matters)."""
    scales = np.float32(amplitude) * (np.float32(1.0) + rng.uniform(0.0, 4.0, size=(S,) + (1,) * (len(lead) + 1)))
    scales = scales.astype(np.float32)
    V = rng.standard_normal((S, *lead, D), dtype=np.float32) * scales
    return dict(sources=V,
                proj_w=(rng.standard_normal(D, dtype=np.float32) / np.float32(math.sqrt(D))),
                norm_w=(np.float32(1.0) + np.float32(0.1) * rng.standard_normal(D, dtype=np.float32)),
                mix=mix, eps=1e-5)


def bench_cases() -> list[BenchCase]:
    """K3 hidden 7168, S = 9 sources, T in {1, 64}. Report only: one block per token leaves an H200 at most 64
    of its 132 SMs busy here, so the copy-bandwidth ratio says how far v1 is from a split-D kernel."""
    return [BenchCase(label=f"S9-T{T}-D{K3_HIDDEN}",
                      make_inputs=lambda rng, T=T: make_inputs(rng, 9, (T,), K3_HIDDEN),
                      traffic=traffic(9, T, K3_HIDDEN), target_bw_ratio=None)
            for T in (1, 64)]


def check_cases() -> list[CheckCase]:
    """Small correctness cases: one source, S = 9, odd D (scalar path), two leading axes, mix 0 / 0.3, and
    sources so small that eps changes the logits."""
    return [
        CheckCase("S1-T1-D8", lambda rng: make_inputs(rng, 1, (1,), 8)),
        CheckCase("S9-T3-D7168", lambda rng: make_inputs(rng, 9, (3,), K3_HIDDEN)),
        CheckCase("S4-T5-D203-odd", lambda rng: make_inputs(rng, 4, (5,), 203)),
        CheckCase("S3-B2x3-D64-mix0.3", lambda rng: make_inputs(rng, 3, (2, 3), 64, mix=0.3)),
        CheckCase("S2-T4-D1028-mix0", lambda rng: make_inputs(rng, 2, (4,), 1028, mix=0.0)),
        CheckCase("S3-T2-D64-eps-sized", lambda rng: make_inputs(rng, 3, (2,), 64, amplitude=3e-3)),
    ]
