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

`make bench` collects this file too: the memory entry runs only with K3_BENCH_REAL_LAYER=1 (it writes ~20 GB), the
step targets below only with K3_BENCH_REAL_CHECKPOINT=DIR naming a checkpoint of layer 1 that is already there
(`k3conf synth DIR --config k3 --layers 1`).
The numbers, with the command and the machine load, are in docs/measurements.md.

    python -m benchmarks.bench_real_layer --checkpoint /tmp/k3_l1 --layers 1 --steps

times one layer's step against its bytes floor instead (`step_child`): the layer alone (no embedding, no
lm_head) on a 16-token prefill and on decode steps, float64, from the memory-mapped checkpoint with the page
cache warm, on one pinned core and on all cores (one process each). The floor is the bytes the step must
read -- the layer's dense weights in their stored dtype, the routed experts' packed bytes the store handed
out, the layer's state or cache read and written -- at the copy bandwidth measured in the same process.
Target: <= 4x the floor for the decode step and for the prefill. Then the cold page cache: every shard's
pages dropped (posix_fadvise DONTNEED, no root needed), one decode step with the experts read ahead
(`MmapExpertStore.prefetch`, the default) and one without.
"""
from __future__ import annotations

import argparse
import copy
import gc
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
from k3ref.cores import reference_cores
from k3ref.cpu_forward import ForwardContext, K3CpuModel, embed, forward_one_layer, forward_prefill, forward_token
from k3ref.expert_backend import PREFETCH_BUDGET_BYTES, parse_expert_name
from k3ref.greedy import decode_memory
from k3ref.layer import MixerKind
from k3ref.weights import layer_prefix, synth_checkpoint

PROMPT = 16
GIB = 2**30
TARGET_ANON_GIB = 4.0
TARGET_FLOOR_RATIO = 4.0     # one real-size layer step (decode, and a 16-token prefill) against its bytes floor
DECODE_STEPS = 3             # warm decode steps timed (the best is reported with its own floor)
PREFILL_RUNS = 2             # warm prefills timed, each on a fresh state (the best is reported: noise only adds)
COPY_BYTES = 256 << 20       # the copy that measures bandwidth: far past the last-level cache


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


def copy_bandwidth(repeats: int = 5) -> float:
    """Bytes per second one np.copyto of COPY_BYTES moves (best of `repeats`; counted once, as bytes read)."""
    src = np.ones(COPY_BYTES // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return COPY_BYTES / best


def dense_layer_bytes(model: K3CpuModel, layer: int) -> int:
    """Bytes of the layer's tensors in their stored dtype, routed experts excluded (those are counted as read)."""
    prefix = layer_prefix(layer)
    entries = model.expert_store.reader.entries if model.expert_store else {}
    return sum(h.end - h.begin for name, h in entries.items()
               if name.startswith(prefix) and parse_expert_name(name) is None)


def state_bytes(model: K3CpuModel, cache, layer: int, seq: int) -> int:
    """Bytes of the layer's decode state a step reads and writes (KDA: conv buffers and recurrent state, counted
    twice; MLA: the sequence's cached rows, read)."""
    if model.graph.layers[layer].mixer == MixerKind.KDA:
        st = cache.kda_state(layer, seq)
        return 2 * sum(a.nbytes for a in (st.conv_q, st.conv_k, st.conv_v, st.recurrent))
    kv = cache.mla[layer]
    return int(kv.seq_lens([seq])[0]) * kv.width * kv.dtype.itemsize


def timed_layer(model: K3CpuModel, layer: int, tokens, cache, seq: int, prefill: bool) -> tuple[float, int]:
    """(seconds, routed-expert bytes handed out) of the layer alone on `tokens`; advances the sequence."""
    cores = reference_cores()
    ctx = ForwardContext(model, cores, seq, prefill)
    hub = cores.attnres_hub(model.cfg.attn_res_block_size, eps=model.cfg.rms_norm_eps)
    hub.start(embed(model, np.asarray(tokens)))
    store = model.expert_store
    before = store.bytes_touched if store else 0
    t = time.perf_counter()
    forward_one_layer(ctx, layer, hub, cache)
    elapsed = time.perf_counter() - t
    cache.advance(seq, len(tokens))
    return elapsed, (store.bytes_touched if store else 0) - before


