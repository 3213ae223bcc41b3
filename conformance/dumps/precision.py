"""A layer's precision, inferred from what its engine computed: the KDA state's storage dtype, and its drift.

An engine that stores the KDA recurrent state in bf16 between steps (vLLM's K3 TP8 recipe does) rounds it
once per step; the recompute (recompute.py) repeats its KDA mixer with the state rounded to bf16 between steps,
so d = a_bf16state - a is that rounding's effect on the output, and e = a_engine - a the engine's error. The
engine's error holds d when it rounds its state alike: c = sum <e, d> / sum <d, d> over the decode steps of
every KDA layer (a prefill starts from a zero state) is near 1 for a bf16 state and near 0 for an fp32 (or
wider) one, whatever rounding the rest of the engine does; its standard error is sqrt(sum e^2 d^2) / sum <d, d>
(the engine's other rounding is unbiased and nearly orthogonal to d). Verdict: "bf16" when c - Z se > 1/4,
"fp32 or wider" when c + Z se < 3/4, else "not inferable" (a history too short for the state's rounding to
stand out of the engine's own rounding). Z = 3. A bf16 engine's own state differs from the float64 one by
its rounding, so its bf16 roundings match the recompute's only in part: c of a bf16-state bf16 engine
measured 0.7 .. 1.1 on most prompts, less after a long prefill; of a float32 engine, 1.00.
The drift: the KDA mixers' added relative RMS per decode step (RMS over the KDA layers), first to last.
"""
from __future__ import annotations

import dataclasses
import math

from .recompute import LayerResult

Z = 3.0
BF16, WIDE, UNKNOWN = "bf16", "fp32 or wider", "not inferable"


@dataclasses.dataclass(frozen=True)
class StateFingerprint:
    """The KDA state's inferred storage precision over `layers`, from `steps` decode steps."""

    verdict: str
    c: float                      # the engine's share of the bf16-state effect (1: bf16, 0: fp32 or wider)
    se: float                     # its standard error
    layers: list[int]
    steps: int
    drift: list[float]            # RMS over the KDA layers of the mixer's added rel RMS, per decode step

    def line(self) -> str:
        drift = ""
        if len(self.drift) >= 2:
            drift = (f"; KDA mixer added rel RMS over {len(self.drift)} decode steps {self.drift[0]:.2e} -> "
                     f"{self.drift[-1]:.2e} ({self.drift[-1] / self.drift[0]:.2f}x)" if self.drift[0] > 0 else "")
        return (f"KDA state: {self.verdict} (the engine holds {self.c:.2f} +- {self.se:.2f} of what a bf16 state "
                f"changes, over {self.steps} decode steps of KDA layers {', '.join(map(str, self.layers))}){drift}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> StateFingerprint:
        return cls(str(d["verdict"]), float(d["c"]), float(d["se"]), [int(x) for x in d["layers"]],
                   int(d["steps"]), [float(x) for x in d["drift"]])


def kda_state(results: list[LayerResult]) -> StateFingerprint | None:
    """The KDA state fingerprint from the layers' mixer rows (None: no KDA layer or no decode step)."""
    dot = norm = var = 0.0
    layers: list[int] = []
    per_step: dict[int, list[float]] = {}
    for res in results:
        rows = [r for r in res.rows if r.sublayer == "mixer" and r.probe is not None and r.step > 0]
        for r in rows:
            assert r.probe is not None
            if all(math.isfinite(x) for x in r.probe):
                dot, norm, var = dot + r.probe[0], norm + r.probe[1], var + r.probe[2]
            per_step.setdefault(r.step, []).append(r.added.rel_rms)
        layers += [res.layer] if rows else []
    if not layers or norm <= 0:
        return None
    c, se = dot / norm, math.sqrt(var) / norm
    verdict = BF16 if c - Z * se > 0.25 else WIDE if c + Z * se < 0.75 else UNKNOWN
    drift = [math.sqrt(sum(x * x for x in xs) / len(xs)) for _, xs in sorted(per_step.items())]
    return StateFingerprint(verdict, c, se, sorted(layers), len(per_step), drift)
