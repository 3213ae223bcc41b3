"""The speed of one (case, backend), judged where the verdicts are: on calls whose outputs are judged too.

    timing.judge(runner, case, golden, backend, res)   # a passing result: its speed, or why it now fails

A kernel may do its work when judged and none when timed. So the judge times the calls itself
(conformance.isolation.timing, in the backend's worker) on the inputs the kernel was judged on: the case's
golden and, once the fresh-input pass has run, the fresh draw, in turn, so that a timed call cannot answer with
the previous call's outputs. Every timed call's outputs must then be the outputs the kernel gave on the same
inputs when judged (bit for bit, or within the tensor's bound for a backend that declares itself
non-deterministic), and a time below the memory floor of the call's bytes is refused as impossible: a call cannot
read its inputs and write its outputs faster than FLOOR_MULTIPLE x the machine's copy bandwidth. Either failure
fails the cell; so does a kernel that crashes when timed. The copy bandwidth of a backend on the CPU is measured
here, in the run's own process; a device's comes from its worker (docs/untrusted_kernels.md, "Timing").
"""
from __future__ import annotations

from conformance.backends.protocol import BackendBase
from conformance.cases.catalog import kind_of
from conformance.cases.protocol import Case, Timed
from conformance.golden.errors import GoldenError
from conformance.isolation.errors import KernelFailure
from conformance.isolation.remote import RemoteBackend
from conformance.isolation.repeat import TIMED_CALL, repeat_results
from conformance.isolation.timing import timed_calls
from conformance.judge import gates
from conformance.judge.speed import numpy_copy_bandwidth
from conformance.results import CaseResult
from k3ref.cores import UnsupportedShape

# The speed baseline is PyTorch eager doing the same math at the same precision: on the CPU numpy
# vs torch per block, on a GPU the kernels vs torch eager on the same device.
TIME_BASELINE = {"fp64": "torch64", "fp32": "torch", "bf16": "torch-bf16"}
# How far above the copy bandwidth a correct call's bytes/s may go: its inputs may sit in a cache that the 64 MiB copy
# overflows, but no call beats a copy of its bytes from there. `python tools/floor_ratios.py --cache-copy` measured
# that ceiling at 5.4x-6.2x on this 2-core machine (np.copyto of 16-256 KiB; a loaded machine); correct backends
# reached at most 0.73x on tiny and the values in docs/measurements.md on k3 and k3-tp8. 16 leaves 2.5x above the
# ceiling: a refusal is a time no call of those bytes can take.
FLOOR_MULTIPLE = 16.0


def timer(backend: BackendBase, core: str, sets: list, repeats: int) -> tuple[list[float], list]:
    """The judge's timing of `core`: in the backend's worker for an isolated backend, here for a reference."""
    if isinstance(backend, RemoteBackend):
        return backend.timed_calls(core, sets, repeats)
    return timed_calls(backend, core, sets, repeats)


def copy_bandwidth(runner, backend: BackendBase) -> float | None:
    """Bytes/s of a large copy where the backend's data lives, once per backend and run: measured here for the CPU;
    a device's as its worker measures it (None when it claims none)."""
    if backend.name not in runner.copy_bw:
        try:
            runner.copy_bw[backend.name] = (numpy_copy_bandwidth() if backend.device == "cpu"
                                            else backend.copy_bandwidth())
        except Exception:  # noqa: BLE001 - no bandwidth: no ratio and no floor, never a failed case
            runner.copy_bw[backend.name] = None
    return runner.copy_bw[backend.name]


def _inputs_judged(runner, case: Case, golden, backend: BackendBase) -> tuple[list, list[dict]]:
    """(goldens, the outputs judged on each): the case's golden, then the fresh draw when it was judged."""
    goldens, judged = [golden], [runner.judged[(case.name, backend.name)]]
    fresh = runner.fresh
    if fresh is not None and (case.name, backend.name) in fresh.judged:
        drawn = fresh.goldens.get(case.name)
        if drawn is not None and not isinstance(drawn, GoldenError):
            goldens.append(drawn)
            judged.append(fresh.judged[(case.name, backend.name)])
    return goldens, judged


def judge(runner, case: Case, golden, backend: BackendBase, res: CaseResult) -> None:
    """`res` (a passing result) with its speed; failed when a timed call's outputs are not the judged ones, when
    its time is below the memory floor, when a declared speed target is missed, or an error when the kernel
    broke while timed."""
    goldens, judged = _inputs_judged(runner, case, golden, backend)
    kind = kind_of(case)
    try:
        timed = kind.timing(case, goldens, backend, timer)
    except UnsupportedShape:
        timed = None
    except KernelFailure as e:   # a kernel that breaks only when timed has failed
        res.status, res.error = "error", f"while timed: {e}"
        return
    runner.times[(case.name, backend.name)] = None if timed is None else timed.seconds
    if timed is None:
        return
    cores = ", ".join(sorted(kind.cores_of(case) & backend.kernel_cores()))
    for i, outputs in timed.calls:
        failed, notes = repeat_results(res.tensors, judged[i], outputs, backend.deterministic, cores, TIMED_CALL)
        res.notes += notes
        if failed:
            res.tensors += failed
            res.status = "fail"
            return
    bw = copy_bandwidth(runner, backend)
    floor = below_floor(timed, bw)
    if floor:
        res.speed = gates.SpeedResult(timed.seconds, timed.nbytes, None, None, None, None, False, floor)
        res.status = "fail"
        return
    base_s, base = baseline_seconds(runner, case, golden, backend)
    res.speed = gates.judge_speed(case.block, backend.name, timed.seconds, timed.nbytes, bw, base_s,
                                  backend.speed_target(case.block), baseline=base if base_s else None)
    if res.speed.passed is False:
        res.status = "fail"


def below_floor(timed: Timed, copy_bw: float | None) -> str:
    """'' when the time is possible, else why not: faster than the call's bytes can move at FLOOR_MULTIPLE x the
    copy bandwidth."""
    if not (timed.nbytes and copy_bw):
        return ""
    floor = timed.nbytes / (copy_bw * FLOOR_MULTIPLE)
    if timed.seconds >= floor:
        return ""
    return (f"refused: {timed.seconds:.3g} s per call is below the memory floor of its {timed.nbytes:,} bytes "
            f"({floor:.3g} s at {FLOOR_MULTIPLE:g} x the copy bandwidth {copy_bw / 1e9:.3g} GB/s): no call can be "
            "that fast, so the timing is not of the call that was judged")


def baseline_seconds(runner, case: Case, golden, backend: BackendBase) -> tuple[float | None, str | None]:
    """The seconds of the precision's time baseline (TIME_BASELINE) on the case's inputs, and its name; (None,
    name) when it is the backend itself, cannot run or is not timed."""
    base = TIME_BASELINE.get(backend.precision)
    if not base or base == backend.name:
        return None, base
    if (case.name, base) not in runner.times:
        try:
            bb = runner.backend(base)
            timed = kind_of(case).timing(case, [golden], bb, timer) if bb.available()[0] else None
            if timed is not None and below_floor(timed, copy_bandwidth(runner, bb)):
                timed = None
        except Exception:  # noqa: BLE001 - no baseline time: no time ratio, never a failed case
            timed = None
        runner.times[(case.name, base)] = None if timed is None else timed.seconds
    return runner.times[(case.name, base)], base
