#!/usr/bin/env python3
"""Time every k3cuda kernel's bench cases on the GPU and apply the speed gates (docs/spec.md section 5.4).

For each `bench_cases()` entry of each wrapper in k3cuda.KERNEL_MODULES: fresh random inputs, uploaded once;
`time_fn` (below) of the kernel; achieved bytes/s from the case's Traffic; the ratio to the bandwidth of a
copy kernel timed the same way at the start of this same run (the gate: ratio >= target_bw_ratio); the same
math in PyTorch eager (the float32 baseline of `k3conf run`, k3torch.cores, inputs uploaded
once, timed with torch's own events) and the speedup over it.

Timing (`time_fn`): before every repetition a memset of a buffer of twice the L2 size evicts the kernel's data
from L2 (the cases are gated against DRAM bandwidth); a repetition is one pair of CUDA events around
`launches` back-to-back launches (one launch for cases that fit in twice the L2, which a second launch would
find in L2; several for larger ones, so event resolution and launch gaps are amortised); all repetitions are
queued before one host synchronisation; the median per-launch time is reported.

Expected misses: a gate that a kernel's current version is known not to reach, because its own header
(k3cuda/kernels/<block>.cu, "Versions:") works out that it cannot, is listed in EXPECTED_MISSES with that
version and the reason. Such a miss is reported as "XMISS" and does not fail the run; once the header's latest
version is another one, the entry no longer applies and a miss fails again.

    python3 tools/gpu_bench.py [--blocks kda_decode rmsnorm] [--out DIR] [--warmup 3] [--reps 20]

Prints a table last; writes gpu_bench.json (and nothing else) to --out (default reports/).
Exit status: 0 when at least one case was timed and every case passed or missed only as expected; 1 when a
gate failed, a case errored or nothing was timed; 2 no GPU. Importing this file and --help need no pycuda.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))   # run as `python3 tools/gpu_bench.py`: the repository root is not on sys.path yet

import k3cuda  # noqa: E402 -- after the sys.path line above, which makes the checkout importable
from k3cuda import runtime, testing  # noqa: E402 -- likewise

# block -> (kernel version the miss is expected of, reason). Checked against the header's latest "vN:" line.
EXPECTED_MISSES: dict[str, tuple[int, str]] = {
    "mla_decode": (1, "v1 computes q.K and P.V with fp32 FMA on CUDA cores: ~1.9*H FLOP per cache byte, above the "
                      "H200's fp32 ridge (~14 FLOP/byte) from H = 12; its header bounds it at <= ~0.1 (H = 96) "
                      "and <= ~0.55 (H = 12) of copy bandwidth, below the 0.6 target, until a tensor-core v2"),
}
MANY_LAUNCHES = 20        # launches per event pair for cases larger than twice the L2
COPY_BYTES = 1 << 30      # the copy kernel's buffer: far beyond the L2


# ---------------------------------------------------------------------------------------------- timing

class TimingEvent(Protocol):
    """What time_fn needs of an event (pycuda.driver.Event, or _TorchEvent around torch.cuda.Event)."""

    def record(self) -> object: ...

    def time_till(self, other: TimingEvent) -> float: ...   # milliseconds from this event to `other`


def time_fn(fn: Callable[[], object], *, flush: Callable[[], object], event: Callable[[], TimingEvent],
            synchronize: Callable[[], object], launches: int = 1, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds per launch of fn() (see the module docstring). `event()` makes an event with record() and
    time_till(other) -> ms (pycuda.driver.Event); `flush()` evicts L2; `synchronize()` waits for the device."""
    if launches < 1 or reps < 1:
        raise ValueError(f"launches and reps: expected >= 1, found {launches} and {reps}")
    for _ in range(warmup):
        fn()
    pairs = []
    for _ in range(reps):
        flush()
        start, end = event(), event()
        start.record()
        for _ in range(launches):
            fn()
        end.record()
        pairs.append((start, end))
    synchronize()                                                     # the only host sync
    return statistics.median(start.time_till(end) * 1e-3 / launches for start, end in pairs)


