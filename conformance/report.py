"""Reports of a run: a rich terminal table, and report.json / report.md / report.html under --report DIR.

Every report names the first failing (case, backend, tensor) at the top. The HTML is self-contained:
inline CSS and, for cases whose tensors carry a layer index (model traces: `step1.layer03.*`, read by
conformance.cases.trace_names), an inline SVG plot of the relative RMS error per layer for each backend — no
network, no JavaScript.
"""
from __future__ import annotations

import html
import json
import math
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from conformance.results import CaseResult, RunReport


def _cell(r: CaseResult) -> str:
    """Short verdict of one (case, backend): 'ok 3e-08' / 'baseline 3e-03' (the precision's baseline, within
    its own measured cap) / 'FAIL 2e-03>1e-05' / 'FAIL NaN/Inf' / 'FAIL 2 differ' / 'FAIL shape' /
    'FAIL speed' / 'n/a (reference core)' / 'skip' / 'ERROR'."""
    if r.status == "error":
        return "ERROR"
    if r.status == "n/a":
        return "n/a (reference core)"
    w = r.worst
    if w is None:
        return r.status
    tag = "baseline " if r.role == "baseline" else ""
    if not w.passed:
        if w.comparison.problem and not w.comparison.exact:
            return "FAIL " + tag + w.comparison.problem.split(":")[0]
        if w.comparison.exact:          # integer tensor: rel_rms is the share of differing elements
            return f"FAIL {tag}{w.comparison.n_total - w.comparison.n_within} differ"
        if not w.comparison.nonfinite_ok:
            return "FAIL " + tag + "NaN/Inf"
        return f"FAIL {tag}{w.comparison.rel_rms:.0e}>{w.verdict.bound:.0e}"
    if r.status == "fail":
        return "FAIL speed"
    return f"{tag or 'ok '}{w.comparison.rel_rms:.0e}"


def _grid(report: RunReport) -> tuple[list[str], list[str], dict]:
    cases, backends, cells = [], [], {}
    for r in report.results:
        if r.case not in cases:
            cases.append(r.case)
        if r.backend not in backends:
            backends.append(r.backend)
        cells[(r.case, r.backend)] = r
    return cases, backends, cells


def print_terminal(report: RunReport, console: Console | None = None) -> None:
    """The first failure, a case x backend table (worst relative RMS error per cell), skipped backends."""
    console = console or Console(width=None if _isatty() else 160)
    style = "bold red" if report.exit_code else "bold green"
    console.print(report.first_failure_line(), style=style, highlight=False, markup=False, soft_wrap=True)
    cases, backends, cells = _grid(report)
    table = Table(title=f"k3conf run ({report.config}): worst relative RMS error per case and backend",
                  title_justify="left")
    table.add_column("case", no_wrap=True)
    for b in backends:
        table.add_column(b, no_wrap=True)
    for c in cases:
        row = [c]
        for b in backends:
            r = cells.get((c, b))
            text = "-" if r is None else _cell(r)
            color = {"pass": "green", "skip": "yellow", "n/a": "cyan"}.get("" if r is None else r.status, "red")
            row.append(f"[{color}]{text}[/]")
        table.add_row(*row)
    console.print(table)
    for row_of in report.backends:
        if not row_of["available"]:
            console.print(f"skipped {row_of['name']}: {row_of['reason']}", style="yellow", highlight=False,
                          markup=False)
    for note in baseline_notes(report):
        console.print(note, style="yellow", highlight=False, markup=False)
    for line in flip_lines(report):
        console.print(line, style="red", highlight=False, markup=False)
    for line in report.strict_missing:
        console.print(f"K3_STRICT=1: {line}", style="red", highlight=False, markup=False)
    for line in report.nothing_judged:
        console.print(line, style="red", highlight=False, markup=False)
    fails = report.failures
    for r in fails[:20]:
        console.print(f"  {r.case} on {r.backend}: {_why(r)}", style="red", highlight=False, markup=False)
    if len(fails) > 20:
        console.print(f"  ... and {len(fails) - 20} more (see the report files)", style="red")
    console.print(f"(case, backend) results: {_tally(report)}, in {report.wall_seconds:.1f} s",
                  highlight=False, markup=False)


