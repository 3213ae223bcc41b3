"""Cores: the heavy steps of the host graph, injectable so one kernel can be swapped in at a time.

The host graph (k3ref.cpu_forward) and the block layer functions (kda_decode_token, mla_decode_token,
latent_moe_forward, ...) call every heavy step through a `Cores` object. k3ref supplies the reference
cores; k3cuda and the torch baseline supply cores with the same signatures (numpy arrays in and out),
and the conformance runner swaps them one at a time to find the first kernel that goes wrong.
Signatures are listed in docs/interfaces.md; each core's docstring in its own module is the contract.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from . import attnres, engine, kda, latent_moe, mla, mxfp4, ops, situ

CORE_NAMES = (
    "rmsnorm",       # (x [..., D], w [D], eps) -> [..., D]
    "situ_glu",      # (gate [..., I], up [..., I], beta=4.0, linear_beta=25.0) -> [..., I]
    "kda_decode",    # one token of the KDA recurrence incl. gate, L2 norms, beta sigmoid
    "kda_prefill",   # T tokens of the same (chunked form)
    "mla_decode",    # absorbed MLA attention over the paged latent cache
    "mxfp4_gemv",    # y = W x with W in the K3 MXFP4 layout
    "moe_route",     # sigmoid top-k router
    "attnres_mix",   # Block AttnRes softmax mix over depth sources
    "attnres_hub",   # factory of the per-token AttnRes block state (block boundaries)
    # engine-shaped cores (k3ref.engine): the same math in the layouts serving engines hold
    "kda_decode_pool",     # kda_decode over a state pool indexed by slot, padded rows (slot -1) skipped
    "kda_conv_pool",       # one step of the short conv + SiLU over a conv-state pool
    "kda_prefill_varlen",  # kda_prefill of sequences packed on one time axis (cu_seqlens), states in a pool
    "mla_decode_fp8",      # mla_decode over an FP8 (e4m3) latent cache with per-group scales, padded rows
    "mla_prefill",         # causal varlen attention of the new tokens (the unabsorbed prefill)
    "moe_experts",         # the routed experts fused: ids + weights -> all selected MXFP4 experts -> weighted sum
    "add_rmsnorm",         # the residual add fused into the RMSNorm
)
ENGINE_CORES = CORE_NAMES[CORE_NAMES.index("kda_decode_pool"):]

# Inputs a core may write: engines update their state pools in place. The updated pool is also an output, so a
# core may return the array it was given; every other input must stay unchanged.
IN_OUT: dict[str, tuple[str, ...]] = {
    "kda_decode_pool": ("state_pool",),
    "kda_conv_pool": ("conv_pool",),
    "kda_prefill_varlen": ("state_pool",),
}


class UnsupportedShape(ValueError):
    """A core's inputs are valid but outside what this implementation handles (e.g. a kernel built for
    head_dim 128 given head_dim 16). The runner reports the case as skipped for that backend, with the reason."""


def require_supported(cond: bool, msg: str) -> None:
    """Raise UnsupportedShape(msg) unless cond."""
    if not cond:
        raise UnsupportedShape(msg)


@dataclasses.dataclass(frozen=True)
class Cores:
    """One callable per heavy step. Build with `reference_cores()` and swap with `.replace(name=fn)`."""

    rmsnorm: Callable[..., Any]
    situ_glu: Callable[..., Any]
    kda_decode: Callable[..., Any]
    kda_prefill: Callable[..., Any]
    mla_decode: Callable[..., Any]
    mxfp4_gemv: Callable[..., Any]
    moe_route: Callable[..., Any]
    attnres_mix: Callable[..., Any]
    attnres_hub: Callable[..., Any]
    # the engine-shaped cores default to k3ref's: a bundle built before they existed stays complete
    kda_decode_pool: Callable[..., Any] = engine.kda_decode_pool
    kda_conv_pool: Callable[..., Any] = engine.kda_conv_pool
    kda_prefill_varlen: Callable[..., Any] = engine.kda_prefill_varlen
    mla_decode_fp8: Callable[..., Any] = engine.mla_decode_fp8
    mla_prefill: Callable[..., Any] = engine.mla_prefill
    moe_experts: Callable[..., Any] = engine.moe_experts
    add_rmsnorm: Callable[..., Any] = engine.add_rmsnorm

    def replace(self, **swaps: Callable[..., Any]) -> Cores:
        unknown = sorted(set(swaps) - set(CORE_NAMES))
        if unknown:
            raise ValueError(f"unknown core(s) {unknown}; expected some of {list(CORE_NAMES)}")
        return dataclasses.replace(self, **swaps)


def reference_cores() -> Cores:
    """The exact NumPy cores (compute in the dtype of their inputs)."""
    return Cores(
        rmsnorm=ops.rmsnorm,
        situ_glu=situ.situ_glu,
        kda_decode=kda.kda_decode_core,
        kda_prefill=kda.kda_prefill_core,
        mla_decode=mla.mla_decode_core,
        mxfp4_gemv=mxfp4.mxfp4_gemv,
        moe_route=latent_moe.sigmoid_topk,
        attnres_mix=attnres.attnres_mix,
        attnres_hub=attnres.AttnResHub,
    )
