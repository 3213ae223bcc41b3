"""report.html: one self-contained page (inline CSS, inline SVG, a few lines of inline JS; no network) that a
reader navigates from the verdict down to the tensor that decided it.

In page order:
- the summary: the first failure (a link to its tensor row), the counts, the notes, what the run ran on
  (`report.metadata`, when the run collected it);
- every failure, each a link to its tensor row;
- the case x backend grid, each cell a link to its result;
- the results table, one row per (case, backend), sortable by any column (click its header);
- per-layer plots of the model traces: for each (trace case, backend) the worst error over bound among a layer's
  tensors, one series per step, the bound at 1, the layers labelled KDA / MLA;
- the speed table: time, bytes moved, the fraction of the copy bandwidth measured in the same run, the ratio to
  the precision's baseline, and a mark on every result too small for its time to say anything about the kernel;
- the details: one collapsed <details> per case (failed cases open), one per (case, backend) inside it, with its
  tensor rows. A result with many tensors (a trace: ~300) lists its failing tensors and the ones nearest their
  bound; report.md and report.json list every tensor.
- the gate rows the run used, with their reasons.

The script sorts the tables, opens the <details> around a linked row, and marks the page (`data-report-js="ok"`
on <html>, `data-sortable="ready"` on each sortable table) so a headless browser can tell that it ran.
"""
from __future__ import annotations

import html
import math
from collections import defaultdict

from conformance import report_text as text_report  # the notes and flip lines the text reports show too
from conformance.report_plots import error_over_bound, layer_plots, show_number
from conformance.results import CaseResult, RunReport, TensorResult

# A result with more tensors than this lists its failing tensors and the NEAREST_ROWS nearest their bound: a trace
# result has ~300 tensors per backend, which made report.html megabytes of passing rows no one reads.
DETAIL_ROWS = 40
NEAREST_ROWS = 12
# Below this many bytes moved, a call's fixed cost (Python dispatch, allocation, a kernel launch: tens of
# microseconds) is as large as the time to move its bytes at a CPU copy bandwidth (~15 GB/s moves 1 MiB in ~70 us),
# so its time and bandwidth fraction measure that overhead, not the kernel.
OVERHEAD_BYTES = 1 << 20

_e = html.escape

