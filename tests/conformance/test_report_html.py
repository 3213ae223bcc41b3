"""report.html from a real run (a core case, a model trace, the fp64 reference and a mutant that fails both): its
links, plots and speed note read from the page itself, and its script run in headless Chromium.

The Chromium tests skip with the reason when no Chromium is here (`bash tools/install_chromium.sh` installs it);
under K3_STRICT=1 they fail instead.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conformance.golden.store import COMMITTED_ROOT
from conformance.report_html import NEAREST_ROWS, OVERHEAD_BYTES, html_report
from conformance.report_plots import layer_svg
from conformance.results import RunReport
from conformance.runner import run
from conformance.session import pick_cases, strict
from k3ref.config import K3Config

CASES = ["kda_decode/B2-H3-K16", "trace/k3geom/layerwise-P3-D1"]
TRACE = "trace/k3geom/layerwise-P3-D1"
TRACE_MODEL = "k3geom"             # the model config of TRACE (its name's middle part)
BACKENDS = ["numpy64", "mutant:kda-l2-eps-1e-12"]
MUTANT = "mutant:kda-l2-eps-1e-12"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER_SECONDS = 120              # a cold headless start on a loaded 2-core machine takes ~10 s


@pytest.fixture(scope="module")
def report() -> RunReport:
    """A real run: timed (the speed table), the mutant failing the KDA core and the trace's KDA layers."""
    rep = run(pick_cases("tiny", CASES), BACKENDS, COMMITTED_ROOT, config="tiny", timing=True)
    failed = {(r.case, r.backend) for r in rep.failures}
    assert failed == {(c, MUTANT) for c in CASES}, f"expected the mutant to fail every case, found {failed}"
    return rep


