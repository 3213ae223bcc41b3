"""The terminal text of a compare (also the body of report.md's summary): the source first, then one line per
layer, the tokens, the engine's findings and the notes.

    source: layer 5 mlp (added rel RMS 3.1e-2 > budget 2.0e-2 at step 0); carried by layers 6..11
    layer  mixer  mlp    attnres_mixer  mixer     attnres_mlp  mlp       layer     carried   verdict
    budget               4.5e-3         2.7e-2    5.0e-3       1.2e-2    2.8e-2    -
        4  KDA    MoE    1.1e-3         3.0e-3    9.0e-4       2.2e-3    2.9e-3    8.0e-3    ok
        5  MLA    MoE    1.0e-3         2.8e-3    8.7e-4       3.1e-2 !  3.0e-2    8.1e-3    source

Each number is the worst added relative RMS of that sublayer over the steps ("!" over its budget), and the
worst carried relative RMS of the layer's input (engine vs the float64 free run; "!" further off than the
source's own input was, which makes a later layer within its own budget a carrier).
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from .recompute import LAYER_ROW, SUBLAYERS
from .verdict import DumpReport, LayerSummary

COLUMNS = (*SUBLAYERS, LAYER_ROW)
_W = 10   # width of a number column


def sci(x: float | None) -> str:
    """A rel RMS for a reader: 2 digits, the exponent without padding (3.1e-2); '-' for none."""
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    mant, exp = f"{x:.1e}".split("e")
    return f"{mant}e{int(exp)}"


def ranges(xs: Iterable[int]) -> str:
    """'0..3, 7, 9..10' for [0, 1, 2, 3, 7, 9, 10]."""
    runs: list[list[int]] = []
    for x in sorted(set(xs)):
        if runs and runs[-1][1] == x - 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def source_line(report: DumpReport) -> str:
    """The verdict in one line: where the divergence starts and who carries it, or that nothing is over."""
    if report.source is None:
        judged = len(report.layers)
        line = f"source: none (the added divergence of every sublayer of the {judged} judged layers is within budget)"
        return line + (f"; layers {ranges(report.missing)} missing" if report.missing else "")
    layer, sublayer, step = report.source
    summary = next((s for s in report.layers if s.layer == layer), None)
    row = None if summary is None else summary.worst.get(sublayer)
    why = ""
    if row is not None:   # the worst row of that sublayer, over its steps; the source step is its first over
        first = "" if row.step == step else f", first over at step {step}"
        # every measure the row is over: rel RMS, gain, a routed expert's pooled gain, non-finite values
        why = f" ({'; '.join(row.over_by) or 'over budget'} at step {row.step}{first})"
    carried = f"; carried by layers {ranges(report.carriers)}" if report.carriers else ""
    return f"source: layer {layer} {sublayer}{why}{carried}"


def header_lines(report: DumpReport) -> list[str]:
    head = f"{'layer':>5}  {'mixer':<5}  {'mlp':<5}  " + "".join(f"{c:<{_W + 4}}" for c in (*COLUMNS, "carried"))
    # the carried divergence has no fixed budget (a correct engine's grows with depth): a carrier is a layer
    # whose input is further off than the source's own input was (verdict.py)
    budgets = [report.budgets.get(c) for c in COLUMNS] + [None]
    return [head + "verdict", f"{'budget':<21}" + "".join(f"{sci(b):<{_W + 4}}" for b in budgets)]


def layer_line(s: LayerSummary) -> str:
    cells = []
    for c in COLUMNS:
        row = s.worst.get(c)
        cells.append("-" if row is None else sci(row.added.rel_rms) + (" !" if row.over else ""))
    carried = s.carried
    over = carried is not None and s.carried_budget is not None and not carried.rel_rms <= s.carried_budget
    cells.append("-" if carried is None else sci(carried.rel_rms) + (" !" if over else ""))
    return f"{s.layer:>5}  {s.mixer:<5}  {s.mlp:<5}  " + "".join(f"{c:<{_W + 4}}" for c in cells) + s.verdict


def token_lines(report: DumpReport) -> list[str]:
    free = report.free
    if free is None:
        return ["tokens: not checked (no free run)"]
    if not free.tokens:
        return ["tokens: no steps"]
    agree = sum(t.agree for t in free.tokens)
    low = min(free.tokens, key=lambda t: t.margin)
    lines = [f"tokens: {agree} of {len(free.tokens)} steps agree with the float64 reference; smallest reference "
             f"margin (top1 - top2) {low.margin:.4g} at step {low.step}"]
    bad = set(report.token_failures)
    for t in free.tokens:
        engine = "-" if t.engine is None else str(t.engine)
        mark = "" if t.agree else ("  DISAGREE" if t.step in bad else
                                   f"  differs at a near tie (gap within the {report.token_tie:.3g} a correct "
                                   f"{report.dtype} engine moves a logit gap; noted)")
        gap = "" if t.gap is None or t.agree else f", gap to the engine's token {t.gap:.4g}"
        lines.append(f"  step {t.step}: engine {engine}, reference {t.reference}, margin {t.margin:.4g}{gap}{mark}")
    return lines


def text_lines(report: DumpReport, *, title: str = "") -> list[str]:
    """The whole terminal text, line by line."""
    lines = [source_line(report)]            # the verdict first; then what was compared
    lines += [title] if title else []
    lines += header_lines(report)
    lines += [layer_line(s) for s in report.layers]
    lines += [f"{layer:>5}  missing" for layer in report.missing]
    lines += [f"amplification: {a}" for a in report.amplification]
    lines += [] if report.kda_state is None else [f"precision: {report.kda_state.line()}"]
    lines += token_lines(report)
    lines += [f"finding: {f}" for f in report.findings]
    lines += [f"note: {n}" for n in report.notes]
    lines.append(verdict_line(report))
    return lines


def verdict_line(report: DumpReport) -> str:
    why = []
    if report.source is not None:
        why.append(f"a source at layer {report.source[0]} {report.source[1]}")
    if report.token_failures:
        why.append(f"token disagreement at steps {ranges(report.token_failures)}")
    if report.missing:
        why.append(f"layers {ranges(report.missing)} missing")
    return f"exit {report.exit_code}: " + ("; ".join(why) if why else "every judged layer within budget")
