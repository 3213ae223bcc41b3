"""The per-layer plots of report.html: for each model trace and backend, an inline SVG of each layer's worst error
over its bound (log scale, the bound a dashed line at 1), one series per step, the layers labelled KDA / MLA."""
from __future__ import annotations

import html
import math
from collections import defaultdict

from conformance.cases.trace_names import TraceName
from conformance.results import CaseResult, RunReport, TensorResult

_e = html.escape
PLOT_FLOOR = 1e-12    # error / bound ratios below this (an exact result: 0) are drawn at it
_STEP_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
_BOUND_COLOR = "#d62728"


def show_number(x: float | None) -> str:
    """A number for the page: the value to 3 digits, '-' when there is none."""
    if x is None:
        return "-"
    return str(x) if not math.isfinite(x) else f"{x:.3g}"


def error_over_bound(t: TensorResult) -> float:
    """The tensor's error over its bound (inf when not comparable): above 1 fails a gated tensor."""
    c = t.comparison
    if c.problem and not c.exact:
        return math.inf
    if not c.nonfinite_ok or math.isnan(c.rel_rms):
        return math.inf
    return c.rel_rms / t.verdict.bound if t.verdict.bound > 0 else (0.0 if c.rel_rms == 0 else math.inf)


def layer_plots(report: RunReport) -> list[str]:
    """For each trace case, one plot per backend (small multiples), open when a backend failed the case."""
    per_case: dict[str, list[CaseResult]] = defaultdict(list)
    for r in report.results:
        if any(t.layer is not None for t in r.tensors):
            per_case[r.case].append(r)
    if not per_case:
        return []
    out = ["<h2 id=layers>Per-layer error</h2><p>Each point: the largest relative RMS error over its bound among the "
           "tensors of one layer at one decode step (step 0 is the prefill); the bound is the line at 1. Layers are "
           "labelled by their mixer, KDA or MLA (MLA columns shaded). Hover a point for its tensor.</p>"]
    for k, (case, results) in enumerate(per_case.items()):   # the first case open, to show what a plot says
        failed = any(r.status in ("fail", "error") for r in results)
        out.append(f"<details{' open' if failed or k == 0 else ''}><summary><b>{_e(case)}</b></summary>"
                   + "".join(layer_svg(f"{case} on {r.backend}", r.tensors) for r in results) + "</details>")
    return out


def layer_kinds(tensors: list[TensorResult]) -> dict[int, str]:
    """layer -> 'KDA' / 'MLA': the block its mixer tensors were judged under (kda_* / mla_*), which the trace
    kind reads from the model config's layer schedule (K3Config.is_mla); '' for a layer it does not say."""
    kinds: dict[int, str] = {}
    for t in tensors:
        if t.layer is not None and t.block.startswith(("kda", "mla")):
            kinds[t.layer] = t.block[:3].upper()
    return kinds


def _worst_per_layer(tensors: list[TensorResult]) -> dict[int, dict[int, TensorResult]]:
    """step -> layer -> the tensor of that layer and step with the largest error over bound."""
    worst: dict[int, dict[int, TensorResult]] = defaultdict(dict)
    for t in tensors:
        name = TraceName.parse(t.tensor)
        if t.layer is None or name is None:
            continue
        cur = worst[name.step].get(t.layer)
        if cur is None or error_over_bound(t) > error_over_bound(cur):
            worst[name.step][t.layer] = t
    return worst