@pytest.fixture(scope="module")
def page(report, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("html") / "report.html"
    path.write_text(html_report(report))
    return path


class Elements(HTMLParser):
    """Every start tag of a page as (tag, attributes), the text of each <title> and <text> by position."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.texts: list[str] = []
        self._in_text = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_text = tag in ("text", "title")

    def handle_data(self, data):
        if self._in_text:
            self.texts.append(data)
            self._in_text = False

    def ids(self) -> set[str]:
        return {str(a["id"]) for _, a in self.tags if a.get("id")}

    def where(self, **attrs) -> list[dict[str, str | None]]:
        return [a for _, a in self.tags if all(a.get(k) == v for k, v in attrs.items())]


def _svgs(text: str) -> dict[str, str]:
    """Each per-layer plot's SVG by its title ('<case> on <backend>')."""
    plots = {}
    for svg in re.findall(r"<svg.*?</svg>", text, re.S):
        title = re.search(r"<text[^>]*>([^<]*)</text>", svg)
        assert title, f"a plot without a title: {svg[:200]}"
        plots[title.group(1)] = svg
    return plots


def test_every_link_resolves_and_every_failure_links_to_its_failing_row(report, page):
    text = page.read_text()
    doc = Elements(text)
    hrefs = [a["href"] for t, a in doc.tags if t == "a" and (a.get("href") or "").startswith("#")]
    assert hrefs, "the page has no in-page links"
    assert {h[1:] for h in hrefs} <= doc.ids(), "links to no element: " + str({h[1:] for h in hrefs} - doc.ids())
    failures = text[text.index("<h2 id=failures>"):text.index("</ol>", text.index("<h2 id=failures>"))]
    targets = re.findall(r"href='#([^']+)'", failures)
    assert len(targets) == len(report.failures)
    for target, r in zip(targets, report.failures, strict=True):
        row = doc.where(id=target)[0]
        assert row.get("class") == "f", f"{r.case} on {r.backend}: its link goes to {target}, not a failing row"
        n, j = map(int, re.fullmatch(r"r(\d+)-t(\d+)", target).groups())
        assert report.results[n] is r and not r.tensors[j].passed
    first = re.search(r"<p class='first bad'><a href='#([^']+)'>FIRST FAILURE", text)
    assert first and first.group(1) == targets[0]


def test_failed_cases_open_and_passing_ones_closed(report, page):
    doc = Elements(page.read_text())
    cases = [a for t, a in doc.tags if t == "details" and re.fullmatch(r"c\d+", a.get("id") or "")]
    assert len(cases) == len(CASES) and all("open" in a for a in cases), "the mutant failed every case"
    passing = RunReport(report.config, report.backends, [r for r in report.results if r.status == "pass"],
                        report.wall_seconds, report.copy_bandwidth)
    doc = Elements(html_report(passing))
    cases = [a for t, a in doc.tags if t == "details" and re.fullmatch(r"c\d+", a.get("id") or "")]
    assert len(cases) == len(CASES) and not any("open" in a for a in cases)
    assert all(doc.where(id=f"r{n}") for n in range(len(passing.results))), "a passing result has no anchor"


def test_layer_plots_have_bound_line_axis_titles_step_legend_and_layer_kinds(report, page):
    text = page.read_text()
    plots = _svgs(text)
    trace_results = [r for r in report.results if r.case == TRACE]
    assert set(plots) == {f"{TRACE} on {r.backend}" for r in trace_results}
    cfg = K3Config.preset(TRACE_MODEL)
    for r in trace_results:
        svg = plots[f"{TRACE} on {r.backend}"]
        assert svg.count("class=bound") == 1, "one bound line"
        labels = re.findall(r">([^<>]+)</text>", svg)
        assert "layer (mixer)" in labels and "rel RMS error / bound" in labels
        steps = sorted({int(re.match(r"step(\d+)\.", t.tensor).group(1)) for t in r.tensors if t.layer is not None})
        assert [x for x in labels if x.startswith("step ")] == [
            f"step {s}" + (" (prefill)" if s == 0 else "") for s in steps]
        assert "bound" in labels
        assert svg.count("<polyline") == len(steps), "one series per step"
        # the layer kinds under the x axis, in layer order, are the model config's schedule
        kinds = [x for x in labels if x in ("KDA", "MLA")]
        assert kinds == ["MLA" if cfg.is_mla(i) else "KDA" for i in range(cfg.num_hidden_layers)]


def test_mutant_plot_puts_the_kda_layers_above_the_bound(report, page):
    """kda-l2-eps-1e-12 breaks the KDA mixer alone, and a layerwise trace feeds every layer the golden's input: at
    every step the KDA layers' points sit above the bound line and the MLA layers' below it. Each point's hover
    text names a tensor of that layer and step."""
    svg = _svgs(page.read_text())[f"{TRACE} on {MUTANT}"]
    bound_y = float(re.search(r"class=bound [^>]*y1=([\d.]+)", svg).group(1))
    points = re.findall(r"<circle cx=[\d.]+ cy=([\d.]+)[^>]*><title>step(\d+)\.layer(\d+)\.", svg)
    cfg = K3Config.preset(TRACE_MODEL)
    steps = {int(s) for _, s, _ in points}
    assert len(points) == len(steps) * cfg.num_hidden_layers
    for cy, step, layer in points:
        above = float(cy) < bound_y            # SVG y grows downwards
        assert above == (not cfg.is_mla(int(layer))), f"step {step} layer {layer}: drawn at y {cy}, bound {bound_y}"


def test_trace_results_list_failing_rows_and_the_nearest(report, page):
    doc = Elements(page.read_text())
    for n, r in enumerate(report.results):
        rows = [a["id"] for a in doc.where() if re.fullmatch(rf"r{n}-t\d+", a.get("id") or "")]
        failing = sum(not t.passed for t in r.tensors)
        if len(r.tensors) > 40:
            assert len(rows) == min(len(r.tensors), failing + NEAREST_ROWS)
        else:
            assert len(rows) == len(r.tensors)


def test_speed_table_marks_the_toy_sizes_overhead_bound(report, page):
    text = page.read_text()
    timed = [r for r in report.results if r.speed is not None]
    assert timed and all(r.speed.bytes_moved < OVERHEAD_BYTES for r in timed)
    start = text.index("<h2 id=speed>")
    speed = text[start:text.index("</table>", start)]
    assert f"Overhead-bound: every one of the {len(timed)} timed results moves under" in speed
    assert speed.split("<tbody>")[1].count("<tr") == len(timed)


def test_metadata_shown_when_present_and_page_renders_without_it(report):
    with_meta = html_report(report)
    assert "Run metadata: k3-conformance" in with_meta
    if report.metadata.get("git"):
        assert str(report.metadata["git"]["sha"])[:10] in with_meta
    bare = RunReport(report.config, report.backends, report.results, report.wall_seconds, report.copy_bandwidth)
    assert "Run metadata" not in html_report(bare)


# ----- in headless Chromium: the script runs -----

def _browser() -> str:
    """The Chromium binary; skip (fail under K3_STRICT=1) with the reason when there is none."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    why = "no chromium, chromium-browser or google-chrome on PATH: bash tools/install_chromium.sh installs it"
    if strict():
        pytest.fail(f"K3_STRICT=1: {why}", pytrace=False)
    pytest.skip(why)


def _dump_dom(page: Path, tmp_path: Path, fragment: str = "") -> str:
    """The page's DOM after its scripts ran, as headless Chromium serialises it."""
    cmd = [_browser(), "--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={tmp_path / 'profile'}",
           "--dump-dom", page.as_uri() + fragment]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=BROWSER_SECONDS)
    assert done.returncode == 0 and "<html" in done.stdout, f"chromium failed: {done.stderr[-2000:]}"
    return done.stdout


