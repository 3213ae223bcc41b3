"""Fuzz draws, judged as the cases are, and a failing draw shrunk to the smallest that still fails.

    runner = FuzzRunner(parent)                              # parent: the run's Runner (its workers, its backends)
    draws = plan(["kda_decode", "mxfp4_gemv"], seed=123)     # one draw of each region of each core
    findings = fuzz(runner, backend, draws, budget=5.0)       # Finding per failing draw, shrunk

A draw is a core case (kind `core`) whose params come from a region of conformance.fuzz.space, whose seed is the
run's, and whose golden is made in memory (the float64 reference on the draw's inputs, as a fresh draw's). It is
judged by the runner's own code with the rules of fresh inputs: no cap (the caps were measured on the goldens),
the bound k x the precision's baseline on the same draw + floor, and the per-element rule; the kernel is called
twice (the determinism check). The baselines themselves are not fuzzed (they set the bounds).

A failing draw (fail or error) is shrunk: each dimension is walked down (space.smaller) while the draw still
fails, so the finding reads "smallest failing: B=1 H=65 K=8 V=8" and points at the bug; the shrunk draw is written
as a replay file (conformance.fuzz.replay) with the failure line and the shape of its error.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import zlib
from pathlib import Path

import numpy as np

from conformance.cases.protocol import Case
from conformance.fuzz import space
from conformance.golden.errors import GoldenError
from conformance.golden.regen import build_blob
from conformance.golden.store import golden_of_bytes
from conformance.results import CaseResult
from conformance.runner import Runner

FUZZ_CONFIG_SEED = 0x5EED   # mixed into each draw's seed: a fuzz draw never reuses a committed case's data
SHRINK_STEPS = 60           # candidates judged while shrinking one finding, at most
SHRINK_SECONDS = 60.0       # and seconds
# What one draw may hand a kernel's worker (its inputs) and hold for the judge (its expected outputs). The regions'
# largest draws take about 12 MiB (kda_prefill_varlen with 96 heads); a draw over the budget is not judged and is
# counted as such (`k3conf fuzz --memory`). The float64 reference builds a draw before its size is known.
MEMORY_MIB = 256.0
OVER_MEMORY = "within the memory budget"


@dataclasses.dataclass(frozen=True)
class Draw:
    """One fuzz draw: the core, the region it came from, the builder's params, the seed of its data and the shape
    set whose magnitudes and gate rows it takes."""

    core: str
    region: str
    params: dict
    seed: int
    config: str = "tiny"

    @property
    def case(self) -> Case:
        """The draw as a core case; its name says the core, the region, the seed and (a digest) the params."""
        digest = hashlib.sha256(json.dumps([self.params, self.config], sort_keys=True, default=str).encode())
        return Case(f"{self.core}/fuzz-{self.region}-{self.seed}-{digest.hexdigest()[:8]}", "core", self.config,
                    self.seed, dict(self.params))

    def with_params(self, params: dict) -> Draw:
        return dataclasses.replace(self, params=dict(params))

    def to_json(self) -> dict:
        return {"core": self.core, "region": self.region, "params": _plain(self.params), "seed": self.seed,
                "config": self.config}

    @classmethod
    def from_json(cls, doc: dict) -> Draw:
        return cls(str(doc["core"]), str(doc["region"]), _tuples(doc["params"]), int(doc["seed"]),
                   str(doc.get("config", "tiny")))


def _plain(value):
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _tuples(value):
    """JSON's lists back to the tuples the builders take (seq_lens, lens, padded, lead, shape, seqs)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def fuzzable(cores) -> list[str]:
    """The cores of `cores` the fuzz space covers, in its order."""
    return [c for c in space.REGIONS if c in cores]


def plan(cores, seed: int, rounds: int = 1, start: int = 0) -> list[Draw]:
    """`rounds` draws (rounds start .. start + rounds - 1) of every region of every core in `cores` (fuzzable ones),
    each drawn with a generator of its own from (seed, core, region, round): the same seed gives the same draws, in
    any order of cores."""
    draws = []
    for r in range(start, start + rounds):
        for core in fuzzable(cores):
            for region in space.REGIONS[core]:
                key = (seed, zlib.crc32(core.encode()), zlib.crc32(region.name.encode()), r)
                rng = np.random.default_rng(key)
                case_seed = int(rng.integers(2 ** 31 - 1)) ^ FUZZ_CONFIG_SEED
                draws.append(Draw(core, region.name, region.draw(rng), case_seed, region.config))
    return draws