def layer_svg(title: str, tensors: list[TensorResult], width: int = 400, height: int = 230) -> str:
    """An inline SVG: x = layer (labelled KDA / MLA), y = log10(worst error / bound), one series per step,
    the bound as a dashed line at 1; the legend to the right, wide enough for its longest label."""
    worst = _worst_per_layer(tensors)
    kinds = layer_kinds(tensors)
    steps = sorted(worst)
    layers = sorted({layer for s in worst.values() for layer in s})
    if not layers:
        return ""
    labels = [f"step {s}" + (" (prefill)" if s == 0 else "") for s in steps] + ["bound"]
    pad_l, pad_t, pad_b = 58, 22, 46
    pad_r = 14 + 7 * max(len(x) for x in labels) + 26

    def lg(v: float) -> float:   # an overflowed or NaN ratio is drawn at the top, an exact result at the floor
        return 3.0 if not math.isfinite(v) else math.log10(min(max(v, PLOT_FLOOR), 1e3))

    ys = [lg(error_over_bound(t)) for s in worst.values() for t in s.values()]
    lo = min(math.floor(min(ys)), -1)
    hi = max(math.ceil(max(ys)), 1)
    x0, x1 = layers[0] - 0.5, layers[-1] + 0.5
    w, h = width + pad_r, height

    def px(layer: float) -> float:
        return pad_l + (layer - x0) / (x1 - x0) * (width - pad_l)

    def py(y: float) -> float:
        return pad_t + (hi - y) / (hi - lo) * (h - pad_t - pad_b)

    p = [f"<svg class=layers width={w} height={h} role=img font-size=10>",
         f"<text x={pad_l} y=14 font-size=12>{_e(title)}</text>"]
    for layer in layers:
        if kinds.get(layer) == "MLA":
            p.append(f"<rect x={px(layer - 0.5):.0f} y={pad_t} width={px(1) - px(0):.0f} "
                     f"height={py(lo) - pad_t:.0f} fill='#f0f0fa' />")
        p.append(f"<text x={px(layer):.0f} y={h - pad_b + 13} text-anchor=middle>{layer}</text>"
                 f"<text x={px(layer):.0f} y={h - pad_b + 24} text-anchor=middle>{kinds.get(layer, '')}</text>")
    step = 1 if hi - lo <= 8 else 2
    for y in range(lo, hi + 1, step):
        p.append(f"<line x1={pad_l} x2={width} y1={py(y):.0f} y2={py(y):.0f} stroke='#eee' />"
                 f"<text x={pad_l - 4} y={py(y) + 3:.0f} text-anchor=end>1e{y}</text>")
    p.append(f"<text x={(pad_l + width) / 2:.0f} y={h - 4} text-anchor=middle>layer (mixer)</text>"
             f"<text transform='translate(12 {(pad_t + h - pad_b) / 2:.0f}) rotate(-90)' text-anchor=middle>"
             "rel RMS error / bound</text>")
    p.append(f"<line class=bound x1={pad_l} x2={width} y1={py(0):.0f} y2={py(0):.0f} stroke='{_BOUND_COLOR}' "
             "stroke-dasharray='5 3' />")
    for i, s in enumerate(steps):
        color = _STEP_COLORS[i % len(_STEP_COLORS)]
        pts = [(px(layer), py(lg(error_over_bound(t))), layer, t) for layer, t in sorted(worst[s].items())]
        p.append(f"<g fill='{color}'><polyline fill=none stroke='{color}' stroke-width=1.5 points='"
                 + " ".join(f"{x:.0f},{y:.0f}" for x, y, _, _ in pts) + "' />")
        p += [f"<circle cx={x:.0f} cy={y:.0f} r=2.5><title>{_e(t.tensor)} ({_e(t.block)}): rel RMS "
              f"{show_number(t.comparison.rel_rms)}, bound {show_number(t.verdict.bound)}</title></circle>"
              for x, y, _, t in pts]
        p.append("</g>")
    for i, label in enumerate(labels):
        color = _BOUND_COLOR if label == "bound" else _STEP_COLORS[i % len(_STEP_COLORS)]
        y = pad_t + 8 + 14 * i
        dash = " stroke-dasharray='5 3'" if label == "bound" else ""
        p.append(f"<line x1={width + 10} x2={width + 26} y1={y - 3} y2={y - 3} stroke='{color}' stroke-width=2{dash} />"
                 f"<text x={width + 30} y={y} font-size=11>{_e(label)}</text>")
    p.append("</svg>")
    return "".join(p)
