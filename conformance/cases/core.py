"""The `core` kind: one core of `k3ref.cores.Cores` called on seeded arrays and scalar kwargs.

A core case's golden holds the arrays (`inputs.*`), the core's float64 outputs (`outputs.*`) and, for KDA, a few
float64 intermediates for `k3conf show` (`inter.*`); the backend's core is called with the same keyword
arguments, inputs cast to its precision (conformance.cases.inputs).

The data builders are in conformance.cases.core_data (what each draw exposes), the cases of each shape set in
conformance.cases.core_table.
"""
from __future__ import annotations

import contextlib
import inspect
import statistics
from collections.abc import Mapping

import numpy as np

import k3cuda
from conformance.cases import engine_kda, engine_mla, engine_moe
from conformance.cases.core_data import BUILDERS
from conformance.cases.core_spec import CoreSpec
from conformance.cases.core_table import TABLE as _HOST_TABLE
from conformance.cases.inputs import cast, fp32_kept, nbytes
from conformance.cases.protocol import Case, Content, Evaluation, KindBase, Timed, Timer, case_seed
from conformance.cases.routes import route_canonical
from k3ref import kda, ops
from k3ref.cores import Cores, reference_cores

# A core case's kwarg naming the kernel entry it must exercise (case param `entry`): not passed to the core;
# the run is wrapped in k3cuda.force_entry(block, entry), which only the CUDA cores read.
ENTRY_KEY = "kernel_entry"
# timed calls per case (after one untimed warm-up call per input set): the median of 5, each call's outputs checked
TIMED_CALLS = 5

def _named(outputs: tuple[str, ...], result) -> dict[str, np.ndarray]:
    vals = result if isinstance(result, tuple) else (result,)
    if len(vals) != len(outputs):
        raise ValueError(f"core returned {len(vals)} value(s), expected {len(outputs)} ({', '.join(outputs)})")
    return {n: np.asarray(v) for n, v in zip(outputs, vals, strict=True)}


