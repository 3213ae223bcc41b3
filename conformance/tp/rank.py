"""What one rank does: build only its shard, run the k3ref host graph with real collectives, rank 0 gathers.

    python -m conformance.tp.rank JOB.json     (a spawned child; the env:// variables say which rank)

A job is a JSON object: kind ("trace" | "decode"), tp, dist, timeout, workdir, and the kind's fields. Rank 0
returns (and, as a child, writes to workdir/result.safetensors + result.json) what the comparison needs:
- trace: per case, run with the cores of the job's backend (by its registry name) at its precision, the
  outputs the TP 1 trace names (the KDA state all-gathered by heads; every other output is replicated after
  its all-reduce), plus `tp.partial.NNNN` [tp, ...]: every rank's input to each all-reduce, in call order, so
  a failure can be pinned on the rank whose partial sum is wrong; `tp.info` [tp, ...]: per rank the calls of
  each core and its fallbacks to the reference, the teacher-forced router choices and the routed-expert bytes
  its store handed out; `tp.note`: rank 0's fallback reasons (UTF-8 bytes);
- decode: the greedy tokens.
Every rank reports its pid, the bytes it read (as the kernel counts them: conformance.tp.measure; a rank that
read more than its shard fails) and holds, its routed experts' bytes served from the mapping (none copied),
and the plan's bytes for it (`tp.ranks`).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from conformance.cases.engine_routes import through_engine
from conformance.cases.inputs import cast_weights
from conformance.cases.trace_run import GoldenFeed, RouterTap, Stepper, compute_dtype, forcing_budgets, guard_kernels
from conformance.golden.store import golden_path
from conformance.isolation.client import DEFAULT_TIMEOUT, WorkerPool
from conformance.session import load_backend
from conformance.tp.comm import CollectiveError, TorchComm
from conformance.tp.launch import error_path, init_group
from conformance.tp.lifetime import PARENT_ENV, die_with_parent
from conformance.tp.measure import measured_shard
from conformance.tp.mutants import plan_mutant
from k3ref.config import K3Config
from k3ref.cores import CORE_NAMES
from k3ref.cpu_forward import K3CpuModel
from k3ref.expert_backend import MmapExpertStore
from k3ref.greedy import greedy_decode
from k3ref.safetensors_io import ITEMSIZE  # the golden stores bf16 weights as exact F32: bytes by its dtype
from k3ref.tp import TpPlan
from k3ref.tp_weights import PrefixedCheckpoint, ShardWeights, SliceReader, synthetic_rank_shard
from k3ref.weights import CheckpointReader, read_header

RANK_FIELDS = ("rank", "pid", "bytes_read", "resident", "plan_bytes", "plan_replicated", "tensors", "copied_experts",
               "mapped")


def make_plan(cfg, tp: int, mutant: str | None):
    if not mutant:
        return TpPlan(cfg, tp)
    return plan_mutant(mutant)(cfg, tp)


def _rank_row(rank: int, cost, plan, itemsize=None) -> np.ndarray:
    b = plan.rank_bytes(rank, itemsize)
    return np.array([rank, os.getpid(), cost.read, cost.resident, b["total"], b["replicated"], cost.tensors,
                     cost.copied_experts, cost.mapped], np.int64)


def _gather_ranks(comm, row: np.ndarray) -> list[dict]:
    return [dict(zip(RANK_FIELDS, map(int, r), strict=True)) for r in comm.all_gather(row)]


# ----- trace -----

def kda_slices(inter: dict, plan, rank: int, head_dim: int) -> dict:
    """The golden layer inputs a rank is fed: its heads of every KDA state, everything else as is."""
    heads, chans = plan.kda_head_slice(rank), plan.kda_head_slice(rank, head_dim)
    out = {}
    for k, v in inter.items():
        if k.endswith(".kda.recurrent"):
            v = v[:, heads]
        elif k.endswith((".kda.conv_q", ".kda.conv_k", ".kda.conv_v")):
            v = v[:, chans]
        out[k] = np.array(v, copy=True)
    return out


def rank_cores(backend):
    """(the cores this rank runs, calls, fallbacks): the backend's, each kernel core falling back to the reference
    on UnsupportedShape (counted, as in one process). Any backend but the built-in NumPy references runs in a
    worker process of this rank (conformance.isolation): it is sent each call's inputs, never the golden this rank
    reads."""
    cores, kernels, _ = through_engine(backend.cores(), backend.kernel_cores())   # engine cores run the graph too
    return guard_kernels(cores, kernels)


def trace_case(job: dict, case: str, rank: int, comm, pool: WorkerPool | None = None) -> tuple[dict | None, list[dict]]:
    """One trace case on this rank with the job's backend: (rank 0: outputs by name plus `tp.info` and
    `tp.note`, else None; every rank's byte row)."""
    cfg = K3Config.preset(job["model"][case])
    plan = make_plan(cfg, job["tp"], job.get("mutant"))
    path = golden_path(Path(job["golden_root"]), case)
    entries = read_header(path)

    def itemsize(name: str) -> int:
        return ITEMSIZE[entries["weights." + name].dtype]

    store = MmapExpertStore(PrefixedCheckpoint(entries, "weights.", path))
    shard, cost = measured_shard(plan, rank, entries, prefix="weights.", itemsize=itemsize, experts=store)
    if not isinstance(shard, ShardWeights):
        raise TypeError(f"rank {rank}: expected the shard served by its expert store, found {type(shard).__name__}")
    row = _rank_row(rank, cost, plan, itemsize)
    pool = pool if pool is not None else WorkerPool()   # starts no process unless a backend needs a worker
    backend = load_backend(job.get("backend", "numpy64"), pool)
    pool.case = case
    p = backend.precision
    comm.record = []
    shard.dense = cast_weights(shard.dense, p)   # the experts stay U8 views of the mapping
    model = K3CpuModel(plan.local_config(), shard, compute_dtype(p), tp=plan.rank(rank, comm))
    inputs = SliceReader()   # the golden tokens and layer inputs: not weights, not counted as shard bytes
    tokens = inputs.copy(inputs.view("inputs.tokens", entries["inputs.tokens"]))
    inter = {k[len("inter."):]: inputs.copy(inputs.view(k, h)) for k, h in entries.items() if k.startswith("inter.")}
    feed = None
    if job["mode"][case] == "layerwise":
        feed = GoldenFeed(kda_slices(inter, plan, rank, cfg.kda_head_dim), p)
    cores, calls, fallbacks = rank_cores(backend)
    tap = RouterTap(cores.moe_route, inter, forcing_budgets(p, job["mode"][case]).get("router", 0.0))
    try:
        out = Stepper(model, cores, feed, tap, prompt_len=job["prompt"][case]).run(tokens)
    except CollectiveError:
        raise
    except Exception as e:   # a KernelFailure names the backend, its core and the case
        raise RuntimeError(f"rank {rank}: {case}: {type(e).__name__}: {e}") from e
    partials, comm.record = comm.record, None
    for name in sorted(out):
        if name.endswith("7_cache") and not cfg.is_mla(int(name.split(".layer")[1][:2])):
            out[name] = np.concatenate(list(comm.all_gather(out[name])), axis=1)   # [1, H, K, V] by heads
    for i, partial in enumerate(partials):
        out[f"tp.partial.{i:04d}"] = comm.all_gather(partial)
    counts = [calls.get(c, 0) for c in CORE_NAMES] + [fallbacks.get(c, [0])[0] for c in CORE_NAMES]
    out["tp.info"] = comm.all_gather(np.array(counts + [tap.forced, store.bytes_touched], np.int64))
    why = "; ".join(f"{c}: {w}" for c, (_, w) in sorted(fallbacks.items()))
    out["tp.note"] = np.frombuffer(why.encode(), np.uint8).copy()
    return (out if rank == 0 else None), _gather_ranks(comm, row)


