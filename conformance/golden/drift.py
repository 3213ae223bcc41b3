"""How a recomputed golden differs from the stored one, and whether the difference is only rounding.

Regeneration keeps a golden whose computed tensors moved by no more than ROUNDING_DRIFT (relative RMS):
float64 BLAS kernels differ in the last bits between CPUs; a real change of the math moves results far more.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import numpy as np

ROUNDING_DRIFT = 1e-12

# A margin (top score minus the runner-up) is the difference of two nearly equal scores, so its rounding is
# that of the scores, not a fraction of the margin: relative to itself it is ill-conditioned. Measured on an
# AVX2-only EPYC against goldens written on another CPU: trace/*-P7-D5 `inter.argmax.step1.margin` (a margin
# of 1.2e-3 between logits of RMS 0.961) moved by 1.69e-14: 1.39e-11 of the margin, 1.76e-14 of the logits,
# while every other tensor of those traces moved by <= ~1e-13 relative RMS. A margin is therefore judged by
# its RMS change over the larger of its own RMS and the RMS of the scores it separates (never stricter than
# before); ROUNDING_DRIFT stays the bound, so a margin that really moved (1e-6 on scores of order 1) is drift.
_ARGMAX_MARGIN = re.compile(r"inter\.argmax\.step(?P<step>\d+)\.margin")
_ROUTE_MARGIN = re.compile(r"inter\.route\..+\.margin")
# Router selection scores are sigmoid(logit) + a correction bias (|bias| ~ 0.1 on the traces): order 1. A
# group margin compares sums of two such scores (order 2); 1 keeps the rule on the strict side for those.
ROUTE_SCORE_SCALE = 1.0


@dataclasses.dataclass(frozen=True)
class TensorDrift:
    """How one tensor changed between the stored golden and a recomputation."""

    name: str
    status: str              # "same" | "changed" | "added" | "removed" | "reshaped"
    max_abs: float = 0.0
    rel_rms: float = 0.0
    detail: str = ""
    score_scale: float | None = None   # a margin's: the RMS of the scores it is a difference of
    scaled_rms: float | None = None    # a margin's: its RMS change over the larger of its RMS and score_scale

    @property
    def rounding_rms(self) -> float:
        """The relative change the rounding rule holds against ROUNDING_DRIFT."""
        return self.rel_rms if self.scaled_rms is None else self.scaled_rms

    def line(self) -> str:
        if self.status in ("changed", "same") and not self.detail:   # a tensor: its numbers
            text = f"{self.name}: {self.status}, max abs {self.max_abs:.3g}, rel RMS {self.rel_rms:.3g}"
            if self.score_scale is not None and self.rel_rms > ROUNDING_DRIFT:   # where the scale decides
                text += f" ({self.rounding_rms:.3g} at the scale of its scores, RMS {self.score_scale:.3g})"
            return text
        return f"{self.name}: {self.status} {self.detail}".rstrip()    # metadata, manifest, shape: the detail


def _rms(a: np.ndarray) -> float:
    return float(np.linalg.norm(a)) / math.sqrt(max(a.size, 1))


def score_scale(name: str, golden: Mapping[str, np.ndarray]) -> float | None:
    """The RMS of the scores that the margin tensor `name` is a difference of (None: not a margin, or its
    scores are not in the golden): an argmax margin's are the golden's logits of that step, a route margin's
    the router's selection scores."""
    argmax = _ARGMAX_MARGIN.fullmatch(name)
    if argmax is not None:
        logits = golden.get(f"outputs.step{argmax['step']}.logits")
        return None if logits is None else _rms(logits.astype(np.float64))
    if _ROUTE_MARGIN.fullmatch(name):
        return ROUTE_SCORE_SCALE
    return None


def _changed(name: str, a: np.ndarray, b: np.ndarray, old: Mapping[str, np.ndarray]) -> TensorDrift:
    tiny = np.finfo(np.float64).tiny
    change = float(np.linalg.norm(b - a))
    rel_rms = change / max(float(np.linalg.norm(a)), tiny)
    scale = score_scale(name, old)
    scaled = None
    if scale is not None:
        scaled = change / max(float(np.linalg.norm(a)), scale * math.sqrt(a.size), tiny)
    return TensorDrift(name, "changed", float(np.max(np.abs(b - a))), rel_rms, score_scale=scale, scaled_rms=scaled)


def diff_tensors(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> list[TensorDrift]:
    """Per-tensor drift from `old` (the stored golden) to `new` (only tensors that differ at all are listed)."""
    out = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            out.append(TensorDrift(name, "removed", detail=f"(was {old[name].dtype}{list(old[name].shape)})"))
        elif name not in old:
            out.append(TensorDrift(name, "added", detail=f"({new[name].dtype}{list(new[name].shape)})"))
        elif old[name].shape != new[name].shape or old[name].dtype != new[name].dtype:
            out.append(TensorDrift(name, "reshaped", detail=(
                f"{old[name].dtype}{list(old[name].shape)} -> {new[name].dtype}{list(new[name].shape)}")))
        elif old[name].tobytes() != new[name].tobytes():
            out.append(_changed(name, old[name].astype(np.float64), new[name].astype(np.float64), old))
    return out


def is_rounding_only(drift: list[TensorDrift], meta_old: Mapping, meta_new: Mapping) -> bool:
    """True when only computed tensors moved, each by <= ROUNDING_DRIFT (relative RMS; margins at the scale
    of their scores)."""
    if dict(meta_old) != dict(meta_new):
        return False
    return all(d.status == "changed" and d.name.split(".")[0] in ("inter", "outputs")
               and d.rounding_rms <= ROUNDING_DRIFT for d in drift)