def launches_for(nbytes: int, l2_bytes: int) -> int:
    """One launch per event pair when the case's bytes fit in twice the L2 (a second launch would read L2)."""
    return 1 if nbytes < 2 * l2_bytes else MANY_LAUNCHES


# ---------------------------------------------------------------------------------------------- gates

def kernel_version(block: str, kernels_dir: Path = REPO / "k3cuda" / "kernels") -> int | None:
    """The latest "vN:" of the Versions list in the kernel's header comment (None when it has none)."""
    path = kernels_dir / f"{block}.cu"
    if not path.exists():
        return None
    found = [int(v) for v in re.findall(r"^//\s+v(\d+):", path.read_text(), flags=re.M)]
    return max(found) if found else None


def expected_miss(block: str, version: int | None) -> str | None:
    """The reason a miss of `block` at this kernel version is expected, or None."""
    entry = EXPECTED_MISSES.get(block)
    if entry is None or version != entry[0]:
        return None
    return entry[1]


def judge(bw_ratio: float, target: float | None, expected: str | None) -> str:
    """PASS / FAIL / XMISS (a declared expected miss) / XPASS (it passed: drop the declaration) / report."""
    if target is None:
        return "report"
    if bw_ratio >= target:
        return "XPASS" if expected else "PASS"
    return "XMISS" if expected else "FAIL"


def exit_status(rows: list[dict]) -> int:
    """0 when something was timed and no row FAILed or ERRORed; else 1 (expected misses do not count)."""
    timed = [r for r in rows if r.get("gate") not in (None, "ERROR")]
    if not timed:
        return 1
    return 1 if any(r["gate"] in ("FAIL", "ERROR") for r in rows) else 0


# ---------------------------------------------------------------------------------------------- the run

@dataclasses.dataclass
class Device:
    """What a run needs from the GPU: the timer's pieces, the L2 size, the copy bandwidth."""

    flush: Callable[[], object]
    event: Callable[[], TimingEvent]
    synchronize: Callable[[], object]
    l2_bytes: int
    keep: object = None       # device buffers that must live as long as the Device (the flush's scrub buffer)

    def time(self, fn, nbytes: int, args) -> float:
        return time_fn(fn, flush=self.flush, event=self.event, synchronize=self.synchronize,
                       launches=launches_for(nbytes, self.l2_bytes), reps=args.reps, warmup=args.warmup)


