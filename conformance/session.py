"""Preparing a run, in one place for its three front ends: `k3conf run`, the pytest plugin and `k3conf run --tp`.

- `pick_cases` / `cases_of`: the cases a run selects (SessionError when a pattern matches nothing);
- `check_backends` / `checked_backend`: each named backend built, asked whether it can run here, and an external
  one's cores tried on a tiny input, so that a wrong signature is named before the run;
- `golden_root`: the golden folder, refused without a manifest (naming the command that makes one);
- `resolve_backends`, `backend_row`, `strict`, `strict_missing`: the backends a run uses, their availability rows
  (which also say whether the run must judge the backend on something), and which of the unavailable ones fail
  the run under K3_STRICT=1.
Every backend is untrusted: what it says about itself (available(), kernel_cores(), its name) is checked here, once,
before a case runs; two backends of one run may not share a name; and loading one may not change the gate table.
Each front end turns a SessionError into its own kind of usage error; the message is the same everywhere.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from conformance.backends.protocol import BackendBase, BackendError, checked_availability, checked_kernel_cores
from conformance.backends.registry import DEVICE_BACKENDS, backend_names, get_backend, is_external
from conformance.cases.catalog import all_cases, select
from conformance.cases.protocol import Case
from conformance.golden.store import MANIFEST, default_root
from conformance.isolation.client import DEFAULT_TIMEOUT, KernelFailure, WorkerPool
from conformance.judge import gate_table, gates

# K3_STRICT: the one parsing rule of the CLI, the pytest plugin and the test suite (tests/support/strict.py)
STRICT_ON = ("1", "true", "yes", "on")
STRICT_OFF = ("0", "false", "no", "off", "")


class SessionError(ValueError):
    """A run that cannot start: no case selected, a backend that does not load, no goldens. The message says
    what was asked for and what was found."""


def cases_of(config: str, kind: str | None = None) -> list[Case]:
    """Every case of `config` (only those of `kind` when given)."""
    return [c for c in all_cases(config) if kind is None or c.kind == kind]


def pick_cases(config: str, patterns: list[str] | None) -> list[Case]:
    """The cases of `config` matching `patterns` (all when none); SessionError when none match, or when one of
    several patterns matches nothing (a typo next to a good pattern would otherwise drop cases silently)."""
    everything = all_cases(config)
    cases = select(everything, patterns)
    if not cases:
        raise SessionError(f"no case matches {patterns} in config {config!r}; `k3conf list cases` shows them")
    idle = [p for p in patterns or [] if not select(everything, [p])]
    if idle:
        raise SessionError(f"--cases {' '.join(repr(p) for p in idle)}: matches no case in config {config!r} "
                           "(`k3conf list cases` shows them)")
    return cases


@dataclasses.dataclass(frozen=True)
class BackendCheck:
    """A backend as a run found it: whether it can run here and why (not), and the cores it supplies itself
    (empty when it cannot run: they are asked only of a backend that can)."""

    backend: BackendBase
    available: bool
    reason: str
    kernel_cores: frozenset[str] = frozenset()


def checked_backend(name: str, timeout: float = DEFAULT_TIMEOUT) -> BackendCheck:
    """The backend `name` and whether it can run here; an available one's kernel_cores() is checked against the
    core names, and an available external backend's cores are called on tiny inputs in a worker process
    (conformance.backends.checks.check_cores). SessionError for an unknown name, a backend that does not load,
    that changes the gate table, whose kernel_cores() is not a set of core names, or a core that breaks the
    interface."""
    try:
        with _gate_table_kept(name):
            backend = get_backend(name)
            ok, why = checked_availability(backend.available)
            kernels = _kernel_cores(backend) if ok else frozenset()
            if ok and is_external(name):
                _check_cores(backend, name, timeout)
    except KeyError as e:
        raise SessionError(e.args[0]) from None
    except BackendError as e:
        raise SessionError(str(e)) from None
    return BackendCheck(backend, ok, why, kernels)


def check_backends(names: list[str], timeout: float = DEFAULT_TIMEOUT) -> list[BackendCheck]:
    """checked_backend of every name; SessionError when K3_STRICT has a value strict() does not know, when two
    names give backends of one name, or when none of them can run here."""
    strict()
    checks = {name: checked_backend(name, timeout) for name in names}
    refuse_shared_names({n: c.backend for n, c in checks.items()})
    why_not = {n: c.reason for n, c in checks.items() if not c.available}
    if names and len(why_not) == len(checks):
        raise SessionError("none of the requested backends can run here: "
                           + "; ".join(f"{n}: {w}" for n, w in why_not.items()))
    return list(checks.values())


def refuse_shared_names(backends: dict[str, BackendBase]) -> None:
    """SessionError when two requested names (`name -> backend`) give backends of one name: their cells would
    overwrite each other's."""
    by_name: dict[str, list[str]] = {}
    for requested, backend in backends.items():
        by_name.setdefault(backend.name, []).append(requested)
    shared = {name: asked for name, asked in by_name.items() if len(asked) > 1}
    if shared:
        raise SessionError("; ".join(f"backends {' and '.join(asked)} are both named {name!r}" for name, asked
                                     in shared.items()) + ": each backend of a run needs a name of its own")


def _kernel_cores(backend: BackendBase) -> frozenset[str]:
    """backend.kernel_cores(), checked against the core names (BackendError naming what was found)."""
    try:
        found = backend.kernel_cores()
    except BackendError:
        raise
    except Exception as e:
        raise BackendError(f"backend {backend.name}: kernel_cores() raised {type(e).__name__}: {e}") from e
    return checked_kernel_cores(found, f"backend {backend.name}")