def _tally(report: RunReport) -> str:
    """'169 passed, 1 failed (1 error), 7 n/a, 4 skipped of 181': n/a (only reference cores would run) and
    skip (a kernel not built for that shape) are neither passes nor failures."""
    c = report.counts()
    fail = f"{c['fail']} failed" + (f" ({c['error']} error{'s' if c['error'] != 1 else ''})" if c["error"] else "")
    return f"{c['pass']} passed, {fail}, {c['n/a']} n/a, {c['skip']} skipped of {c['total']}"


def flip_lines(report: RunReport) -> list[str]:
    """One line per greedy-token flip: case, backend, step, expected and found ids, the reference's margin."""
    return [f"{r.case} on {r.backend}: greedy token flip at step {f['step']}: expected {f['expected']}, found "
            f"{f['found']} (reference logit margin {f['margin']:.3g})" for r in report.results for f in r.flips]


def _isatty() -> bool:
    return sys.stdout.isatty()


def baseline_notes(report: RunReport) -> list[str]:
    """One line per precision whose baseline could not run (its rows used the absolute cap alone), and the
    notes of the results (e.g. a trace core that fell back to the reference)."""
    notes: set[str] = set()
    fresh_passes: dict[str, int] = {}   # seed -> cells that passed on fresh inputs too: one line, not one per cell
    for r in report.results:
        for n in r.notes:
            seed = _fresh_pass_seed(n)
            if seed is None:
                notes.add(f"{r.case} on {r.backend}: {n}")
            else:
                fresh_passes[seed] = fresh_passes.get(seed, 0) + 1
        if r.status == "n/a":
            notes.add(f"{r.case} on {r.backend}: n/a, {r.error}")
        for t in r.tensors:
            if t.baseline is not None and t.baseline_err is None and not t.comparison.exact:
                notes.add(f"baseline {t.baseline} unavailable for {r.precision}: the absolute cap alone applied")
    notes.update(f"fresh inputs: seed {seed}: {n} (case, backend) result(s) passed on them too (replay: "
                 f"K3CONF_FRESH_SEED={seed} k3conf run ...)" for seed, n in fresh_passes.items())
    return sorted(notes)


def _fresh_pass_seed(note: str) -> str | None:
    """The seed of a runner's 'fresh inputs: seed N (pass; ...)' note, else None (a failure keeps its own line)."""
    head, _, rest = note.partition(" (")
    if head.startswith("fresh inputs: seed ") and rest.startswith("pass;"):
        return head.removeprefix("fresh inputs: seed ")
    return None


def _why(r: CaseResult) -> str:
    if r.status in ("error", "skip", "n/a"):
        return r.error
    t = r.first_failing
    if t is None:
        if r.status == "pass" and r.worst is not None:
            return r.worst.verdict.why
        return f"speed: {r.speed.note}" if r.speed else r.status
    return (f"outputs.{t.tensor} (block {t.block}): " + (f"{t.note}; " if t.note else "")
            + f"{t.comparison.summary()} [{t.verdict.why}]")


def _verdict(t) -> str:
    """'pass' / 'FAIL' for a gated tensor; 'reported' / 'reported (above bound)' for a reported-only one."""
    if not t.gated:
        return "reported" if t.verdict.passed else "reported (above bound)"
    return "pass" if t.passed else "FAIL"


def present(report: RunReport, out_dir: Path, command: str, console: Console | None = None) -> int:
    """The end of a run for its front end: `report` on the terminal, its files in `out_dir`, and the run's exit
    status. The folder was writable before the run; if it is not now, a failed gate still says 1, else 2."""
    console = console or Console(width=None if _isatty() else 160)
    print_terminal(report, console)
    try:
        paths = write_reports(report, out_dir)
    except OSError as e:
        print(f"{command}: cannot write the reports to {out_dir} ({e.strerror or e}); none was written",
              file=sys.stderr)
        return report.exit_code or 2
    console.print(f"reports: {', '.join(str(p) for p in paths)}", highlight=False)
    return report.exit_code


