"""mxfp4_gemv: y = W x with W in the K3 MXFP4 layout on the GPU (kernel k3cuda/kernels/mxfp4_gemv.cu).

Same signature as k3ref.mxfp4.mxfp4_gemv: (packed u8 [N, K/2], scale u8 [N, K/32], x [..., K]) -> y [..., N].
The weights are dequantised on the fly (E2M1 codes, low nibble first; E8M0 scale per 32 elements); x goes as
float32 (bf16 and float64 x are converted on the host), accumulation is fp32. Float64 x gets a float64 result
(the fp32 result widened), as the core's contract says.
"""
from __future__ import annotations

import numpy as np

from k3ref.checks import as_float, check_shape, require

from . import runtime
from .spec import BenchCase, CheckCase, EntrySpec, KernelSpec, Traffic, register_budget

GROUP = 32                   # elements per E8M0 scale (one 16-byte load of packed codes)
THREADS, MIN_BLOCKS = 256, 3
ROWS_PER_WARP = 2            # MX_ROWS_PER_WARP
ROWS_PER_BLOCK = THREADS // 32 * ROWS_PER_WARP
VECTORS_PER_BLOCK = 4        # MX_VECTORS_PER_BLOCK: blockIdx.y walks T in steps of 4
ENTRY = "mxfp4_gemv_f32"
CHOOSABLE_ENTRIES: tuple[str, ...] = ()   # one entry: nothing for k3cuda.force_entry to choose
ARGS = ("packed", "scale", "x", "y", "N", "K", "T")
ARG_FORMAT = "PPPPiii"

KERNEL = KernelSpec(
    block="mxfp4_gemv",
    source="mxfp4_gemv.cu",
    entries=(EntrySpec(ENTRY, ARG_FORMAT, THREADS, register_budget(THREADS, MIN_BLOCKS)),),
)

# K3 routed expert shapes: (name, N out, K in)
K3_EXPERT = (("w1", 3072, 3584), ("w3", 3072, 3584), ("w2", 3584, 3072))


