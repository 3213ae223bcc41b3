"""A candidate judged against a deployment's own control: a second dump of the same prompts from a trusted
configuration (another engine, TP 1, one-shot prefill, an earlier release).

    cand, ctrl = compare_dump(candidate, ckpt), compare_dump(control, ckpt)     # both against float64
    verdict = judge_against(cand, ctrl, limit=control_limit(cand))

Each dump is recomputed in float64 from its own inputs, so each sublayer's added divergence is measured
against the same arbiter. Only the steps both dumps ran on the same tokens count (the prefill, and the decode
steps until their greedy choices part: after that their inputs differ). The relative verdict per layer and
sublayer: the candidate's worst added relative RMS over those steps divided by the control's; over when that
ratio is past `limit`, the largest ratio two correct engines of one precision showed on the same prompts
(k3torch and k3ref at float32, TP 1 and TP 2: the `control_ratio` row of the budget table, measured by
conformance/dumps/measure.py) times the margin.

A ratio over in every layer of one kind (every KDA mixer, every MoE mlp, at least two layers) is not a layer's
bug but the candidate's recipe: it is reported as a precision difference, with the KDA state fingerprints of
both dumps where they differ (precision.py), and no layer is named for it. Otherwise the first layer (in
compute order its first sublayer) with a ratio over is the source. Exit 1 for a source or a precision
difference from the control, else 0.
"""
from __future__ import annotations

import dataclasses

from .budgets import CONTROL_RATIO, BudgetTable, default_table, geometry_of
from .recompute import SUBLAYERS
from .report_text import ranges
from .verdict import DumpReport

_FLOOR = 1e-30      # a control that adds exactly nothing (a float64 engine): any candidate error is a ratio


@dataclasses.dataclass(frozen=True)
class RowRatio:
    layer: int
    sublayer: str
    kind: str             # the layer's kind for this sublayer: its mixer (KDA | MLA) or its mlp (dense | MoE)
    candidate: float
    control: float
    ratio: float
    over: bool


@dataclasses.dataclass(frozen=True)
class ControlVerdict:
    limit: float
    ratios: list[RowRatio]
    precision: list[str]                   # recipe differences: systematic ratios, KDA state fingerprints
    source: tuple[int, str] | None

    @property
    def exit_code(self) -> int:
        return 1 if self.source is not None or self.precision else 0

    def lines(self) -> list[str]:
        out = [f"against the control: candidate added / control added per layer and sublayer, limit {self.limit:.3g}"]
        if self.source is not None:
            r = next(x for x in self.ratios if (x.layer, x.sublayer) == self.source)
            out.append(f"relative source: layer {r.layer} {r.sublayer} (added rel RMS {r.candidate:.2e} vs the "
                       f"control's {r.control:.2e}: {r.ratio:.2f}x > {self.limit:.3g})")
        out += [f"precision differs from the control: {p}" for p in self.precision]
        if self.source is None and not self.precision:
            top = max(self.ratios, key=lambda x: x.ratio, default=None)
            out.append("relative: every sublayer within the control's error" + (
                f" (largest ratio {top.ratio:.2f}x at layer {top.layer} {top.sublayer})" if top else ""))
        out.append(f"exit {self.exit_code} (against the control)")
        return out

    def to_json(self) -> dict:
        return {"limit": self.limit, "ratios": [dataclasses.asdict(r) for r in self.ratios],
                "precision": self.precision, "source": None if self.source is None else list(self.source),
                "exit_code": self.exit_code}


def _kind(summary, sublayer: str) -> str:
    return summary.mixer if sublayer in ("attnres_mixer", "mixer") else summary.mlp


def judge_against(cand: DumpReport, ctrl: DumpReport, limit: float, steps: int | None = None) -> ControlVerdict:
    """The relative verdict of `cand` against `ctrl` (reports of the same prompt and checkpoint) over their
    first `steps` steps (None: every step both hold; see common_steps)."""
    theirs = {s.layer: s for s in ctrl.layers}
    ratios = []
    for s in cand.layers:
        c = theirs.get(s.layer)
        for sub in SUBLAYERS:
            if c is None or sub not in s.per_step or sub not in c.per_step:
                continue
            n = min(len(s.per_step[sub]), len(c.per_step[sub]), steps if steps is not None else 1 << 30)
            a, b = max(s.per_step[sub][:n]), max(c.per_step[sub][:n])
            ratio = a / max(b, _FLOOR)
            ratios.append(RowRatio(s.layer, sub, _kind(s, sub), a, b, ratio, not ratio <= limit))
    precision, systematic = [], set()
    for sub in SUBLAYERS:
        for kind in sorted({r.kind for r in ratios if r.sublayer == sub}):
            group = [r for r in ratios if r.sublayer == sub and r.kind == kind]
            if len(group) >= 2 and all(r.over for r in group):
                systematic |= {(r.layer, sub) for r in group}
                lo, hi = min(r.ratio for r in group), max(r.ratio for r in group)
                precision.append(f"{kind} {sub} of every {kind} layer ({ranges(r.layer for r in group)}) adds "
                                 f"{lo:.3g}x .. {hi:.3g}x the control's: the candidate's recipe, not one layer")
    fa, fb = cand.kda_state, ctrl.kda_state
    if fa is not None and fb is not None and fa.verdict != fb.verdict:
        precision.append(f"KDA state {fa.verdict} in the candidate, {fb.verdict} in the control "
                         f"(candidate: {fa.line()}; control: {fb.line()})")
    first = next((r for r in ratios if r.over and (r.layer, r.sublayer) not in systematic), None)
    return ControlVerdict(limit, ratios, precision, None if first is None else (first.layer, first.sublayer))


def control_limit(dump, table: BudgetTable | None = None) -> float:
    """The control_ratio budget for this candidate dump (format.Dump): its geometry's, else the largest."""
    return (table or default_table()).row(geometry_of(dump.config), dump.dtype, CONTROL_RATIO).limit


def common_steps(cand, ctrl) -> int:
    """How many leading steps two dumps (format.Dump) ran on the same tokens."""
    n = 0
    for a, b in zip(cand.steps, ctrl.steps, strict=False):
        if list(map(int, a.tokens)) != list(map(int, b.tokens)):
            break
        n += 1
    return n


def same_prompts(cand, ctrl) -> str | None:
    """Why two dumps (format.Dump) cannot be judged against each other, or None."""
    a = [list(map(int, s.tokens)) for s in cand.steps]
    b = [list(map(int, s.tokens)) for s in ctrl.steps]
    if a[:1] != b[:1]:
        return "expected the control's prompt to be the candidate's, found another prefill"
    if cand.config.to_json() != ctrl.config.to_json():
        return "expected the control's config to be the candidate's, found another"
    return None
