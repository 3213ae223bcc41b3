"""The files of a compare under --report DIR: report.json, report.md and report.html, all three or none.

report.json is DumpReport.to_json() (what `DumpReport.from_json` reads back) plus two keys of its own: "run"
(how the work was spread: workers or ranks, seconds, workers that died) and "metadata" (what it ran on:
conformance.metadata). report.md is the terminal text's content as Markdown tables; report.html is one
self-contained page (inline CSS and SVG, no script, no network): the verdict, the per-layer plot
(conformance.dumps.report_plot), the layer table, the tokens, the findings and the budget rows with their reasons.
"""
from __future__ import annotations

import html
import json
import os
import shutil
import tempfile
from pathlib import Path

from conformance import metadata
from conformance.report_plots import show_number

from .budgets import ROWS
from .divergence import Divergence
from .recompute import Row
from .report_plot import layer_plot
from .report_text import COLUMNS, ranges, sci, source_line, token_lines, verdict_line
from .verdict import DumpReport, LayerSummary

_e = html.escape
RUN_KEYS = ("run", "metadata")   # the keys report.json adds to DumpReport.to_json()

_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:110em}h1{font-size:1.3em}
h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}.first{padding:.6em;border-radius:4px;
font-weight:bold}.bad{background:#fde2e2;color:#8b0000}.good{background:#e3f6e3;color:#1d5e1d}
table{border-collapse:collapse;font-size:.85em;margin:.6em 0}td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f3f3f3;text-align:left}td.n{text-align:right;white-space:nowrap}td.over{background:#fde2e2;
font-weight:bold}tr.source{outline:2px solid #d62728}tr.carrier td:first-child{background:#ffe9d1}
svg{background:#fff;border:1px solid #ddd;margin:.3em}"""


def report_doc(report: DumpReport, run: dict, meta: dict | None = None) -> dict:
    """report.json's object; `meta` defaults to conformance.metadata.collect() for this run."""
    doc = report.to_json()
    doc["run"] = run
    doc["metadata"] = meta if meta is not None else metadata.collect(duration=run.get("seconds"))
    return doc


def report_json(report: DumpReport, run: dict, meta: dict | None = None) -> str:
    """Strict JSON (Divergence writes NaN and inf as strings)."""
    return json.dumps(report_doc(report, run, meta), indent=1, sort_keys=True, allow_nan=False)


def write_reports(report: DumpReport, run: dict, out_dir: Path) -> list[Path]:
    """report.json, report.md, report.html under `out_dir`, staged in a temporary folder inside it and renamed
    into place only once all three exist (a failure never leaves a new JSON next to a stale HTML)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=out_dir))
    try:
        staged = {"report.json": report_json(report, run) + "\n", "report.md": markdown(report, run),
                  "report.html": html_page(report, run)}
        for name, text in staged.items():
            (tmp / name).write_text(text)
        final = [out_dir / name for name in staged]
        for path in final:
            os.replace(tmp / path.name, path)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----- Markdown -----

def _cell(row: Row | None) -> str:
    return "-" if row is None else sci(row.added.rel_rms) + (" **over**" if row.over else "")


def _carried(s: LayerSummary) -> str:
    if s.carried is None:
        return "-"
    off = s.carried_budget is not None and not s.carried.rel_rms <= s.carried_budget
    return sci(s.carried.rel_rms) + (" **over the source's input**" if off else "")


def markdown(report: DumpReport, run: dict) -> str:
    lines = [f"# k3conf compare: engine `{report.engine}` ({report.dtype}, TP {report.tp_size})", "",
             f"**{source_line(report)}**", "", verdict_line(report), "",
             "Worst added relative RMS per sublayer over the steps (engine output vs the float64 recompute from "
             "the engine's own input), and the worst carried relative RMS of the layer input (engine vs the "
             "float64 free run).", "",
             "| layer | mixer | mlp | " + " | ".join(COLUMNS) + " | carried | verdict |",
             "|---:|---|---|" + "---:|" * (len(COLUMNS) + 1) + "---|"]
    for s in report.layers:
        lines.append(f"| {s.layer} | {s.mixer} | {s.mlp} | " + " | ".join(_cell(s.worst.get(c)) for c in COLUMNS)
                     + f" | {_carried(s)} | {s.verdict} |")
    lines += [f"| {la} | | | " + " | ".join("-" for _ in COLUMNS) + " | - | missing |" for la in report.missing]
    lines += ["", "## Tokens", "", *(f"    {x}" for x in token_lines(report))]
    if report.findings:
        lines += ["", "## Findings (non-finite engine values)", "", *(f"- {f}" for f in report.findings)]
    if report.notes:
        lines += ["", "## Notes", "", *(f"- {n}" for n in report.notes)]
    lines += ["", "## Budgets", "", "| row | limit | reason |", "|---|---:|---|"]
    lines += [f"| {k} | {sci(report.budgets[k])} | {report.budget_source} |" for k in ROWS if k in report.budgets]
    lines += ["", f"Run: {_how(run)}", ""]
    return "\n".join(lines)


def _how(run: dict) -> str:
    where = (f"{len(run.get('ranks', []))} torchrun ranks" if run.get("distributed")
             else f"{run.get('workers', 1)} worker(s)")
    fails = run.get("failures") or []
    return (f"layers {ranges(run.get('layers', []))} on {where} in {run.get('seconds', '?')} s"
            + (f"; {len(fails)} worker failure(s)" if fails else ""))


# ----- HTML -----

def _div_title(d: Divergence) -> str:
    ulp = "" if d.ulp_max is None else f", ULP max {d.ulp_max} median {show_number(d.ulp_median)}"
    return (f"rel RMS {show_number(d.rel_rms)}, cosine {d.cosine:.9g}, max |diff| {show_number(d.max_abs)} at "
            f"{d.max_index}{ulp}" + (f", {d.nonfinite} non-finite" if d.nonfinite else ""))


def _html_cell(row: Row | None) -> str:
    if row is None:
        return "<td class=n>-</td>"
    cls = "n over" if row.over else "n"
    return (f"<td class='{cls}' title='{_e(_div_title(row.added))} (budget {sci(row.budget)}, step {row.step})'>"
            f"{_e(sci(row.added.rel_rms))}</td>")


def _layer_table(report: DumpReport) -> list[str]:
    out = ["<table class=layers><thead><tr><th>layer</th><th>mixer</th><th>mlp</th>"
           + "".join(f"<th>{_e(c)}</th>" for c in COLUMNS) + "<th>carried</th><th>verdict</th></tr></thead><tbody>"]
    for s in report.layers:
        carried = "-" if s.carried is None else (f"<span title='{_e(_div_title(s.carried))}'>"
                                                 f"{_e(sci(s.carried.rel_rms))}</span>")
        out.append(f"<tr class={s.verdict} id=layer-{s.layer}><td class=n>{s.layer}</td><td>{s.mixer}</td>"
                   f"<td>{s.mlp}</td>" + "".join(_html_cell(s.worst.get(c)) for c in COLUMNS)
                   + f"<td class=n>{carried}</td><td>{_e(s.verdict)}</td></tr>")
    out += [f"<tr class=missing><td class=n>{la}</td><td colspan={len(COLUMNS) + 4}>missing</td></tr>"
            for la in report.missing]
    out.append("</tbody></table>")
    return out


def html_page(report: DumpReport, run: dict) -> str:
    good = report.exit_code == 0
    body = [f"<h1>k3conf compare: engine {_e(report.engine)} ({_e(report.dtype)}, TP {report.tp_size})</h1>",
            f"<p class='first {'good' if good else 'bad'}'>{_e(source_line(report))}</p>",
            f"<p>{_e(verdict_line(report))}. {_e(_how(run))}.</p>",
            "<h2 id=plot>Per-layer divergence</h2><p>Added: the layer's sublayer furthest over its budget (engine "
            "output vs the float64 recompute from the engine's own input); carried: the layer input (engine vs "
            "the float64 free run). Worst over the steps; hover a point for its numbers.</p>",
            layer_plot(report), "<h2 id=layers>Layers</h2>", *_layer_table(report),
            "<h2 id=tokens>Tokens</h2><pre>" + _e("\n".join(token_lines(report))) + "</pre>"]
    if report.findings:
        body += ["<h2 id=findings>Findings</h2><ul>", *(f"<li>{_e(f)}</li>" for f in report.findings), "</ul>"]
    if report.notes:
        body += ["<h2 id=notes>Notes</h2><ul>", *(f"<li>{_e(n)}</li>" for n in report.notes), "</ul>"]
    body += ["<h2 id=budgets>Budgets</h2><table><tr><th>row</th><th>limit</th><th>reason</th></tr>",
             *(f"<tr><td>{_e(k)}</td><td class=n>{sci(report.budgets[k])}</td><td>{_e(report.budget_source)}</td>"
               "</tr>"
               for k in ROWS if k in report.budgets), "</table>"]
    return ("<!doctype html><html lang=en><head><meta charset=utf-8><title>k3conf compare</title>"
            f"<style>{_CSS}</style></head><body>" + "\n".join(body) + "</body></html>\n")
