"""SiTU-GLU: the K3 MLP nonlinearity (docs/spec.md section 3.3).

    softcap_c(z)   = c * tanh(z / c)
    SiTU_b(g)      = softcap_b(g) * sigma(g)
    situ_glu(g, u) = SiTU_beta(g) * softcap_linear_beta(u)          (beta 4, linear_beta 25 in K3)
    MLP(x)         = W2 situ_glu(W1 x, W3 x)                         (w1 = gate, w3 = up, w2 = down)

The nonlinearities run in fp32 or wider: float64 stays float64; float16/bf16 are promoted to float32.
Fused checkpoints store the gate and up projections stacked as one [gate | up] matrix.
"""
from __future__ import annotations

import numpy as np

from .checks import as_float, check_shape, is_finite_real, require
from .ops import linear, sigmoid


def _check_cap(name: str, cap) -> float:
    require(is_finite_real(cap) and cap > 0, f"{name}: expected a finite positive cap, found {cap}")
    return float(cap)


def softcap(z: np.ndarray, cap: float) -> np.ndarray:
    """softcap_c(z) = c * tanh(z / c); any shape, |result| < c, odd, ~z for |z| << c."""
    z = as_float("z", z)
    cap = _check_cap("cap", cap)
    return (cap * np.tanh(z / cap)).astype(z.dtype, copy=False)


def situ(g: np.ndarray, beta: float) -> np.ndarray:
    """SiTU_beta(g) = softcap_beta(g) * sigma(g); any shape. Tends to SiLU(g) = g sigma(g) for |g| << beta."""
    g = as_float("g", g)
    return softcap(g, beta) * sigmoid(g)


def situ_glu(gate: np.ndarray, up: np.ndarray, beta: float = 4.0, linear_beta: float = 25.0) -> np.ndarray:
    """The `situ_glu` core: SiTU_beta(gate) * softcap_linear_beta(up).

    gate: [..., I]; up: [..., I] -> [..., I] in float32 (float16/bf16/float32 inputs) or float64
    (float64 inputs; mixed inputs compute in the wider).
    """
    gate = as_float("gate", gate)
    up = as_float("up", up)
    require(gate.ndim >= 1, "gate: expected shape [..., I], found a scalar")
    check_shape("up", up, gate.shape)
    dt = np.result_type(gate.dtype, up.dtype)
    gate, up = gate.astype(dt, copy=False), up.astype(dt, copy=False)
    return situ(gate, beta) * softcap(up, linear_beta)


def situ_glu_vec(x: np.ndarray, w1: np.ndarray, w3: np.ndarray, w2: np.ndarray,
                 beta: float = 4.0, linear_beta: float = 25.0, cores=None) -> np.ndarray:
    """The dense SiTU MLP: y = W2 situ_glu(W1 x, W3 x).

    x: [..., D]; w1 (gate), w3 (up): [I, D]; w2 (down): [D, I] -> y [..., D], in x's dtype
    (float32 for bf16/float16 x). `cores.situ_glu` does the nonlinearity (reference cores when None).
    """
    x = as_float("x", x)
    require(x.ndim >= 1, "x: expected shape [..., D], found a scalar")
    D = x.shape[-1]
    Di, _ = check_shape("w1", w1, (None, D))
    check_shape("w3", w3, (Di, D))
    check_shape("w2", w2, (D, Di))
    glu = situ_glu if cores is None else cores.situ_glu
    h = glu(linear(x, w1), linear(x, w3), beta=beta, linear_beta=linear_beta)
    return linear(np.asarray(h).astype(x.dtype, copy=False), w2)


def split_fused_gate_up(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split a fused [gate | up] weight [2I, D] into (w1 = gate [I, D], w3 = up [I, D]) (views, no copy)."""
    w = np.asarray(w)
    check_shape("w", w, (None, None))
    require(w.shape[0] % 2 == 0, f"w: expected a fused [gate | up] weight with an even row count 2I, "
                                 f"found shape {w.shape}")
    Di = w.shape[0] // 2
    return w[:Di], w[Di:]