def drop_page_cache(checkpoint: Path) -> None:
    """Ask the kernel to drop every shard's cached pages (posix_fadvise DONTNEED: no root needed; pages another
    process has mapped and touched may stay)."""
    for path in sorted(checkpoint.glob("*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _ratio_row(kind: str, seconds: float, dense: int, experts: int, state: int, bandwidth: float) -> dict:
    floor = (dense + experts + state) / bandwidth
    return {"step": kind, "s": round(seconds, 4), "floor_s": round(floor, 4), "ratio": round(seconds / floor, 2),
            "dense_mb": round(dense / 1e6, 1), "experts_mb": round(experts / 1e6, 1), "state_mb": round(state / 1e6, 1)}


def step_child(checkpoint: Path, layer: int, dtype: str, pinned: bool, cold: bool) -> dict:
    """The layer's prefill and decode steps against their bytes floor, page cache warm; with `cold`, decode steps
    after dropping the checkpoint's pages instead (`cold_steps`)."""
    if pinned:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    model = K3CpuModel.from_checkpoint(checkpoint, dtype=np.dtype(dtype), layers=[layer])
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, PROMPT + DECODE_STEPS + 3)
    bandwidth = copy_bandwidth()
    dense = dense_layer_bytes(model, layer)
    if cold:
        del model                                    # its memory maps would keep the pages `cold_steps` drops
        rows = cold_steps(checkpoint, layer, np.dtype(dtype), tokens, dense, bandwidth)
    else:
        rows = warm_steps(model, layer, tokens, dense, bandwidth)
    return {"layer": layer, "dtype": dtype, "pinned": pinned, "threads": len(os.sched_getaffinity(0)),
            "copy_gb_s": round(bandwidth / 1e9, 2), "load": round(os.getloadavg()[0], 2), "rows": rows}


def warm_steps(model: K3CpuModel, layer: int, tokens, dense: int, bandwidth: float) -> list[dict]:
    """A 16-token prefill (the best of PREFILL_RUNS, each from an empty state) and DECODE_STEPS decode steps, each
    timed after the same step ran once on a copy of the state (compiled; the same experts chosen, so their pages
    are in the page cache)."""
    warm = model.new_cache(num_pages=2)
    wseq = warm.add_sequence()
    timed_layer(model, layer, tokens[:PROMPT], warm, wseq, prefill=True)
    timed_layer(model, layer, tokens[PROMPT:PROMPT + 1], warm, wseq, prefill=False)
    prefills = []
    for _ in range(PREFILL_RUNS):
        cache = model.new_cache(num_pages=2)
        seq = cache.add_sequence()
        secs, experts = timed_layer(model, layer, tokens[:PROMPT], cache, seq, prefill=True)
        prefills.append(_ratio_row("prefill16", secs, dense, experts, state_bytes(model, cache, layer, seq),
                                   bandwidth))
    rows = [min(prefills, key=lambda r: r["ratio"])]
    for i in range(DECODE_STEPS):
        state = state_bytes(model, cache, layer, seq)
        token = tokens[PROMPT + i:PROMPT + i + 1]
        timed_layer(model, layer, token, copy.deepcopy(cache), seq, prefill=False)   # the same experts, paged in
        secs, experts = timed_layer(model, layer, token, cache, seq, prefill=False)
        rows.append(_ratio_row("decode", secs, dense, experts, state, bandwidth))
    return rows


def cold_steps(checkpoint: Path, layer: int, dtype: np.dtype, tokens, dense: int, bandwidth: float) -> list[dict]:
    """Decode steps of one sequence from an empty state: one to compile, then for read-ahead on and off the
    second step on a model opened after every shard's pages were dropped (the old model's memory maps closed
    first: the kernel keeps pages a live mapping holds), then that step again, warm."""
    model = K3CpuModel.from_checkpoint(checkpoint, dtype=dtype, layers=[layer])
    cache = model.new_cache(num_pages=2)
    seq = cache.add_sequence()
    timed_layer(model, layer, tokens[:1], cache, seq, prefill=False)
    rows = []
    store = model.expert_store
    pos, before = int(cache.seq_len(seq)), copy.deepcopy(cache)      # every timed step starts here: the same
    for budget in (PREFETCH_BUDGET_BYTES, 0):                       # token, state and experts
        del model, store
        gc.collect()
        drop_page_cache(checkpoint)
        model = K3CpuModel.from_checkpoint(checkpoint, dtype=dtype, layers=[layer])
        store = model.expert_store
        assert store is not None, "a checkpoint model serves its experts from a store"
        store.planner.byte_budget = budget
        for label in ("cold", "warm"):                       # the same step twice: the second finds its pages
            cache = copy.deepcopy(before)
            state = state_bytes(model, cache, layer, seq)
            io0 = _io()
            secs, experts = timed_layer(model, layer, tokens[pos:pos + 1], cache, seq, prefill=False)
            row = _ratio_row(f"decode {label}, read-ahead {'on' if budget else 'off'}", secs, dense, experts,
                             state, bandwidth)
            row["read_from_disk_mb"] = round((_io()["read_bytes"] - io0["read_bytes"]) / 1e6, 1)
            rows.append(row)
    return rows


def run_steps(checkpoint: Path, layer: int, dtype: str, cold: bool) -> list[dict]:
    """step_child pinned to one core (one thread everywhere) and on all cores, each in a fresh process."""
    out = []
    for pinned in (True, False):
        env = dict(os.environ)
        if pinned:
            env.update(K3_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        args = ([sys.executable, "-m", "benchmarks.bench_real_layer", "--step-child", str(checkpoint),
                 "--layers", str(layer), "--dtypes", dtype]
                + (["--pinned"] if pinned else []) + (["--cold"] if cold else []))
        res = subprocess.run(args, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise RuntimeError(f"step child (pinned={pinned}): exit {res.returncode}\n{res.stderr[-3000:]}")
        row = json.loads(res.stdout.strip().splitlines()[-1])
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


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
    p.add_argument("--steps", action="store_true", help="time the layer's steps against their bytes floor "
                                                         "(needs --checkpoint; dtype: the first of --dtypes)")
    p.add_argument("--cold", action="store_true", help="with --steps: also cold page-cache decode steps")
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--step-child", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--pinned", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    layers = [int(x) for x in a.layers.split(",")]
    dtypes = a.dtypes.split(",")
    if a.child is not None:
        print(json.dumps(child(a.child, layers[0], dtypes[0])))
        return 0
    if a.step_child is not None:
        print(json.dumps(step_child(a.step_child, layers[0], dtypes[0], a.pinned, a.cold)))
        return 0
    if a.steps:
        if a.checkpoint is None:
            p.error("--steps needs --checkpoint (a real-size checkpoint holding the layer)")
        for layer in layers:
            for r in run_steps(a.checkpoint, layer, dtypes[0], a.cold):
                where = "pinned, 1 core" if r["pinned"] else f"{r['threads']} cores"
                for row in r["rows"]:
                    print(f"layer {layer} {r['dtype']} {where} (copy {r['copy_gb_s']} GB/s, load {r['load']}): {row}")
        return 0
    rows = run_all(a.workdir, layers, dtypes, a.keep, a.checkpoint)
    print(f"load {os.getloadavg()[0]:.2f}")
    for r in rows:
        print(f"layer {r['layer']} ({r['mixer']} + MoE) {r['dtype']}: wall {r['wall_s']} s (load {r['load_s']}, "
              f"prefill {r['prefill_s']}, decode {r['decode_s']}), peak anon {r['peak_anon_gib']} GiB "
              f"(estimate {r['estimate_gib']}), peak RSS {r['peak_rss_gib']} GiB, experts read "
              f"{r['expert_bytes_touched_gib']} GiB")
    return 0


REAL_CHECKPOINT = os.environ.get("K3_BENCH_REAL_CHECKPOINT", "")


@pytest.fixture(scope="module")
def real_steps() -> dict[bool, list[dict]]:
    """{pinned: the rows of `step_child`} for K3 layer 1, float64, from the checkpoint K3_BENCH_REAL_CHECKPOINT."""
    return {r["pinned"]: r["rows"] for r in run_steps(Path(REAL_CHECKPOINT), 1, "float64", cold=False)}


@pytest.mark.skipif(not REAL_CHECKPOINT, reason="needs a real-size checkpoint of K3 layer 1: `k3conf synth DIR "
                                                "--config k3 --layers 1` (~21 GB), then K3_BENCH_REAL_CHECKPOINT=DIR")
@pytest.mark.parametrize("step", ["decode", "prefill16"])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "all-cores"])
def test_real_layer_step_vs_bytes_floor(real_steps, speed, step, pinned):
    rows = [r for r in real_steps[pinned] if r["step"] == step]
    best = min(rows, key=lambda r: r["ratio"])                        # decode: the best of DECODE_STEPS steps
    speed.check(f"K3 layer 1 (KDA + MoE) {step}, float64, warm / bytes floor, {'pinned' if pinned else 'all cores'}",
                best["ratio"], TARGET_FLOOR_RATIO,
                f"{best['s']:.3f} s vs {best['floor_s']:.3f} s = {best['dense_mb']:.0f} MB dense + "
                f"{best['experts_mb']:.0f} MB experts + {best['state_mb']:.0f} MB state")


@pytest.mark.skipif(os.environ.get("K3_BENCH_REAL_LAYER") != "1",
                    reason="writes a ~20 GB real-size checkpoint; set K3_BENCH_REAL_LAYER=1 to run it")
def test_bench_real_kda_moe_layer(tmp_path):
    rows = run_all(tmp_path, [1], ["float32", "float64"], keep=False, checkpoint=None)
    for r in rows:
        assert r["peak_anon_gib"] <= r["estimate_gib"], r   # the estimate counts everything the run holds
    assert min(r["peak_anon_gib"] for r in rows) < TARGET_ANON_GIB, rows


if __name__ == "__main__":
    raise SystemExit(main())
