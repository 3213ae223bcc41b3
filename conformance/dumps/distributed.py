"""The layers of one compare spread over the ranks of torch.distributed (`torchrun ... compare --distributed`).

    torchrun --nproc-per-node 2 -m conformance compare DUMP --checkpoint DIR --distributed --report out/

Every rank is started by torchrun (the env:// variables RANK and WORLD_SIZE are set; several machines work the
same way with --nnodes) and opens the dump and the checkpoint itself, so each must see them at the same path.
Rank r of W runs the layers [r::W] of the sorted list in its own process, one layer's weights at a time; rank 0
also runs the float64 free run while the others work. The results are then exchanged as UTF-8 JSON bytes:
one all_gather of each rank's byte count, then one all_gather of the bytes padded to the longest, as uint8
tensors over gloo (never gather_object, which pickles). Rank 0 assembles the report; the other ranks return
nothing and print nothing but their own line.

A rank that raises inside a layer reports that layer missing; a DumpError on any rank is raised by rank 0 after
the exchange (every rank reaches it, so none waits for a peer that left). A rank that dies is torchrun's to
handle: its agent ends the other ranks and torchrun exits non-zero; the layers can be run again with --layers.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from conformance.dumps.errors import DumpError
from conformance.dumps.format import Dump
from conformance.dumps.workers import LayerRuns, RunLayer, run_here
from conformance.tp.comm import TorchComm
from conformance.tp.launch import env_rank, init_group, under_torchrun

# The exchange waits for the slowest rank's layers (a real-size MoE layer takes minutes on a CPU); a rank that
# dies does not leave the others waiting this long, torchrun's agent ends them.
EXCHANGE_TIMEOUT_S = 6 * 3600.0


class NotDistributed(Exception):
    """--distributed outside torchrun: the message says what was expected."""


def check_environment() -> tuple[int, int]:
    """(rank, world size) of this torchrun rank; NotDistributed when the env:// variables are absent."""
    if not under_torchrun():
        raise NotDistributed("--distributed: expected the env:// variables RANK and WORLD_SIZE that torchrun sets "
                             "(torchrun --nproc-per-node N -m conformance compare ... --distributed), found "
                             f"RANK={os.environ.get('RANK')!r} WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}")
    rank, size, _ = env_rank()
    return rank, size


def gather_bytes(comm, payload: bytes) -> list[bytes]:
    """Every rank's payload, in rank order, on every rank: the lengths first, then the bytes padded to the
    longest (both uint8 / int64 tensors, nothing pickled)."""
    lengths = comm.all_gather(np.array([len(payload)], np.int64)).reshape(-1)
    width = int(lengths.max()) if lengths.size else 0
    padded = np.zeros(max(width, 1), np.uint8)
    padded[:len(payload)] = np.frombuffer(payload, np.uint8)
    rows = comm.all_gather(padded)
    return [bytes(rows[r, :int(n)]) for r, n in enumerate(lengths)]


def rank_payload(rank: int, layers: Sequence[int], runs: LayerRuns, dump_error: str | None) -> bytes:
    doc = {"rank": rank, "pid": os.getpid(), "layers": list(layers), "dump_error": dump_error,
           "results": {str(k): v for k, v in runs.results.items()},
           "missing": {str(k): v for k, v in runs.missing.items()}}
    return json.dumps(doc, allow_nan=True).encode()


def merge_payloads(payloads: Sequence[bytes]) -> tuple[LayerRuns, list[dict]]:
    """The ranks' results as one LayerRuns, and per rank {rank, pid, layers}; a rank's DumpError is raised."""
    runs, ranks = LayerRuns(), []
    for r, blob in enumerate(payloads):
        try:
            doc = json.loads(blob.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RuntimeError(f"rank {r}: expected its results as JSON, found {len(blob)} bytes that are not "
                               f"({e})") from None
        if doc.get("dump_error"):
            raise DumpError(f"rank {r}: {doc['dump_error']}")
        runs.results.update({int(k): v for k, v in doc["results"].items()})
        runs.missing.update({int(k): f"{v} (rank {r})" for k, v in doc["missing"].items()})
        ranks.append({"rank": r, "pid": doc["pid"], "layers": doc["layers"]})
    return runs, ranks


def run_ranks(dump: Dump, checkpoint: Path, layers: Sequence[int], *, run_layer: RunLayer,
              meanwhile: Callable[[], Any] | None = None, timeout_s: float = EXCHANGE_TIMEOUT_S
              ) -> tuple[LayerRuns, Any, list[dict]] | None:
    """This rank's share of the layers, exchanged; on rank 0 (every layer's runs, meanwhile()'s value, the ranks
    [{rank, pid, layers}]), on the others None. `meanwhile` runs on rank 0 only, after its own layers."""
    import torch.distributed as tdist  # noqa: PLC0415 -- optional: only --distributed needs torch

    check_environment()
    rank, size, device, group = init_group("gloo", timeout_s)
    try:
        mine = sorted(int(x) for x in layers)[rank::size]
        dump_error, other = None, None
        try:
            runs = run_here(dump, checkpoint, mine, run_layer)
            if rank == 0 and meanwhile is not None:
                other = meanwhile()
        except DumpError as e:   # told to rank 0 through the exchange, so no peer waits for a rank that left
            runs, dump_error = LayerRuns(), str(e)
        payloads = gather_bytes(TorchComm(rank, size, device, group), rank_payload(rank, mine, runs, dump_error))
    finally:
        tdist.destroy_process_group()
    if rank != 0:
        return None
    merged, ranks = merge_payloads(payloads)
    return merged, other, ranks
