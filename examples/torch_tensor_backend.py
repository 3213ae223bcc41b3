"""An external backend whose kernels are torch code on device tensors: rmsnorm and kda_decode.

    k3conf run --backend examples/torch_tensor_backend.py:make --no-timing
    pytest --k3conf-backend examples/torch_tensor_backend.py:make -k 'rmsnorm or kda_decode'

`tensors="torch"` tells the judge that the cores take and return torch tensors on `device`: it moves each case's
inputs there, checks that tensors on that device come back, and times the cores on device-resident inputs
(docs/external_backends.md, "Device tensors"). K3CONF_EXAMPLE_DEVICE picks the device (default cpu; cuda on a
GPU machine). K3CONF_EXAMPLE_BUG plants a layout bug in kda_decode, the mistake a kernel written against another
layout makes: "kda-dt-bias-kh" reads dt_bias [H*K] as if it were stored K-major ([K, H]); the cases then fail and
the first failure names kda_decode and the case (on about 1 start-up check seed in 20 its error is large enough for
the check to refuse the backend instead; K3CONF_CHECK_SEED=0 replays a check it passes). "kda-state-vk" reads
the state [B, H, K, V] as [B, H, V, K]: an error so large that the start-up check of the cores refuses the
backend before any case runs, naming kda_decode.
"""
from __future__ import annotations

import os

import torch

from conformance import Backend

BUG_ENV, DEVICE_ENV = "K3CONF_EXAMPLE_BUG", "K3CONF_EXAMPLE_DEVICE"
BUGS = ("kda-dt-bias-kh", "kda-state-vk")
KDA_L2_EPS = 1e-6   # docs/spec.md section 3.1: eps inside the sqrt of the q/k L2 norm


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D]; w: [D] -> w * x / sqrt(mean(x^2) + eps) over the last axis."""
    return w * x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(torch.sum(x * x, dim=-1, keepdim=True) + KDA_L2_EPS)


def kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None, bug: str = ""):
    """One KDA token. q, k, g_raw: [B, H, K]; v: [B, H, V]; beta_raw: [B, H]; A_log: [H]; dt_bias: [H*K];
    state: [B, H, K, V] -> (o [B, H, V], new state [B, H, K, V]). `bug`: one of BUGS, planted."""
    B, H, K = q.shape
    V = v.shape[-1]
    z = g_raw + (dt_bias.reshape(K, H).T if bug == "kda-dt-bias-kh" else dt_bias.reshape(H, K))
    a = torch.exp(A_log)[:, None]                                       # [H, 1]
    g = -a * torch.nn.functional.softplus(z) if lower_bound is None else lower_bound * torch.sigmoid(a * z)
    q_hat, k_hat = _l2(q) * (K ** -0.5 if scale is None else scale), _l2(k)
    beta = torch.sigmoid(beta_raw)[..., None]                           # [B, H, 1]
    S = state.reshape(B, H, V, K).transpose(-1, -2) if bug == "kda-state-vk" else state
    S = torch.exp(g)[..., None] * S                                     # decay: Diag(e^g) S
    u = beta * (v - torch.einsum("bhkv,bhk->bhv", S, k_hat))            # beta (v - S^T k^)
    S = S + torch.einsum("bhk,bhv->bhkv", k_hat, u)
    return torch.einsum("bhkv,bhk->bhv", S, q_hat), S


def make() -> Backend:
    bug = os.environ.get(BUG_ENV, "")
    if bug and bug not in BUGS:
        raise ValueError(f"{BUG_ENV}: expected one of {BUGS}, found {bug!r}")

    def decode(*args, **kwargs):
        return kda_decode(*args, **kwargs, bug=bug)

    return Backend.from_cores("example-torch", "fp32", lambda base: base.replace(rmsnorm=rmsnorm, kda_decode=decode),
                              tensors="torch", device=os.environ.get(DEVICE_ENV, "cpu"))
