"""The gate table, built here and only here from data: the rows written by hand with their reasons, the rows
derived from the baselines' measured errors (conformance.judge.measured), the near-tie budgets and the speed
targets. conformance.judge.gates looks rows up in these tables; nothing else adds to them.

Every table is read-only once built (ReadOnlyTable): a backend is judged by these rows, so code loaded with a
backend cannot edit them; an attempt raises TypeError naming the table.

Look-up keys are (block, tensor, precision); a tensor may be a glob pattern (the model traces' rows are
'<model>/step*', looked up by '<model>/<tensor>', with '*/step*' the rows every model config starts from).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

from conformance.judge import measured
from conformance.judge.gate_row import BASELINE_FACTOR, Gate, baseline_row

Key = tuple[str, str, str]


class ReadOnlyTable(Mapping):
    """A gate table after it is built: it reads like a dict, and any write raises TypeError naming the table."""

    def __init__(self, name: str, rows: Mapping):
        self._name, self._rows = name, dict(rows)

    def __getitem__(self, key: Any) -> Any:
        return self._rows[key]

    def __iter__(self) -> Iterator:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"ReadOnlyTable({self._name}, {len(self._rows)} rows)"

    def __setitem__(self, key: Any, value: Any) -> NoReturn:
        raise self._refused(f"set {key!r}")

    def __delitem__(self, key: Any) -> NoReturn:
        raise self._refused(f"delete {key!r}")

    def _refused(self, what: str) -> TypeError:
        return TypeError(f"the gate table {self._name} is read-only once built: cannot {what}; its rows are data "
                         "in conformance/judge/gate_table.py (a backend is never judged by rows it wrote)")

_FP64 = "numpy64 = the generator's own float64 code, exact by construction; room for another CPU's BLAS rounding"
_FP32 = "fp32 inputs and math against the fp64 golden; k=4 leaves room for another summation order than numpy32's"
_BF16 = ("bf16 inputs (2^-9 relative rounding) against the fp64 golden; k=2.5 over torch-bf16 and no floor, so the "
         "bound stays under 3x the baseline's error on the same tensor")

_BY_HAND: dict[tuple[str, str, str], Gate] = {
    # defaults per precision
    ("*", "*", "fp64"): Gate(1e-12, None, 0.0, 1e-12, 1e-9, _FP64),
    ("*", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3, _FP32 + "; cap = ~1e-7/op over <=100 ops"),
    ("*", "*", "bf16"): Gate(3e-2, 2.5, 0.0, 1e-2, 5e-2, _BF16 + "; cap = a few bf16 ulps (2^-8) of error"),
    # the CUDA kernels' blocks at fp32 (the kernels' GPU tests apply these caps too, against float64): the
    # default numbers, each with what bounds that kernel's error
    ("kda_decode", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; fp32 state and math: decay, two K-term column sums and an update "
                                      "per step, ~1e-7 per op; o and the new state both checked"),
    ("rmsnorm", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                   _FP32 + "; a sum of D <= 7168 squares (tree + serial, ~sqrt(D) ulp) and one "
                                   "exact sqrt"),
    ("situ_glu", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                    _FP32 + "; elementwise with exact exp/tanh (a few ulp each), no reduction"),
    ("attnres_mix", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                       _FP32 + "; RMS norms over D, a softmax over <= 9 sources and a weighted sum"),
    ("mxfp4_gemv", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; MXFP4 codes and scales decode exactly in fp32; fp32 accumulation "
                                      "over K <= 7168"),
    # KDA: the recurrence carries state over T steps; the chunked prefill uses a WY/UT triangular solve
    ("kda_prefill", "*", "fp64"): Gate(1e-10, None, 0.0, 1e-10, 1e-8,
                                       _FP64 + "; chunked WY solve over T<=65 steps reorders sums"),
    ("kda_prefill", "*", "fp32"): Gate(1e-4, 4.0, 1e-6, 1e-4, 1e-2,
                                       _FP32 + "; T<=65 recurrent steps plus a triangular solve per chunk"),
    ("kda_prefill", "*", "bf16"): Gate(5e-2, 2.5, 0.0, 2e-2, 1e-1,
                                       _BF16 + "; the state sums T<=65 bf16-rounded rank-1 updates"),
    # MLA: softmax over up to ~200 cached rows of width 576 in fp32
    ("mla_decode", "*", "fp32"): Gate(2e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; dot products of length 576 and a softmax over <=200 rows"),
    # MXFP4: weights are exact codes x powers of two; only x and the accumulation are rounded
    ("mxfp4_gemv", "*", "bf16"): Gate(2e-2, 2.5, 0.0, 1e-2, 5e-2,
                                      _BF16 + "; weights exact (E2M1 x 2^e), x rounded to bf16"),
    # LatentMoE composite: router + 2 MXFP4 GEMVs per expert + RMSNorm + shared MLP
    ("latent_moe", "*", "fp32"): Gate(2e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; composite of ~10 steps (router, experts, norm, shared MLP)"),
    ("latent_moe", "*", "bf16"): Gate(5e-2, 2.5, 0.0, 2e-2, 1e-1,
                                      _BF16 + "; composite of ~10 steps, each rounding its inputs"),
}

_TRACE_FP32_WHY = ("whole float32 host graph with the backend's cores: numpy32 measured 8e-7 (layerwise) and 1e-5 "
                   "(free run: 7 layers x 6 steps of accumulation); k=4 over numpy32, cap 10x the measured worst")
_TRACE_BF16_WHY = ("bf16 host graph with router and argmax near-ties teacher-forced: k=2.5 over torch-bf16, no floor "
                   "(under 3x the baseline's error on the same tensor); cap 3x torch-bf16's worst, {:.3g} ({})")
_TOKEN_WHY = ("greedy token ids compare as exact integers (these numbers are unused); a flip fails unless the "
              "reference's argmax margin is below the precision's budget (then the step is teacher-forced and counted)")

# model config -> trace mode -> (that mode's measurements: block -> ((numpy32 worst, tensor), (torch-bf16 worst,
# tensor)), which traces were measured); '*': every config without its own rows. A trace tensor looks its rows up
# as '<model>/<mode>/<tensor>' (conformance.cases.traces.TraceKind.gate_tensor), so each cap gates the mode
# it was measured on.
TRACES_BY_MODEL = {"*": {mode: (measured.trace_blocks(mode), measured.TINY_TRACES_WHERE)
                         for mode in measured.TRACE_MODES}}


def trace_rows(model: str, blocks: dict, where: str, mode: str = "*") -> tuple[dict[Key, Gate], dict[Key, Gate]]:
    """(gate rows, baseline rows) for the trace tensors of model config `model` in trace mode `mode` ('*': both).

    blocks: block -> ((numpy32 worst rel RMS, tensor), (torch-bf16 worst rel RMS, tensor)) over the gated
    tensors of those traces; where: which traces were measured. fp32: k=4 over numpy32, cap 1e-4;
    bf16: k=2.5 over torch-bf16, cap 3x its worst; the baselines themselves: 3x their worst; greedy tokens: exact."""
    pattern = f"{model}/{mode}/step*"
    rows: dict[Key, Gate] = {}
    baseline_rows: dict[Key, Gate] = {}
    for block, ((fp32, at32), (bf16, at16)) in blocks.items():
        rows[(block, pattern, "fp32")] = Gate(1e-4, 4.0, 1e-6, 1e-4, 1e-2, _TRACE_FP32_WHY)
        rows[(block, pattern, "bf16")] = Gate(BASELINE_FACTOR * bf16, 2.5, 0.0, 5e-2, 2e-1,
                                              _TRACE_BF16_WHY.format(bf16, at16))
        baseline_rows[(block, pattern, "fp32")] = baseline_row("fp32", fp32, f"{where} {at32}")
        baseline_rows[(block, pattern, "bf16")] = baseline_row("bf16", bf16, f"{where} {at16}")
    for p in ("fp32", "bf16"):
        rows[("greedy", pattern, p)] = Gate(1e-12, 1.0, 0.0, 0.0, 0.0, _TOKEN_WHY)
    return rows, baseline_rows


def _block_baseline_rows() -> dict[Key, Gate]:
    """The baselines' rows for the block cases: about 3x the worst error each measured on the tiny cases of that
    (block, tensor) with `k3conf run` (CPU, this repository's goldens)."""
    rows: dict[Key, Gate] = {}
    for (block, tensor), (fp32, bf16) in measured.BLOCK_CASES.items():
        rows[(block, tensor, "fp32")] = baseline_row("fp32", *fp32)
        rows[(block, tensor, "bf16")] = baseline_row("bf16", *bf16)
    return rows


# The per-element rule of every baseline-relative row: precision -> (multiple of the baseline's worst element
# error, floor, reason). A whole-tensor rule alone averages one wrong element away (FlashMLA and triton_kernels
# check both).
_FP32_RATIO, _FP32_AT = measured.WORST_ELEMENT_RATIO["fp32"]
_BF16_RATIO, _BF16_AT = measured.WORST_ELEMENT_RATIO["bf16"]
ELEMENT_RULES: dict[str, tuple[float, float, str]] = {
    "fp32": (8.0, 1e-6, f"a built-in fp32 backend's worst element errs at most {_FP32_RATIO:g}x numpy32's ({_FP32_AT});"
                        " 8x leaves room for another summation order, the floor as the rel RMS row's"),
    "bf16": (3.0, 0.0, "every bf16 backend gets the same bf16-rounded inputs as torch-bf16, so its worst element "
                       "is the same rounding: 3x, about the rel RMS row's k=2.5, no floor like that row; a "
                       f"one-element slip errs {_BF16_RATIO:g}x ({_BF16_AT})"),
}


def _with_element_rule(key: Key, gate: Gate) -> Gate:
    """`gate` with its precision's per-element rule, when it is baseline-relative and has none of its own."""
    precision = key[2]
    if gate.k is None or gate.elem_k is not None or precision not in ELEMENT_RULES:
        return gate
    k, floor, why = ELEMENT_RULES[precision]
    return dataclasses.replace(gate, elem_k=k, elem_floor=floor, elem_why=why)


def _tables() -> tuple[dict[Key, Gate], dict[Key, Gate]]:
    """GATES and BASELINE_GATES: the rows by hand, then the block cases' and every model config's trace rows;
    every baseline-relative row carries its precision's per-element rule."""
    gates, baselines = dict(_BY_HAND), _block_baseline_rows()
    for model, modes in TRACES_BY_MODEL.items():
        for mode, (blocks, where) in modes.items():
            rows, baseline_rows = trace_rows(model, blocks, where, mode)
            gates.update(rows)
            baselines.update(baseline_rows)
    return {key: _with_element_rule(key, gate) for key, gate in gates.items()}, baselines


# The baselines gated against themselves would always pass, so they are judged by BASELINE_GATES: absolute rows,
# each about 3x the worst error the baseline measured on that (block, tensor), the measurement in its reason.
_GATES, _BASELINE_GATES = _tables()
GATES: Mapping[Key, Gate] = ReadOnlyTable("GATES", _GATES)
BASELINE_GATES: Mapping[Key, Gate] = ReadOnlyTable("BASELINE_GATES", _BASELINE_GATES)

# Discrete choices inside the model traces (conformance/cases/traces.py): where the float64 golden's margin is below
# the budget of the backend's precision, the backend is given the golden's choice (teacher-forced, counted).
# Absent (fp64, fp32): no forcing, every choice must match. Router margins are in selection-score units
# (sigmoid + bias), argmax margins in logits. precision -> choice -> (budget, reason).
_MARGIN_BUDGETS: dict[str, dict[str, tuple[float, str]]] = {
    "bf16": {
        "router": (1.5e-2, "torch-bf16 moves the selection scores by at most 4.5e-3 on the layerwise tiny trace; "
                           "3x that (the golden's smallest router margin there is 2.1e-4)"),
        "argmax": (3.5e-2, "torch-bf16 moves the logits by at most 1.2e-2 on the layerwise tiny trace; 3x that "
                           "(the golden's step-1 margin is 1.2e-3: a near-tie at bf16, far from one at fp32)"),
    },
}

MARGIN_BUDGETS: Mapping[str, Mapping[str, tuple[float, str]]] = ReadOnlyTable(
    "MARGIN_BUDGETS", {p: ReadOnlyTable(f"MARGIN_BUDGETS[{p!r}]", budgets) for p, budgets in _MARGIN_BUDGETS.items()})


# (block, backend) -> (target bw_ratio or None, target time_ratio or None, reason). Absent = report only.
SPEED_TARGETS: Mapping[tuple[str, str], tuple[float | None, float | None, str]] = ReadOnlyTable("SPEED_TARGETS", {})
