"""Block AttnRes: the softmax mix over depth that replaces the plain residual sum (docs/spec.md section 3.6).

For sources V_i (the embedding, completed block sums, the running partial sum of the current block):

    k_i     = V_i / sqrt(mean_d(V_i^2) + eps)                  (RMS-normalised keys, eps = rms_norm_eps)
    logit_i = sum_d k_id * norm_w_d * proj_w_d                 (one learned query per sublayer)
    alpha   = softmax_i(logit)
    out     = sum_i alpha_i V_i                                (the values are NOT normalised)

Per token and layer l the state is (`blocks`, `prefix`); `AttnResHub` carries it:

    h = prefix if not blocks else AR(blocks + [prefix], w_attn)
    if l % block_size == 0: blocks.append(prefix); prefix = None       # layer 0 appends the embedding
    a = Mixer(input_norm(h)); prefix = a if prefix is None else prefix + a
    f = MLP(post_norm(AR(blocks + [prefix], w_mlp))); prefix = prefix + f
    final: AR(blocks + [prefix], w_out)

Computed in float32 or wider (float64 stays float64; bf16/float16 are promoted to float32).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from .checks import as_float, check_shape, is_finite_real, require
from .ops import mean_square, softmax
from .threads import fixed_blas


def _as_sources(sources) -> np.ndarray:
    if isinstance(sources, (list, tuple)):
        require(len(sources) > 0, "sources: expected at least one source, found an empty list")
        sources = np.stack([as_float(f"sources[{i}]", s) for i, s in enumerate(sources)])
    V = as_float("sources", sources)
    require(V.ndim >= 2 and V.shape[0] >= 1,
            f"sources: expected shape [S >= 1, ..., D], found {V.shape}")
    return V


def _as_query(proj_w, norm_w, D: int, dtype) -> np.ndarray:
    proj_w = as_float("proj_w", proj_w)
    if proj_w.ndim == 2:
        check_shape("proj_w", proj_w, (1, D))
        proj_w = proj_w[0]
    check_shape("proj_w", proj_w, (D,))
    norm_w = as_float("norm_w", norm_w)
    check_shape("norm_w", norm_w, (D,))
    return (norm_w.astype(dtype) * proj_w.astype(dtype)).astype(dtype, copy=False)


def attnres_softmax_mix(sources, proj_w: np.ndarray, norm_w: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """AR(V): softmax over sources of RMS-normalised keys against norm_w * proj_w, mixing the raw values.

    sources: [S, ..., D] (or a list of S arrays [..., D]); proj_w: [D] or [1, D] (checkpoint shape);
    norm_w: [D] -> out [..., D].  out = sum_i softmax_i(sum_d k_id norm_w_d proj_w_d) V_i with
    k_i = V_i / sqrt(mean(V_i^2) + eps).
    """
    V = _as_sources(sources)
    D = V.shape[-1]
    q = _as_query(proj_w, norm_w, D, V.dtype)
    k = V / np.sqrt(mean_square(V) + eps)
    alpha = softmax(k @ q, axis=0)                           # [S, ...]
    return np.sum(alpha[..., None] * V, axis=0)


def attnres_blend(skip: np.ndarray, mixed: np.ndarray, mix: float) -> np.ndarray:
    """(1 - mix) * skip + mix * mixed; skip, mixed: [..., D] (same shape). mix 1 = production AttnRes,
    mix 0 = the plain residual stream (an ablation lever)."""
    skip = as_float("skip", skip)
    mixed = as_float("mixed", mixed)
    check_shape("mixed", mixed, skip.shape)
    require(is_finite_real(mix), f"mix: expected a finite number, found {mix}")
    mix = float(mix)
    if mix == 1.0:
        return mixed                                         # exact, whatever skip holds
    return (1.0 - mix) * skip + mix * mixed


@fixed_blas
def attnres_mix(sources, proj_w: np.ndarray, norm_w: np.ndarray, mix: float = 1.0,
                eps: float = 1e-5) -> np.ndarray:
    """The `attnres_mix` core: attnres_blend(sum_i V_i, AR(V), mix).

    sources: [S, ..., D]; proj_w: [D] or [1, D]; norm_w: [D] -> [..., D].
    """
    V = _as_sources(sources)
    mixed = attnres_softmax_mix(V, proj_w, norm_w, eps)
    if is_finite_real(mix) and float(mix) == 1.0:
        return as_float("mixed", mixed)                      # attnres_blend's answer, the skip not summed
    return attnres_blend(np.sum(V, axis=0), mixed, mix)


class MixCores(Protocol):
    """What the hub needs of a cores bundle (`k3ref.cores.Cores` has it): the `attnres_mix` core."""

    @property
    def attnres_mix(self) -> Callable[..., np.ndarray]: ...


class AttnResHub:
    """Per-token Block AttnRes state across depth: `blocks` (completed block sums) and `prefix`.

    Arrays are [..., D] (one token or a batch). Call order per layer l:
    `mixer_input(l, ...)`, `add_mixer(a)`, `mlp_input(...)`, `add_mlp(f)`; at the end `final_input(...)`.
    The heavy step goes through `cores.attnres_mix` (reference cores when None), with the keys' RMSNorm
    eps `eps` (the config's rms_norm_eps; 1e-5 in every preset).
    """

    def __init__(self, block_size: int, eps: float = 1e-5):
        require(isinstance(block_size, (int, np.integer)) and block_size >= 1,
                f"block_size: expected a positive int, found {block_size!r}")
        require(is_finite_real(eps) and eps > 0, f"eps: expected a positive finite number, found {eps!r}")
        self.block_size = int(block_size)
        self.eps = float(eps)
        self.blocks: list[np.ndarray] = []
        self.prefix: np.ndarray | None = None

    def _ar(self, proj_w, norm_w, mix: float, cores: MixCores | None) -> np.ndarray:
        if self.prefix is None:
            raise ValueError("AttnResHub: prefix is empty; call start() (or add_mixer()) before asking for a mix")
        mix_core = attnres_mix if cores is None else cores.attnres_mix
        return mix_core(np.stack(self.blocks + [self.prefix]), proj_w, norm_w, mix=mix, eps=self.eps)

    def start(self, embedding: np.ndarray) -> None:
        """Reset to the token embedding(s) [..., D]: blocks = [], prefix = embedding."""
        e = as_float("embedding", embedding)
        require(e.ndim >= 1, "embedding: expected shape [..., D], found a scalar")
        self.blocks, self.prefix = [], e

    def mixer_input(self, layer: int, proj_w, norm_w, mix: float = 1.0, cores: MixCores | None = None) -> np.ndarray:
        """h for layer `layer`'s mixer; commits the prefix as a completed block when layer % block_size == 0."""
        require(isinstance(layer, (int, np.integer)) and layer >= 0,
                f"layer: expected a non-negative int, found {layer!r}")
        prefix = self.prefix
        if prefix is None:
            raise ValueError(f"AttnResHub: prefix is empty at layer {layer}; call start() and finish the previous "
                             "layer")
        h = prefix if not self.blocks else self._ar(proj_w, norm_w, mix, cores)
        if layer % self.block_size == 0:
            self.blocks.append(prefix)
            self.prefix = None
        return h

    def add_mixer(self, a: np.ndarray) -> None:
        """prefix = a if prefix is None else prefix + a  (a: [..., D], the mixer output)."""
        a = as_float("a", a)
        if self.prefix is None:
            check_shape("a", a, self.blocks[-1].shape if self.blocks else a.shape)
            self.prefix = a
        else:
            check_shape("a", a, self.prefix.shape)
            self.prefix = self.prefix + a

    def mlp_input(self, proj_w, norm_w, mix: float = 1.0, cores: MixCores | None = None) -> np.ndarray:
        """AR(blocks + [prefix], w_mlp): the input of this layer's MLP (before post_attention_layernorm)."""
        return self._ar(proj_w, norm_w, mix, cores)

    def add_mlp(self, f: np.ndarray) -> None:
        """prefix = prefix + f  (f: [..., D], the MLP output)."""
        if self.prefix is None:
            raise ValueError("AttnResHub: add_mlp() before add_mixer()")
        f = as_float("f", f)
        check_shape("f", f, self.prefix.shape)
        self.prefix = self.prefix + f

    def final_input(self, proj_w, norm_w, mix: float = 1.0, cores: MixCores | None = None) -> np.ndarray:
        """AR(blocks + [prefix], w_out): the input of the final norm and lm_head."""
        return self._ar(proj_w, norm_w, mix, cores)

    def copy(self) -> AttnResHub:
        """An independent copy (arrays copied) of this state."""
        new = type(self)(self.block_size, self.eps)
        new.blocks = [b.copy() for b in self.blocks]
        new.prefix = None if self.prefix is None else self.prefix.copy()
        return new