def run_trace(job: dict, rank: int, comm) -> dict | None:
    """Every trace case of the job on this rank, the backend's kernels in a worker process of this rank; a
    RuntimeError when they left processes running (killed when the worker was stopped)."""
    outs, ranks = {}, {}
    pool = WorkerPool(job.get("worker_timeout", DEFAULT_TIMEOUT))
    try:
        for case in job["cases"]:
            out, rows = trace_case(job, case, rank, comm, pool)
            ranks[case] = rows
            if out is not None:
                outs.update({f"{case}::{k}": v for k, v in out.items()})
    finally:
        pool.close()
    if pool.left_lines():
        raise RuntimeError(f"rank {rank}: {pool.left_lines()[0]}")
    return None if rank else {"tensors": outs, "ranks": ranks}


# ----- decode -----

def run_decode(job: dict, rank: int, comm) -> dict | None:
    cfg = K3Config.from_json(job["config_json"])
    plan = make_plan(cfg, job["tp"], job.get("mutant"))
    if job.get("checkpoint"):
        reader = CheckpointReader(job["checkpoint"])
        shard, cost = measured_shard(plan, rank, reader.entries, experts=MmapExpertStore(reader))
    else:
        shard, cost = synthetic_rank_shard(plan, rank, job["seed"])
    row = _rank_row(rank, cost, plan)
    model = K3CpuModel(plan.local_config(), shard, np.dtype(job["dtype"]), tp=plan.rank(rank, comm))
    tokens = greedy_decode(model, job["prompt"], job["max_new"]).tokens
    ranks = _gather_ranks(comm, row)
    return None if rank else {"tensors": {}, "ranks": {"decode": ranks}, "tokens": tokens}