def write_reports(report: RunReport, out_dir: Path) -> list[Path]:
    """report.json, report.md and report.html under out_dir, all three or none; returns the paths. They are
    written into a temporary folder inside `out_dir` first and renamed into place only when all three exist, so
    a failure (disk full, say) never leaves a new JSON next to a stale HTML."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=out_dir))
    try:
        staged = [tmp / "report.json", tmp / "report.md", tmp / "report.html"]
        staged[0].write_text(json.dumps(_strict_json(report.to_dict()), indent=1, sort_keys=True, allow_nan=False,
                                        default=_json_default) + "\n")
        staged[1].write_text(markdown(report))
        staged[2].write_text(html_report(report))
        final = [out_dir / p.name for p in staged]
        for src, dst in zip(staged, final, strict=True):
            os.replace(src, dst)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _strict_json(o):
    """`o` with every non-finite float as the string "nan" / "inf" / "-inf": json.dumps would write the bare
    tokens NaN / Infinity, which strict JSON readers reject, exactly in the reports of failing runs."""
    if isinstance(o, dict):
        return {k: _strict_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_strict_json(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    return o


def _json_default(o):
    if hasattr(o, "item"):
        return _strict_json(o.item())
    return str(o)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def versus(t) -> str:
    """' (0.7x the torch-bf16 baseline)' when the row is baseline-relative and the baseline erred; else ''."""
    m = t.baseline_multiple
    return "" if m is None else f" ({m:.2g}x the {t.baseline} baseline)"


def speed_text(sp) -> str:
    """'35 us, 0.012 of copy bw, 0.73x baseline time[, PASS/FAIL vs target]'."""
    parts = [f"{sp.seconds * 1e6:.0f} us"]
    if sp.bw_ratio is not None:
        parts.append(f"{sp.bw_ratio:.3g} of copy bw")
    if sp.time_ratio is not None:
        parts.append(f"{sp.time_ratio:.3g}x {sp.baseline or 'baseline'} time")
    if sp.passed is not None:
        parts.append(("PASS" if sp.passed else "FAIL") + f" ({sp.note})")
    return ", ".join(parts)


def markdown(report: RunReport) -> str:
    """The report as Markdown: first failure, per-result table, skipped backends, gate reasons."""
    lines = [f"# k3conf run ({report.config})", "", f"**{report.first_failure_line()}**", ""]
    cnt = report.counts()
    lines += [f"Results (case, backend): **{cnt['pass']} pass, {cnt['fail']} fail, {cnt['n/a']} n/a, "
              f"{cnt['skip']} skip** of {cnt['total']}"
              + (f" ({cnt['error']} of the failures are errors)" if cnt["error"] else "") + ".", ""]
    lines += [f"- K3_STRICT=1: {m}" for m in report.strict_missing]
    lines += [f"- {m}" for m in report.nothing_judged]
    lines += [f"- skipped `{b['name']}`: {b['reason']}" for b in report.backends if not b["available"]]
    lines += [f"- {n}" for n in baseline_notes(report)]
    lines += [f"- {n}" for n in flip_lines(report)]
    lines += ["",
              "| case | backend | status | tensor | max abs | rel RMS | bound | passed | worst (out vs ref) | speed |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report.results:
        sp = "-" if r.speed is None else speed_text(r.speed)
        if r.status in ("error", "skip", "n/a"):
            error = r.error.replace("|", "/")
            lines.append(f"| {r.case} | {r.backend} | {r.status.upper()} | - | - | - | - | - | {error} | - |")
            continue
        for t in r.tensors:
            c = t.comparison
            if c.problem and not c.exact:      # not comparable (shape, dtype, missing): the metrics are empty
                worst = c.problem.replace("|", "/")
            elif c.worst_index is None or (c.max_abs == 0 and c.nonfinite_ok):   # nothing differs
                worst = "-"
            else:
                worst = f"{list(c.worst_index)}: {c.worst_out:.6g} vs {c.worst_ref:.6g}"
            if t.note:
                worst = f"{t.note}; {worst}".replace("|", "/")
            role = " (baseline)" if r.role == "baseline" else ""
            lines.append(f"| {r.case} | {r.backend}{role} | {_verdict(t)} | {t.tensor} | {_fmt(c.max_abs)} | "
                         f"{_fmt(c.rel_rms)}{versus(t)} | {_fmt(t.verdict.bound)} | {c.passed_line} | {worst} | {sp} |")
    lines += ["", "## Gate rows used", "", "| block | tensor | precision | applies to | cap | k | floor | reason |",
              "|---|---|---|---|---|---|---|---|"]
    used = {}
    for r in report.results:
        for t in r.tensors:
            used[(tuple(t.gate_key), "the baseline itself" if r.role == "baseline" else "other backends")] = t.gate
    for (key, who), g in sorted(used.items()):
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {who} | {g.cap:g} | {_fmt(g.k)} | {g.floor:g} | {g.reason} |")
    lines.append(f"\n(case, backend) results: {_tally(report)}, in {report.wall_seconds:.1f} s.\n")
    return "\n".join(lines)


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em} .first{padding:.6em;border-radius:4px;font-weight:bold}
.bad{background:#fde2e2;color:#8b0000} .good{background:#e3f6e3;color:#1d5e1d}
table{border-collapse:collapse;font-size:.85em;margin:1em 0} td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f3f3f3} td.pass{color:#1d5e1d} td.fail,td.error{color:#b00000;font-weight:bold}
td.skip{color:#8a6d00} td.na{color:#2a6f8a}
.note{color:#8a6d00} svg{background:#fff;border:1px solid #ddd;margin:.5em 0}"""


