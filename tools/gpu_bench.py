#!/usr/bin/env python3
"""Time every k3cuda kernel's bench cases on the GPU and apply the speed gates (DESIGN.md section 5).

For each `bench_cases()` entry of each wrapper in k3cuda.KERNEL_MODULES: fresh random inputs, uploaded once;
CUDA-event median of the kernel after warm-up; achieved bytes/s from the case's Traffic; the ratio to the
device-to-device copy bandwidth measured at the start of this same run (the gate: ratio >= target_bw_ratio);
the same math in PyTorch eager (`torch_eager`, timed with torch's own events) and the speedup over it.
A case whose bytes fit in twice the L2 is marked L2: repeated launches then measure the cache, not HBM.

    python3 tools/gpu_bench.py [--blocks kda_decode rmsnorm] [--out DIR] [--warmup 10] [--iters 50]

Prints a table last; writes gpu_bench.json (and nothing else) to --out (default $OUT, else reports/).
Exit status: 0 all gates pass, 1 a gate failed or a case errored, 2 no GPU.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import k3cuda  # noqa: E402
from k3cuda import runtime, testing  # noqa: E402


def time_torch(fn, warmup: int, iters: int) -> float:
    """Median seconds of fn() with torch CUDA events on torch's current stream."""
    import torch

    with torch.no_grad():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def bench_case(mod, block: str, case, copy_bw: float, l2_bytes: int, args) -> dict:
    row = {"block": block, "case": case.label, "bytes": case.traffic.bytes, "flops": case.traffic.flops,
           "target_bw_ratio": case.target_bw_ratio, "l2_resident": case.traffic.bytes < 2 * l2_bytes}
    inputs = case.make_inputs(np.random.default_rng(testing.case_seed(f"bench/{block}/{case.label}")))
    launch = mod.device_launch(inputs)
    t = runtime.time_fn(launch, args.warmup, args.iters)
    row.update(seconds=t, gbps=case.traffic.bytes / t / 1e9, bw_ratio=case.traffic.bytes / t / copy_bw,
               tflops=case.traffic.flops / t / 1e12)
    row["gate"] = ("report" if case.target_bw_ratio is None
                   else "PASS" if row["bw_ratio"] >= case.target_bw_ratio else "FAIL")
    del launch
    if not args.no_torch:
        try:
            fn = mod.torch_eager(inputs)
            row["torch_seconds"] = time_torch(fn, args.warmup, args.iters)
            row["speedup_vs_torch"] = row["torch_seconds"] / t
            del fn
        except Exception as e:  # noqa: BLE001 - the baseline failing is reported, not fatal
            row["torch_error"] = f"{type(e).__name__}: {e}"
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", nargs="*", default=list(k3cuda.KERNEL_MODULES))
    p.add_argument("--out", default=os.environ.get("OUT") or "reports")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager baseline")
    args = p.parse_args(argv)

    ok, why = k3cuda.available()
    if not ok:
        print(f"gpu_bench: CUDA backend unavailable: {why}", file=sys.stderr)
        return 2
    cuda = runtime.driver()
    l2 = runtime.device().get_attribute(cuda.device_attribute.L2_CACHE_SIZE)
    t0 = time.time()
    copy_bw = runtime.copy_bandwidth()
    print(f"device: {why}; L2 {l2 / 2**20:.0f} MiB; copy bandwidth (read + write) {copy_bw / 1e9:.0f} GB/s",
          flush=True)

    rows = []
    for block in args.blocks:
        try:
            mod = k3cuda.kernel_module(block)
            cases = mod.bench_cases()
        except Exception as e:  # noqa: BLE001
            rows.append({"block": block, "case": "-", "gate": "ERROR", "error": f"{type(e).__name__}: {e}"})
            continue
        for case in cases:
            try:
                row = bench_case(mod, block, case, copy_bw, l2, args)
            except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
                row = {"block": block, "case": case.label, "gate": "ERROR", "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()}
            rows.append(row)
            print(f"  {block}/{case.label}: {row.get('gate')}", flush=True)
            gc.collect()
            if "torch" in sys.modules:
                sys.modules["torch"].cuda.empty_cache()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"device": why, "copy_bandwidth_Bps": copy_bw, "l2_bytes": l2, "warmup": args.warmup,
               "iters": args.iters, "wall_s": time.time() - t0, "rows": rows}
    (out / "gpu_bench.json").write_text(json.dumps(summary, indent=1))

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
    failed = [r for r in rows if r["gate"] in ("FAIL", "ERROR")]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} cases pass their gate; copy {copy_bw / 1e9:.0f} GB/s; "
          f"{time.time() - t0:.0f} s; JSON in {out / 'gpu_bench.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
