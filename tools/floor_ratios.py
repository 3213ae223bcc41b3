"""How far above the copy bandwidth a call can go: the two measurements behind the memory floor that refuses
impossible times (conformance.timing.FLOOR_MULTIPLE).

    python tools/floor_ratios.py reports/tiny/report.json reports/k3/report.json ...   # correct backends' calls
    python tools/floor_ratios.py --cache-copy                                          # the machine's ceiling

Reports: for every timed (case, backend) cell, bytes moved / seconds / the run's copy bandwidth, the ratio the
floor bounds (a cell whose time was refused counts too, from its recorded seconds and bytes); the largest ratios,
per backend the maximum, and the largest over all, next to FLOOR_MULTIPLE. The reports come from `k3conf run` with
timing on, for each shape set to be covered.

--cache-copy: a call must at least read its inputs and write its outputs, so none beats a copy of its bytes from
the fastest cache that holds them: np.copyto of 4 KiB .. 16 MiB arrays, each the best of repeated copies, over the
64 MiB copy the run's floor divides by. The largest of these is the machine's ceiling for a correct call.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from conformance.judge.speed import timed
from conformance.timing import FLOOR_MULTIPLE


def ratios(report: dict) -> list[tuple[float, str, str, str]]:
    """(ratio, shape set, case, backend) of every timed cell with bytes, a time and its backend's copy bandwidth."""
    found = []
    bandwidth = report.get("copy_bandwidth", {})
    for r in report["results"]:
        speed, bw = r.get("speed"), bandwidth.get(r["backend"])
        if not speed or not speed.get("bytes_moved") or not speed.get("seconds") or not bw:
            continue
        found.append((speed["bytes_moved"] / speed["seconds"] / bw, report.get("config", "?"), r["case"], r["backend"]))
    return found


def cache_copy(repeats: int = 7) -> list[tuple[int, float]]:
    """(bytes, bandwidth over the 64 MiB copy's) of np.copyto at sizes from 4 KiB to 16 MiB."""
    def best(fn, n: int) -> float:
        return min(timed(fn) for _ in range(n))

    big = 64 << 20
    src = np.ones(big // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    base = 2 * big / best(lambda: np.copyto(dst, src), repeats)
    rows = []
    for n in (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20):
        s, d = np.ones(n // 4, np.float32), np.empty(n // 4, np.float32)
        inner = max(1, big // n)

        def many(s=s, d=d, inner=inner) -> None:
            for _ in range(inner):
                np.copyto(d, s)

        rows.append((n, 2 * n / (best(many, repeats) / inner) / base))
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="*", type=Path, help="report.json files of timed runs")
    p.add_argument("--top", type=int, default=10, help="how many of the largest ratios to list")
    p.add_argument("--cache-copy", action="store_true", help="measure the machine's in-cache copy ceiling")
    args = p.parse_args(argv)
    if args.cache_copy:
        rows = cache_copy()
        print("np.copyto, bytes/s over the 64 MiB copy's: " + ", ".join(f"{n >> 10} KiB {r:.2f}x" for n, r in rows))
        top = max(r for _, r in rows)
        print(f"ceiling {top:.2f}x; FLOOR_MULTIPLE {FLOOR_MULTIPLE:g} ({FLOOR_MULTIPLE / top:.1f}x above it)")
        if not args.reports:
            return 0
    every = [x for path in args.reports for x in ratios(json.loads(path.read_text()))]
    if not every:
        print("no timed cell with bytes in these reports", file=sys.stderr)
        return 1
    every.sort(reverse=True)
    print(f"{len(every)} timed cells; largest bytes/s over the copy bandwidth:")
    for ratio, config, case, backend in every[:args.top]:
        print(f"  {ratio:8.3f}  {config:7s} {case:48s} {backend}")
    per_backend: dict[str, float] = {}
    for ratio, _, _, backend in every:
        per_backend[backend] = max(per_backend.get(backend, 0.0), ratio)
    print("per backend: " + ", ".join(f"{b} {v:.3f}" for b, v in sorted(per_backend.items())))
    top = every[0][0]
    print(f"largest {top:.3f}; FLOOR_MULTIPLE {FLOOR_MULTIPLE:g} ({FLOOR_MULTIPLE / top:.1f}x above it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
