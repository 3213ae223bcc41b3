"""flash-linear-attention (fla-core) KDA kernels as the `kda_prefill` and `kda_decode` cores.

K3's KDA core (docs/interfaces.md) and fla's kernels share the layout (q, k [B, T, H, K], v [B, T, H, V],
state [B, H, K, V] in fp32) and, with these options, the math:

| K3 core step                                            | fla argument                                      |
|---------------------------------------------------------|---------------------------------------------------|
| q^ = L2(q) * scale, k^ = L2(k), eps 1e-6 inside the sqrt | use_qk_l2norm_in_kernel=True (fla's eps is 1e-6)  |
| g = lb * sigma(exp(A_log) * (g_raw + dt_bias)), lb = -5  | use_gate_in_kernel=True, A_log, dt_bias [H*K],    |
|                                                         | lower_bound=lb (chunk_kda: with safe_gate=True)   |
| lower_bound=None: g = -exp(A_log) * softplus(g_raw + dt) | use_gate_in_kernel=True, lower_bound=None         |
| beta = sigma(beta_raw)                                  | use_beta_sigmoid_in_kernel=True                   |
| S: [B, H, K, V] fp32, new state returned                | initial_state (fp32), output_final_state=True     |

`kda_prefill` calls `chunk_kda`, `kda_decode` calls `fused_recurrent_kda` on a T=1 axis. dt_bias is [H*K] for both:
fused_recurrent_kda's docstring says [HV], but its kernel reads dt_bias[i_hv * K + k] (fla-core 0.6.0). The Triton
kernels need a CUDA GPU; the backend is unavailable (with the reason) without one, without torch or without fla.
fla's safe gate accepts -5 <= lower_bound < 0 only: another bound is an UnsupportedShape (a skipped case).
The cores take and return numpy arrays (the runner's interface), so their host time includes the copies.
"""
from __future__ import annotations

import importlib
import importlib.util

import numpy as np

from conformance.backends.external import Backend
from k3ref.cores import Cores, require_supported

NAME = "fla"
SAFE_GATE_RANGE = (-5.0, 0.0)    # chunk_kda(safe_gate=True) rejects lower bounds outside [-5, 0)


def available() -> tuple[bool, str]:
    """(True, version and GPU) when torch with CUDA and fla's KDA kernels import; else (False, why not)."""
    if importlib.util.find_spec("torch") is None:
        return False, "PyTorch is not installed (fla's kernels are torch + Triton): pip install torch fla-core"
    if importlib.util.find_spec("fla") is None:
        return False, "flash-linear-attention is not installed: pip install fla-core"
    import torch  # noqa: PLC0415 -- optional: this module imports without torch (it reports torch missing)

    if not torch.cuda.is_available():
        return False, ("no CUDA GPU (torch.cuda.is_available() is False): fla's chunk_kda / fused_recurrent_kda "
                       "are Triton kernels for CUDA")
    try:
        fla_kda = importlib.import_module("fla.ops.kda")
    except Exception as e:  # noqa: BLE001 - e.g. triton missing or too old for this fla
        return False, f"cannot import fla.ops.kda ({type(e).__name__}: {e})"
    version = vars(importlib.import_module("fla")).get("__version__", "?")
    missing = [f for f in ("chunk_kda", "fused_recurrent_kda") if f not in vars(fla_kda)]
    if missing:
        return False, f"fla {version} has no {missing} in fla.ops.kda"
    return True, f"fla {version} chunk_kda / fused_recurrent_kda on {torch.cuda.get_device_name()}"