def html_report(report: RunReport) -> str:
    """Self-contained HTML (inline CSS, inline SVG per-layer plots; no scripts, no external links)."""
    e = html.escape
    cls = "bad" if report.exit_code else "good"
    out = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>k3conf report</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>k3conf run ({e(report.config)})</h1>",
           f"<p class='first {cls}'>{e(report.first_failure_line())}</p>"]
    cnt = report.counts()
    out.append(f"<p>Results (case, backend): <b>{cnt['pass']} pass, {cnt['fail']} fail, {cnt['n/a']} n/a, "
               f"{cnt['skip']} skip</b> of {cnt['total']}"
               + (f" ({cnt['error']} of the failures are errors)" if cnt["error"] else "") + ".</p>")
    out += [f"<p class='first bad'>K3_STRICT=1: {e(m)}</p>" for m in report.strict_missing]
    out += [f"<p class='first bad'>{e(m)}</p>" for m in report.nothing_judged]
    for row_of in report.backends:
        if not row_of["available"]:
            out.append(f"<p class='note'>skipped {e(row_of['name'])}: {e(row_of['reason'])}</p>")
    out += [f"<p class='note'>{e(n)}</p>" for n in baseline_notes(report)]
    out += [f"<p class='first bad'>{e(n)}</p>" for n in flip_lines(report)]
    out += _layer_plots(report)
    cases, backends, cells = _grid(report)
    out.append("<table><tr><th>case</th>" + "".join(f"<th>{e(b)}</th>" for b in backends) + "</tr>")
    for c in cases:
        row = f"<tr><td>{e(c)}</td>"
        for b in backends:
            r = cells.get((c, b))
            row += ("<td>-</td>" if r is None else
                    f"<td class='{r.status.replace('/', '')}' title='{e(_why(r))}'>{e(_cell(r))}</td>")
        out.append(row + "</tr>")
    out.append("</table>")
    out.append("<table><tr><th>case</th><th>backend</th><th>tensor</th><th>status</th><th>max abs</th><th>rel RMS</th>"
               "<th>bound</th><th>passed</th><th>rule</th><th>speed</th></tr>")
    for r in report.results:
        if r.status in ("error", "skip", "n/a"):
            css = r.status.replace("/", "")
            out.append(f"<tr><td>{e(r.case)}</td><td>{e(r.backend)}</td><td>-</td><td class='{css}'>"
                       f"{r.status.upper()}</td><td colspan='6'>{e(r.error)}</td></tr>")
        for t in r.tensors:
            cmp = t.comparison
            st = "pass" if t.passed else "fail"
            role = " (baseline)" if r.role == "baseline" else ""
            rule = (f"{t.note}; " if t.note else "") + t.verdict.why
            out.append(f"<tr><td>{e(r.case)}</td><td>{e(r.backend + role)}</td><td>{e(t.tensor)}</td>"
                       f"<td class='{st}'>{e(_verdict(t))}</td>"
                       f"<td>{_fmt(cmp.max_abs)}</td><td>{_fmt(cmp.rel_rms)}{e(versus(t))}</td>"
                       f"<td>{_fmt(t.verdict.bound)}</td><td>{e(cmp.passed_line)}</td><td>{e(rule)}</td>"
                       f"<td>{'-' if r.speed is None else e(speed_text(r.speed))}</td></tr>")
    out.append("</table></body></html>\n")
    return "\n".join(out)


