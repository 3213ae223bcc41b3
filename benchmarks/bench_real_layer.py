"""One real-size K3 layer on this machine: prefill 16 tokens + 1 decode step from a memory-mapped checkpoint.

    python -m benchmarks.bench_real_layer --workdir /tmp/k3layer --layers 1,3 --dtypes float32,float64

writes a real-geometry checkpoint of the layers (k3ref.weights.synth_checkpoint: the globals plus each layer;
K3 layer 1 is KDA + LatentMoE, layer 3 MLA + LatentMoE; ~20 GB for one layer, ~36 GB for both), then runs
each (layer, dtype) in a fresh process (so each peak is its own) and prints one JSON line per run and a table:
wall time of loading, prefill and the decode step; peak anonymous memory (RssAnon, sampled every 5 ms by a
thread: the run's own allocations, not the checkpoint pages it maps) and peak RSS (VmHWM, mapped pages
included); bytes read (the expert store's count of routed-expert bytes handed out, and the process's read
syscalls + page faults as /proc/self/io counts them: `read_bytes` is what came from the disk, 0 when the
checkpoint is still in the page cache after writing it); and `k3ref.greedy.decode_memory`'s estimate, which
must cover the measured peak. The checkpoint is deleted at the end unless --keep. Target: the KDA + MoE layer
under 4 GiB peak anonymous memory. Disk: it checks the space first (synth_checkpoint refuses without room).

`make bench` collects this file too; its pytest entry runs only with K3_BENCH_REAL_LAYER=1 (it writes ~20 GB).
The numbers, with the command and the machine load, are in docs/measurements.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel, forward_prefill, forward_token
from k3ref.greedy import decode_memory
from k3ref.weights import synth_checkpoint

PROMPT = 16
GIB = 2**30
TARGET_ANON_GIB = 4.0


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (its kB value)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


class AnonPeak:
    """The peak RssAnon of this process, sampled every `period` seconds by a daemon thread."""

    def __init__(self, period: float = 0.005):
        self.peak = _status("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.peak = max(self.peak, _status("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _status("RssAnon"))
        return self.peak


def child(checkpoint: Path, layer: int, dtype: str) -> dict:
    """One run in this process: load, prefill PROMPT tokens, one decode step; the measurements."""
    sampler = AnonPeak()
    io0 = _io()
    t0 = time.perf_counter()
    model = K3CpuModel.from_checkpoint(checkpoint, dtype=np.dtype(dtype), layers=[layer])
    t1 = time.perf_counter()
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, PROMPT)
    cache = model.new_cache(num_pages=2)
    seq = cache.add_sequence()
    logits = forward_prefill(model, tokens, cache, seq=seq)[-1]
    t2 = time.perf_counter()
    step = forward_token(model, int(np.argmax(logits)), PROMPT, cache, seq=seq)
    t3 = time.perf_counter()
    peak = sampler.stop()
    io1 = _io()
    estimate = decode_memory(model.cfg, prompt_len=PROMPT, max_new=2, dtype=dtype, layers=[layer])
    assert np.all(np.isfinite(step)), "the decode step's logits are not finite"
    store = model.expert_store
    return {
        "layer": layer, "mixer": model.graph.layers[layer].mixer.value, "dtype": dtype,
        "load_s": round(t1 - t0, 2), "prefill_s": round(t2 - t1, 2), "decode_s": round(t3 - t2, 2),
        "peak_anon_gib": round(peak / GIB, 3), "peak_rss_gib": round(_status("VmHWM") / GIB, 3),
        "estimate_gib": round(estimate.needed / GIB, 3),
        "expert_bytes_touched_gib": round((store.bytes_touched if store else 0) / GIB, 3),
        "read_syscall_gib": round((io1["rchar"] - io0["rchar"]) / GIB, 3),
        "read_from_disk_gib": round((io1["read_bytes"] - io0["read_bytes"]) / GIB, 3),
        "keep_casts": model.keep_casts,
    }


def run_all(workdir: Path, layers: list[int], dtypes: list[str], keep: bool, checkpoint: Path | None) -> list[dict]:
    ckpt = checkpoint or workdir / "k3_layers"
    made = checkpoint is None
    if made:
        t = time.perf_counter()
        synth_checkpoint(K3Config.preset("k3"), ckpt, layers=layers)
        print(json.dumps({"synth_s": round(time.perf_counter() - t, 1),
                          "bytes_gib": round(sum(p.stat().st_size for p in ckpt.iterdir()) / GIB, 2)}), flush=True)
    rows = []
    try:
        for layer in layers:
            for dtype in dtypes:
                t = time.perf_counter()
                out = subprocess.run([sys.executable, "-m", "benchmarks.bench_real_layer", "--child", str(ckpt),
                                      "--layers", str(layer), "--dtypes", dtype], capture_output=True, text=True)
                if out.returncode != 0:
                    raise RuntimeError(f"layer {layer} {dtype}: exit {out.returncode}\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["wall_s"] = round(time.perf_counter() - t, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        if made and not keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/k3_real_layer"))
    p.add_argument("--checkpoint", type=Path, default=None, help="use this synth checkpoint (kept) instead")
    p.add_argument("--layers", default="1", help="K3 layers, e.g. 1 (KDA + MoE) or 1,3 (and MLA + MoE)")
    p.add_argument("--dtypes", default="float32,float64")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint written")
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    layers = [int(x) for x in a.layers.split(",")]
    dtypes = a.dtypes.split(",")
    if a.child is not None:
        print(json.dumps(child(a.child, layers[0], dtypes[0])))
        return 0
    rows = run_all(a.workdir, layers, dtypes, a.keep, a.checkpoint)
    print(f"load {os.getloadavg()[0]:.2f}")
    for r in rows:
        print(f"layer {r['layer']} ({r['mixer']} + MoE) {r['dtype']}: wall {r['wall_s']} s (load {r['load_s']}, "
              f"prefill {r['prefill_s']}, decode {r['decode_s']}), peak anon {r['peak_anon_gib']} GiB "
              f"(estimate {r['estimate_gib']}), peak RSS {r['peak_rss_gib']} GiB, experts read "
              f"{r['expert_bytes_touched_gib']} GiB")
    return 0


@pytest.mark.skipif(os.environ.get("K3_BENCH_REAL_LAYER") != "1",
                    reason="writes a ~20 GB real-size checkpoint; set K3_BENCH_REAL_LAYER=1 to run it")
def test_bench_real_kda_moe_layer(tmp_path):
    rows = run_all(tmp_path, [1], ["float32", "float64"], keep=False, checkpoint=None)
    for r in rows:
        assert r["peak_anon_gib"] <= r["estimate_gib"], r   # the estimate counts everything the run holds
    assert min(r["peak_anon_gib"] for r in rows) < TARGET_ANON_GIB, rows


if __name__ == "__main__":
    raise SystemExit(main())
