"""kda_decode: one decode token of the KDA recurrence on the GPU (kernel k3cuda/kernels/kda_decode.cu).

Same signature as k3ref.kda.kda_decode_core. The fp32 state lives in a device buffer that the kernel updates
in place; the host function uploads the state, launches, and returns (o, new_state) as NumPy float32.
The short conv + SiLU before it stay in the host graph (k3ref.kda), as in the core.
"""
from __future__ import annotations

import numpy as np

from k3ref.checks import as_float, check_shape, require
from k3ref.cores import require_supported
from k3ref.kda import check_lower_bound, query_scale  # the reference core's own checks: one rule for both

from . import runtime
from .forcing import forced_entry
from .spec import BenchCase, CheckCase, EntrySpec, KernelSpec, Traffic, register_budget

HEAD_DIM = 128                     # K = V the kernel is built for (KDA_K / KDA_V in the .cu)
THREADS = 256
ARG_FORMAT = "PPPPPPPPPiff"        # q k v g_raw beta_raw A_log dt_bias state o | H lower_bound scale
ENTRY_FULL, ENTRY_SPLIT = "kda_decode_f32", "kda_decode_f32_split4"
SPLIT = {ENTRY_FULL: 1, ENTRY_SPLIT: 4}   # blocks per (b, h): V / COLS
CHOOSABLE_ENTRIES = (ENTRY_FULL, ENTRY_SPLIT)   # pick_entry chooses; k3cuda.force_entry may override

KERNEL = KernelSpec(
    block="kda_decode",
    source="kda_decode.cu",
    entries=(
        EntrySpec(ENTRY_FULL, ARG_FORMAT, THREADS, register_budget(THREADS, 2)),
        EntrySpec(ENTRY_SPLIT, ARG_FORMAT, THREADS, register_budget(THREADS, 4)),
    ),
)


def _check_inputs(q, k, v, g_raw, beta_raw, A_log, dt_bias, state):
    """Validate shapes ([B,H,K] ... [B,H,K,V]) and return the arrays as float32 plus (B, H)."""
    q, k, v, g_raw = (as_float(n, a) for n, a in (("q", q), ("k", k), ("v", v), ("g_raw", g_raw)))
    B, H, K = check_shape("q", q, ("B", "H", "K"))
    check_shape("k", k, (B, H, K))
    V = check_shape("v", v, (B, H, None))[2]
    check_shape("g_raw", g_raw, (B, H, K))
    beta_raw = as_float("beta_raw", beta_raw)
    check_shape("beta_raw", beta_raw, (B, H))
    A_log, dt_bias, state = as_float("A_log", A_log), as_float("dt_bias", dt_bias), as_float("state", state)
    check_shape("A_log", A_log, (None,))
    require(A_log.shape[0] >= H, f"A_log: expected at least H={H} entries, found shape {A_log.shape}")
    check_shape("dt_bias", dt_bias, (H * K,))
    check_shape("state", state, (B, H, K, V))
    require(B <= 65535 and H <= 65535, f"q: expected B, H <= 65535 (grid z and y), found B={B}, H={H}")
    require_supported(K == HEAD_DIM and V == HEAD_DIM,
            f"kda_decode (CUDA): expected K = V = {HEAD_DIM}, found K={K}, V={V} "
            "(the kernel is built for K3's head_dim; use the k3ref core for other sizes)")
    f32 = [np.ascontiguousarray(a, np.float32) for a in (q, k, v, g_raw, beta_raw, A_log[:H], dt_bias, state)]
    return f32, B, H


def pick_entry(B: int, H: int) -> str:
    """The full-width entry when B*H blocks fill the GPU twice over, else the 4-way V split (or the entry
    k3cuda.force_entry set)."""
    forced = forced_entry(KERNEL.block)
    if forced:
        return forced
    return ENTRY_FULL if B * H >= 2 * runtime.multiprocessor_count() else ENTRY_SPLIT


def device_launch(inputs: dict, entry: str | None = None) -> runtime.Launch:
    """Upload the core's inputs once and return a Launch (data resident; the state buffer updated in place).

    inputs: the core's keyword arguments (q, k, v, g_raw, beta_raw, A_log, dt_bias, state, lower_bound, scale).
    Outputs: 'o' [B,H,V] (poisoned with NaN here) and 'state' [B,H,K,V].
    """
    arrays, B, H = _check_inputs(*(inputs[n] for n in ("q", "k", "v", "g_raw", "beta_raw", "A_log", "dt_bias",
                                                        "state")))
    lower_bound = check_lower_bound("lower_bound", inputs.get("lower_bound", -5.0))
    sc = query_scale(inputs.get("scale"), HEAD_DIM)
    lb = float("nan") if lower_bound is None else lower_bound   # NaN selects the softplus gate in the kernel
    names = ("q", "k", "v", "g_raw", "beta_raw", "A_log", "dt_bias", "state")
    bufs = {n: runtime.to_device(a) for n, a in zip(names, arrays, strict=True)}
    bufs["o"] = runtime.empty_poisoned((B, H, HEAD_DIM))
    entry = entry or pick_entry(B, H)
    args = tuple(runtime.ptr(bufs[n]) for n in (*names, "o")) + (np.int32(H), np.float32(lb), np.float32(sc))
    run = runtime.bind(KERNEL, entry, (SPLIT[entry], H, B), args)
    return runtime.Launch(run, bufs, ("o", "state"))


def kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
    """One KDA decode token on the GPU; the k3ref.kda.kda_decode_core contract.

    q, k, g_raw: [B, H, K]; v: [B, H, V]; beta_raw: [B, H]; A_log: [H] (or longer, first H used);
    dt_bias: [H*K]; state: [B, H, K, V]; K = V = 128.
      g = lower_bound * sigma(exp(A_log) * (g_raw + dt_bias))   (lower_bound None: -exp(A_log) softplus(...))
      q^ = L2(q) * scale (default K^-1/2), k^ = L2(k) (eps 1e-6 inside the sqrt), beta = sigma(beta_raw)
      S <- Diag(exp g) S;  S <- S + beta k^ (v - S^T k^)^T;  o = S^T q^
    Returns (o [B, H, V], new_state [B, H, K, V]), float32.
    """
    launch = device_launch(dict(q=q, k=k, v=v, g_raw=g_raw, beta_raw=beta_raw, A_log=A_log, dt_bias=dt_bias,
                                state=state, lower_bound=lower_bound, scale=scale))
    launch()
    out = launch.outputs()
    return out["o"], out["state"]


def traffic(B: int, H: int, K: int = HEAD_DIM, V: int = HEAD_DIM) -> Traffic:
    """The fewest bytes one decode step must move, and its FLOPs."""
    f32 = 4
    nbytes = (
        2 * B * H * K * V * f32    # state read + written in place (the dominant term)
        + 3 * B * H * K * f32      # q, k, g_raw
        + B * H * V * f32          # v
        + B * H * f32              # beta_raw
        + H * f32 + H * K * f32    # A_log, dt_bias
        + B * H * V * f32          # o written
    )
    flops = (
        B * H * K * V              # decay: S *= exp(g)
        + 2 * B * H * K * V        # u = S^T k^
        + 2 * B * H * K * V        # S += k^ (beta (v - u))^T
        + 2 * B * H * K * V        # o = S^T q^
        + 8 * B * H * K            # gate, norms (per element, a few ops each)
    )
    return Traffic(bytes=nbytes, flops=flops)


def make_inputs(rng: np.random.Generator, B: int, H: int, lower_bound=-5.0) -> dict:
    """Random core inputs for B sequences x H heads (K = V = 128), float32, never zeros."""
    K = V = HEAD_DIM

    def normal(*shape, s=1.0):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(s))

    return dict(
        q=normal(B, H, K), k=normal(B, H, K), v=normal(B, H, V), g_raw=normal(B, H, K),
        beta_raw=normal(B, H), A_log=np.log(rng.uniform(1.0, 16.0, H)).astype(np.float32),
        dt_bias=normal(H * K, s=0.5), state=normal(B, H, K, V, s=0.1), lower_bound=lower_bound, scale=None,
    )


# The state is updated in place, so repeated timed launches keep it in L2 when it fits there (an H200 has 60 MB):
# the bandwidth gate applies only from this state size up, where the measurement is of HBM.
GATE_MIN_STATE_BYTES = 64 << 20


def bench_cases() -> list[BenchCase]:
    """B in {1, 32, 128} x H in {96, 12}; the state bandwidth gate (0.6 of copy) applies to the states of
    >= 64 MiB (B32-H96, B128-H96, B128-H12); B32-H12's 24 MiB state stays in L2 between launches (report only)."""
    cases = []
    for B in (1, 32, 128):
        for H in (96, 12):
            state_bytes = B * H * HEAD_DIM * HEAD_DIM * 4
            cases.append(BenchCase(
                label=f"B{B}-H{H}",
                make_inputs=lambda rng, B=B, H=H: make_inputs(rng, B, H),
                traffic=traffic(B, H),
                target_bw_ratio=0.6 if state_bytes >= GATE_MIN_STATE_BYTES else None,
            ))
    return cases


def check_cases() -> list[CheckCase]:
    """Small correctness cases: one head, odd B and H, and the Kimi Linear (no lower bound) gate."""
    return [
        CheckCase("B1-H1", lambda rng: make_inputs(rng, 1, 1)),
        CheckCase("B3-H5", lambda rng: make_inputs(rng, 3, 5)),
        CheckCase("B2-H7-softplus", lambda rng: make_inputs(rng, 2, 7, lower_bound=None)),
        CheckCase("B5-H67", lambda rng: make_inputs(rng, 5, 67)),  # B*H = 335: the full-width entry on an H200
    ]