JOBS = {"trace": run_trace, "decode": run_decode}


def run_job(job: dict) -> dict | None:
    """Join the group, run the job on this rank, leave the group; rank 0 returns the result."""
    import torch.distributed as tdist  # noqa: PLC0415 -- optional: torch is needed only when ranks run

    rank, size, device, group = init_group(job["dist"], job["timeout"])
    if job.get("workdir"):
        (Path(job["workdir"]) / f"rank{rank}.ready").touch()   # joined the group: the run is under way
    if size != job["tp"]:
        raise ValueError(f"WORLD_SIZE is {size}, the job asks for --tp {job['tp']}")
    comm = TorchComm(rank, size, device, group)
    t0 = time.perf_counter()
    result = JOBS[job["kind"]](job, rank, comm)
    if result is not None:
        result["seconds"] = time.perf_counter() - t0
        result["host"] = socket.gethostname()
    comm.barrier()
    tdist.destroy_process_group()   # only after success: a failed group is left to the process exit
    return result


def write_result(result: dict, workdir: Path) -> None:
    """Rank 0's result: tensors as safetensors, the rest as JSON, each written to a temp file and renamed."""
    tmp = workdir / "result.safetensors.tmp"
    save_file({k: np.ascontiguousarray(v) for k, v in result.pop("tensors").items()}, str(tmp))
    os.replace(tmp, workdir / "result.safetensors")
    tmp = workdir / "result.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, workdir / "result.json")


def read_result(workdir: Path) -> dict:
    result = json.loads((workdir / "result.json").read_text())
    result["tensors"] = load_file(str(workdir / "result.safetensors"))
    return result


def main(argv: list[str]) -> int:
    if PARENT_ENV in os.environ:   # spawned by `--tp N`: never outlive the launcher
        die_with_parent(int(os.environ[PARENT_ENV]))
    job = json.loads(Path(argv[0]).read_text())
    workdir = Path(job["workdir"])
    rank = int(os.environ.get("RANK", -1))
    try:
        result = run_job(job)
        if result is not None:
            write_result(result, workdir)
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure leaves a report naming this rank, then exits 1
        kind = "collective" if isinstance(e, CollectiveError) else "raised"
        msg = f"{type(e).__name__}: {e}" if kind == "raised" else str(e)
        tmp = error_path(workdir, rank).with_suffix(".tmp")
        tmp.write_text(json.dumps({"kind": kind, "message": msg, "pid": os.getpid()}))
        os.replace(tmp, error_path(workdir, rank))
        sys.stderr.write(f"rank {rank}: {msg}\n")
        sys.stderr.flush()
        os._exit(1)   # no interpreter teardown: a wedged transport thread must not keep the rank alive


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
