"""The per-layer plot of a compare: an inline SVG of the added and the carried divergence of every layer.

x: the judged layers, each labelled with its number and kinds (KDA / MLA over dense / MoE; MLA columns shaded);
y: relative RMS, log scale. Two series: "added" (per layer, its sublayer with the largest added divergence over
its budget, worst over the steps) and "carried" (the layer input's divergence from the float64 free run, worst
over the steps). The added budget is a dashed line; the carried divergence has no fixed budget (a correct engine's
grows with depth), so when there is a source a dotted line marks its own input's carried divergence, the level a
later layer's input must pass to make that layer a carrier. The source layer is ringed and labelled, the carriers'
carried points are filled orange. One point per layer and series; a layer without a number (no free run, say)
has no point of that series.
"""
from __future__ import annotations

import html
import math

from conformance.report_plots import show_number

from .recompute import LAYER_ROW, Row
from .verdict import DumpReport, LayerSummary

_e = html.escape
FLOOR, CEIL = 1e-12, 1e3     # rel RMS drawn at least at FLOOR (exact: 0), at most at CEIL (NaN, inf, huge)
ADDED, CARRIED_COLOR, BUDGET, SOURCE, CARRIER = "#1f77b4", "#2ca02c", "#d62728", "#d62728", "#ff7f0e"


def worst_added(s: LayerSummary) -> Row | None:
    """The sublayer row of `s` furthest over (or nearest to) its budget; the whole-layer row only when no
    sublayer row exists."""
    rows = [r for k, r in s.worst.items() if k != LAYER_ROW] or [r for k, r in s.worst.items() if k == LAYER_ROW]
    return max(rows, key=_ratio) if rows else None


def _over(value: float, budget: float | None) -> float:
    return 0.0 if budget is None else (value / budget if budget > 0 else math.inf)


def _ratio(r: Row) -> float:
    """How far the row is over its budgets, as a multiple: the largest of rel RMS, gain and (mlp) a routed expert's
    pooled gain score over their budgets, so a layer flagged by any of them plots above the budget line."""
    if r.added.nonfinite or not math.isfinite(r.added.rel_rms):
        return math.inf
    ratios = [_over(r.added.rel_rms, r.budget), _over(abs(r.added.gain), r.gain_budget)]
    x = r.experts
    if x is not None and x.worst is not None:
        ratios.append(_over(x.worst.score, x.gain_budget))
    return max(ratios)


def _lg(v: float) -> float:
    return math.log10(CEIL) if not math.isfinite(v) else math.log10(min(max(v, FLOOR), CEIL))


def layer_plot(report: DumpReport, width: int = 640, height: int = 260) -> str:
    """The SVG (empty string when no layer was judged)."""
    layers = report.layers
    if not layers:
        return ""
    added = {s.layer: r for s in layers if (r := worst_added(s)) is not None}
    carried = {s.layer: s.carried.rel_rms for s in layers if s.carried is not None}
    budgets = [r.budget for r in added.values()] + [b for s in layers if (b := s.carried_budget) is not None]
    values = [r.added.rel_rms for r in added.values()] + list(carried.values()) + budgets
    ys = [_lg(v) for v in values] or [0.0]
    lo, hi = math.floor(min(ys)), math.ceil(max(ys))
    hi += hi == lo   # a single decade still gets a height
    pad_l, pad_t, pad_b, legend = 58, 24, 50, 175
    xs = [s.layer for s in layers]
    n = len(xs)
    w, h = width + legend, height

    def px(i: float) -> float:   # i: position of the layer in the list (layers need not be consecutive)
        return pad_l + (i + 0.5) / n * (width - pad_l)

    def py(v: float) -> float:
        return pad_t + (hi - _lg(v)) / (hi - lo) * (h - pad_t - pad_b)

    p = [f"<svg class=dump-layers xmlns='http://www.w3.org/2000/svg' width={w} height={h} role=img font-size=10>",
         f"<text x={pad_l} y=15 font-size=12>added vs carried relative RMS per layer ({_e(report.dtype)})</text>"]
    col = (width - pad_l) / n
    for i, s in enumerate(layers):
        if s.mixer == "MLA":
            p.append(f"<rect class=mla x={px(i) - col / 2:.1f} y={pad_t} width={col:.1f} height={h - pad_t - pad_b} "
                     "fill='#f0f0fa' />")
        p.append(f"<text class=layer-label x={px(i):.1f} y={h - pad_b + 12} text-anchor=middle>{s.layer}</text>"
                 f"<text class=kind x={px(i):.1f} y={h - pad_b + 23} text-anchor=middle>{_e(s.mixer)}</text>"
                 f"<text class=kind x={px(i):.1f} y={h - pad_b + 34} text-anchor=middle>{_e(s.mlp)}</text>")
    step = 1 if hi - lo <= 8 else 2
    for y in range(lo, hi + 1, step):
        yy = pad_t + (hi - y) / (hi - lo) * (h - pad_t - pad_b)
        p.append(f"<line x1={pad_l} x2={width} y1={yy:.1f} y2={yy:.1f} stroke='#eee' />"
                 f"<text x={pad_l - 4} y={yy + 3:.1f} text-anchor=end>1e{y}</text>")
    p.append(f"<text x={(pad_l + width) / 2:.0f} y={h - 3} text-anchor=middle>layer (mixer, mlp)</text>"
             f"<text transform='translate(12 {(pad_t + h - pad_b) / 2:.0f}) rotate(-90)' text-anchor=middle>"
             "relative RMS</text>")
    index = {layer: i for i, layer in enumerate(xs)}
    p += _budget_lines(report, added, px, py, index)
    p += _series("added", ADDED, [(index[la], r.added.rel_rms, f"layer {la} {r.sublayer}: added rel RMS "
                                   f"{show_number(r.added.rel_rms)} (budget {show_number(r.budget)}, step {r.step})")
                                  for la, r in added.items()], px, py)
    p += _series("carried", CARRIED_COLOR, [(index[la], v, f"layer {la}: carried rel RMS {show_number(v)}")
                                            for la, v in carried.items()], px, py,
                 marked={index[c] for c in report.carriers if c in index})
    if report.source is not None and report.source[0] in added:
        la, sub, step = report.source
        x, y0 = px(index[la]), py(added[la].added.rel_rms)
        p.append(f"<g class=source><circle cx={x:.1f} cy={y0:.1f} r=7 fill=none stroke='{SOURCE}' stroke-width=2 />"
                 f"<text x={x + 9:.1f} y={max(y0 - 8, pad_t + 8):.1f} fill='{SOURCE}' font-weight=bold>source: "
                 f"{_e(sub)} (step {step})</text></g>")
    p += _legend(width)
    p.append("</svg>")
    return "".join(p)


