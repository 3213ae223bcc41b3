"""The precision casts every kind applies to a golden's inputs before a backend sees them.

One rule: a float array is rounded to the backend's precision (bf16: rounded to bf16, held as float32), an
integer array is passed as is, and the tensors K3 keeps in fp32 (F32 checkpoint tensors, the recurrent KDA
state, the router logits) reach a bf16 backend in fp32, not rounded.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import ml_dtypes
import numpy as np


def cast(a: np.ndarray, precision: str) -> np.ndarray:
    """Float arrays to the backend precision (bf16: values rounded to bf16, held as float32); ints untouched."""
    a = np.asarray(a)
    if a.dtype.kind != "f":
        return a
    if precision == "fp64":
        return a.astype(np.float64)
    if precision == "fp32":
        return a.astype(np.float32)
    if precision == "bf16":
        return a.astype(ml_dtypes.bfloat16).astype(np.float32)
    raise ValueError(f"precision: expected fp64, fp32 or bf16, found {precision!r}")


def fp32_kept(precision: str) -> str:
    """The precision of a tensor K3 keeps in fp32: fp32 under a bf16 backend, the backend's own otherwise."""
    return "fp32" if precision == "bf16" else precision


# Checkpoint tensors K3 stores in F32 (docs/spec.md section 7): a bf16 backend receives them in fp32, not rounded.
F32_SUFFIXES = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias", "o_norm.weight")


def cast_weights(weights: Mapping[str, np.ndarray], precision: str) -> dict[str, np.ndarray]:
    """Checkpoint weights (module-local or full names) to the backend precision; F32 tensors stay fp32 at bf16."""
    keep32 = fp32_kept(precision)
    return {k: cast(v, keep32 if k.endswith(F32_SUFFIXES) else precision) for k, v in weights.items()}


def nbytes(arrays: Iterable) -> int:
    """Bytes held by `arrays` together."""
    return int(sum(np.asarray(a).nbytes for a in arrays))
