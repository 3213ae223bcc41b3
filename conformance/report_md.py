"""report.md: the first failure, what could not run, the notes, the case x backend verdicts and the per-tensor
table (a result with hundreds of tensors lists its failures and those nearest their bounds; report.json keeps them
all)."""
from __future__ import annotations

import math

from conformance.report_text import (
    baseline_notes,
    cell,
    counts_elements,
    flip_lines,
    fmt,
    grid,
    never_runs,
    not_run_lines,
    skip_lines,
    speed_text,
    tally,
    verdict_text,
    versus,
)
from conformance.results import CaseResult, RunReport

# A result with more tensors than this (a model trace: hundreds) lists in report.md its failures and its
# MD_WORST tensors nearest their bounds; report.json and report.html keep every tensor.
MD_TENSORS = 12
MD_WORST = 5


def markdown(report: RunReport) -> str:
    """The report as Markdown: first failure, what could not run, notes, the case x backend verdicts, the
    per-tensor table (long results cut to the tensors that matter), gate reasons."""
    lines = [f"# k3conf run ({report.config})", "", f"**{plain(report.first_failure_line())}**", ""]
    cnt = report.counts()
    lines += [f"Results (case, backend): **{cnt['pass']} pass, {cnt['fail']} fail, {cnt['n/a']} n/a, "
              f"{cnt['skip']} skip** of {cnt['total']}"
              + (f" ({cnt['error']} of the failures are errors)" if cnt["error"] else "") + ".", ""]
    lines += [f"- {plain(report.fuzz.line())}"] if report.fuzz is not None else []
    lines += [f"- {plain(m)}" for m in report.run_failures() + report.nothing_judged]
    lines += [f"- skipped `{b['name']}`: {plain(b['reason'])}" for b in report.backends if not b["available"]]
    lines += [f"- {plain(n)}" for n in not_run_lines(report) + skip_lines(report)]
    lines += [f"- {plain(n)}" for n in baseline_notes(report)]
    lines += [f"- {plain(n)}" for n in flip_lines(report)]
    lines += ["", *_md_grid(report), "", "## Tensors", "",
              "| case | backend | status | tensor | max abs | rel RMS | bound | of bound | passed | worst (out vs ref) "
              "| speed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    never = never_runs(report)
    for r in report.results:
        if (r.case, r.backend) not in never:
            lines += _md_rows(r)
    lines += ["", "## Gate rows used", "", "| block | tensor | precision | applies to | cap | k | floor | reason |",
              "|---|---|---|---|---|---|---|---|"]
    used = {}
    for r in report.results:
        for t in r.tensors:
            used[(tuple(t.gate_key), "the baseline itself" if r.role == "baseline" else "other backends")] = t.gate
    for (key, who), g in sorted(used.items()):
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {who} | {g.cap:g} | {fmt(g.k)} | {g.floor:g} | {g.reason} |")
    lines.append(f"\n(case, backend) results: {tally(report)}, in {report.wall_seconds:.1f} s.\n")
    return "\n".join(lines)


def plain(text: str, limit: int = 4000) -> str:
    """`text` with its HTML escaped for Markdown: a backend's words (a reason, an error, a note, a process's command
    line) may hold tags a reader's renderer would act on; cut to `limit` characters."""
    text = text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"
    return "".join("\\" + ch if ch in _MARKUP else ch for ch in text)


_MARKUP = frozenset("<>\\")   # raw HTML is what a renderer would act on (a backslash first: it could undo the escape)


def _md_grid(report: RunReport) -> list[str]:
    """The terminal's case x backend table, each cell naming its tensor where the case has several."""
    cases, backends, cells = grid(report)
    never = never_runs(report)
    shown = [b for b in backends if any((c, b) not in never for c in cases if (c, b) in cells)]
    out = ["## Verdicts (worst relative RMS error, its share of the bound, and the tensor)", "",
           "| case | " + " | ".join(shown) + " |", "|---" * (len(shown) + 1) + "|"]
    for c in cases:
        row = ["-" if (c, b) not in cells or (c, b) in never else cell(cells[(c, b)], name_tensor=True)
               for b in shown]
        if any(cell != "-" for cell in row):
            out.append(f"| {c} | " + " | ".join(row) + " |")
    return out


def _md_rows(r: CaseResult) -> list[str]:
    """The per-tensor rows of one result; past MD_TENSORS tensors, its failures, the MD_WORST nearest their
    bounds and the gated one its cell shows, then one row counting the rest."""
    sp = "-" if r.speed is None else speed_text(r.speed)
    if r.status in ("error", "skip", "n/a"):
        error = plain(r.error).replace("|", "/")
        return [f"| {r.case} | {r.backend} | {r.status.upper()} | - | - | - | - | - | - | {error} | - |"]
    kept = r.tensors
    if len(kept) > MD_TENSORS:
        near = sorted(r.tensors, key=_share, reverse=True)[:MD_WORST]
        kept = [t for t in r.tensors if t in near or t is r.worst or not t.verdict.passed]
    role = " (baseline)" if r.role == "baseline" else ""
    lines = []
    for t in kept:
        c = t.comparison
        if c.problem and not c.exact:      # not comparable (shape, dtype, missing): the metrics are empty
            worst = plain(c.problem).replace("|", "/")
        elif c.worst_index is None or (c.max_abs == 0 and c.nonfinite_ok):   # nothing differs
            worst = "-"
        else:
            worst = f"{list(c.worst_index)}: {c.worst_out:.6g} vs {c.worst_ref:.6g}"
        if t.note:
            worst = plain(f"{t.note}; {worst}").replace("|", "/")
        share = "-" if c.exact or t.verdict.bound <= 0 else f"{_share(t):.0%}"
        passed = c.passed_line if counts_elements(r, t) else "-"
        lines.append(f"| {r.case} | {r.backend}{role} | {verdict_text(t)} | {t.tensor} | {fmt(c.max_abs)} | "
                     f"{fmt(c.rel_rms)}{versus(t)} | {fmt(t.verdict.bound)} | {share} | {passed} | {worst} | {sp} |")
    if len(kept) < len(r.tensors):
        rest = len(r.tensors) - len(kept)
        lines.append(f"| {r.case} | {r.backend}{role} | - | {rest} more tensors, each within its bound (report.json "
                     "and report.html list every one) | - | - | - | - | - | - | - |")
    return lines


def _share(t) -> float:
    """A tensor's relative RMS error over its bound (0 for an exact or unbounded one): how near it came."""
    if t.comparison.exact or t.verdict.bound <= 0:
        return 0.0 if t.verdict.passed else math.inf
    return t.comparison.rel_rms / t.verdict.bound
