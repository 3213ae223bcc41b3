"""Every kind of case, in one table built from data: the runner, the regeneration tool and the front ends ask
here for the cases of a config and for the kind that handles a case.

Kinds, in the order their cases are listed:
- `core` (conformance.cases.core): one core of `k3ref.cores.Cores` on seeded arrays;
- `latent_moe` (conformance.cases.latent_moe): the LatentMoE layer over a small config;
- `trace` (conformance.cases.traces): a preset model's whole host graph, layer by layer or free-running.
A new kind is one more entry of KINDS (docs/runner.md shows the interface).
"""
from __future__ import annotations

import fnmatch

from conformance.cases.core import CORE_SPECS, CORE_TABLE, CoreKind
from conformance.cases.latent_moe import LatentMoeKind
from conformance.cases.protocol import CONFIGS, Case, CaseKind
from conformance.cases.traces import TraceKind

KINDS: dict[str, CaseKind] = {kind.name: kind for kind in (CoreKind(CORE_SPECS, CORE_TABLE), LatentMoeKind(),
                                                           TraceKind())}


def all_cases(config: str = "tiny") -> list[Case]:
    """Every case of every kind for `config`, in the order of KINDS."""
    if config not in CONFIGS:
        raise ValueError(f"config: expected one of {CONFIGS}, found {config!r}")
    return [c for kind in KINDS.values() for c in kind.cases(config)]


def select(cases: list[Case], patterns: list[str] | None) -> list[Case]:
    """Cases whose name matches any glob in `patterns` (all when None/empty); a bare block name matches its cases."""
    if not patterns:
        return list(cases)
    pats = [p if any(ch in p for ch in "*?[/") else p + "/*" for p in patterns]
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in pats)]


def kind_of(case: Case) -> CaseKind:
    """The kind that handles `case`."""
    return KINDS[case.kind]
