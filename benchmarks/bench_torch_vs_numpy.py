"""Torch fp32 baseline vs the k3ref NumPy float32 cores, per core, at K3 decode sizes on this machine.

Per core: median seconds of the k3ref core on float32 inputs, median seconds of the torch float32 core on
device-resident inputs (make_backend(...).time_core: inputs uploaded once, outside the timed region), their
ratio, and the torch-bf16 error (relative RMS vs the float64 k3ref core) at the same size. Report only: nothing
is gated, the numbers go into docs/torch_baseline.md.

Run: .venv/bin/python benchmarks/bench_torch_vs_numpy.py [--threads 1]   (table)
 or: .venv/bin/python -m pytest benchmarks/bench_torch_vs_numpy.py -q -s
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np
import pytest

from conformance.backends.pytorch import make_backend
from k3ref.cores import reference_cores

torch = pytest.importorskip("torch", reason="PyTorch is not installed: pip install 'k3-conformance[torch]'")

REPEATS = 7
H_KDA, K_KDA = 96, 128             # K3 KDA heads x head_dim
H_MLA, R, P, PAGE = 96, 512, 64, 64
CONTEXT = 4096                     # MLA decode context (tokens in the latent cache)


def _mla_inputs(rng):
    n_pages = CONTEXT // PAGE
    return dict(q_abs=rng.normal(size=(1, H_MLA, R + P)) * 0.05,
                kv_cache=rng.normal(size=(n_pages, PAGE, R + P)),
                block_table=rng.permutation(n_pages).astype(np.int32)[None],
                seq_lens=np.array([CONTEXT], dtype=np.int32), scale=1 / math.sqrt(192), kv_rank=R)


def _kda_inputs(rng, lead):
    H, K = H_KDA, K_KDA
    return dict(q=rng.normal(size=lead + (H, K)), k=rng.normal(size=lead + (H, K)),
                v=rng.normal(size=lead + (H, K)), g_raw=rng.normal(size=lead + (H, K)),
                beta_raw=rng.normal(size=lead + (H,)), A_log=np.log(rng.uniform(1, 16, H)),
                dt_bias=rng.normal(size=H * K), state=0.1 * rng.normal(size=(1, H, K, K)))


# core: (what the size is, rng -> keyword inputs)
DECODE_SIZES = {
    "rmsnorm": ("x [1, 7168]", lambda rng: dict(x=rng.normal(size=(1, 7168)), w=1 + 0.1 * rng.normal(size=7168),
                                                 eps=1e-5)),
    "situ_glu": ("16 experts x 3072", lambda rng: dict(gate=rng.normal(size=(16, 3072)) * 3,
                                                       up=rng.normal(size=(16, 3072)) * 3)),
    "kda_decode": ("B1 H96 K=V=128", lambda rng: _kda_inputs(rng, (1,))),
    "kda_prefill": ("B1 T64 H96 K=V=128", lambda rng: _kda_inputs(rng, (1, 64))),
    "mla_decode": (f"B1 H96 576-wide, {CONTEXT} tokens", _mla_inputs),
    "mxfp4_gemv": ("w1 expert [3072, 3584], x [1, 3584]",
                   lambda rng: dict(packed=rng.integers(0, 256, size=(3072, 1792), dtype=np.uint8),
                                    scale=rng.integers(118, 126, size=(3072, 112), dtype=np.uint8),
                                    x=rng.normal(size=(1, 3584)))),
    "moe_route": ("T1 E896 top-16", lambda rng: dict(logits=rng.normal(size=(1, 896)), bias=0.1 * rng.normal(size=896),
                                                     top_k=16)),
    "attnres_mix": ("9 sources x [1, 7168]", lambda rng: dict(sources=rng.normal(size=(9, 1, 7168)),
                                                              proj_w=0.01 * rng.normal(size=7168),
                                                              norm_w=1 + 0.1 * rng.normal(size=7168))),
}


def _float32(inputs: dict) -> dict:
    return {k: v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == np.float64 else v
            for k, v in inputs.items()}


def _median_seconds(fn, repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel_rms(out, ref) -> float:
    out, ref = (np.asarray(a, dtype=np.float64) for a in (out, ref))
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), np.finfo(np.float64).tiny))


def _first_output(result):
    """The first output of a core (cores with several outputs return a tuple)."""
    return result[0] if isinstance(result, tuple) else result


def measure(core: str, seed: int = 0) -> dict:
    """One row: numpy32 seconds, torch fp32 seconds, ratio, torch-bf16 rel RMS vs float64 (first output)."""
    size, make = DECODE_SIZES[core]
    inputs = make(np.random.default_rng(seed))
    ref_fn = getattr(reference_cores(), core)
    inputs32 = _float32(inputs)    # cast once, outside the timed region, as time_core does for torch
    numpy_s = _median_seconds(lambda: ref_fn(**inputs32))
    torch_s = make_backend("torch", device="cpu").time_core(core, inputs)
    ref64 = ref_fn(**inputs)
    bf16 = getattr(make_backend("torch-bf16", device="cpu").cores(), core)(**inputs)
    return dict(core=core, size=size, numpy_s=numpy_s, torch_s=torch_s, ratio=numpy_s / torch_s,
                bf16_err=_rel_rms(_first_output(bf16), _first_output(ref64)))


def format_row(r: dict) -> str:
    return (f"| {r['core']} | {r['size']} | {r['numpy_s'] * 1e3:.3f} | {r['torch_s'] * 1e3:.3f} | "
            f"{r['ratio']:.2f} | {r['bf16_err']:.2e} |")


HEADER = ("| core | decode size | numpy32 ms | torch fp32 ms | numpy/torch | torch-bf16 rel RMS vs fp64 |\n"
          "|---|---|---|---|---|---|")


@pytest.mark.parametrize("core", list(DECODE_SIZES))
def test_torch_vs_numpy(core):
    r = measure(core)
    print("\n" + HEADER + "\n" + format_row(r))
    assert r["numpy_s"] > 0 and r["torch_s"] > 0 and r["bf16_err"] > 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice); on a "
                        "shared machine 1 avoids OpenMP oversubscription stalls")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, numpy {np.__version__}, "
          f"{os.cpu_count()} CPUs, load average {load:.1f}")
    print(HEADER)
    for core in DECODE_SIZES:
        print(format_row(measure(core)), flush=True)


if __name__ == "__main__":
    main()
