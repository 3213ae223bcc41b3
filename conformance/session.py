"""Preparing a run, in one place for its three front ends: `k3conf run`, the pytest plugin and `k3conf run --tp`.

- `pick_cases` / `cases_of`: the cases a run selects (SessionError when a pattern matches nothing);
- `load_backend`, `checked_backend`, `backend_checks`, `check_backends`: each backend loaded (the built-in NumPy
  references here, every other one by its worker process: its module is never imported in the run's process),
  asked whether it can run here, and an external one's cores tried on tiny inputs (conformance.backends.checks,
  called from here: the reference answers stay here), so that a wrong signature is named before the run and a
  core that answers nothing is refused with the reason;
- `golden_root`: the golden folder, absolute, refused without a manifest (naming the command that makes one);
- `run_rows`, `resolve_backends`, `backend_row`, `strict`, `strict_missing`: the backends a run uses, their rows
  in the report (which also say whether the run must judge the backend on something), and which of the
  unavailable ones fail the run under K3_STRICT=1.
Every backend is untrusted: what it says about itself (available(), kernel_cores(), its name) comes over the wire
from its worker and is checked there and here, once, before a case runs; two backends of one run may not share a
name; an external one may not take a built-in's. Each front end turns a SessionError into its own kind of usage
error; the message is the same everywhere. A core refused by the start-up check is no usage error: the backend's
row says why, and the run fails (exit 1) with its report written.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from conformance.backends import registry
from conformance.backends.checks import check_cores, check_seed
from conformance.backends.protocol import BackendBase, BackendError, checked_availability, checked_kernel_cores
from conformance.backends.registry import (
    DEVICE_BACKENDS,
    backend_names,
    get_backend,
    is_external,
    known_name,
    reserved_names,
)
from conformance.cases.catalog import all_cases, select
from conformance.cases.protocol import Case
from conformance.golden.store import MANIFEST, default_root
from conformance.isolation.client import WorkerPool
from conformance.isolation.errors import KernelFailure
from conformance.isolation.remote import RemoteBackend

# K3_STRICT: the one parsing rule of the CLI, the pytest plugin and the test suite (tests/support/strict.py)
STRICT_ON = ("1", "true", "yes", "on")
STRICT_OFF = ("0", "false", "no", "off", "")


def in_processes(asked: frozenset[str] | None = None) -> frozenset[str]:
    """The backends a run builds in its own process: `asked`, else conformance.backends.registry.IN_PROCESS as it
    is now (k3ref's NumPy references; a test adds the backends it defines in its own process)."""
    return registry.IN_PROCESS if asked is None else asked


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
    """A backend as a run found it: the name it was asked for, whether it can run here and why (not), the cores
    it supplies itself (empty when it cannot run: they are asked only of a backend that can), why the start-up
    check refused it ('' when it did not), and whether the run fails when it is judged on nothing."""

    backend: BackendBase
    available: bool
    reason: str
    kernel_cores: frozenset[str] = frozenset()
    name: str = ""
    refused: str = ""
    must_judge: bool = True


def load_backend(name: str, pool: WorkerPool, in_process: frozenset[str] | None = None) -> BackendBase:
    """The backend `name`: a built-in NumPy reference built here; any other one loaded and described by its worker
    in `pool`, never imported here. SessionError for an unknown name, a backend that does not load, that
    describes itself wrongly, or an external one that takes a built-in backend's name."""
    try:
        known_name(name)
    except KeyError as e:
        raise SessionError(e.args[0]) from None
    if name in in_processes(in_process):
        return get_backend(name)
    try:
        backend = pool.backend(name)
    except (BackendError, KernelFailure) as e:
        raise SessionError(str(e)) from None
    if is_external(name) and (backend.name in reserved_names() or backend.name.startswith("mutant:")):
        raise SessionError(f"{name}: the name {backend.name!r} is a built-in backend's; give yours another name")
    return backend


def checked_backend(name: str, pool: WorkerPool, in_process: frozenset[str] | None = None,
                    must_judge: bool = True) -> BackendCheck:
    """The backend `name` (load_backend) and whether it can run here; an available external backend's cores are
    called on tiny inputs (conformance.backends.checks.check_cores, in this process: each call goes to the
    worker, the reference is computed here): a core that breaks the interface, answers nothing or crashes is
    `refused` with the check's message."""
    backend = load_backend(name, pool, in_process)
    ok, why = checked_availability(backend.available)
    kernels: frozenset[str] = frozenset()
    refused = ""
    if ok:
        try:
            kernels = checked_kernel_cores(backend.kernel_cores(), f"backend {backend.name}")
        except BackendError as e:
            raise SessionError(str(e)) from None
        if is_external(name):
            refused = _start_up_check(backend, pool)
    return BackendCheck(backend, ok, why, kernels, name, refused, must_judge)


def _start_up_check(backend: BackendBase, pool: WorkerPool) -> str:
    """'' when the backend's cores keep the interface and answer their inputs (check_cores), else the refusal.
    A write into an input is left to the cells, which name the case."""
    try:
        seed = check_seed()   # a K3CONF_CHECK_SEED that is no seed is a usage error, before any core runs
    except BackendError as e:
        raise SessionError(str(e)) from None
    pool.case = "(start-up check of the cores)"
    remote = backend if isinstance(backend, RemoteBackend) else None
    if remote is not None:
        remote.check_writes = False
    try:
        check_cores(backend, seed)
    except (BackendError, KernelFailure) as e:
        return f"backend {backend.name}: the start-up check of its cores failed: {e}"
    finally:
        if remote is not None:
            remote.check_writes = True
    return ""


def backend_checks(names: list[str] | None, pool: WorkerPool,
                   in_process: frozenset[str] | None = None) -> list[BackendCheck]:
    """checked_backend of every name (each once; no names: every registered backend, of which only the external
    ones must be judged on something); SessionError when two of them are named alike."""
    must_judge = bool(names)
    asked = list(dict.fromkeys(names)) if names else backend_names()
    checks = [checked_backend(n, pool, in_process, must_judge or is_external(n)) for n in asked]
    refuse_shared_names({c.name: c.backend for c in checks})
    return checks


def check_backends(names: list[str] | None, pool: WorkerPool) -> list[BackendCheck]:
    """backend_checks, for `k3conf run`; SessionError when K3_STRICT has a value strict() does not know, or when
    none of the requested backends can run here."""
    strict()
    checks = backend_checks(names, pool)
    why_not = {c.name: c.reason for c in checks if not c.available}
    if names and len(why_not) == len(checks):
        raise SessionError("none of the requested backends can run here: "
                           + "; ".join(f"{n}: {w}" for n, w in why_not.items()))
    return checks


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
    """The golden folder of a run (`golden`, else the config's default one), absolute (nothing a kernel does to
    a working directory can move it); SessionError when it is not usable or has no manifest, naming the command
    that makes one."""
    root = (golden or default_root(config))
    try:
        root = root.resolve()
        has_manifest = (root / MANIFEST).is_file()
    except OSError as e:   # a name too long, a path through a file
        raise SessionError(f"--golden {str(root)[:300]}: not usable as a golden directory ({e.strerror})") from None
    if not has_manifest:
        raise SessionError(f"no goldens in {root} (no {MANIFEST}); generate them with: k3conf regen --config {config}"
                           + (f" --out {root}" if golden else ""))
    return root


def resolve_backends(names: list[str] | None, pool: WorkerPool) -> tuple[list[BackendBase], list[dict]]:
    """(runnable backends, report rows for all requested, each name once): backend_checks without the start-up
    check's refusals counting as runnable."""
    checks = backend_checks(names, pool)
    return [c.backend for c in checks if c.available and not c.refused], run_rows(checks)


def run_rows(checks: list[BackendCheck], in_process: frozenset[str] | None = None,
             timeout: float | None = None) -> list[dict]:
    """The report's row of each backend of a run (backend_row), with how it ran (in this process or in a worker
    process, its time limit)."""
    rows = []
    for c in checks:
        row = backend_row(c.name, c.backend, c, c.must_judge)
        limit = "" if timeout is None else f", time limit {timeout:g} s per core call"
        row["isolation"] = ("in the run's process (built-in NumPy reference)" if c.name in in_processes(in_process)
                            else f"worker process{limit}")
        rows.append(row)
    return rows


def backend_row(name: str, backend: BackendBase, check: BackendCheck, must_judge: bool) -> dict:
    """A run's row of one backend (report.json `backends`): as requested (`name`), the name its results carry
    (`backend`), whether it can run here and why, its device, its kernel cores, why the start-up check refused
    it ('' when it did not), and whether the run fails when none of its results is a pass or a fail
    (conformance.results.RunReport.nothing_judged)."""
    return {"name": name, "precision": backend.precision, "available": check.available, "reason": check.reason,
            "device": backend.device, "backend": backend.name, "kernel_cores": sorted(check.kernel_cores),
            "must_judge": must_judge, "refused": check.refused}


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
