"""situ_glu: the SiTU-GLU nonlinearity on the GPU (kernel k3cuda/kernels/situ_glu.cu).

Same signature as k3ref.situ.situ_glu: (gate [..., I], up [..., I], beta=4.0, linear_beta=25.0) -> [..., I].
The host function packs gate and up into one [rows, 2I] buffer, the fused [gate | up] layout of the
checkpoints, and the kernel reads both halves through one row stride (ld = 2I); `fused=False` in
`device_launch` uploads them separately (ld = I) so both paths are tested.
"""
from __future__ import annotations

import numpy as np

from k3ref.checks import as_float, check_shape, require

from . import runtime
from .spec import BenchCase, CheckCase, EntrySpec, KernelSpec, Traffic, register_budget

THREADS = 256
PER_THREAD = 4
ENTRY = "situ_glu_f32"
CHOOSABLE_ENTRIES: tuple[str, ...] = ()   # one entry: nothing for k3cuda.force_entry to choose
KERNEL = KernelSpec(
    block="situ_glu",
    source="situ_glu.cu",
    entries=(EntrySpec(ENTRY, "PPPiiff", THREADS, register_budget(THREADS, 4)),),  # gate up h | I ld beta lbeta
)


def device_launch(inputs: dict, fused: bool = True) -> runtime.Launch:
    """Upload gate/up [..., I] once; the Launch writes 'h' [..., I] (poisoned with NaN here)."""
    gate, up = as_float("gate", inputs["gate"]), as_float("up", inputs["up"])
    require(gate.ndim >= 1, f"gate: expected [..., I], found shape {gate.shape}")
    check_shape("up", up, gate.shape)
    beta, linear_beta = float(inputs.get("beta", 4.0)), float(inputs.get("linear_beta", 25.0))
    require(beta > 0 and linear_beta > 0, f"beta, linear_beta: expected > 0, found {beta}, {linear_beta}")
    inter = gate.shape[-1]   # the intermediate width I
    rows = int(np.prod(gate.shape[:-1], dtype=np.int64))
    require(rows < 2**31 and 2 * inter < 2**31, f"gate: expected fewer than 2^31 rows and 2I, found shape {gate.shape}")
    require(inter <= 65535 * THREADS * PER_THREAD,   # grid y = ceil(I / 1024) is limited to 65535
            f"gate: expected I <= {65535 * THREADS * PER_THREAD} (grid y), found I={inter}")
    bufs = {"h": runtime.empty_poisoned(gate.shape)}
    if fused:
        gate_up = np.concatenate([gate.reshape(rows, inter), up.reshape(rows, inter)], axis=1)
        bufs["gate_up"] = runtime.to_device(gate_up)
        g_ptr, u_ptr, ld = runtime.ptr(bufs["gate_up"]), runtime.ptr(bufs["gate_up"]) + 4 * inter, 2 * inter
    else:
        bufs["gate"], bufs["up"] = runtime.to_device(gate), runtime.to_device(up)
        g_ptr, u_ptr, ld = runtime.ptr(bufs["gate"]), runtime.ptr(bufs["up"]), inter
    if rows == 0 or inter == 0:
        return runtime.Launch(lambda: None, bufs, ("h",))
    grid = (rows, -(-inter // (THREADS * PER_THREAD)), 1)
    args = (g_ptr, u_ptr, runtime.ptr(bufs["h"]), np.int32(inter), np.int32(ld), np.float32(beta),
            np.float32(linear_beta))
    return runtime.Launch(runtime.bind(KERNEL, ENTRY, grid, args), bufs, ("h",))


def situ_glu(gate, up, beta=4.0, linear_beta=25.0):
    """h = SiTU_beta(gate) * softcap_linear_beta(up), SiTU_b(g) = softcap_b(g) * sigma(g), softcap_c(z) =
    c tanh(z / c), on the GPU. gate, up: [..., I] -> h [..., I] float32 (exact expf/tanhf)."""
    launch = device_launch({"gate": gate, "up": up, "beta": beta, "linear_beta": linear_beta})
    launch()
    return launch.outputs()["h"]


def traffic(rows: int, inter: int) -> Traffic:
    """Bytes and FLOPs of the nonlinearity over [rows, inter] (inter: the intermediate width I)."""
    f32 = 4
    nbytes = (
        2 * rows * inter * f32   # gate and up read
        + rows * inter * f32     # h written
    )
    flops = rows * inter * 10    # two softcaps (div, tanh, mul), sigmoid (exp, add, div), two products
    return Traffic(bytes=nbytes, flops=flops)


def make_inputs(rng: np.random.Generator, shape: tuple, scale: float = 4.0) -> dict:
    """Random gate/up [*shape] with spread `scale` (gate) and 6 * scale (up), wide enough to reach both
    softcaps' bends, float32."""
    g = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    u = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale * 6)
    return {"gate": g, "up": u, "beta": 4.0, "linear_beta": 25.0}


def bench_cases() -> list[BenchCase]:
    """Decode-sized rows for the expert width and the dense layer-0 width (report only), one large gated case."""
    return [
        BenchCase("rows16-I3072", lambda rng: make_inputs(rng, (16, 3072)), traffic(16, 3072)),
        BenchCase("rows32-I33792", lambda rng: make_inputs(rng, (32, 33792)), traffic(32, 33792)),
        BenchCase("rows8192-I6144", lambda rng: make_inputs(rng, (8192, 6144)), traffic(8192, 6144), 0.6),
    ]


def check_cases() -> list[CheckCase]:
    """Odd widths (scalar path), a 3-D input, a single element, and non-default betas."""
    return [
        CheckCase("rows1-I3072", lambda rng: make_inputs(rng, (1, 3072))),
        CheckCase("rows5-I203", lambda rng: make_inputs(rng, (5, 203))),
        CheckCase("rows1-I1", lambda rng: make_inputs(rng, (1, 1))),
        CheckCase("2x3-I1028", lambda rng: make_inputs(rng, (2, 3, 1028))),
        CheckCase("rows9-I64-beta2-lb7", lambda rng: {**make_inputs(rng, (9, 64)), "beta": 2.0, "linear_beta": 7.0}),
    ]
