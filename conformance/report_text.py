"""What a person reads of a run in text: the terminal table and report.md, and the lines both share with
report.html (conformance.report_html).

Every report names the first failing (case, backend, tensor) at the top. A table cell reads as the tensor that
line names: its error, and for a pass the share of its bound it used ('ok 8e-07 (12%)'). What a backend cannot
run (n/a: only k3ref's cores would; skips of whole blocks) is a dash in the table and one line per backend and
reason, and a note several cases share is one line with their count.
"""
from __future__ import annotations

import math
import sys
from collections import defaultdict

from rich.console import Console
from rich.table import Table

from conformance.results import CaseResult, RunReport


def cell(r: CaseResult, name_tensor: bool = False) -> str:
    """Short verdict of one (case, backend), its tensor the one the report's failure line names.

    'ok 3e-08 (12%)': the worst gated tensor's relative RMS error and its share of that tensor's bound;
    'baseline 3e-03 (40%)': the precision's baseline, within its own measured cap; 'ok exact': integers only;
    'FAIL 2e-03>1e-05' / 'FAIL NaN/Inf' / 'FAIL shape' / 'FAIL worst element' / 'FAIL 4 of 5 tokens' /
    'FAIL 3 of 20 idx values' (an integer tensor) / 'FAIL speed' / 'n/a (reference core)' / 'skip' / 'ERROR'.
    name_tensor: append the tensor's name when the case has several gated tensors (the terminal names it
    only for a failure, report.md always)."""
    if r.status == "error":
        return "ERROR"
    if r.status == "n/a":
        return "n/a (reference core)"
    t = r.first_failing or r.worst   # a failure: the tensor failure_line names
    if t is None:
        return r.status
    tag = "baseline " if r.role == "baseline" else ""
    if t.passed and r.status == "fail":
        return "FAIL speed"
    text = _failed_text(r, t) if not t.passed else f"{tag or 'ok '}{_error_of(t)}"
    text = text if t.passed else "FAIL " + tag + text
    several = sum(u.gated for u in r.tensors) > 1
    if (name_tensor or not t.passed) and several and not _is_token(t):
        text += f" {t.tensor}"
    return text


def _error_of(t) -> str:
    """'8e-07 (12%)': a passing tensor's relative RMS error and its share of the bound; 'exact' for integers."""
    if t.comparison.exact:
        return "exact"
    share = "" if t.verdict.bound <= 0 else f" ({_percent(t.comparison.rel_rms / t.verdict.bound)})"
    return f"{t.comparison.rel_rms:.0e}{share}"


def _percent(fraction: float) -> str:
    """12% / <1% / 100%: a share of the bound as a person reads it (never rounded up to a failure)."""
    if fraction < 0.01:
        return "<1%"
    return f"{min(math.floor(fraction * 100), 100):d}%"


def _failed_text(r: CaseResult, t) -> str:
    """What failed on `t`, in a few words: the metric over its bound, or the rule that decided."""
    c = t.comparison
    if c.exact:
        if _is_token(t):   # one tensor per greedy step: count the steps, not the one-element tensors
            tokens = [u for u in r.tensors if u.gated and _is_token(u)]
            return f"{sum(not u.passed for u in tokens)} of {len(tokens)} tokens"
        return f"{c.n_total - c.n_within} of {c.n_total} {t.tensor} values"
    if c.problem:
        return c.problem.split(":")[0]
    if not c.nonfinite_ok:
        return "NaN/Inf"
    if c.rel_rms <= t.verdict.bound:   # the whole-tensor rule held: another rule decided
        if t.verdict.why.startswith("worst element"):
            return "worst element"
        return f"{c.n_total - c.n_within} of {c.n_total} elements"
    return f"{c.rel_rms:.0e}>{t.verdict.bound:.0e}"


def _is_token(t) -> bool:
    """A greedy token of a model trace ('step3.token'): one integer per decoding step."""
    return t.comparison.exact and t.tensor.endswith(".token")


def grid(report: RunReport) -> tuple[list[str], list[str], dict]:
    cases, backends, cells = [], [], {}
    for r in report.results:
        if r.case not in cases:
            cases.append(r.case)
        if r.backend not in backends:
            backends.append(r.backend)
        cells[(r.case, r.backend)] = r
    return cases, backends, cells


def never_runs(report: RunReport) -> set[tuple[str, str]]:
    """(case, backend) cells a backend cannot run at all: n/a (only k3ref's cores would run), and skips where the
    backend skipped every case of that block (two or more) for one reason (torch-model: the per-block cases). A
    skip among cases of a block it runs (a kernel not built for that shape) is a finding and stays in the table."""
    by_block: dict[tuple[str, str], list[CaseResult]] = defaultdict(list)
    for r in report.results:
        by_block[(r.backend, r.block)].append(r)
    out = set()
    for rs in by_block.values():
        whole = len(rs) > 1 and len({r.error for r in rs}) == 1 and all(r.status == "skip" for r in rs)
        out |= {(r.case, r.backend) for r in rs if r.status == "n/a" or whole}
    return out