def test_script_runs_and_marks_every_sortable_table(page, tmp_path):
    dom = _dump_dom(page, tmp_path)
    doc = Elements(dom)
    assert doc.where(**{"data-report-js": "ok"}), "the report's script did not run to its end"
    tables = [a for t, a in doc.tags if t == "table" and a.get("class") == "sort"]
    assert len(tables) >= 3 and all(a.get("data-sortable") == "ready" for a in tables)


def test_clicking_a_header_sorts_the_results_table(report, page, tmp_path):
    """Two clicks on 'err/bound': ascending, then descending; the column read back in the page's order."""
    probe = """<script>(function(){var t=document.getElementById('results'),hs=t.tHead.rows[0].cells,i=-1;
    for(var k=0;k<hs.length;k++){if(hs[k].textContent==='err/bound'){i=k;}}
    hs[i].click();hs[i].click();
    var v=Array.prototype.map.call(t.tBodies[0].rows,function(r){return r.cells[i].textContent;});
    document.body.setAttribute('data-probe',JSON.stringify({dir:hs[i].getAttribute('data-dir'),v:v}));})();
    </script></body>"""
    sorted_page = tmp_path / "probe.html"
    sorted_page.write_text(page.read_text().replace("</body>", probe))
    probe_attr = Elements(_dump_dom(sorted_page, tmp_path)).where()
    body = next(a for a in probe_attr if a.get("data-probe"))
    got = json.loads(body["data-probe"])
    values = [float(x) for x in got["v"]]
    assert got["dir"] == "desc" and len(values) == len(report.results)
    assert values == sorted(values, reverse=True)
    assert math.isclose(values[0], max(float(f"{_worst_ratio(r):.3g}") for r in report.results))


def _worst_ratio(r) -> float:
    w = r.worst
    return w.comparison.rel_rms / w.verdict.bound


def test_a_link_into_a_closed_case_opens_it(report, page, tmp_path):
    """Chromium opens the <details> around a fragment's target itself; the page's script does the same for
    browsers that do not, so this holds the page's behaviour, not which of the two did it."""
    n = next(n for n, r in enumerate(report.results) if r.status == "pass" and r.case == CASES[0])
    closed = page.read_text().replace(" open>", ">")          # every <details> closed: the script must open it
    path = tmp_path / "closed.html"
    path.write_text(closed)
    dom = _dump_dom(path, tmp_path, f"#r{n}")
    m = re.search(rf"<details id=\"c(\d+)\"( open=\"\")?>(?:(?!<details id=\"c).)*id=\"r{n}\"", dom, re.S)
    assert m, f"r{n} is not inside a case's <details>"
    assert m.group(2), "the case around the linked row stayed closed"


def test_a_layer_plot_survives_an_overflowed_error(report):
    """A float64 kernel writing 1e200 makes ||out - ref|| overflow to inf (and 0 * inf gives NaN): the plot still
    draws, the point at the top of the axis."""
    trace = next(r for r in report.results if r.case.startswith("trace/") and r.backend == "numpy64")
    tensors = [t for t in trace.tensors if t.layer is not None]
    broken = [dataclasses.replace(t, comparison=dataclasses.replace(t.comparison, rel_rms=bad))
              for t, bad in zip(tensors[:2], (math.inf, math.nan), strict=True)] + tensors[2:]
    svg = layer_svg(trace.case, broken)
    assert svg.startswith("<svg") and "<polyline" in svg and "nan" not in svg.lower().replace("nanosec", "")
