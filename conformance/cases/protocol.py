"""What a case is and what a kind of case must answer: the one interface the runner and the regeneration tool use.

A *case* is one golden file: a name `<block>/<id>` (e.g. `kda_decode/B2-H3-K16`), a config (`tiny` is
committed; `small`, `k3` and `k3-tp8` are generated into a cache), a seed, and the *kind* that knows how to build
its data, compute its float64 golden and run a backend on it. A kind satisfies `CaseKind`; subclassing `KindBase`
supplies the optional answers (every core exercised, every tensor gated, gate rows looked up by the tensor's
own name), so callers ask every kind the same questions without probing for methods.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from k3ref.cores import CORE_NAMES

GENERATOR_VERSION = "k3conf-cases/1"   # bump when the data or the way a golden is computed changes
# the case sets: tiny (committed), small, and K3's real block sizes (k3; k3-tp8 = one rank of tensor parallelism 8)
CONFIGS = ("tiny", "small", "k3", "k3-tp8")


@dataclasses.dataclass(frozen=True)
class Case:
    """One golden: `name` = '<block>/<id>', the kind that handles it, its config, seed and parameters."""

    name: str
    kind: str
    config: str
    seed: int
    params: Mapping = dataclasses.field(default_factory=dict)

    @property
    def block(self) -> str:
        return self.name.split("/", 1)[0]


@dataclasses.dataclass
class Content:
    """What a kind generates for one case: tensors by full name and the scalar kwargs (JSON-able)."""

    tensors: dict[str, np.ndarray]
    kwargs: dict


@dataclasses.dataclass
class RunInfo:
    """What a kind learned while running a backend, beside the tensors.

    kernels_ran: the backend's kernel cores that ran at least once (None: the kind does not track it; empty: no
    kernel of the backend ran, so the result is n/a). tensor_notes: tensor -> a line shown with its verdict.
    flips: greedy-token flips (step, expected, found, margin). teacher_forced: near-tie choices (router,
    argmax) for which the backend was given the golden's choice, counted by kind of choice."""

    kernels_ran: list[str] | None = None
    tensor_notes: dict[str, str] = dataclasses.field(default_factory=dict)
    flips: list[dict] = dataclasses.field(default_factory=list)
    teacher_forced: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Timed:
    """A kind's timing of a backend on a case: the median seconds of one call, the bytes one call moves (every
    input read and every output written once: a floor for any kernel; 0 when not counted), and every timed call's
    outputs by name, each with the index of the golden whose inputs it ran on (the run holds them to the outputs
    the backend gave when judged on those inputs)."""

    seconds: float
    nbytes: int
    calls: list[tuple[int, dict[str, np.ndarray]]]


# timer(backend, core, sets, repeats) -> (seconds, outputs) of `repeats` calls of `core` on the input sets in turn
# (conformance.isolation.timing.timed_calls, in the backend's worker for an isolated one)
Timer = Callable[[Any, str, list, int], tuple[list[float], list]]


@dataclasses.dataclass
class Evaluation:
    """A backend's run of one case: its outputs by name (without the 'outputs.' prefix), the lines the report
    shows with the result (e.g. cores that fell back to the reference) and what the kind learned (RunInfo)."""

    outputs: dict[str, np.ndarray]
    notes: list[str] = dataclasses.field(default_factory=list)
    info: RunInfo = dataclasses.field(default_factory=RunInfo)


class CaseKind(Protocol):
    """What the runner and the regeneration tool need from a kind of case."""

    name: str

    def cases(self, config: str) -> list[Case]:
        """Every case of this kind for `config` (deterministic order)."""

    def generate(self, case: Case) -> Content:
        """The float64 golden content: inputs (+ weights, inter) and outputs computed by k3ref."""

    def evaluate(self, case: Case, golden, backend) -> Evaluation:
        """Run `backend` on the golden's inputs."""

    def block_of(self, case: Case, tensor: str) -> str:
        """The block a tensor belongs to (gate row and the name in a first-failure line)."""

    def timing(self, case: Case, goldens: list, backend, timer: Timer) -> Timed | None:
        """The backend timed on the inputs of `goldens` (the case's golden, then a fresh draw when there is one),
        or None when the case is not timed."""

    def cores_of(self, case: Case) -> frozenset[str]:
        """The cores the case exercises: a backend supplying none of them itself gets "n/a (reference core)"."""

    def is_gated(self, case: Case, tensor: str) -> bool:
        """False: the tensor is reported, never failing."""

    def gate_tensor(self, case: Case, tensor: str) -> str:
        """The name the tensor's gate rows are looked up by."""

    def pooled_baseline(self, case: Case, errs: dict) -> dict:
        """The baseline's errors per tensor (gates.BaselineError) as the bounds scale with them: `errs` itself,
        or where one tensor's error is one noisy draw of many alike, the worst of them."""


class KindBase:
    """The answers most kinds share: the block is the case's, every core is exercised, every tensor is gated
    under its own name, nothing is timed."""

    name = ""

    def block_of(self, case: Case, tensor: str) -> str:
        return case.block

    def timing(self, case: Case, goldens: list, backend, timer: Timer) -> Timed | None:
        return None

    def cores_of(self, case: Case) -> frozenset[str]:
        return frozenset(CORE_NAMES)

    def is_gated(self, case: Case, tensor: str) -> bool:
        return True

    def gate_tensor(self, case: Case, tensor: str) -> str:
        return tensor

    def pooled_baseline(self, case: Case, errs: dict) -> dict:
        return errs


def case_seed(name: str) -> int:
    """A stable per-case seed from its name (no Python hash randomisation)."""
    return int.from_bytes(name.encode(), "little") % (2 ** 31 - 1)
