"""rmsnorm: RMSNorm over the last axis on the GPU (kernel k3cuda/kernels/rmsnorm.cu).

Same signature as k3ref.ops.rmsnorm: (x [..., D], w [D], eps) -> [..., D]; computes in float32.
"""
from __future__ import annotations

import numpy as np

from k3ref.checks import as_float, check_shape, require

from . import runtime
from .spec import BenchCase, CheckCase, EntrySpec, KernelSpec, Traffic, register_budget

THREADS = 256
ENTRY = "rmsnorm_f32"
CHOOSABLE_ENTRIES: tuple[str, ...] = ()   # one entry: nothing for k3cuda.force_entry to choose
KERNEL = KernelSpec(
    block="rmsnorm",
    source="rmsnorm.cu",
    entries=(EntrySpec(ENTRY, "PPPif", THREADS, register_budget(THREADS, 4)),),  # x w y | D eps
)


def device_launch(inputs: dict) -> runtime.Launch:
    """Upload x [..., D] and w [D] once; the Launch writes 'y' [..., D] (poisoned with NaN here)."""
    x = as_float("x", inputs["x"])
    require(x.ndim >= 1, f"x: expected [..., D], found shape {x.shape}")
    D = x.shape[-1]
    w = as_float("w", inputs["w"])
    check_shape("w", w, (D,))
    eps = float(inputs.get("eps", 1e-5))
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    require(rows < 2**31 and D < 2**31, f"x: expected fewer than 2^31 rows and columns, found shape {x.shape}")
    bufs = {"x": runtime.to_device(x), "w": runtime.to_device(w), "y": runtime.empty_poisoned(x.shape)}
    if rows == 0 or D == 0:
        return runtime.Launch(lambda: None, bufs, ("y",))
    args = (runtime.ptr(bufs["x"]), runtime.ptr(bufs["w"]), runtime.ptr(bufs["y"]), np.int32(D), np.float32(eps))
    return runtime.Launch(runtime.bind(KERNEL, ENTRY, (rows, 1, 1), args), bufs, ("y",))


def rmsnorm(x, w, eps):
    """RMSNorm_eps(x; w) = w * x / sqrt(mean(x^2) + eps) over the last axis, on the GPU.

    x: [..., D]; w: [D] -> [..., D] float32 (sum of squares accumulated in fp32, exact sqrtf).
    """
    launch = device_launch({"x": x, "w": w, "eps": eps})
    launch()
    return launch.outputs()["y"]


def traffic(rows: int, D: int) -> Traffic:
    """Bytes and FLOPs of one RMSNorm over [rows, D]."""
    f32 = 4
    nbytes = (
        rows * D * f32     # x read (once; the kernel's second pass should hit L1)
        + D * f32          # w read
        + rows * D * f32   # y written
    )
    flops = rows * D * 2 + rows * D * 2   # x^2 and sum; x * inv * w
    return Traffic(bytes=nbytes, flops=flops)


def make_inputs(rng: np.random.Generator, shape: tuple, eps: float = 1e-5) -> dict:
    """Random x [*shape] (N(0, 1) + 0.5 offset) and w [shape[-1]] (around 1), float32."""
    x = rng.standard_normal(shape, dtype=np.float32) + np.float32(0.5)
    w = (1.0 + 0.1 * rng.standard_normal(shape[-1])).astype(np.float32)
    return {"x": x, "w": w, "eps": eps}


def bench_cases() -> list[BenchCase]:
    """Decode-sized rows at K3's widths (report only), and one large memory-bound case (gated)."""
    return [
        BenchCase("rows32-D7168", lambda rng: make_inputs(rng, (32, 7168)), traffic(32, 7168)),
        BenchCase("rows128-D1536", lambda rng: make_inputs(rng, (128, 1536), 1e-6), traffic(128, 1536)),
        BenchCase("rows16384-D7168", lambda rng: make_inputs(rng, (16384, 7168)), traffic(16384, 7168), 0.6),
    ]


def check_cases() -> list[CheckCase]:
    """Odd sizes: scalar path (D % 4 != 0), a single row, a 3-D input, K3's hidden and the MLA norm widths."""
    return [
        CheckCase("rows1-D7168", lambda rng: make_inputs(rng, (1, 7168))),
        CheckCase("rows7-D113", lambda rng: make_inputs(rng, (7, 113))),
        CheckCase("3x5-D512-eps1e-6", lambda rng: make_inputs(rng, (3, 5, 512), 1e-6)),
        CheckCase("rows203-D1536", lambda rng: make_inputs(rng, (203, 1536), 1e-6)),
        CheckCase("D1", lambda rng: make_inputs(rng, (4, 1))),
    ]