def fla_arguments(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None,
                  dtype=None, device="cpu") -> dict:
    """K3's core arguments (q, k, g_raw [B, T, H, K], v [B, T, H, V], beta_raw [B, T, H], A_log [H],
    dt_bias [H*K], state [B, H, K, V]) as the keyword arguments of fla's `fused_recurrent_kda`: torch
    tensors on `device`, activations in `dtype` (default: the dtype of q), A_log, dt_bias and the state fp32.
    `chunk_kda` takes the same plus `safe_gate` (see chunk_arguments)."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    B, T, H, K = np.shape(q)
    V = np.shape(v)[-1]
    expect = {"k": (B, T, H, K), "v": (B, T, H, V), "g_raw": (B, T, H, K), "beta_raw": (B, T, H),
              "A_log": (H,), "dt_bias": (H * K,), "state": (B, H, K, V)}
    for arg, a in zip(expect, (k, v, g_raw, beta_raw, A_log, dt_bias, state), strict=True):
        if np.shape(a) != expect[arg]:
            raise ValueError(f"{arg}: expected shape {list(expect[arg])}, found {list(np.shape(a))}")

    def tensor(a, dt):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)

    act = dtype or torch.from_numpy(np.asarray(q)).dtype
    f32 = torch.float32
    return dict(q=tensor(q, act), k=tensor(k, act), v=tensor(v, act), g=tensor(g_raw, act),
                beta=tensor(beta_raw, act), A_log=tensor(A_log, f32), dt_bias=tensor(dt_bias, f32), scale=scale,
                initial_state=tensor(state, f32), output_final_state=True, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)


def chunk_arguments(*args, **kwargs) -> dict:
    """fla_arguments plus `safe_gate`: chunk_kda applies the lower-bound gate with safe_gate=True."""
    out = fla_arguments(*args, **kwargs)
    lb = out["lower_bound"]
    if lb is not None:
        require_supported(SAFE_GATE_RANGE[0] <= lb < SAFE_GATE_RANGE[1],
                          f"fla's bounded gate needs {SAFE_GATE_RANGE[0]} <= lower_bound < 0, found {lb}")
    return {**out, "safe_gate": lb is not None}


def _host(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def fla_cores(base: Cores, chunk_kda, fused_recurrent_kda, *, dtype=None, device="cuda") -> Cores:
    """`base` with kda_prefill calling `chunk_kda` and kda_decode calling `fused_recurrent_kda` (fla's, or
    stand-ins with their keyword arguments: the CPU test of this mapping passes fla's naive recurrence)."""

    def kda_prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
        kw = chunk_arguments(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, lower_bound=lower_bound,
                             scale=scale, dtype=dtype, device=device)
        o, S = chunk_kda(**kw)
        return _host(o), _host(S)

    def kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
        step = [np.asarray(a)[:, None] for a in (q, k, v, g_raw, beta_raw)]     # a T=1 axis
        kw = fla_arguments(*step, A_log, dt_bias, state, lower_bound=lower_bound, scale=scale, dtype=dtype,
                           device=device)
        o, S = fused_recurrent_kda(**kw)
        return _host(o)[:, 0], _host(S)

    return base.replace(kda_prefill=kda_prefill, kda_decode=kda_decode)


def make_cores(base: Cores, *, dtype_name: str = "bfloat16", device: str = "cuda") -> Cores:
    """`base` with fla's kernels (imported here) as kda_prefill and kda_decode."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch
    from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: PLC0415 -- optional: fla needs torch and a GPU

    return fla_cores(base, chunk_kda, fused_recurrent_kda, dtype=getattr(torch, dtype_name), device=device)


def make_backend(precision: str = "bf16") -> Backend:
    """The `fla` backend: bf16 activations (how fla's kernels run in a model) with the fp32 state, judged by
    the bf16 gates; `make_backend("fp32")` gives fp32 activations (Triton may use TF32 in its dots)."""
    dtype_name = {"bf16": "bfloat16", "fp32": "float32"}.get(precision)
    if dtype_name is None:
        raise ValueError(f"fla backend precision: expected 'bf16' or 'fp32', found {precision!r}")
    name = NAME if precision == "bf16" else f"{NAME}-{precision}"
    return Backend.from_cores(name, precision, lambda base: make_cores(base, dtype_name=dtype_name),
                              available=available, device="cuda")
