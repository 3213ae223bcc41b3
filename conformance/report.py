"""Reports of a run: the terminal table, and report.json / report.md / report.html under --report DIR, all three
or none. The text (terminal and Markdown) is conformance.report_text's, the navigable page conformance.report_html's.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

from rich.console import Console

from conformance import report_html
from conformance.report_md import markdown
from conformance.report_text import print_terminal, stdout_is_terminal
from conformance.results import RunReport


def present(report: RunReport, out_dir: Path, command: str, console: Console | None = None) -> int:
    """The end of a run for its front end: `report` on the terminal, its files in `out_dir`, and the run's exit
    status. The folder was writable before the run; if it is not now, a failed gate still says 1, else 2."""
    console = console or Console(width=None if stdout_is_terminal() else 160)
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
        staged[2].write_text(report_html.html_report(report))
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


__all__ = ["markdown", "present", "print_terminal", "write_reports"]