def _check_cores(backend: BackendBase, name: str, timeout: float) -> None:
    """check_cores in a worker process, as the run calls the backend's cores: a core that crashes, exits or hangs
    in the check cannot take the run's process with it. Any failure (the check's BackendError, an exception of
    the backend's own code, a crash or the time limit) becomes a BackendError with the worker's message."""
    pool = WorkerPool(timeout)
    pool.specs[backend.name] = name   # a worker started afresh (a device backend's) loads it by this name
    try:
        pool.check_cores(backend)
    except KernelFailure as e:
        raise BackendError(f"backend {backend.name}: the start-up check of its cores failed: {e}") from None
    finally:
        pool.close()


def _gate_tables() -> tuple:
    """The gate tables where they are built and where the verdicts read them."""
    return (gate_table.GATES, gate_table.BASELINE_GATES, gate_table.MARGIN_BUDGETS, gate_table.SPEED_TARGETS,
            gate_table.MEASURED, gate_table.ELEMENT_RULES, gate_table.ELEMENT_RULES_BY_SET,
            gates.GATES, gates.BASELINE_GATES, gates.MARGIN_BUDGETS, gates.SPEED_TARGETS, gates.MEASURED,
            gates.ELEMENT_RULES)


@contextlib.contextmanager
def _gate_table_kept(name: str) -> Iterator[None]:
    """BackendError when loading backend `name` replaced a gate table (its rows are read-only: an edit raises
    TypeError at the edit, which loading reports as an error of that backend)."""
    before = _gate_tables()
    try:
        yield
    finally:   # even when loading failed otherwise: a replaced table is the news, and the run must not go on
        if any(a is not b for a, b in zip(before, _gate_tables(), strict=True)):
            raise BackendError(f"backend {name}: loading it replaced the gate table (conformance.judge.gates); a "
                               "backend is judged by the rows of conformance/judge/gate_table.py, never by its own")


def check_report_dir(out: Path) -> None:
    """Refuse an unwritable --report before running anything (not after a long run): create the folder and a
    probe file in it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except (OSError, ValueError) as e:
        why = (e.strerror if isinstance(e, OSError) else None) or str(e)
        raise SessionError(f"--report {str(out)[:300]}: cannot write reports there ({why}); pass --report DIR") \
            from None


def golden_root(golden: Path | None, config: str) -> Path:
    """The golden folder of a run (`golden`, else the config's default one); SessionError when it is not usable
    or has no manifest, naming the command that makes one."""
    root = golden or default_root(config)
    try:
        has_manifest = (root / MANIFEST).is_file()
    except OSError as e:   # a name too long, a path through a file
        raise SessionError(f"--golden {str(root)[:300]}: not usable as a golden directory ({e.strerror})") from None
    if not has_manifest:
        raise SessionError(f"no goldens in {root} (no {MANIFEST}); generate them with: k3conf regen --config {config}"
                           + (f" --out {root}" if golden else ""))
    return root


def resolve_backends(names: list[str] | None) -> tuple[list[BackendBase], list[dict]]:
    """(runnable backends, availability rows for all requested, each name once); KeyError for an unknown name,
    SessionError for two backends of one name or one that changes the gate table. No names: every registered
    backend. A backend the run must judge on something (`must_judge` in its row): every requested one, and in
    a run of every registered backend the external ones. A kernel_cores() that is not a set of core names
    makes its backend unavailable, with the reason."""
    must_judge = bool(names)
    names = list(dict.fromkeys(names)) if names else backend_names()
    runnable, rows, loaded = [], [], {}
    for name in names:
        try:
            with _gate_table_kept(name):
                b = get_backend(name)
        except BackendError as e:
            raise SessionError(str(e)) from None
        loaded[name] = b
        ok, why = checked_availability(b.available)
        kernels: frozenset[str] = frozenset()
        if ok:
            try:
                kernels = _kernel_cores(b)
            except BackendError as e:
                ok, why = False, str(e)
        rows.append(backend_row(name, b, BackendCheck(b, ok, why, kernels), must_judge or is_external(name)))
        if ok:
            runnable.append(b)
    refuse_shared_names(loaded)
    return runnable, rows


def backend_row(name: str, backend: BackendBase, check: BackendCheck, must_judge: bool) -> dict:
    """A run's row of one backend (report.json `backends`): as requested (`name`), the name its results carry
    (`backend`), whether it can run here and why, its device, its kernel cores, and whether the run fails when
    none of its results is a pass or a fail (conformance.results.RunReport.nothing_judged)."""
    return {"name": name, "precision": backend.precision, "available": check.available, "reason": check.reason,
            "device": backend.device, "backend": backend.name, "kernel_cores": sorted(check.kernel_cores),
            "must_judge": must_judge}


def strict() -> bool:
    """K3_STRICT (CI): a missing tool or library fails instead of skipping. 1/true/yes/on (any case) is strict,
    0/false/no/off or unset/empty is not; SessionError for any other value."""
    value = os.environ.get("K3_STRICT", "").strip()
    if value.lower() in STRICT_ON:
        return True
    if value.lower() in STRICT_OFF:
        return False
    raise SessionError(f"K3_STRICT: expected one of {', '.join(STRICT_ON)} (strict) or {', '.join(STRICT_OFF[:-1])} "
                       f"or empty (not strict), found {value[:100]!r}")


def strict_missing(rows: list[dict]) -> list[str]:
    """Under K3_STRICT=1: one line per unavailable backend that needs no accelerator (not in DEVICE_BACKENDS
    and declaring no device other than the CPU, e.g. the `fla` adapter's "cuda"), with its reason."""
    if not strict():
        return []
    return [f"backend {r['name']} cannot run here: {r['reason']}" for r in rows
            if not r["available"] and r["name"] not in DEVICE_BACKENDS and r.get("device", "cpu") == "cpu"]