class FuzzRunner(Runner):
    """The runner of fuzz draws: a draw's golden is made in memory from its params and seed, judged with the rules
    of fresh inputs (no cap: capped = False; the baseline on the same draw), never timed."""

    capped = False

    def __init__(self, parent: Runner, memory_mib: float = MEMORY_MIB):
        super().__init__(parent.root, parent.config, False, seed=None, in_process=parent.in_process,
                         pool=parent.pool, handles=parent.handles)
        self.memory_mib = memory_mib

    def golden(self, case: Case):
        if case.name not in self.goldens:
            try:
                blob = build_blob(case)
                if len(blob) > self.memory_mib * 2 ** 20:
                    raise GoldenError(f"{case.name}: cannot be drawn {OVER_MEMORY}: its inputs and expected outputs "
                                      f"take {len(blob) / 2 ** 20:.1f} MiB, the budget is {self.memory_mib:g} MiB")
                self.goldens[case.name] = golden_of_bytes(blob, case.name, case.config, _memory_path(case))
            except GoldenError as e:
                self.goldens[case.name] = e
            except (ValueError, RuntimeError) as e:   # params the builder refuses: no draw, never a verdict
                self.goldens[case.name] = GoldenError(f"{case.name}: cannot be drawn: {type(e).__name__}: {e}")
        return self.goldens[case.name]

    def golden_fault(self, case: Case, golden) -> str:
        return ""   # the draw was made moments ago from its own params: nothing to regenerate


def _memory_path(case: Case) -> Path:
    return Path(f"(fuzz draw, seed {case.seed}, in memory)") / case.name


@dataclasses.dataclass
class Finding:
    """A failing draw and the smallest draw found that still fails, with the result of each."""

    backend: str
    first: Draw
    first_result: CaseResult
    smallest: Draw
    smallest_result: CaseResult
    steps: int

    def line(self) -> str:
        """'smallest failing: B=1 H=65 K=8 V=8 (kda_decode, region heads-past-64, seed S): <failure line>'."""
        r = self.smallest_result
        why = r.failure_line() or r.error
        shape = next((t.diagnosis for t in r.tensors if not t.passed and t.diagnosis), None)
        return (f"{self.backend}: {self.smallest.core}: smallest failing: {space.describe(self.smallest.params)} "
                f"(region {self.smallest.region}, seed {self.smallest.seed}; shrunk in {self.steps} step(s) from "
                f"{space.describe(self.first.params)}): {why}" + (f"; shape of the error: {shape}" if shape else ""))


def failed(result: CaseResult) -> bool:
    return result.status in ("fail", "error")


def judge(runner: FuzzRunner, draw: Draw, backend) -> CaseResult:
    """One draw on one backend, as the runner judges a case."""
    return runner.run_one(draw.case, backend)


def shrink(runner: FuzzRunner, draw: Draw, result: CaseResult, backend) -> tuple[Draw, CaseResult, int]:
    """The smallest draw below `draw` that still fails on `backend` and its result, and the candidates judged:
    each dimension (space.dims) bisected between its floor and where it fails, in turn, until a pass over every
    dimension changes nothing (a size threshold is monotone: past it, the bug shows). Bounded by SHRINK_STEPS
    candidates and SHRINK_SECONDS."""
    steps, deadline = 0, time.monotonic() + SHRINK_SECONDS
    best, best_result = draw, result

    def fails(params: dict) -> CaseResult | None:
        nonlocal steps
        if steps >= SHRINK_STEPS or time.monotonic() >= deadline or not space.valid(draw.core, params):
            return None
        steps += 1
        r = judge(runner, best.with_params(params), backend)
        return r if failed(r) and not _undrawable(r) else None

    changed = True
    while changed:
        changed = False
        for dim in space.dims(draw.core, best.params):
            lo, hi = dim.floor, space.size(best.params, dim)
            if hi <= lo:
                continue
            r = fails(space.with_dim(best.params, dim, lo))
            if r is not None:
                best, best_result, changed = best.with_params(space.with_dim(best.params, dim, lo)), r, True
                continue
            while hi - lo > dim.step:      # lo passes, hi fails: the smallest failing value lies in (lo, hi]
                mid = (lo + hi) // 2 // dim.step * dim.step
                if mid <= lo:
                    break
                r = fails(space.with_dim(best.params, dim, mid))
                if r is None:
                    lo = mid
                else:
                    best, best_result, changed, hi = best.with_params(space.with_dim(best.params, dim, mid)), r, \
                        True, mid
    return best, best_result, steps


def _undrawable(result: CaseResult) -> bool:
    """A candidate the builder could not draw is no smaller failure."""
    return result.status == "error" and "cannot be drawn" in result.error


def fuzz(runner: FuzzRunner, backend, draws: list[Draw], budget: float | None = None,
         results: list[CaseResult] | None = None) -> list[Finding]:
    """Judge `draws` on `backend` (those of its kernel cores), stopping when `budget` seconds are spent (None: all);
    each failing draw shrunk. `results` receives every draw's result (the shrink candidates' are not kept)."""
    findings: list[Finding] = []
    deadline = None if budget is None else time.monotonic() + budget
    own = backend.kernel_cores()
    for draw in draws:
        if draw.core not in own:
            continue
        if deadline is not None and time.monotonic() > deadline:
            break
        r = judge(runner, draw, backend)
        if results is not None:
            results.append(r)
        if failed(r) and not _undrawable(r):
            smallest, smallest_result, steps = shrink(runner, draw, r, backend)
            findings.append(Finding(backend.name, draw, r, smallest, smallest_result, steps))
    return findings


__all__ = ["MEMORY_MIB", "OVER_MEMORY", "Draw", "Finding", "FuzzRunner", "fuzz", "fuzzable", "judge", "plan", "shrink"]