class CoreKind(KindBase):
    """Cases that call one core directly. Case params are the keyword arguments of CoreSpec.make."""

    name = "core"

    def __init__(self, specs: Mapping[str, CoreSpec], table: Mapping[str, list[tuple[str, dict]]]):
        self.specs = dict(specs)      # block -> spec
        self.table = dict(table)      # config -> [(case name, params)]

    def cases(self, config: str) -> list[Case]:
        return [Case(name, self.name, config, case_seed(name), params) for name, params in self.table.get(config, [])]

    def _run(self, case: Case, cores: Cores, inputs: dict, kwargs: dict) -> dict[str, np.ndarray]:
        spec = self.specs[case.block]
        kwargs = dict(kwargs)
        with _forced_entry(spec.core, kwargs.pop(ENTRY_KEY, None)):
            out = _named(spec.outputs, getattr(cores, spec.core)(**inputs, **kwargs))
        return spec.normal_form(inputs, out)

    def generate(self, case: Case) -> Content:
        spec = self.specs[case.block]
        params = dict(case.params)
        entry = params.pop("entry", None)
        inputs, kwargs = spec.make(np.random.default_rng(case.seed), **params)
        if entry is not None:
            kwargs[ENTRY_KEY] = entry
        outputs = self._run(case, reference_cores(), inputs, kwargs)
        tensors = {f"inputs.{k}": v for k, v in inputs.items()}
        tensors.update({f"outputs.{k}": _f64(v) for k, v in outputs.items()})
        tensors.update({f"inter.{k}": v for k, v in _inter(case.block, inputs, kwargs).items()})
        return Content(tensors, kwargs)

    def _inputs(self, golden, backend) -> tuple[dict, dict]:
        spec = self.specs[golden.block]
        # a golden missing an argument of the core is a broken golden (file + regen command), not a TypeError
        params = inspect.signature(getattr(reference_cores(), spec.core)).parameters.values()
        needed = [p.name for p in params if p.default is p.empty and p.name not in golden.kwargs
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        golden.require([f"inputs.{n}" for n in needed] + [f"outputs.{o}" for o in spec.outputs])
        p = backend.precision
        return ({k: cast(v, fp32_kept(p) if k in spec.fp32_inputs else p) for k, v in golden.group("inputs").items()},
                golden.kwargs)

    def evaluate(self, case: Case, golden, backend) -> Evaluation:
        inputs, kwargs = self._inputs(golden, backend)
        outputs = self._run(case, backend.cores(), inputs, kwargs)
        return Evaluation(outputs, backend.run_notes())

    def cores_of(self, case: Case) -> frozenset[str]:
        return frozenset({self.specs[case.block].core})

    def timing(self, case: Case, goldens: list, backend, timer: Timer) -> Timed | None:
        """The core timed on each golden's inputs in turn (the case's, then a fresh draw's); None for a core the
        backend does not time. Bytes: every input read once and every output written once, a floor for any
        kernel."""
        spec = self.specs[case.block]
        if spec.core not in backend.timed_cores():
            return None
        sets, entry = [], None
        for golden in goldens:
            inputs, kwargs = self._inputs(golden, backend)
            kwargs = dict(kwargs)
            entry = kwargs.pop(ENTRY_KEY, None)
            sets.append((inputs, kwargs))
        with _forced_entry(spec.core, entry):
            seconds, results = timer(backend, spec.core, [([], {**i, **k}) for i, k in sets], TIMED_CALLS)
        calls = [(r % len(sets), spec.normal_form(sets[r % len(sets)][0], _named(spec.outputs, out)))
                 for r, out in enumerate(results)]
        outs = [cast(v, backend.precision) for v in goldens[0].group("outputs").values()]
        return Timed(statistics.median(seconds), nbytes(sets[0][0].values()) + nbytes(outs), calls)


def _forced_entry(core: str, entry: str | None):
    """k3cuda.force_entry(core, entry) when a case names an entry, else a no-op context."""
    if entry is None:
        return contextlib.nullcontext()
    return k3cuda.force_entry(core, entry)


def _f64(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype.kind == "f" else a


def _inter(block: str, inputs: dict, kwargs: dict) -> dict[str, np.ndarray]:
    """Float64 intermediates worth keeping for `k3conf show` (not compared: cores do not return them)."""
    if block in ("kda_decode", "kda_prefill"):
        return {
            "g": kda.kda_gate(inputs["g_raw"], inputs["A_log"], inputs["dt_bias"], kwargs["lower_bound"]),
            "beta": ops.sigmoid(inputs["beta_raw"]),
        }
    return {}


_KDA_FP32 = ("A_log", "dt_bias", "state")  # F32 in the checkpoint; the recurrent state is fp32

CORE_SPECS: dict[str, CoreSpec] = {
    "rmsnorm": CoreSpec("rmsnorm", ("y",), BUILDERS["rmsnorm"]),
    "situ_glu": CoreSpec("situ_glu", ("h",), BUILDERS["situ_glu"]),
    "kda_decode": CoreSpec("kda_decode", ("o", "state"), BUILDERS["kda_decode"], fp32_inputs=_KDA_FP32),
    "kda_prefill": CoreSpec("kda_prefill", ("o", "state"), BUILDERS["kda_prefill"], fp32_inputs=_KDA_FP32),
    "mla_decode": CoreSpec("mla_decode", ("o_lat",), BUILDERS["mla_decode"]),
    "mxfp4_gemv": CoreSpec("mxfp4_gemv", ("y",), BUILDERS["mxfp4_gemv"]),
    "moe_route": CoreSpec("moe_route", ("weights", "indices"), BUILDERS["moe_route"], route_canonical,
                          ("logits", "bias")),
    "attnres_mix": CoreSpec("attnres_mix", ("out",), BUILDERS["attnres_mix"]),
    **engine_kda.SPECS, **engine_mla.SPECS, **engine_moe.SPECS,
}

# config -> [(case name, builder params)]: the host-graph cores' cases, then the engine-shaped cores'
CORE_TABLE: dict[str, list[tuple[str, dict]]] = {
    config: [*_HOST_TABLE.get(config, []), *engine_kda.TABLE.get(config, []), *engine_mla.TABLE.get(config, []),
             *engine_moe.TABLE.get(config, [])]
    for config in dict.fromkeys([*_HOST_TABLE, *engine_kda.TABLE, *engine_mla.TABLE, *engine_moe.TABLE])}

__all__ = ["CORE_SPECS", "CORE_TABLE", "ENTRY_KEY", "CoreKind", "CoreSpec"]
