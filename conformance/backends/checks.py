"""Checking a backend's own cores on fresh tiny inputs before a run, two questions in this order:

1. the interface: a wrong signature or output (count, type, shape, kind of dtype, NaN where the reference has
   none) is named in a second, with the core, the case and what was expected, instead of showing as a column
   of red cells;
2. whether the values answer the inputs at all: each output against the float64 reference core on the same
   inputs, all calls of a core judged as one tensor per output (integer outputs call by call, exactly). A core
   that returns stored outputs when the inputs match a golden, zeros, or the answer of its first call (per shape
   or overall) is off by O(1) and is refused before the first case runs. A core that is merely inaccurate is not
   refused here: no baseline has run yet, so no bound this check could apply would be the run's; the run judges
   it against its gate rows and writes the report that says where it first goes wrong.

The inputs are the block's tiny cases drawn afresh with a seed of this check (named in every error, so the
failure replays with `check_cores(backend, seed=...)`, or in a run with K3CONF_CHECK_SEED=N), twice per case.
"""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np

from conformance.backends.external import BackendError
from conformance.backends.protocol import BackendBase
from conformance.cases.core import CORE_SPECS, CORE_TABLE, CoreSpec
from conformance.cases.fresh import env_seed
from conformance.cases.inputs import cast, fp32_kept
from conformance.cases.protocol import case_seed
from conformance.isolation.errors import RaisedInWorker
from conformance.judge.compare import compare
from conformance.judge.gates import gate_for
from k3ref.cores import UnsupportedShape, reference_cores