_COPY_SRC = r"""
extern "C" __global__ void copy_f4(const float4* __restrict__ src, float4* __restrict__ dst, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


def pycuda_device() -> tuple[Device, Callable[[Device, object], float]]:
    """The Device of k3cuda's context, and a function measuring the copy kernel's bandwidth (read + write)."""
    from pycuda.compiler import SourceModule  # noqa: PLC0415 -- optional: importing this file needs no pycuda

    cuda = runtime.driver()
    l2 = runtime.device().get_attribute(cuda.device_attribute.L2_CACHE_SIZE)
    scrub = cuda.mem_alloc(2 * l2)

    dev = Device(flush=lambda: cuda.memset_d32_async(scrub, 0, 2 * l2 // 4), event=cuda.Event,
                 synchronize=cuda.Context.synchronize, l2_bytes=l2, keep=scrub)

    def copy_bandwidth(dev: Device, args) -> float:
        fn = SourceModule(_COPY_SRC, no_extern_c=True).get_function("copy_f4")
        src, dst = cuda.mem_alloc(COPY_BYTES), cuda.mem_alloc(COPY_BYTES)
        try:
            cuda.memset_d32(src, 0x3F800000, COPY_BYTES // 4)             # 1.0f: not zeros
            n = COPY_BYTES // 16
            blocks = 4 * runtime.multiprocessor_count()
            t = dev.time(lambda: fn(src, dst, np.int64(n), block=(256, 1, 1), grid=(blocks, 1)), 2 * COPY_BYTES, args)
        finally:
            src.free()
            dst.free()
        return 2 * COPY_BYTES / t

    return dev, copy_bandwidth


def torch_baseline(block: str, inputs: dict, device: str = "cuda"):
    """The PyTorch core of `k3conf run` for `block` in float32 on `device`: inputs checked and uploaded here,
    once; the returned callable runs the math alone (what is timed)."""
    import torch  # noqa: PLC0415 -- optional: the kernels are timed without torch (--no-torch)

    from k3torch.bundle import torch_core  # noqa: PLC0415 -- optional: k3torch imports torch

    core = torch_core(block, dtype=torch.float32, device=device)
    prepared = core.prepare(**inputs)
    return lambda: core.compute(**prepared)


def time_torch(fn, dev: Device, nbytes: int, args) -> float:
    """time_fn with torch's events and synchronisation (the flush stays k3cuda's memset on the same device)."""
    import torch  # noqa: PLC0415 -- optional: the kernels are timed without torch (--no-torch)

    with torch.no_grad():
        return time_fn(fn, flush=dev.flush, event=lambda: _TorchEvent(torch), synchronize=torch.cuda.synchronize,
                       launches=launches_for(nbytes, dev.l2_bytes), reps=args.reps, warmup=args.warmup)


class _TorchEvent:
    def __init__(self, torch):
        self._e = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self._e.record()

    def time_till(self, other: TimingEvent) -> float:
        if not isinstance(other, _TorchEvent):   # a torch event can only be timed against another torch event
            raise TypeError(f"time_till: expected a _TorchEvent, found {type(other).__name__}")
        return self._e.elapsed_time(other._e)


def bench_case(mod, block: str, case, copy_bw: float, dev: Device, version: int | None, args) -> dict:
    nbytes = case.traffic.bytes
    row = {"block": block, "case": case.label, "bytes": nbytes, "flops": case.traffic.flops,
           "target_bw_ratio": case.target_bw_ratio, "l2_resident": nbytes < 2 * dev.l2_bytes,
           "launches_per_pair": launches_for(nbytes, dev.l2_bytes), "kernel_version": version}
    inputs = case.make_inputs(np.random.default_rng(testing.case_seed(f"bench/{block}/{case.label}")))
    launch = mod.device_launch(inputs)
    t = dev.time(launch, nbytes, args)
    row.update(seconds=t, gbps=nbytes / t / 1e9, bw_ratio=nbytes / t / copy_bw, tflops=case.traffic.flops / t / 1e12)
    expected = expected_miss(block, version)
    row["gate"] = judge(row["bw_ratio"], case.target_bw_ratio, expected)
    if row["gate"] in ("XMISS", "XPASS"):
        row["expected_miss"] = expected
    del launch
    if not args.no_torch:
        try:
            fn = torch_baseline(block, inputs)
            row["torch_seconds"] = time_torch(fn, dev, nbytes, args)
            row["speedup_vs_torch"] = row["torch_seconds"] / t
            del fn
        except Exception as e:  # noqa: BLE001 - the baseline failing is reported, not fatal
            row["torch_error"] = f"{type(e).__name__}: {e}"
    return row


def run_blocks(blocks, dev: Device, copy_bw: float, args, kernel_module, case_fn=bench_case) -> list[dict]:
    """Every bench case of every block: one row each; an exception in one case is that row's ERROR."""
    rows = []
    for block in blocks:
        try:
            mod = kernel_module(block)
            cases = mod.bench_cases()
        except Exception as e:  # noqa: BLE001
            rows.append({"block": block, "case": "-", "gate": "ERROR", "error": f"{type(e).__name__}: {e}"})
            continue
        version = kernel_version(block)
        for case in cases:
            try:
                row = case_fn(mod, block, case, copy_bw, dev, version, args)
            except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
                row = {"block": block, "case": case.label, "gate": "ERROR", "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()}
            rows.append(row)
            print(f"  {block}/{case.label}: {row.get('gate')}", flush=True)
            gc.collect()
            if "torch" in sys.modules:
                sys.modules["torch"].cuda.empty_cache()
    return rows


def print_table(rows: list[dict], copy_bw: float, out: Path, wall_s: float) -> None:
    print(f"\n{'block/case':34} {'us':>9} {'GB/s':>7} {'/copy':>6} {'target':>6} {'gate':>6} "
          f"{'torch us':>9} {'speedup':>7}")
    for r in rows:
        if r["gate"] == "ERROR":
            print(f"{r['block'] + '/' + r['case']:34} ERROR {r['error'][:90]}")
            continue
        tgt = "-" if r["target_bw_ratio"] is None else f"{r['target_bw_ratio']:.2f}"
        tt = f"{r['torch_seconds'] * 1e6:9.1f}" if "torch_seconds" in r else f"{'n/a':>9}"
        sp = f"{r['speedup_vs_torch']:7.2f}" if "speedup_vs_torch" in r else f"{'n/a':>7}"
        name = r["block"] + "/" + r["case"] + (" (L2)" if r["l2_resident"] else "")
        print(f"{name:34} {r['seconds'] * 1e6:9.1f} {r['gbps']:7.0f} {r['bw_ratio']:6.2f} {tgt:>6} {r['gate']:>6} "
              f"{tt} {sp}")
    for r in rows:
        if r["gate"] in ("XMISS", "XPASS"):
            note = ("expected miss" if r["gate"] == "XMISS"
                    else "passed although declared an expected miss: remove its EXPECTED_MISSES entry")
            print(f"{r['gate']} {r['block']}/{r['case']} (kernel v{r['kernel_version']}): {note}: {r['expected_miss']}")
    counts = {g: sum(r["gate"] == g for r in rows) for g in ("PASS", "XPASS", "XMISS", "FAIL", "ERROR", "report")}
    print(f"\n{len(rows)} cases: " + ", ".join(f"{n} {g}" for g, n in counts.items() if n)
          + f"; copy kernel {copy_bw / 1e9:.0f} GB/s; {wall_s:.0f} s; JSON in {out / 'gpu_bench.json'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", nargs="*", default=None, help="kernel blocks (default: every k3cuda kernel)")
    p.add_argument("--out", default="reports")
    p.add_argument("--warmup", type=int, default=3, help="untimed launches before the repetitions")
    p.add_argument("--reps", type=int, default=20, help="event pairs per case (L2 flushed before each)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager baseline")
    args = p.parse_args(argv)

    ok, why = k3cuda.available()
    if not ok:
        print(f"gpu_bench: CUDA backend unavailable: {why}", file=sys.stderr)
        return 2
    t0 = time.time()
    dev, copy_bandwidth = pycuda_device()
    copy_bw = copy_bandwidth(dev, args)
    print(f"device: {why}; L2 {dev.l2_bytes / 2**20:.0f} MiB (flushed with a {2 * dev.l2_bytes / 2**20:.0f} MiB "
          f"memset per repetition); copy kernel (read + write) {copy_bw / 1e9:.0f} GB/s", flush=True)
    rows = run_blocks(args.blocks or list(k3cuda.KERNEL_MODULES), dev, copy_bw, args, k3cuda.kernel_module)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"device": why, "copy_bandwidth_Bps": copy_bw, "l2_bytes": dev.l2_bytes, "warmup": args.warmup,
               "reps": args.reps, "wall_s": time.time() - t0, "rows": rows,
               "expected_misses": {b: {"version": v, "reason": r} for b, (v, r) in EXPECTED_MISSES.items()}}
    (out / "gpu_bench.json").write_text(json.dumps(summary, indent=1))
    print_table(rows, copy_bw, out, time.time() - t0)
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
