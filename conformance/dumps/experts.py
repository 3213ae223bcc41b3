"""The routed experts of one MoE layer, slot by slot: where a dump holds them (experts.in, experts.out and
router.ids), each slot's expert output is compared with the float64 expert on the engine's own expert input.

Why a separate check inside the mlp row: one expert's 1% scale error is diluted in the MoE output f (a few
tokens' share of several experts, then the routed RMSNorm) below the bf16 rounding of a correct MLP, in
relative RMS and in gain alike. In the expert's own output it is a gain of 1%. One slot alone cannot show it
at bf16: a slot's output has only the latent width of entries (32 in the synthetic configs), and rounding an
input dominated by a few entries is itself a scale error of up to a bf16 step, so a clean slot's gain reaches
a few 1e-3. But rounding is unbiased and a scale error is not: pooled over every slot an expert served so far
(gain g - 1 = sum <e - r, r> / sum <r, r>), the rounding shrinks as 1 / sqrt(n_eff) while the scale error
stays. The judged score is |g - 1| * sqrt(n_eff), n_eff = (sum |r|^2)^2 / sum |r|^4 the effective number of
slots (Kish: slots with small outputs weigh less in the pooled gain, so they count less): a score is the
rounding of about one slot, wherever the pool is small or large.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from k3ref.latent_moe import LatentMoeConfig, routed_expert

from .divergence import Divergence, _from_json_float, _json_float, divergence

KEYS = ("experts.in", "experts.out", "router.ids")


@dataclasses.dataclass(frozen=True)
class ExpertGain:
    """One routed expert's pooled gain over the slots it served in the steps so far."""

    expert: int
    gain: float             # g - 1
    slots: int
    effective: float        # n_eff = (sum |r|^2)^2 / sum |r|^4

    @property
    def score(self) -> float:
        return abs(self.gain) * math.sqrt(self.effective)

    def to_json(self) -> dict:
        return {"expert": self.expert, "gain": _json_float(self.gain), "slots": self.slots,
                "effective": _json_float(self.effective), "score": _json_float(self.score)}

    @classmethod
    def from_json(cls, d: dict) -> ExpertGain:
        return cls(int(d["expert"]), _from_json_float(d["gain"]), int(d["slots"]), _from_json_float(d["effective"]))


@dataclasses.dataclass(frozen=True)
class ExpertsCheck:
    """A step's routed expert outputs: `added` over all its slots, and the expert whose pooled gain (steps so
    far) stands furthest out, judged against `gain_budget` (a score, see the module docstring)."""

    added: Divergence
    worst: ExpertGain | None          # None while no slot had a finite, non-zero reference
    gain_budget: float

    @property
    def over(self) -> bool:
        return self.added.nonfinite > 0 or (self.worst is not None and not self.worst.score <= self.gain_budget)

    def to_json(self) -> dict:
        return {"added": self.added.to_json(), "worst": None if self.worst is None else self.worst.to_json(),
                "gain_budget": self.gain_budget}

    @classmethod
    def from_json(cls, d: dict) -> ExpertsCheck:
        worst = d.get("worst")
        return cls(Divergence.from_json(d["added"]), None if worst is None else ExpertGain.from_json(worst),
                   float(d["gain_budget"]))


class ExpertPool:
    """Running sums per expert over the steps of one layer: sum <e - r, r>, sum |r|^2, sum |r|^4, slots."""

    def __init__(self) -> None:
        self.sums: dict[int, list[float]] = {}

    def add(self, ids: np.ndarray, engine: np.ndarray, ref: np.ndarray) -> None:
        """One step's slots: ids [T, k], engine and ref outputs [T, k, Dl]; slots with a non-finite engine
        value (counted by the Divergence) or a zero reference output are left out."""
        d = engine - ref
        ok = np.all(np.isfinite(engine), axis=-1)
        dr, rr = np.einsum("tkd,tkd->tk", np.where(ok[..., None], d, 0.0), ref), np.einsum("tkd,tkd->tk", ref, ref)
        for (t, j), e in np.ndenumerate(ids):
            if ok[t, j] and rr[t, j] > 0:
                s = self.sums.setdefault(int(e), [0.0, 0.0, 0.0, 0.0])
                s[0] += float(dr[t, j])
                s[1] += float(rr[t, j])
                s[2] += float(rr[t, j]) ** 2
                s[3] += 1

    def worst(self) -> ExpertGain | None:
        gains = [ExpertGain(e, s[0] / s[1], int(s[3]), s[1] * s[1] / s[2]) for e, s in sorted(self.sums.items())]
        return max(gains, key=lambda g: g.score) if gains else None


def expert_outputs(weights: Mapping, z: np.ndarray, ids: np.ndarray, cfg: LatentMoeConfig, cores) -> np.ndarray:
    """The float64 output of the expert in every slot: z [T, Dl], ids [T, k] -> [T, k, Dl]."""
    T, k = ids.shape
    if z.shape != (T, cfg.latent_size):
        raise ValueError(f"experts.in: expected shape {[T, cfg.latent_size]} (tokens x latent width), "
                         f"found {list(z.shape)}")
    out = np.zeros((T, k, cfg.latent_size))
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        out[rows, slot] = routed_expert(weights, int(e), z[rows], cfg, cores)
    return out


def check_experts(weights: Mapping, cfg: LatentMoeConfig, cores, pool: ExpertPool, z: np.ndarray,
                  ids: np.ndarray, engine: np.ndarray, *, bf16: bool, gain_budget: float) -> ExpertsCheck:
    """One step of one layer: the engine's expert outputs against the float64 experts on the engine's own
    expert input, added to `pool`; the worst pooled expert so far."""
    ids = np.asarray(ids, np.int64)
    if not (ids.min(initial=0) >= 0 and ids.max(initial=0) < cfg.num_experts):
        raise ValueError(f"router.ids: expected expert ids in 0..{cfg.num_experts - 1}, found {ids.min()}..{ids.max()}")
    ref = expert_outputs(weights, z, ids, cfg, cores)
    pool.add(ids, engine, ref)
    return ExpertsCheck(divergence(engine, ref, bf16=bf16), pool.worst(), gain_budget)