# draws per tiny case: the second one has the shape of the first, so a core answering from a per-shape cache of
# its first call returns the first draw's outputs for it
DRAWS = 2
# A float output whose relative RMS error against the reference exceeds this is no answer to its inputs: zeros
# err 1.0, the answer to other inputs ~1.4, while the loosest gate row (bf16) caps at 0.2 and the baselines
# measured at most 6.6e-2 on one tiny draw (torch-bf16, mxfp4_gemv/N1-K32, 40 seeds).
NOT_AN_ANSWER = 0.5
CHECK_SEED_ENV = "K3CONF_CHECK_SEED"


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of a backend's core in the check: where it was made (for errors), its outputs and the float64
    reference's, both by output name and in the spec's canonical order."""

    where: str
    got: dict[str, np.ndarray]
    want: dict[str, np.ndarray]


def check_seed() -> int:
    """The start-up check's seed: K3CONF_CHECK_SEED when set (a replay of a check an error named), else a new
    random one."""
    return env_seed(CHECK_SEED_ENV, "a check error", BackendError)


def check_cores(backend: BackendBase, seed: int | None = None) -> None:
    """Call every core the backend supplies on fresh inputs shaped like its block's tiny cases (K != V and odd
    sizes among them), DRAWS draws each; BackendError naming the core, the case, the seed and what was expected
    and found when a call fails or an output breaks the interface, then when an output's error against the
    float64 reference exceeds the bound of its gate row (see the module docstring). A case the core raises
    UnsupportedShape on is skipped. seed: replays an earlier check (default: `check_seed()`)."""
    seed = check_seed() if seed is None else seed
    cores = backend.cores()
    for name in sorted(backend.kernel_cores()):
        spec = CORE_SPECS.get(name)
        if spec is None:          # attnres_hub: a factory, exercised by the traces only
            continue
        calls = [_call(backend, getattr(cores, name), spec, case, params, (seed, draw))
                 for case, params in CORE_TABLE["tiny"] if case.split("/", 1)[0] == name for draw in range(DRAWS)]
        made = [c for c in calls if c is not None]
        if made:                  # every call kept the interface: only now is a value error the news
            _check_values(backend, name, made)


def _call(backend: BackendBase, fn, spec: CoreSpec, case: str, params: dict, draw: tuple[int, int]) -> _Call | None:
    """The backend's core and the float64 reference on one fresh draw of `case`'s inputs; None when the core
    raises UnsupportedShape. BackendError when the call fails or its outputs break the interface."""
    shape_params = {k: v for k, v in params.items() if k != "entry"}   # a CUDA entry override only
    seed, n = draw
    inputs, kwargs = spec.make(np.random.default_rng((seed, case_seed(case), n)), **shape_params)
    keep = set(spec.fp32_inputs)
    cast_inputs = {k: cast(v, fp32_kept(backend.precision) if k in keep else backend.precision)
                   for k, v in inputs.items()}
    ref = getattr(reference_cores(), spec.core)
    want = ref(**inputs, **kwargs)   # before the backend's call: a core may write into the arrays it is given
    where = (f"backend {backend.name}: core {spec.core} on a tiny input like {case} ({_shapes(cast_inputs)}; "
             f"check seed {seed}, draw {n + 1} of {DRAWS})")
    try:
        got = fn(**cast_inputs, **kwargs)
    except UnsupportedShape:
        return None
    except Exception as e:
        if isinstance(e, TypeError) or (isinstance(e, RaisedInWorker) and e.type_name == "TypeError"):
            said = e.text if isinstance(e, RaisedInWorker) else str(e)
            raise BackendError(f"{where}: the call raised TypeError: {said}; expected the signature "
                               f"{spec.core}{_plain_signature(ref)} (docs/interfaces.md)") from e
        said = str(e) if isinstance(e, RaisedInWorker) else f"{type(e).__name__}: {e}"   # it names its type
        raise BackendError(f"{where}: the call raised {said}") from e
    _compare_outputs(where, got, want, spec.outputs)
    return _Call(where, _canonical(spec, inputs, got), _canonical(spec, inputs, want))


def _canonical(spec: CoreSpec, inputs: dict, result) -> dict[str, np.ndarray]:
    """A result that kept the interface, by output name, in the spec's normal form (padded rows zeroed, router
    rows by expert)."""
    values = result if isinstance(result, tuple) else (result,)
    named = {out: np.asarray(v) for out, v in zip(spec.outputs, values, strict=True)}
    return spec.normal_form(inputs, named)


def _check_values(backend: BackendBase, core: str, calls: list[_Call]) -> None:
    """BackendError naming the core, the output, its error and the bound when an output is no answer to its inputs.

    Integer outputs (router indices) must match on every call. A float output is judged on all its calls as one
    tensor: the relative RMS of a single call is ill-conditioned where its outputs cancel (mxfp4_gemv/N1-K32 is
    one dot product; torch-bf16 errs up to 6e-2 there on some draws while its median is 1e-3), and a core that
    answers from stored data, with zeros or with its first answer is off by O(1) on most calls."""
    precision = backend.precision
    for out in calls[0].want:
        key, gate = gate_for(core, out, precision)
        if calls[0].want[out].dtype.kind != "f":
            for call in calls:
                cmp = compare(call.got[out], call.want[out])
                if cmp.problem:
                    raise BackendError(f"{call.where}: output {out} must equal the float64 reference core's on the "
                                       f"same inputs exactly (gate row {key}): {cmp.problem}")
            continue
        got, want = (np.concatenate([c.got[out].ravel() for c in calls]),
                     np.concatenate([c.want[out].ravel() for c in calls]))
        cmp = compare(got, want, gate.atol, gate.rtol)
        problem = cmp.problem or ("" if cmp.nonfinite_ok else "NaN/Inf where the reference has none (or vice versa)")
        if not problem and cmp.rel_rms <= NOT_AN_ANSWER:
            continue
        worst = max(calls, key=lambda c: compare(c.got[out], c.want[out]).rel_rms)
        raise BackendError(
            f"backend {backend.name}: core {core}: output {out} is no answer to its inputs: against the float64 "
            f"reference core on the same fresh inputs ({len(calls)} calls as one tensor) "
            f"{problem or f'rel RMS {cmp.rel_rms:.3g} > {NOT_AN_ANSWER:g}'}, max abs {cmp.max_abs:.3g} "
            f"(zeros err 1, another input's answer ~1.4; gate row {key} caps the run at {gate.cap:.3g}). "
            f"Worst call: {worst.where}: {compare(worst.got[out], worst.want[out], gate.atol, gate.rtol).summary()}")


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
