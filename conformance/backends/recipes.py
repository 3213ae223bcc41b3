"""Correct kernels written another way: the recipes the judge's false-fail rate is measured on.

A gate that passes only the baselines it was measured on is no judge: a correct kernel computes in another order,
at another precision inside, and rounds its outputs once. Each recipe is a correct reading of every core at its
precision, built from k3ref's cores (the spec's own statement) with one honest difference:

- `recipe:fp32-wide`: every core in float64 on the fp32 inputs, each output rounded to the nearest fp32 (a kernel
  accumulating in wider registers);
- `recipe:fp32-numpy-sums`: every core in float32 by k3ref's NumPy forms (K3_FAST=numpy: BLAS's and NumPy's
  pairwise sums) instead of the compiled fixed-order sums numpy32 runs (another summation order);
- `recipe:bf16-f32-math`: every core in float32 on the bf16 inputs, each float output rounded to the nearest bf16
  (the usual bf16 kernel: bf16 in memory, fp32 in registers);
- `recipe:bf16-wide`: every core in float64 on the bf16 inputs, each output rounded to the nearest bf16.
Integer outputs (router indices) pass through; the outputs K3 keeps in fp32 (the KDA recurrent state and its pools,
the router's weights, an attention's log-sum-exp) are rounded to fp32, not to bf16, as a bf16 engine keeps them.

tools/verdict_rates.py runs them, with the built-in backends, over fresh draws of every case and fuzz draws, to
publish how often a correct kernel is failed (docs/verdict_rates.md).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import ml_dtypes
import numpy as np

from conformance.backends.builtin import NumpyBackend
from conformance.cases.core import CORE_SPECS
from k3ref.cores import CORE_NAMES, Cores, reference_cores

# outputs K3 keeps in fp32 whatever the activations' precision (docs/spec.md section 7): a bf16 recipe rounds them to
# fp32 only
FP32_OUTPUTS: dict[str, tuple[str, ...]] = {
    "kda_decode": ("state",), "kda_prefill": ("state",), "kda_decode_pool": ("state_pool",),
    "kda_prefill_varlen": ("state_pool",), "moe_route": ("weights",), "mla_prefill": ("lse",),
}


def _to(dtype) -> Callable[[np.ndarray], np.ndarray]:
    def round_output(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a)
        if a.dtype.kind != "f":
            return a
        if dtype == "bf16":
            return a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
        return a.astype(dtype)
    return round_output


def _widen(dtype) -> Callable:
    def widen(value):
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            return value.astype(dtype)
        if isinstance(value, list | tuple):
            items = [widen(v) for v in value]
            return items if isinstance(value, list) else tuple(items)
        return value
    return widen


@contextlib.contextmanager
def _numpy_sums() -> Iterator[None]:
    """k3ref's NumPy forms for the block (K3_FAST=numpy), K3_FAST restored after it."""
    before = os.environ.get("K3_FAST")
    os.environ["K3_FAST"] = "numpy"
    try:
        yield
    finally:
        if before is None:
            del os.environ["K3_FAST"]
        else:
            os.environ["K3_FAST"] = before


def recipe_cores(compute_dtype, out_round: Callable[[np.ndarray], np.ndarray], numpy_sums: bool = False) -> Cores:
    """k3ref's cores computing in `compute_dtype` on their (already rounded) inputs, each float output rounded by
    `out_round` (the ones K3 keeps in fp32 to fp32); the AttnRes hub stays k3ref's (its mixes call attnres_mix,
    rounded like every core)."""
    base = reference_cores()
    widen = _widen(compute_dtype)
    keep32 = _to(np.float32)

    def wrapped(core: str, fn):
        names = CORE_SPECS[core].outputs if core in CORE_SPECS else ()

        def rounded(i: int, o):
            kept = i < len(names) and names[i] in FP32_OUTPUTS.get(core, ())
            return keep32(o) if kept else out_round(o)

        def call(*args, **kwargs):
            with _numpy_sums() if numpy_sums else contextlib.nullcontext():
                out = fn(*(widen(a) for a in args), **{k: widen(v) for k, v in kwargs.items()})
            return tuple(rounded(i, o) for i, o in enumerate(out)) if isinstance(out, tuple) else rounded(0, out)
        return call

    return base.replace(**{n: wrapped(n, getattr(base, n)) for n in CORE_NAMES if n != "attnres_hub"})


RECIPES: dict[str, tuple[str, Callable[[], Cores]]] = {
    "fp32-wide": ("fp32", lambda: recipe_cores(np.float64, _to(np.float32))),
    "fp32-numpy-sums": ("fp32", lambda: recipe_cores(np.float32, _to(np.float32), numpy_sums=True)),
    "bf16-f32-math": ("bf16", lambda: recipe_cores(np.float32, _to("bf16"))),
    "bf16-wide": ("bf16", lambda: recipe_cores(np.float64, _to("bf16"))),
}


def recipe_backend(name: str) -> NumpyBackend:
    """The backend `recipe:<name>`; KeyError naming the recipes for an unknown name."""
    key = name.removeprefix("recipe:")
    if key not in RECIPES:
        raise KeyError(f"unknown recipe {name!r}; known: {['recipe:' + r for r in RECIPES]}")
    precision, make = RECIPES[key]
    backend = NumpyBackend(f"recipe:{key}", precision, make)
    return backend


__all__ = ["FP32_OUTPUTS", "RECIPES", "recipe_backend", "recipe_cores"]