def check_inputs(packed, scale, x):
    """Validate (packed u8 [N, K/2], scale u8 [N, K/32], x [..., K]); return (packed, scale, x2d f32 [T, K], lead).

    lead is x's leading shape (y is lead + (N,)).
    """
    packed, scale = np.asarray(packed), np.asarray(scale)
    require(packed.dtype == np.uint8, f"packed: expected dtype uint8, found {packed.dtype}")
    require(scale.dtype == np.uint8, f"scale: expected dtype uint8, found {scale.dtype}")
    x = as_float("x", x)
    require(x.ndim >= 1, "x: expected shape [..., K], found a scalar")
    K = x.shape[-1]
    require(K % GROUP == 0 and K > 0, f"x: expected a last dim K that is a positive multiple of {GROUP}, found {K}")
    N = check_shape("packed", packed, (None, K // 2))[0]
    check_shape("scale", scale, (N, K // GROUP))
    lead = x.shape[:-1]
    T = int(np.prod(lead, dtype=np.int64))
    require(N < 2**31 and T * K < 2**31 and T * N < 2**31,
            f"mxfp4_gemv (CUDA): expected int32-indexable sizes, found N={N}, K={K}, T={T}")
    x2 = np.ascontiguousarray(x.reshape(T, K), np.float32)
    return np.ascontiguousarray(packed), np.ascontiguousarray(scale), x2, lead


def grid(N: int, T: int) -> tuple[int, int]:
    """(row blocks of 16, vector blocks of 4); the second is gridDim.y, at most 65535 (T <= 262140)."""
    ty = -(-T // VECTORS_PER_BLOCK)
    require(ty <= 65535, f"mxfp4_gemv (CUDA): expected T <= {65535 * VECTORS_PER_BLOCK} vectors (grid y), found {T}")
    return (-(-N // ROWS_PER_BLOCK), ty)


def device_launch(inputs: dict) -> runtime.Launch:
    """Upload packed, scale, x once; the Launch writes 'y' [T, N] float32 (poisoned with NaN here)."""
    packed, scale, x, _ = check_inputs(inputs["packed"], inputs["scale"], inputs["x"])
    N, T, K = packed.shape[0], x.shape[0], x.shape[1]
    bufs = dict(packed=runtime.to_device(packed, np.uint8), scale=runtime.to_device(scale, np.uint8),
                x=runtime.to_device(x), y=runtime.empty_poisoned((T, N)))
    if N == 0 or T == 0:
        return runtime.Launch(lambda: None, bufs, ("y",))
    scalars = dict(N=np.int32(N), K=np.int32(K), T=np.int32(T))
    args = tuple(runtime.ptr(bufs[n]) if n in bufs else scalars[n] for n in ARGS)
    return runtime.Launch(runtime.bind(KERNEL, ENTRY, grid(N, T), args), bufs, ("y",))


def mxfp4_gemv(packed, scale, x):
    """y = dequantize(packed, scale) x on the GPU; the k3ref.mxfp4.mxfp4_gemv contract.

    packed: u8 [N, K/2] (element 2i low nibble, 2i+1 high); scale: u8 [N, K/32] (2^(e-127), e=255 NaN);
    x: [..., K]. y[..., n] = sum_g 2^(e[n,g]-127) sum_{k in g} E2M1[code[n,k]] x[..., k]
    -> y [..., N] float32 (float64 for float64 x: the fp32 result widened).
    """
    x_dtype = np.asarray(x).dtype
    launch = device_launch(dict(packed=packed, scale=scale, x=x))   # validates (check_inputs) before any upload
    launch()
    y = launch.outputs()["y"].reshape(*np.shape(x)[:-1], np.shape(packed)[0])
    return y.astype(np.float64) if x_dtype == np.float64 else y


def traffic(N: int, K: int, T: int = 1) -> Traffic:
    """Bytes and FLOPs of y [T, N] = W [N, K] x [T, K] with W in MXFP4."""
    nbytes = (
        N * K // 2           # packed E2M1 codes, two per byte
        + N * K // GROUP     # E8M0 scales, one byte per 32 elements
        + T * K * 4          # x read (fp32)
        + T * N * 4          # y written (fp32)
    )
    flops = (
        2 * T * N * K        # multiply-add per weight and vector
        + T * N * K // GROUP # one scale multiply per group and vector
    )
    return Traffic(bytes=nbytes, flops=flops)


def make_inputs(rng: np.random.Generator, N: int, K: int, T: int | None = 1) -> dict:
    """Random codes (all 16, both signs), scales 2^-3 .. 2^2 (e = 124 .. 129), x ~ N(0, 1).

    T=None gives x [K] (one vector, no batch axis).
    """
    packed = rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8)
    scale = rng.integers(124, 130, size=(N, K // GROUP), dtype=np.uint8)
    x = rng.standard_normal((K,) if T is None else (T, K), dtype=np.float32)
    return dict(packed=packed, scale=scale, x=x)


def bench_cases() -> list[BenchCase]:
    """One K3 routed expert at T=1: w1 / w3 [3072, 3584 in], w2 [3584, 3072 in].

    Report only (no gate): 5.5 MB of weights stay in the 50 MB L2 across repeated timings, so the bytes/s
    measured this way is L2 speed, not DRAM speed.
    """
    return [BenchCase(label=f"{name}-N{N}-K{K}-T1",
                      make_inputs=lambda rng, N=N, K=K: make_inputs(rng, N, K, 1),
                      traffic=traffic(N, K, 1), target_bw_ratio=None)
            for name, N, K in K3_EXPERT[::2]]   # w1 and w2 (w3 has w1's shape)


def check_cases() -> list[CheckCase]:
    """Small correctness cases: one group, odd N (a half-filled warp pair and block), a vector without a batch
    axis, T = 5 and 9 (more than one block of 4 vectors), a NaN scale (e = 255) in one group, scales 2^-127..2^-125."""
    def with_nan_scale(rng):
        d = make_inputs(rng, 7, 64, 2)
        d["scale"][3, 1] = 255
        return d

    def with_subnormal_scales(rng):
        d = make_inputs(rng, 9, 64, 3)
        d["scale"] = rng.integers(0, 3, size=d["scale"].shape, dtype=np.uint8)  # e = 0: 2^-127, a subnormal
        return d

    return [
        CheckCase("N1-K32-T1", lambda rng: make_inputs(rng, 1, 32, 1)),
        CheckCase("N37-K96-vec", lambda rng: make_inputs(rng, 37, 96, None)),
        CheckCase("N129-K1088-T5", lambda rng: make_inputs(rng, 129, 1088, 5)),
        CheckCase("N64-K3584-T9", lambda rng: make_inputs(rng, 64, 3584, 9)),
        CheckCase("N7-K64-T2-nan-scale", with_nan_scale),
        CheckCase("N9-K64-T3-subnormal-scales", with_subnormal_scales),
    ]