def _case_globs(names: list[str], every: list[str], most: int = 12) -> str:
    """'rmsnorm/*, kda_prefill/B1-T1-H1-K16': a family (the name up to its first '/') as one glob where all of
    the run's cases of it are in `names`, at most `most` items, then how many more."""
    family = defaultdict(list)
    for n in every:
        family[n.split("/")[0]].append(n)
    chosen = set(names)
    items: list[str] = []
    for fam, members in family.items():
        mine = [n for n in members if n in chosen]
        if mine and len(mine) == len(members) and len(members) > 1:
            items.append(f"{fam}/*")
        else:
            items += mine
    more = len(items) - most
    return ", ".join(items[:most]) + (f", ... ({more} more)" if more > 0 else "")


def _why_not_run(r: CaseResult) -> str:
    """The reason an n/a or whole-block skip shares with its backend's other such cells (the block removed)."""
    if r.status == "n/a" and r.error.startswith(f"reference core: {r.backend} supplies no kernel for "):
        return f"n/a (reference core only: {r.backend} supplies no kernel for the cores they exercise)"
    return f"n/a ({r.error})" if r.status == "n/a" else f"skipped ({r.error})"


def not_run_lines(report: RunReport) -> list[str]:
    """One line per backend and reason for the cells it could not run (n/a, and the skips of whole blocks):
    'cuda-emu: 28 cases n/a (reference core only: ...): rmsnorm/*, ...'. A reason of one case names it."""
    never = never_runs(report)
    every = list(dict.fromkeys(r.case for r in report.results))
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for r in report.results:
        if (r.case, r.backend) in never:
            groups[(r.backend, _why_not_run(r))].append(r.case)
    return [f"{backend}: {len(cases)} case{'s' if len(cases) != 1 else ''} {why}: {_which(cases, every)}"
            for (backend, why), cases in groups.items()]


def _which(cases: list[str], every: list[str]) -> str:
    """The globs of `cases`, or 'every case but <globs>' where the run's other cases are named more briefly."""
    chosen = set(cases)
    rest = [n for n in every if n not in chosen]
    named, but = _case_globs(cases, every), _case_globs(rest, every)
    return f"every case but {but}" if rest and 2 * len(but) < len(named) else named


def skip_lines(report: RunReport) -> list[str]:
    """One line per backend and reason for the skips the table shows (valid inputs a kernel is not built for)."""
    never = never_runs(report)
    every = list(dict.fromkeys(r.case for r in report.results))
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for r in report.results:
        if r.status == "skip" and (r.case, r.backend) not in never:
            groups[(r.backend, r.error)].append(r.case)
    return [f"{backend}: skipped {_case_globs(cases, every)}: {why}" for (backend, why), cases in groups.items()]


def print_terminal(report: RunReport, console: Console | None = None) -> None:
    """The first failure, a case x backend table (worst relative RMS error per cell and its share of the bound),
    one line per backend for what it could not run, skipped backends, notes, failures, the tally."""
    console = console or Console(width=None if stdout_is_terminal() else 160)

    def say(line: str, style: str = "") -> None:   # plain text: case names hold '[' and ']'
        console.print(line, style=style, highlight=False, markup=False)

    style = "bold red" if report.exit_code else "bold green"
    console.print(report.first_failure_line(), style=style, highlight=False, markup=False, soft_wrap=True)
    cases, backends, cells = grid(report)
    never = never_runs(report)
    shown = [b for b in backends if any((c, b) not in never for c in cases if (c, b) in cells)]
    # the title is a line of its own: a table's title wraps at the table's width, which may be narrow
    if report.results:
        say(f"k3conf run ({report.config}): worst relative RMS error per case and backend (its share of the bound)")
    table = Table()
    table.add_column("case", no_wrap=True)
    for b in shown:
        table.add_column(b, no_wrap=True)
    for c in cases:
        if all(cells.get((c, b)) is None or (c, b) in never for b in shown):
            continue   # no backend runs it: the lines under the table say why
        row = [c]
        for b in shown:
            r = cells.get((c, b))
            if r is None or (c, b) in never:
                row.append("[dim]-[/]")
                continue
            color = {"pass": "green", "skip": "yellow"}.get(r.status, "red")
            row.append(f"[{color}]{cell(r)}[/]")
        table.add_row(*row)
    if table.row_count:   # else every case is n/a or skipped for every backend: the lines below say why
        console.print(table)

    for line in not_run_lines(report):
        say(line, "cyan")
    for line in skip_lines(report):
        say(line, "yellow")
    for row_of in report.backends:
        if not row_of["available"]:
            say(f"skipped {row_of['name']}: {row_of['reason']}", "yellow")
    for note in baseline_notes(report):
        say(note, "yellow")
    for line in flip_lines(report):
        say(line, "red")
    if report.fuzz is not None:
        say(report.fuzz.line(), "red" if report.fuzz.findings else "cyan")
    for line in report.run_failures() + report.nothing_judged:
        say(line, "red")
    fails = report.failures
    for r in fails[:20]:
        say(f"  {r.case} on {r.backend}: {_why(r)}", "red")
    if len(fails) > 20:
        console.print(f"  ... and {len(fails) - 20} more (see the report files)", style="red")
    say(f"(case, backend) results: {tally(report)}, in {report.wall_seconds:.1f} s")