def _budget_lines(report: DumpReport, added: dict[int, Row], px, py, index: dict[int, int]) -> list[str]:
    """The added budget (one segment per layer: the budget of the sublayer plotted; one straight line when the
    sublayers share a budget) and the carried budget, both dashed."""
    out = []
    if added:
        pts = " ".join(f"{px(index[la] + d):.1f},{py(r.budget):.1f}" for la, r in sorted(added.items())
                       for d in (-0.5, 0.5))
        out.append(f"<polyline class=budget data-series=added fill=none stroke='{BUDGET}' stroke-dasharray='5 3' "
                   f"points='{pts}'><title>added budget</title></polyline>")
    cb = [b for s in report.layers if (b := s.carried_budget) is not None]
    if cb:
        y = py(max(cb))
        out.append(f"<line class=budget data-series=carried x1={px(-0.5):.1f} x2={px(len(report.layers) - 0.5):.1f} "
                   f"y1={y:.1f} y2={y:.1f} stroke='{CARRIED_COLOR}' stroke-dasharray='2 3'>"
                   f"<title>the source's input: carried {show_number(max(cb))}</title></line>")
    return out


def _series(name: str, color: str, pts: list[tuple[int, float, str]], px, py, marked=frozenset()) -> list[str]:
    if not pts:
        return []
    pts = sorted(pts)
    line = " ".join(f"{px(i):.1f},{py(v):.1f}" for i, v, _ in pts)
    out = [f"<g class=series data-series={name}>"
           f"<polyline fill=none stroke='{color}' stroke-width=1.5 points='{line}' />"]
    for i, v, tip in pts:
        fill = CARRIER if i in marked else color
        out.append(f"<circle class={name} cx={px(i):.1f} cy={py(v):.1f} r=3 fill='{fill}'><title>{_e(tip)}"
                   f"{' (carrier)' if i in marked else ''}</title></circle>")
    out.append("</g>")
    return out


def _legend(width: int) -> list[str]:
    items = [("added (worst sublayer)", ADDED, ""), ("carried (layer input)", CARRIED_COLOR, ""),
             ("added budget", BUDGET, "5 3"), ("source's input (carried)", CARRIED_COLOR, "2 3"),
             ("carrier", CARRIER, ""), ("source", SOURCE, "")]
    out = []
    for k, (label, color, dash) in enumerate(items):
        y = 34 + 14 * k
        dashed = f" stroke-dasharray='{dash}'" if dash else ""
        mark = f"<line x1={width + 10} x2={width + 26} y1={y - 3} y2={y - 3} stroke='{color}' stroke-width=2{dashed} />"
        out.append(mark + f"<text x={width + 30} y={y} font-size=11>{_e(label)}</text>")
    return out
