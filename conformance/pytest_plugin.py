"""pytest plugin: the conformance cases as test items of a kernel author's own test run (a CI route).

    pytest --k3conf-backend my_kernels.k3:make                          # every case, besides the repository's tests
    pytest --k3conf-backend ./k3_backend.py:make -m kda_decode --junitxml=junit.xml --k3conf-report reports/

Registered under the entry point `pytest11` (name `k3conf`), so it loads in every pytest run of an
environment where k3-conformance is installed; without `--k3conf-backend` it only adds its options (no
import of the package's heavy modules, no items, no markers). With it, pytest loads the plugin
conformance.pytest_cases, which holds the rest: one collector `k3conf` whose items are the cases, each item's id
its case name (`kda_decode/B2-H3-K16`), marked `k3conf`, with its block and with every core it exercises (`-m
kda_decode` selects the kda_decode cases and the model traces that run kda_decode); a failing item shows its own
failure line (case, backend, tensor, why); JUnit rows are classed by block (`k3conf.kda_decode`); the session ends
with the run's table, and `--k3conf-report DIR` writes the report files `k3conf run --report DIR` writes. After
the cases come the fuzz items `fuzz/<core>`, one per core the backend supplies (`--k3conf-fuzz SECONDS`, as `k3conf
run --fuzz`; `--k3conf-no-fuzz` leaves them out): a failing one names the smallest failing draw. Cases
whose cores the backend does not supply skip as "n/a (reference core)"; an unavailable backend skips every item
with its reason (fails it under K3_STRICT, read as `k3conf run` reads it). The verdicts and the outcome are those
of `k3conf run --backend` on the same cases: a backend judged on nothing (every item skip or n/a) fails the session.
"""
from __future__ import annotations

# conformance.cases.protocol.CONFIGS, written out: this module loads in every pytest run and imports nothing heavy
# (tests/conformance checks the two agree)
_SHAPE_SETS = ("tiny", "small", "k3", "k3-tp8")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("k3conf", "K3 conformance cases on a kernel backend (k3-conformance)")
    group.addoption("--k3conf-backend", metavar="MODULE:ATTR", default=None,
                    help="run the K3 conformance cases on this backend: MODULE:ATTR, ./file.py:ATTR or a name "
                         "from `k3conf list backends`")
    group.addoption("--k3conf-cases", action="append", metavar="GLOB", default=None,
                    help="only cases matching this glob (repeatable), e.g. 'kda_*'")
    group.addoption("--k3conf-config", choices=_SHAPE_SETS, default="tiny",
                    help="case set (default tiny; the others come from `k3conf regen --shapes NAME`)")
    group.addoption("--k3conf-golden", metavar="DIR", default=None,
                    help="golden directory (default: the package's goldens for tiny, the cache for small)")
    group.addoption("--k3conf-report", metavar="DIR", default=None,
                    help="also write report.json, report.md and report.html of the cases run here, as `k3conf run "
                         "--report DIR` does (default: none)")
    group.addoption("--k3conf-timing", action="store_true",
                    help="also measure speed and apply the speed gates (off by default: tests are not benchmarks)")
    group.addoption("--k3conf-fuzz", type=float, default=0.0, metavar="SECONDS",
                    help="after the cases, items fuzz/<core>: one draw of every region of each core the backend "
                         "supplies, then more for SECONDS in all (default 0: one round), as `k3conf run --fuzz`")
    group.addoption("--k3conf-no-fuzz", action="store_true", help="no fuzz items (the cases alone)")


def pytest_configure(config) -> None:
    if config.getoption("k3conf_backend", None):
        # The cases, the backends and the runner load only when asked for: pytest's own plugin loading
        # (conformance.pytest_cases configures itself), so that a pytest run without the option stays cheap.
        config.pluginmanager.import_plugin("conformance.pytest_cases")
