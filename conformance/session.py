"""Preparing a run, in one place for its three front ends: `k3conf run`, the pytest plugin and `k3conf run --tp`.

- `pick_cases` / `cases_of`: the cases a run selects (SessionError when a pattern matches nothing);
- `check_backends` / `checked_backend`: each named backend built, asked whether it can run here, and an external
  one's cores tried on a tiny input, so that a wrong signature is named before the run;
- `golden_root`: the golden folder, refused without a manifest (naming the command that makes one);
- `resolve_backends`, `strict`, `strict_missing`: the backends a run uses, their availability rows, and which
  of the unavailable ones fail the run under K3_STRICT=1.
Each front end turns a SessionError into its own kind of usage error; the message is the same everywhere.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from conformance.backends.checks import check_cores
from conformance.backends.external import BackendError
from conformance.backends.protocol import BackendBase
from conformance.backends.registry import DEVICE_BACKENDS, backend_names, get_backend, is_external
from conformance.cases.catalog import all_cases, select
from conformance.cases.protocol import Case
from conformance.golden.store import MANIFEST, default_root


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
    """A backend as a run found it: whether it can run here and why (not)."""

    backend: BackendBase
    available: bool
    reason: str


def checked_backend(name: str) -> BackendCheck:
    """The backend `name` and whether it can run here; an available external backend's cores are first called
    on tiny inputs (conformance.backends.checks.check_cores). SessionError for an unknown name, a backend that
    does not load, or a core that breaks the interface."""
    try:
        backend = get_backend(name)
        ok, why = backend.available()
        if ok and is_external(name):
            check_cores(backend)
    except KeyError as e:
        raise SessionError(e.args[0]) from None
    except BackendError as e:
        raise SessionError(str(e)) from None
    return BackendCheck(backend, ok, why)


def check_backends(names: list[str]) -> list[BackendCheck]:
    """checked_backend of every name; SessionError when none of them can run here."""
    checks = {name: checked_backend(name) for name in names}
    why_not = {n: c.reason for n, c in checks.items() if not c.available}
    if names and len(why_not) == len(checks):
        raise SessionError("none of the requested backends can run here: "
                           + "; ".join(f"{n}: {w}" for n, w in why_not.items()))
    return list(checks.values())


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
    """(runnable backends, availability rows for all requested, each name once); KeyError for an unknown name.
    No names: every registered backend."""
    names = list(dict.fromkeys(names)) if names else backend_names()
    runnable, rows = [], []
    for name in names:
        b = get_backend(name)
        ok, why = b.available()
        rows.append({"name": name, "precision": b.precision, "available": ok, "reason": why, "device": b.device})
        if ok:
            runnable.append(b)
    return runnable, rows


def strict() -> bool:
    """K3_STRICT=1 (CI): a missing tool or library fails instead of skipping."""
    return os.environ.get("K3_STRICT", "").strip() == "1"


def strict_missing(rows: list[dict]) -> list[str]:
    """Under K3_STRICT=1: one line per unavailable backend that needs no accelerator (not in DEVICE_BACKENDS
    and declaring no device other than the CPU, e.g. the `fla` adapter's "cuda"), with its reason."""
    if not strict():
        return []
    return [f"backend {r['name']} cannot run here: {r['reason']}" for r in rows
            if not r["available"] and r["name"] not in DEVICE_BACKENDS and r.get("device", "cpu") == "cpu"]