_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")


def _layer_plots(report: RunReport) -> list[str]:
    """One SVG per case with per-layer tensors: log10 relative RMS error vs layer, one line per backend."""
    series: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in report.results:
        for t in r.tensors:
            if t.layer is not None:
                cur = series[r.case][r.backend].get(t.layer, 0.0)
                series[r.case][r.backend][t.layer] = max(cur, t.comparison.rel_rms)
    return [svg_plot(case, per_backend) for case, per_backend in series.items()]


def svg_plot(title: str, per_backend: dict[str, dict[int, float]], width: int = 560, height: int = 240) -> str:
    """An inline SVG line plot: x = layer, y = log10(rel RMS error) (clipped to 1e-18 .. 1e3), one line per backend."""
    pad_l, pad_r, pad_t, pad_b = 48, 110, 24, 30
    layers = sorted({layer for s in per_backend.values() for layer in s})

    def lg(v: float) -> float:   # clipped to [1e-18, 1e3]: an overflowed (inf) error is drawn at the top
        return math.log10(min(max(v, 1e-18), 1e3)) if not math.isnan(v) else 3.0

    ys = [lg(v) for s in per_backend.values() for v in s.values()]
    lo, hi = math.floor(min(ys)), math.ceil(max(ys))
    hi = hi if hi > lo else lo + 1
    x0, x1 = layers[0], max(layers[-1], layers[0] + 1)

    def px(layer):
        return pad_l + (layer - x0) / (x1 - x0) * (width - pad_l - pad_r)

    def py(y):
        return pad_t + (hi - y) / (hi - lo) * (height - pad_t - pad_b)

    e = html.escape
    parts = [f"<svg width='{width}' height='{height}' role='img'>",
             f"<text x='{pad_l}' y='16' font-size='12'>{e(title)}: relative RMS error per layer</text>"]
    for y in range(lo, hi + 1):
        parts.append(f"<line x1='{pad_l}' x2='{width - pad_r}' y1='{py(y):.1f}' y2='{py(y):.1f}' stroke='#eee'/>"
                     f"<text x='4' y='{py(y) + 4:.1f}' font-size='10'>1e{y}</text>")
    for layer in layers:
        parts.append(f"<text x='{px(layer) - 4:.1f}' y='{height - 10}' font-size='10'>{layer}</text>")
    for i, (backend, s) in enumerate(sorted(per_backend.items())):
        color = _COLORS[i % len(_COLORS)]
        pts = " ".join(f"{px(layer):.1f},{py(lg(s[layer])):.1f}" for layer in sorted(s))
        parts.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='{pts}'/>")
        parts.append(f"<text x='{width - pad_r + 6}' y='{pad_t + 14 * i + 8}' font-size='11' fill='{color}'>"
                     f"{e(backend)}</text>")
    parts.append("</svg>")
    return "".join(parts)