def tally(report: RunReport) -> str:
    """'169 passed, 1 failed (1 error), 7 n/a, 4 skipped of 181': n/a (only reference cores would run) and
    skip (a kernel not built for that shape) are neither passes nor failures."""
    c = report.counts()
    fail = f"{c['fail']} failed" + (f" ({c['error']} error{'s' if c['error'] != 1 else ''})" if c["error"] else "")
    return f"{c['pass']} passed, {fail}, {c['n/a']} n/a, {c['skip']} skipped of {c['total']}"


def flip_lines(report: RunReport) -> list[str]:
    """One line per (case, backend) with greedy-token flips: each flip's step, expected and found ids and the
    reference's logit margin."""
    lines = []
    for r in report.results:
        if not r.flips:
            continue
        each = "; ".join(f"step {f['step']}: expected {f['expected']}, found {f['found']} (reference logit margin "
                         f"{f['margin']:.3g})" for f in r.flips)
        n = len(r.flips)
        lines.append(f"{r.case} on {r.backend}: {n} greedy token flip{'s' if n != 1 else ''}: {each}")
    return lines


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def baseline_notes(report: RunReport) -> list[str]:
    """One line per precision whose baseline could not run (its rows used the absolute cap alone), and the
    notes of the results (e.g. a trace core that fell back to the reference): a note that several cases of one
    backend share is one line with their count and names."""
    notes: set[str] = set()
    fresh_passes: dict[str, int] = {}   # seed -> cells that passed on fresh inputs too: one line, not one per cell
    shared: dict[tuple[str, str], list[str]] = defaultdict(list)   # (backend, note) -> cases
    for r in report.results:
        for n in r.notes:
            seed = _fresh_pass_seed(n)
            if seed is None:
                shared[(r.backend, n)].append(r.case)
            else:
                fresh_passes[seed] = fresh_passes.get(seed, 0) + 1
        for t in r.tensors:
            if t.baseline is not None and t.baseline_err is None and not t.comparison.exact:
                notes.add(f"baseline {t.baseline} unavailable for {r.precision}: the absolute cap alone applied")
    every = list(dict.fromkeys(r.case for r in report.results))
    # 'kda_prefill: k3ref's reference core ran (...)' and 'moe_route: <the same>' on the same cases: one line
    # naming both cores
    by_core: dict[tuple[str, str, tuple[str, ...]], list[str]] = defaultdict(list)
    for (backend, n), cases in shared.items():
        core, sep, rest = n.partition(": ")
        if sep and core.isidentifier():
            by_core[(backend, rest, tuple(cases))].append(core)
        else:
            notes.add(_note_line(backend, n, cases, every))
    for (backend, rest, on), cores in by_core.items():
        notes.add(_note_line(backend, f"{', '.join(sorted(cores))}: {rest}", list(on), every))
    notes.update(f"fresh inputs: seed {seed}: {n} (case, backend) result(s) passed on them too (replay: "
                 f"K3CONF_FRESH_SEED={seed} k3conf run ...)" for seed, n in fresh_passes.items())
    return sorted(notes)


def _note_line(backend: str, note: str, cases: list[str], every: list[str]) -> str:
    """'<case> on <backend>: <note>' for one case; '<backend>: <note> — on N cases: <globs>' for several."""
    if len(cases) == 1:
        return f"{cases[0]} on {backend}: {note}"
    return f"{backend}: {note} — on {len(cases)} cases: {_case_globs(cases, every)}"


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
    return f"outputs.{t.tensor} (block {t.block}): {_without_count(r, t, t.why())}"


def counts_elements(r: CaseResult, t) -> bool:
    """Whether `t`'s 'N of M passed' decided anything (CaseResult.counts_elements)."""
    return r.counts_elements(t)


def _without_count(r: CaseResult, t, text: str) -> str:
    """`text` (Comparison.summary() or a line holding it) without the per-element count where that count decides
    nothing."""
    return text if counts_elements(r, t) else text.replace(f"; {t.comparison.passed_line}", "", 1)


def verdict_text(t) -> str:
    """'pass' / 'FAIL' for a gated tensor; 'reported' / 'reported (above bound)' for a reported-only one."""
    if not t.gated:
        return "reported" if t.verdict.passed else "reported (above bound)"
    return "pass" if t.passed else "FAIL"


def fmt(x) -> str:
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
