"""Checking a backend's own cores on tiny inputs before a run: a wrong signature or output is named in a second,
with the core, the case and what was expected, instead of showing as a column of red cells.
"""
from __future__ import annotations

import inspect

import numpy as np

from conformance.backends.external import BackendError
from conformance.backends.protocol import BackendBase
from conformance.cases.core import CORE_SPECS, CORE_TABLE
from conformance.cases.inputs import cast
from k3ref.cores import UnsupportedShape, reference_cores


def check_cores(backend: BackendBase) -> None:
    """Call every core the backend supplies on the inputs of its block's tiny cases (made afresh, no golden
    read; K != V and odd sizes among them), next to the reference core on the same inputs; BackendError
    naming the core, the case, what was expected and what was found when the call fails, or an output
    differs in count, type, shape or kind of dtype, or is non-finite where the reference's is finite.
    Values are not judged here (the run does that); a case the core raises UnsupportedShape on is skipped."""
    cores, base = backend.cores(), reference_cores()
    for name in sorted(backend.kernel_cores()):
        spec = CORE_SPECS.get(name)
        if spec is None:          # attnres_hub: a factory, exercised by the traces only
            continue
        fn, ref = getattr(cores, name), getattr(base, name)
        for case, params in CORE_TABLE["tiny"]:
            if case.split("/", 1)[0] != name:
                continue
            shape_params = {k: v for k, v in params.items() if k != "entry"}   # a CUDA entry override only
            inputs, kwargs = spec.make(np.random.default_rng(0), **shape_params)
            keep = spec.fp32_inputs if backend.precision == "bf16" else ()
            inputs = {k: cast(v, "fp32" if k in keep else backend.precision) for k, v in inputs.items()}
            where = f"backend {backend.name}: core {name} on a tiny input like {case} ({_shapes(inputs)})"
            try:
                got = fn(**inputs, **kwargs)
            except UnsupportedShape:
                continue
            except TypeError as e:
                raise BackendError(f"{where}: the call raised TypeError: {e}; expected the signature "
                                   f"{name}{_plain_signature(ref)} (docs/interfaces.md)") from e
            except Exception as e:
                raise BackendError(f"{where}: the call raised {type(e).__name__}: {e}") from e
            _compare_outputs(where, got, ref(**inputs, **kwargs), spec.outputs)


def _plain_signature(fn) -> inspect.Signature:
    """fn's signature without annotations: `(x, w, eps)` reads better in an error than the type hints."""
    sig = inspect.signature(fn)
    return sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                       return_annotation=sig.empty)


def _shapes(arrays: dict) -> str:
    return ", ".join(f"{k} {list(np.shape(v))}" for k, v in arrays.items())


def _compare_outputs(where: str, got, want, names: tuple[str, ...]) -> None:
    got_t = got if isinstance(got, tuple) else (got,)
    want_t = want if isinstance(want, tuple) else (want,)
    if len(got_t) != len(want_t):
        raise BackendError(f"{where}: returned {len(got_t)} value(s), expected {len(want_t)} ({', '.join(names)})")
    for out, g, w in zip(names, got_t, want_t, strict=False):   # names may run past the outputs
        w = np.asarray(w)
        if not isinstance(g, np.ndarray):
            raise BackendError(f"{where}: output {out} is a {type(g).__module__}.{type(g).__name__}, expected a "
                               "numpy.ndarray (cores take and return numpy arrays; copy device tensors to the host)")
        if g.shape != w.shape:
            raise BackendError(f"{where}: output {out} has shape {list(g.shape)}, expected {list(w.shape)}")
        if (g.dtype.kind == "f") != (w.dtype.kind == "f") or (w.dtype.kind in "iu" and g.dtype.kind not in "iu"):
            raise BackendError(f"{where}: output {out} has dtype {g.dtype}, expected {w.dtype} (or another "
                               f"{'floating' if w.dtype.kind == 'f' else 'integer'} dtype)")
        if g.dtype.kind == "f":
            bad = ~np.isfinite(g) & np.isfinite(w)
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0])
                raise BackendError(f"{where}: output {out} holds {int(bad.sum())} non-finite value(s) where the "
                                   f"reference's are finite (first at {list(idx)}: {g[idx]}, expected {w[idx]})")