_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:110em}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.6em;border-bottom:1px solid #ddd}
.first{padding:.6em;border-radius:4px;font-weight:bold}.bad{background:#fde2e2;color:#8b0000}
.good{background:#e3f6e3;color:#1d5e1d}.note{color:#8a6d00}
table{border-collapse:collapse;font-size:.85em;margin:.6em 0}td,th{border:1px solid #ccc;padding:2px 6px}
th{background:#f3f3f3;text-align:left}table.sort th{cursor:pointer}table.sort th[data-dir=asc]:after{content:" \\25B2"}
table.sort th[data-dir=desc]:after{content:" \\25BC"}
tr.res th{background:#eef3fa;font-weight:normal}
.tt td:nth-child(n+4):nth-child(-n+7),td.n{text-align:right;white-space:nowrap}.grid td{white-space:nowrap}
.pass{color:#1d5e1d}.fail,.error{color:#b00000;font-weight:bold}.skip{color:#8a6d00}.na{color:#2a6f8a}
.rep{color:#555}tr.f{background:#fde2e2}details{margin:.3em 0}
summary{cursor:pointer}dl{display:grid;grid-template-columns:max-content auto;gap:0 1em;font-size:.85em}
dt{font-weight:bold}dd{margin:0}svg{background:#fff;border:1px solid #ddd;margin:.3em}.tag{font-size:.8em;
padding:0 .3em;border-radius:3px;background:#fff3cd;color:#6b5200}:target{outline:2px solid #1f77b4}"""

# Sorts a table.sort by the clicked column (numbers by data-v, else text), opens the <details> around the element a
# link points at, and marks the page so a headless browser can tell that the script ran to its end.
_JS = """(function(){
function key(td){var t=td.getAttribute('data-v')||td.textContent.trim(),x=parseFloat(t);return isNaN(x)?t:x;}
function cmp(a,b){var x=typeof a==='number',y=typeof b==='number';
if(x&&y){return a===b?0:(a<b?-1:1);}return x!==y?(x?-1:1):String(a).localeCompare(String(b));}
document.querySelectorAll('table.sort').forEach(function(t){
var hs=t.tHead.rows[0].cells;
Array.prototype.forEach.call(hs,function(th,i){th.addEventListener('click',function(){
var asc=th.getAttribute('data-dir')!=='asc',b=t.tBodies[0],rows=Array.prototype.slice.call(b.rows);
Array.prototype.forEach.call(hs,function(h){h.removeAttribute('data-dir');});
th.setAttribute('data-dir',asc?'asc':'desc');
rows.sort(function(x,y){var r=cmp(key(x.cells[i]),key(y.cells[i]));return asc?r:-r;});
rows.forEach(function(r){b.appendChild(r);});});});
t.setAttribute('data-sortable','ready');});
function reveal(){var id=decodeURIComponent(location.hash.slice(1)),e=id&&document.getElementById(id);
for(var p=e;p;p=p.parentElement){if(p.tagName==='DETAILS'){p.open=true;}}if(e){e.scrollIntoView();}}
window.addEventListener('hashchange',reveal);reveal();
document.documentElement.setAttribute('data-report-js','ok');})();"""


def html_report(report: RunReport) -> str:
    """The whole page of `report` (see the module docstring)."""
    cnt = report.counts()
    out = ["<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>k3conf report</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>k3conf run ({_e(report.config)})</h1>"]
    out += _summary(report, cnt)
    out += _metadata(report.metadata)
    out += _failures(report)
    out += _grid(report)
    out += _results_table(report)
    out += layer_plots(report)
    out += _speed(report)
    out += _details(report)
    out += _gate_rows(report)
    out.append(f"<script>{_JS}</script></body></html>\n")
    return "\n".join(out)


# ----- anchors and cell text -----

def _rid(n: int) -> str:
    """The anchor of report.results[n]."""
    return f"r{n}"


def _tid(n: int, j: int) -> str:
    """The anchor of tensor row j of report.results[n]."""
    return f"r{n}-t{j}"


def _target(n: int, r: CaseResult) -> str:
    """Where a link to result n goes: its first failing tensor row, else the result."""
    bad = next((j for j, t in enumerate(r.tensors) if not t.passed), None)
    return _rid(n) if bad is None else _tid(n, bad)


def _ncell(x: float | None, text: str | None = None) -> str:
    """A numeric cell. The script sorts by the number the text starts with; only where the text is not a number
    ('-' for none, 'nan', 'inf') a data-v key says where it sorts: none below every value, NaN above."""
    shown = _e(show_number(x) if text is None else text)
    if text is not None and x is not None and math.isfinite(x):   # text with a unit: '2.6 KiB' sorts by the bytes
        return f"<td class=n data-v={x:.6g}>{shown}"
    if x is None:
        return f"<td class=n data-v=-Infinity>{shown}"
    if not math.isfinite(x):
        return f"<td class=n data-v={'-Infinity' if x < 0 else 'Infinity'}>{shown}"
    return f"<td class=n>{shown}"


def _css(status: str) -> str:
    return {"n/a": "na"}.get(status, status)


def _tensor_verdict(t: TensorResult) -> tuple[str, str]:
    """(text, css class) of one tensor row."""
    if not t.gated:
        return ("reported" if t.verdict.passed else "reported (above bound)"), "rep"
    return ("pass", "pass") if t.passed else ("FAIL", "fail")


def _summary(report: RunReport, cnt: dict[str, int]) -> list[str]:
    cls = "bad" if report.exit_code else "good"
    line = _e(report.first_failure_line())
    first = report.first_failure
    if first is not None:
        n = report.results.index(first)
        line = f"<a href='#{_target(n, first)}'>{line}</a>"
    out = [f"<p class='first {cls}'>{line}</p>",
           f"<p>Results (case, backend): <b class=pass>{cnt['pass']} pass</b>, <b class=fail>{cnt['fail']} fail</b>"
           + (f" ({cnt['error']} error{'s' if cnt['error'] != 1 else ''})" if cnt["error"] else "")
           + f", <b class=na>{cnt['n/a']} n/a</b>, <b class=skip>{cnt['skip']} skip</b> of {cnt['total']}, "
           f"in {report.wall_seconds:.0f} s.</p>"]
    if report.fuzz is not None:
        out.append(f"<p class='{'first bad' if report.fuzz.findings else 'note'}'>{_e(report.fuzz.line())}</p>")
    out += [f"<p class='first bad'>{_e(m)}</p>" for m in report.run_failures() + report.nothing_judged]
    out += [f"<p class='first bad'>{_e(m)}</p>" for m in text_report.flip_lines(report)]
    notes = [f"skipped {row['name']}: {row['reason']}" for row in report.backends if not row["available"]]
    notes += text_report.not_run_lines(report) + text_report.skip_lines(report) + text_report.baseline_notes(report)
    if notes:
        out.append(f"<details><summary class=note>{len(notes)} note(s): skipped backends, baselines, reference "
                   "cores that ran</summary><ul>" + "".join(f"<li class=note>{_e(n)}" for n in notes) + "</ul>"
                   "</details>")
    return out


def _metadata(meta: dict) -> list[str]:
    """What the run ran on: one line up front (version, commit, host, start), every field in a <details>."""
    if not meta:
        return []
    git = meta.get("git") or {}
    host = meta.get("host") or {}
    head = [f"k3-conformance {(meta.get('package') or {}).get('version', '?')}",
            f"git {str(git.get('sha', ''))[:10]}{' (dirty)' if git.get('dirty') else ''}" if git else "",
            f"host {host.get('name')} ({host.get('cpu')}, {host.get('cores')} cores)" if host else "",
            f"started {meta['started']}" if meta.get("started") else ""]
    rows = "".join(f"<dt>{_e(str(k))}<dd>{_e(_flat(v))}" for k, v in meta.items() if v not in (None, {}, []))
    return [f"<details><summary>Run metadata: {_e(', '.join(h for h in head if h))}</summary><dl>{rows}</dl>"
            "</details>"]


def _flat(v) -> str:
    """A metadata value on one line: a dict as 'key: value; ...' without its empty fields."""
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_flat(x)}" for k, x in v.items() if x not in (None, {}, []))
    if isinstance(v, (list, tuple)):
        return ", ".join(_flat(x) for x in v)
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _failures(report: RunReport) -> list[str]:
    fails = [(n, r) for n, r in enumerate(report.results) if r.status in ("fail", "error")]
    if not fails:
        return []
    items = "".join(f"<li><a href='#{_target(n, r)}'>{_e(r.case)} on {_e(r.backend)}</a>: "
                    f"{_e(r.failure_line().split(': ', 1)[-1])}" for n, r in fails)
    return [f"<h2 id=failures>Failures ({len(fails)})</h2><ol>{items}</ol>"]


def _grid(report: RunReport) -> list[str]:
    """Case x backend: each cell the result's short verdict, a link to it."""
    cases: dict[str, dict[str, int]] = {}
    backends: list[str] = []
    for n, r in enumerate(report.results):
        cases.setdefault(r.case, {})[r.backend] = n
        if r.backend not in backends:
            backends.append(r.backend)
    out = ["<h2>Case x backend</h2><p>Each cell links to its rows: the verdict and the relative RMS error of the "
           "tensor the failure line names (else the worst), for a pass with the share of its bound it used.</p>"
           "<table class=grid><thead><tr><th>case" + "".join(f"<th>{_e(b)}" for b in backends)
           + "</thead><tbody>"]
    for case, row in cases.items():
        cells = []
        for b in backends:
            m = row.get(b)
            if m is None:
                cells.append("<td>-")
                continue
            r = report.results[m]
            cells.append(f"<td class={_css(r.status)}><a class={_css(r.status)} href='#{_target(m, r)}'>"
                         f"{_e(text_report.cell(r))}</a>")
        out.append(f"<tr><td>{_e(case)}" + "".join(cells))
    out.append("</tbody></table>")
    return out


def _results_table(report: RunReport) -> list[str]:
    """One row per (case, backend), sortable: the worst gated tensor and how close it came to its bound."""
    out = ["<h2>Results</h2><p>One row per (case, backend); click a header to sort. <i>err/bound</i>: the worst "
           "gated tensor's relative RMS error over its bound (above 1 fails).</p>",
           "<table class=sort id=results><thead><tr><th>case<th>backend<th>precision<th>status<th>worst tensor"
           "<th>rel RMS<th>bound<th>err/bound<th>x baseline err<th>seconds</thead><tbody>"]
    for n, r in enumerate(report.results):
        w = r.worst
        role = " (baseline)" if r.role == "baseline" else ""
        row = (f"<tr><td><a href='#{_target(n, r)}'>{_e(r.case)}</a><td>{_e(r.backend + role)}<td>{_e(r.precision)}"
               f"<td class={_css(r.status)}>{_e(r.status)}")
        if w is None:
            row += f"<td colspan=5>{_e(r.error)}"
        else:
            row += (f"<td>{_e(w.tensor)}{_ncell(w.comparison.rel_rms)}{_ncell(w.verdict.bound)}"
                    f"{_ncell(error_over_bound(w))}{_ncell(w.baseline_multiple)}")
        out.append(row + _ncell(r.seconds))
    out.append("</tbody></table>")
    return out


def _details(report: RunReport) -> list[str]:
    """One <details> per case (open when a backend failed it) holding one table: per backend a heading row (the
    result's anchor: verdict, speed, notes, error) and its tensor rows."""
    by_case: dict[str, list[int]] = defaultdict(list)
    for n, r in enumerate(report.results):
        by_case[r.case].append(n)
    out = ["<h2>Details</h2><p>Cases with a failure are open; a link to a row opens its case. <i>within</i>: "
           "elements within the per-element rule (reported; the verdict is the relative RMS error's).</p>"]
    for k, (case, ns) in enumerate(by_case.items()):
        failed = any(report.results[n].status in ("fail", "error") for n in ns)
        chips = " ".join(f"<span class={_css(report.results[n].status)}>{_e(report.results[n].backend)}</span>"
                         for n in ns)
        out.append(f"<details id=c{k}{' open' if failed else ''}><summary><b>{_e(case)}</b> {chips}</summary>"
                   "<table class=tt><thead><tr><th>tensor<th>block<th>verdict<th>max abs<th>rel RMS<th>bound"
                   "<th>within<th>rule; detail</thead><tbody>"
                   + "".join(_result_rows(n, report.results[n]) for n in ns) + "</tbody></table></details>")
    return out


def _result_rows(n: int, r: CaseResult) -> str:
    """The heading row of one (case, backend) and its tensor rows."""
    role = " (baseline)" if r.role == "baseline" else ""
    # a pass on fresh inputs is summed up once per seed in the notes at the top; a failure keeps its line here
    notes = [x for x in r.notes if not (x.startswith("fresh inputs: seed ") and " (pass;" in x)]
    said = [f"<span class={_css(r.status)}>{_e(text_report.cell(r))}</span>"]
    said += [_e(r.error)] if r.error else []
    said += [f"speed: {_e(text_report.speed_text(r.speed))}"] if r.speed is not None else []
    said += [f"<span class=note>{_e(x)}</span>" for x in notes]
    rows = [f"<tr id={_rid(n)} class=res><th colspan=8>{_e(r.backend + role)} ({_e(r.precision)}): "
            + "; ".join(said)]
    shown = _shown(r.tensors)
    for j, t in enumerate(r.tensors):
        if j not in shown:
            continue
        c = t.comparison
        text, cls = _tensor_verdict(t)
        detail = "; ".join(x for x in (t.verdict.why, t.note, "" if t.passed and not c.problem else c.summary()) if x)
        vs = "" if t.baseline_multiple is None else f" ({t.baseline_multiple:.2g}x {t.baseline})"
        rows.append(f"<tr id={_tid(n, j)}{' class=f' if not t.passed else ''}><td>{_e(t.tensor)}<td>{_e(t.block)}"
                    f"<td class={cls}>{text}<td>{show_number(c.max_abs)}<td>{show_number(c.rel_rms)}{_e(vs)}"
                    f"<td>{show_number(t.verdict.bound)}<td>{c.n_within}/{c.n_total}<td>{_e(detail)}")
    if len(shown) < len(r.tensors):
        rows.append(f"<tr><td colspan=8><i>{len(shown)} of {len(r.tensors)} tensors: every failing one and the "
                    f"{NEAREST_ROWS} nearest their bound (report.md and report.json list all)</i>")
    return "".join(rows)


def _shown(tensors: list[TensorResult]) -> set[int]:
    """The rows a result lists: all of a small result; else every failing tensor and the ones nearest their bound."""
    if len(tensors) <= DETAIL_ROWS:
        return set(range(len(tensors)))
    failing = {j for j, t in enumerate(tensors) if not t.passed}
    nearest = sorted((j for j in range(len(tensors)) if j not in failing), key=lambda j: -error_over_bound(tensors[j]))
    return failing | set(nearest[:NEAREST_ROWS])


def _gate_rows(report: RunReport) -> list[str]:
    used = {}
    for r in report.results:
        for t in r.tensors:
            used[(tuple(t.gate_key), "the baseline itself" if r.role == "baseline" else "other backends")] = t.gate
    if not used:
        return []
    out = ["<h2>Gate rows used</h2><table class=sort id=gates><thead><tr><th>block<th>tensor<th>precision"
           "<th>applies to<th>cap<th>k<th>floor<th>reason</thead><tbody>"]
    for (key, who), g in sorted(used.items()):
        out.append(f"<tr><td>{_e(str(key[0]))}<td>{_e(str(key[1]))}<td>{_e(str(key[2]))}<td>{who}"
                   f"{_ncell(g.cap)}{_ncell(g.k)}{_ncell(g.floor)}<td>{_e(g.reason)}")
    out.append("</tbody></table>")
    return out


# ----- speed -----

def _speed(report: RunReport) -> list[str]:
    """Time, bandwidth and baseline ratio of every timed result; results under OVERHEAD_BYTES are marked."""
    timed = [(n, r) for n, r in enumerate(report.results) if r.speed is not None]
    if not timed:
        return []
    small = [r for _, r in timed if r.speed is not None and r.speed.bytes_moved < OVERHEAD_BYTES]
    out = ["<h2 id=speed>Speed</h2>"]
    if small:
        largest = max(r.speed.bytes_moved for _, r in timed if r.speed is not None)
        scope = (f"every one of the {len(timed)} timed results moves" if len(small) == len(timed)
                 else f"{len(small)} of the {len(timed)} timed results move")
        out.append(f"<p class='first bad'>Overhead-bound: {scope} under "
                   f"{OVERHEAD_BYTES >> 20} MiB (the largest here: {largest / 1024:.0f} KiB). At these sizes a "
                   "call's fixed cost (Python dispatch, allocation, a kernel launch) is as large as moving its bytes, "
                   "so their times and bandwidth fractions measure that overhead, not the kernel. Judge speed on "
                   "the small or k3 shape sets (<code>k3conf run --config k3</code>), on the device the kernel is "
                   "for.</p>")
    ceilings = ", ".join(f"{b} {bw / 1e9:.3g} GB/s" for b, bw in report.copy_bandwidth.items())
    out.append("<p><i>of copy bw</i>: achieved bytes/s over the copy bandwidth measured for that backend in this "
               f"run ({_e(ceilings or 'none measured')}); <i>x baseline</i>: time over the precision's baseline "
               "backend's time on the same case. A result that failed its accuracy gate makes no speed claim.</p>")
    mixed = 0 < len(small) < len(timed)   # when every result is overhead-bound the note above says so once
    out.append("<table class=sort id=speed-table><thead><tr><th>case<th>backend<th>status<th>time (us)"
               "<th>bytes moved<th>GB/s<th>of copy bw<th>x baseline<th>baseline<th>target"
               + ("<th>size" if mixed else "") + "</thead><tbody>")
    for n, r in timed:
        sp = r.speed
        assert sp is not None
        gbs = sp.bytes_moved / sp.seconds / 1e9 if sp.seconds > 0 else None
        accurate = not (r.first_failing or r.status == "error")
        target = "-" if sp.passed is None else ("PASS" if sp.passed else "FAIL") + f" ({sp.note})"
        size = "<td><span class=tag>overhead-bound</span>" if sp.bytes_moved < OVERHEAD_BYTES else "<td>"
        out.append(f"<tr{'' if accurate else ' class=f'}><td><a href='#{_rid(n)}'>{_e(r.case)}</a>"
                   f"<td>{_e(r.backend)}<td class={_css(r.status)}>{_e(r.status)}{_ncell(sp.seconds * 1e6)}"
                   f"{_ncell(sp.bytes_moved, _bytes(sp.bytes_moved))}{_ncell(gbs)}{_ncell(sp.bw_ratio)}"
                   f"{_ncell(sp.time_ratio)}<td>{_e(sp.baseline or '-')}<td>{_e(target)}" + (size if mixed else ""))
    out.append("</tbody></table>")
    return out


def _bytes(b: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b} B"


# ----- per-layer plots -----
