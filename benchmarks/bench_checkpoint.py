"""Seconds to write the `small` synthetic checkpoint (~0.40B parameters, ~0.5 GB mostly bf16) and to admit it.

Run with `make bench` (or `pytest benchmarks/bench_checkpoint.py`). One round each: the write is disk- and
RNG-bound (every tensor generated, rounded to bf16 / float32 or MXFP4-quantised, streamed to its shard);
admission reads only the safetensors headers, so it should take well under a second. The checkpoint
is deleted afterwards.
"""
from __future__ import annotations

import shutil

import pytest

from k3ref.config import K3Config
from k3ref.weights import admit_checkpoint, inventory, synthetic_checkpoint

SEED = 0


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("small_ckpt")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _write(cfg, d):
    if not (d / "config.json").exists():
        synthetic_checkpoint(cfg, SEED, d, shard_bytes=256 << 20)
    return d


def test_bench_synthetic_checkpoint_small(benchmark, small_dir):
    cfg = K3Config.preset("small")
    benchmark.pedantic(_write, args=(cfg, small_dir), rounds=1, iterations=1)
    written = sum(p.stat().st_size for p in small_dir.glob("*.safetensors"))
    benchmark.extra_info["bytes_written"] = written
    assert written >= sum(s.nbytes for s in inventory(cfg))


def test_bench_admit_small(benchmark, small_dir):
    cfg = K3Config.preset("small")
    _write(cfg, small_dir)
    verdict = benchmark.pedantic(admit_checkpoint, args=(small_dir, cfg), rounds=1, iterations=1)
    assert verdict.ok, verdict.summary()
