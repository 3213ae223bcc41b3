"""The gate table, built here and only here from data: the rows written by hand with their reasons, the rows
derived from the baselines' measured errors (conformance.judge.measured), the near-tie budgets and the speed
targets. conformance.judge.gates looks rows up in these tables; nothing else adds to them.

Every table is read-only once built (ReadOnlyTable): a backend is judged by these rows, so code loaded with a
backend cannot edit them; an attempt raises TypeError naming the table.

Look-up keys are (block, tensor, precision); a tensor may be a glob pattern (the model traces' rows are
'<model>/<mode>/step*', looked up by '<model>/<mode>/<tensor>', with '*/<mode>/step*' the rows every model config
starts from). A row derived from a measurement holds on the shapes it was measured on, and only there: its tensor
is qualified by that shape set, '<set>:<tensor>' (gate_row.qualified), so a case of set X finds X's measured rows
and never another set's. The rows written by hand gate every set; where a set has measurements, each hand cap is
checked at build time to lie above the baseline's measured worst there (hand_caps_below_measurements), and its
reason names those sets.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

from conformance.judge import measured
from conformance.judge.bf16_rules import BIAS_RULES, FREE_MARGIN_BUDGETS, MARGIN_BUDGETS
from conformance.judge.gate_row import (
    BASELINE,
    BASELINE_FACTOR,
    Gate,
    ReadOnlyTable,
    baseline_row,
    lookup,
    qualified,
)

Key = tuple[str, str, str]


_FP64 = "numpy64 = the generator's own float64 code, exact by construction; room for another CPU's BLAS rounding"
_FP32 = "fp32 inputs and math against the fp64 golden; k=4 leaves room for another summation order than numpy32's"
_BF16 = ("bf16 inputs (2^-8 relative rounding: 8 significant bits) against the fp64 golden; k=2.5 over torch-bf16 "
         "and no floor, so the bound stays under 3x the baseline's error on the same tensor")

_BY_HAND: dict[tuple[str, str, str], Gate] = {
    # defaults per precision
    ("*", "*", "fp64"): Gate(1e-12, None, 0.0, 1e-12, 1e-9, _FP64),
    ("*", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3, _FP32 + "; cap = ~100 fp32 roundings (~1e-7 each)"),
    ("*", "*", "bf16"): Gate(3e-2, 2.5, 0.0, 1e-2, 5e-2, _BF16 + "; cap = a few bf16 ulps (2^-8) of error"),
    # the CUDA kernels' blocks at fp32 (the kernels' GPU tests apply these caps too, against float64): the
    # default numbers, each with what bounds that kernel's error
    ("kda_decode", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; fp32 state and math: decay, two K-term column sums and an update "
                                      "per step, ~1e-7 per op; o and the new state both checked"),
    ("rmsnorm", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                   _FP32 + "; a sum of D <= 7168 squares (K3's hidden size, the widest norm; tree + "
                                   "serial, ~sqrt(D) ulp) and one exact sqrt"),
    ("situ_glu", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                    _FP32 + "; elementwise with exact exp/tanh (a few ulp each), no reduction"),
    ("attnres_mix", "*", "fp32"): Gate(1e-5, 4.0, 3e-6, 1e-5, 1e-3,
                                       _FP32 + "; RMS norms over D, a softmax over the sources and a weighted sum. "
                                       "Floor 3e-6: the softmax's logits (|16|-|36|) carry their sums' rounding into "
                                       "every weight, so two correct fp32 forms' errors are two draws of that noise "
                                       "(numpy32's own error reached 5.5e-6 over 20,000 fresh draws of "
                                       "attnres_mix/S9-T2-D256, torch's 3.9e-6); torch's exceeded 4 x numpy32's by "
                                       "up to 1.8e-6, so the old floor 1e-6 failed a correct torch on 23 of them"),
    ("mxfp4_gemv", "*", "fp32"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; MXFP4 codes and scales decode exactly in fp32; fp32 accumulation "
                                      "over K <= 7168 (K3's hidden size, the widest input of any MXFP4 matrix)"),
    # KDA: the recurrence carries state over T steps; the chunked prefill uses a WY/UT triangular solve
    ("kda_prefill", "*", "fp64"): Gate(1e-10, None, 0.0, 1e-10, 1e-8,
                                       _FP64 + "; the chunked WY solve reorders the T steps' sums (torch64 measured "
                                       "3e-15 at T=65 on tiny, 2.7e-15 at T=257 on small)"),
    ("kda_prefill", "*", "fp32"): Gate(1e-4, 4.0, 1e-6, 1e-4, 1e-2,
                                       _FP32 + "; T recurrent steps plus a triangular solve per chunk"),
    ("kda_prefill", "*", "bf16"): Gate(5e-2, 2.5, 0.0, 2e-2, 1e-1,
                                       _BF16 + "; the state sums T bf16-rounded rank-1 updates"),
    # MLA: a softmax over the context's cached rows of width kv_lora + rope in fp32
    ("mla_decode", "*", "fp32"): Gate(2e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; dot products of length <= 576 (K3's kv_lora 512 + rope 64) and a "
                                      "softmax over the context's rows"),
    # MXFP4: weights are exact codes x powers of two; only x and the accumulation are rounded
    ("mxfp4_gemv", "*", "bf16"): Gate(2e-2, 2.5, 0.0, 1e-2, 5e-2,
                                      _BF16 + "; weights exact (E2M1 x 2^e), x rounded to bf16. torch-bf16 returns "
                                      "y as its fp32 sum, while a kernel may store y in bf16 (docs/spec.md 1.4): "
                                      "rounding to the nearest bf16 moves each element by at most 2^-8 of itself, "
                                      "allowed in both rules (out_round); without it a correct bf16-output kernel "
                                      "failed 2.5x torch-bf16 on 1 of 30 fresh draws of mxfp4_gemv/N1-K32 "
                                      "(one output: its rounding is not averaged)", out_round=2.0 ** -8),
    # the router's outputs come from its fp32 logits and fp32 bias (spec 1.4: router scores in fp32), so at bf16
    # they carry fp32 rounding only: a ratio of two fp32 roundings with no floor is no bf16 rule
    ("moe_route", "weights", "bf16"): Gate(1e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                           "the routing weights from fp32 logits and bias: fp32 math at every "
                                           "precision; the fp32 rule (k=4 over torch-bf16's fp32 sums, floor 1e-6). "
                                           "With bf16's k=2.5 and no floor, a correct fp32 sigmoid failed on 1 of "
                                           "30 fresh draws (moe_route/T3-E13-k1-norenorm-s2.5: 6.6e-8 against "
                                           "2.5 x 2.4e-8)", elem_k=8.0, elem_floor=1e-6,
                                           elem_why="the fp32 per-element rule (fp32 math on fp32 inputs)"),
    # LatentMoE composite: router + 2 MXFP4 GEMVs per expert + RMSNorm + shared MLP
    ("latent_moe", "*", "fp32"): Gate(2e-5, 4.0, 1e-6, 1e-5, 1e-3,
                                      _FP32 + "; composite of ~10 steps (router, experts, norm, shared MLP)"),
    ("latent_moe", "*", "bf16"): Gate(5e-2, 2.5, 0.0, 2e-2, 1e-1,
                                      _BF16 + "; composite of ~10 steps, each rounding its inputs"),
}


_TRACE_FP32_CAP = 1e-4
_TRACE_FP32_WHY = ("whole float32 host graph with the backend's cores: numpy32 measured at most {:.3g} on {} (its {} "
                   "traces; the free run accumulates over every layer and step); cap 1e-4 above every such measurement")
_TRACE_BF16_WHY = ("bf16 host graph with router and argmax near-ties teacher-forced, no floor; cap {:.3g}x "
                   "torch-bf16's worst, {:.3g} on {} ({}); {}")


_TOKEN_WHY = ("greedy token ids compare as exact integers (these numbers are unused); a flip fails unless the "
              "reference's argmax margin is below the precision's budget (then the step is teacher-forced and counted)")


def _trace_multiples(precision: str, mode: str, model: str) -> tuple[float, float, str]:
    """(k, elem_k, why) of the trace rows of `model` ('*': the set's shared rows) at `precision` in `mode` ('*': both
    modes' rows): 1.5x the largest multiple of the baseline's error (relative RMS; worst element) a correct
    implementation showed on the trace over many synthetic models (measured.TRACE_SPREAD), never below the blocks'
    own k and elem_k; where none is measured (the blocks' multiples held), those."""
    least_k = 2.5 if precision == "bf16" else 4.0
    least_elem = ELEMENT_RULES[precision][0]
    modes = measured.TRACE_MODES if mode == "*" else (mode,)
    spread = measured.TRACE_SPREAD.get(model, measured.TRACE_SPREAD["*"])   # a model not measured: the shared rows'
    seen = [e for e in (spread[precision][m] for m in modes) if e is not None]
    if not seen:
        return least_k, least_elem, (f"the blocks' k and elem_k: they passed every correct {precision} "
                                     f"implementation's tensors of this trace on every model measured "
                                     f"({measured.TRACE_SPREAD_HOW})")
    rel = max((e[0] for e in seen if e[0] is not None), default=None)
    elem = max((e[1] for e in seen if e[1] is not None), default=None)
    at = "; ".join(e[2] for e in seen)
    k = least_k if rel is None else max(least_k, round(1.5 * rel, 1))
    elem_k = least_elem if elem is None else max(least_elem, round(1.5 * elem, 1))
    k_text = (f"k = {least_k:g}, the blocks' (it held on every model)" if rel is None else
              f"k = the larger of {least_k:g} and 1.5x the {rel:g}x of {BASELINE[precision]}'s error a correct "
              f"{precision} implementation reached on this trace over many models")
    elem_text = (f"elem_k = {least_elem:g}, the blocks'" if elem is None else
                 f"elem_k the larger of {least_elem:g} and 1.5x the {elem:g}x it reached on the worst element")
    return k, elem_k, f"{k_text}, {elem_text} ({at}; {measured.TRACE_SPREAD_HOW})"


# shape set -> model config -> trace mode -> (that mode's measurements: block -> ((numpy32 worst, tensor),
# (torch-bf16 worst, tensor)), which traces were measured); model '*': every model of that set without its own.
# A trace tensor looks its rows up as '<set>:<model>/<mode>/<tensor>' (TraceKind.gate_tensor, qualified by the
# case's set), so each cap gates the set and the trace mode it was measured on.
TRACES_BY_SET = measured.TRACES


def trace_rows(shape_set: str, model: str, blocks: dict, where: str,
               mode: str = "*") -> tuple[dict[Key, Gate], dict[Key, Gate]]:
    """(gate rows, baseline rows) for the trace tensors of model config `model` in trace mode `mode` ('*': both),
    measured on the traces of shape set `shape_set`.

    blocks: block -> ((numpy32 worst rel RMS, tensor), (torch-bf16 worst rel RMS, tensor)) over the gated
    tensors of those traces; where: which traces were measured. fp32: k=4 over numpy32, cap 1e-4;
    bf16: k=2.5 over torch-bf16, cap 3x its worst; the baselines themselves: 3x their worst."""
    pattern = qualified(shape_set, f"{model}/{mode}/step*")
    rows: dict[Key, Gate] = {}
    baseline_rows: dict[Key, Gate] = {}
    worst32 = max((fp32 for (fp32, _), _ in blocks.values()), default=0.0)
    if worst32 > _TRACE_FP32_CAP:
        raise ValueError(f"trace rows of {pattern}: numpy32 measured {worst32:.3g}, above the fp32 trace cap "
                         f"{_TRACE_FP32_CAP:g}; give that set its own cap with a reason")
    fp32_why = _TRACE_FP32_WHY.format(worst32, shape_set, "layerwise and free" if mode == "*" else mode)
    elem32_floor, elem16_floor = ELEMENT_RULES["fp32"][1], ELEMENT_RULES["bf16"][1]
    k32, elem32, why32 = _trace_multiples("fp32", mode, model)
    k16, elem16, why16 = _trace_multiples("bf16", mode, model)
    for block, ((fp32, at32), (bf16, at16)) in blocks.items():
        rows[(block, pattern, "fp32")] = Gate(_TRACE_FP32_CAP, k32, 1e-6, 1e-4, 1e-2, f"{fp32_why}; {why32}",
                                              elem_k=elem32, elem_floor=elem32_floor, elem_why=why32)
        cap16 = max(BASELINE_FACTOR, k16) * bf16
        rows[(block, pattern, "bf16")] = Gate(cap16, k16, 0.0, 5e-2, 2e-1,
                                              _TRACE_BF16_WHY.format(max(BASELINE_FACTOR, k16), bf16, shape_set,
                                                                     f"{where} {at16}", why16),
                                              elem_k=elem16, elem_floor=elem16_floor, elem_why=why16)
        baseline_rows[(block, pattern, "fp32")] = baseline_row("fp32", fp32, f"{where} {at32}", shape_set)
        baseline_rows[(block, pattern, "bf16")] = baseline_row("bf16", bf16, f"{where} {at16}", shape_set)
    return rows, baseline_rows


def _token_rows() -> dict[Key, Gate]:
    """The greedy tokens of every trace, on every shape set: exact integers, nothing measured."""
    return {("greedy", f"*/{mode}/step*", p): Gate(1e-12, 1.0, 0.0, 0.0, 0.0, _TOKEN_WHY)
            for mode in measured.TRACE_MODES for p in ("fp32", "bf16")}


def _block_baseline_rows() -> dict[Key, Gate]:
    """The baselines' rows for the block cases: about 3x the worst error each measured on the cases of that
    (block, tensor) of one shape set with `k3conf run` (CPU), keyed '<set>:<tensor>'."""
    rows: dict[Key, Gate] = {}
    for shape_set, cases in measured.BLOCK_CASES.items():
        for (block, tensor), (fp32, bf16) in cases.items():
            rows[(block, qualified(shape_set, tensor), "fp32")] = baseline_row("fp32", *fp32, shape_set)
            rows[(block, qualified(shape_set, tensor), "bf16")] = baseline_row("bf16", *bf16, shape_set)
    return rows


# shape set -> the case families measured on it ('blocks': the per-block and latent_moe cases, 'traces'); on a set
# without a family's measurements that family's cases are judged with no cap (conformance.judge.gates.judge)
MEASURED: Mapping[str, frozenset[str]] = ReadOnlyTable("MEASURED", {
    s: frozenset(f for f, table in (("blocks", measured.BLOCK_CASES), ("traces", TRACES_BY_SET)) if s in table)
    for s in sorted({*measured.BLOCK_CASES, *TRACES_BY_SET})})


# The per-element rule of every baseline-relative row: precision -> (multiple of the baseline's worst element
# error, floor, reason). A whole-tensor rule alone averages one wrong element away (FlashMLA and triton_kernels
# check both).
_FP32_RATIO, _FP32_AT = measured.WORST_ELEMENT_RATIO["fp32"]
_BF16_RATIO, _BF16_AT = measured.WORST_ELEMENT_RATIO["bf16"]
_FP32_K = 8.0


def _seen(sets) -> str:
    return "; ".join(f"{measured.ELEMENT_RATIO_BY_SET[s][0]:g}x on {s} ({measured.ELEMENT_RATIO_BY_SET[s][1]})"
                     for s in sets)


# shape set -> precision -> that set's own per-element rule, where the shared one does not hold there
_K3_FP32_WHY = ("a built-in fp32 backend's worst element errs at most {} numpy32's: K3's outlier channels put the "
                "worst element on one large value, where another summation order's few ulps of it show as a large "
                "multiple; about 3x that, and an element read wrong errs O(1)")
ELEMENT_RULES_BY_SET: Mapping[str, Mapping[str, tuple[float, float, str]]] = ReadOnlyTable("ELEMENT_RULES_BY_SET", {
    s: ReadOnlyTable(f"ELEMENT_RULES_BY_SET[{s!r}]", {"fp32": (25.0, 1e-6, _K3_FP32_WHY.format(_seen([s])))})
    for s in ("k3", "k3-tp8")})
ELEMENT_RULES: Mapping[str, tuple[float, float, str]] = ReadOnlyTable("ELEMENT_RULES", {
    "fp32": (_FP32_K, 1e-6, "a built-in fp32 backend's worst element errs at most this multiple of numpy32's: "
                            + _seen(s for s in measured.ELEMENT_RATIO_BY_SET if "fp32" not in
                                    ELEMENT_RULES_BY_SET.get(s, {}))
                            + "; 8x leaves room for another summation order, the floor as the rel RMS row's (own "
                            f"rules on {', '.join(sorted(ELEMENT_RULES_BY_SET))}: ELEMENT_RULES_BY_SET)"),
    "bf16": (3.0, 0.0, "every bf16 backend gets the same bf16-rounded inputs as torch-bf16, so its worst element "
                       "is the same rounding: 3x, about the rel RMS row's k=2.5, no floor like that row; a "
                       f"one-element slip errs {_BF16_RATIO:g}x ({_BF16_AT}, tiny)"),
})


# tiny's own variants of three fp32 rows, measured on fresh draws (the shared rows were measured on the goldens
# alone): torch on 7,000 fresh seeds of the tiny cases, on which the shared rows failed it 68 times, and cuda-emu on
# 500 (once); `python tools/fresh_margins.py --seeds A:B --dist` prints these numbers
_FRESH_TINY = "over fresh seeds 1000:1500, 2000:2500, 3000:9000 (torch) and 1000:1500 (cuda-emu)"
_SHARED_K, _SHARED_FLOOR, _ = ELEMENT_RULES["fp32"]
_BY_HAND.update({
    ("kda_prefill", "tiny:*", "fp32"): dataclasses.replace(
        _BY_HAND[("kda_prefill", "*", "fp32")], floor=2.6e-6,
        reason=_BY_HAND[("kda_prefill", "*", "fp32")].reason + f"; tiny: {_FRESH_TINY}, torch's o exceeded 4 x "
        "numpy32's by up to 1.72e-6 (kda_prefill/B2-T63-H2-K16, seed 4949), past the floor 1e-6 on 10 seeds: floor "
        "2.6e-6, 1.5x that",
        elem_k=22.0, elem_floor=_SHARED_FLOOR,
        elem_why=f"{_FRESH_TINY}, torch's worst element of kda_prefill o reached 14.9x numpy32's (+1e-6; "
                 "B2-T63-H2-K16, seed 6033; 10.7x at seed 3753), past the shared 8x on 39 seeds of B2-T63-H2-K16 "
                 "and 2 of B1-T65-H3-K32: 22x, 1.5x the worst; an element read wrong errs O(1)"),
    ("mxfp4_gemv", "tiny:*", "fp32"): dataclasses.replace(
        _BY_HAND[("mxfp4_gemv", "*", "fp32")], abs_floor=7e-6,
        reason=_BY_HAND[("mxfp4_gemv", "*", "fp32")].reason + "; tiny: abs floor 7e-6 (y's own units). "
        "mxfp4_gemv/N1-K32's one output is a 32-term dot product that cancels (sum |w x| / |y| up to 29,000): each "
        "fp32 form errs <= 2.25 eps x sum |w x| whatever |y| is, so its relative error is any size and two forms' "
        "are two draws of it (torch's reached 32x numpy32's). " + _FRESH_TINY + ", k=4 failed 16 + 1 draws, and "
        "their error exceeded 4 x numpy32's + 1e-6 of |y| by at most 4.5e-6 absolute (torch, seed 7831; sum |w x| "
        "166, |y| 0.97); 7e-6, 1.5x that, is 1e-7 of RMS(y) on N113-K64 and far below a bf16 accumulation's "
        "2e-3 x sum |w x| (>= 0.86 on every draw)"),
    ("attnres_mix", "tiny:*", "fp32"): dataclasses.replace(
        _BY_HAND[("attnres_mix", "*", "fp32")],
        elem_k=_SHARED_K, elem_floor=6.3e-6,
        elem_why=f"{_FRESH_TINY}, torch's worst element of attnres_mix/S9-T2-D256 exceeded 8 x numpy32's by up to "
                 "4.2e-6 (seed 2067; the multiple reached 17.5x), past the floor 1e-6 on 11 seeds, cuda-emu's by "
                 "2.6e-7: the softmax's logits make two correct fp32 forms' errors two draws of one noise (as the "
                 "rel RMS floor 3e-6 says); floor 6.3e-6, 1.5x the worst, multiple 8 as shared"),
})


def element_rule(precision: str, shape_set: str | None) -> tuple[float, float, str] | None:
    """The per-element rule of a baseline-relative row at `precision` on `shape_set`: the set's own, else the
    shared one (None: no such rule at that precision)."""
    own = ELEMENT_RULES_BY_SET.get(shape_set or "", {})
    return own.get(precision, ELEMENT_RULES.get(precision))


def element_rules_below_measurements() -> list[str]:
    """Every set whose fp32 per-element multiple does not lie above the worst element ratio measured there."""
    bad = []
    for shape_set, (ratio, where) in measured.ELEMENT_RATIO_BY_SET.items():
        rule = element_rule("fp32", shape_set)
        if rule is None or rule[0] <= ratio:
            bad.append(f"{shape_set}: fp32 multiple {rule and rule[0]} <= {ratio:g} measured ({where})")
    return bad


def _with_element_rule(key: Key, gate: Gate) -> Gate:
    """`gate` with its precision's per-element rule, when it is baseline-relative and has none of its own."""
    precision = key[2]
    if gate.k is None or gate.elem_k is not None or precision not in ELEMENT_RULES:
        return gate
    k, floor, why = ELEMENT_RULES[precision]
    return dataclasses.replace(gate, elem_k=k, elem_floor=floor, elem_why=why)


def _hand_row(key: Key, gate: Gate) -> Gate:
    """A hand row with the shape sets it was checked on in its reason: below fp64 its cap must lie above the
    baseline's measured worst on every set with block measurements (hand_caps_below_measurements)."""
    if key[2] == "fp64":
        return dataclasses.replace(gate, reason=gate.reason + "; not a measurement: the same on every shape set")
    if ":" in key[1]:   # a set's own variant of a hand row
        sets = key[1].split(":", 1)[0]
    else:
        sets = ", ".join(sorted(s for s, families in MEASURED.items() if "blocks" in families))
    return dataclasses.replace(gate, reason=gate.reason + f"; cap above the baseline's measured worst on {sets} "
                                                          "(no cap applies on a set not measured)")


def hand_caps_below_measurements(hand: Mapping[Key, Gate], block_cases: Mapping) -> list[str]:
    """Every (set, block, tensor, precision) whose hand cap lies below what the baseline measured there: a kernel
    exactly as good as the baseline would fail that cap. Empty when every hand cap holds where it is checked."""
    bad = []
    for shape_set, cases in block_cases.items():
        for (block, tensor), worsts in cases.items():
            for precision, (worst, where) in zip(("fp32", "bf16"), worsts, strict=True):
                key, gate = lookup(hand, block, tensor, precision, shape_set)
                if gate is not None and gate.cap < worst:
                    bad.append(f"{key} cap {gate.cap:.3g} < {worst:.3g} measured on {shape_set} ({where})")
    return bad


def _tables() -> tuple[dict[Key, Gate], dict[Key, Gate]]:
    """GATES and BASELINE_GATES: the rows by hand (checked against every set's measurements), then the block
    cases' and every shape set's model traces' rows; every baseline-relative row carries its precision's
    per-element rule."""
    below = hand_caps_below_measurements(_BY_HAND, measured.BLOCK_CASES) + element_rules_below_measurements()
    if below:
        raise ValueError("hand gate rows below a baseline's measured worst (give the row a per-set variant "
                         f"(block, '<set>:*', precision), or the set an ELEMENT_RULES_BY_SET entry, with its "
                         f"reason): {'; '.join(below)}")
    gates, baselines = {key: _hand_row(key, g) for key, g in _BY_HAND.items()}, _block_baseline_rows()
    gates.update(_token_rows())
    for shape_set, models in TRACES_BY_SET.items():
        for model, modes in models.items():
            for mode, (blocks, where) in modes.items():
                rows, baseline_rows = trace_rows(shape_set, model, blocks, where, mode)
                gates.update(rows)
                baselines.update(baseline_rows)
    return {key: _with_element_rule(key, gate) for key, gate in gates.items()}, baselines


# The baselines gated against themselves would always pass, so they are judged by BASELINE_GATES: absolute rows,
# each about 3x the worst error the baseline measured on that (block, tensor) of one shape set, the measurement in
# its reason.
_GATES, _BASELINE_GATES = _tables()
GATES: Mapping[Key, Gate] = ReadOnlyTable("GATES", _GATES)
BASELINE_GATES: Mapping[Key, Gate] = ReadOnlyTable("BASELINE_GATES", _BASELINE_GATES)

# (block, backend) -> (target bw_ratio or None, target time_ratio or None, reason). Absent = report only.
SPEED_TARGETS: Mapping[tuple[str, str], tuple[float | None, float | None, str]] = ReadOnlyTable("SPEED_TARGETS", {})

TABLES = {"GATES": GATES, "BASELINE_GATES": BASELINE_GATES, "MARGIN_BUDGETS": MARGIN_BUDGETS,
          "FREE_MARGIN_BUDGETS": FREE_MARGIN_BUDGETS, "BIAS_RULES": BIAS_RULES,
          "SPEED_TARGETS": SPEED_TARGETS, "MEASURED": MEASURED, "ELEMENT_RULES": ELEMENT_RULES,
          "ELEMENT_RULES_BY_SET": ELEMENT_RULES_BY_SET}


def _plain(value: Any) -> Any:
    """A table's value as plain data, nested tables read through (a row's repr holds every field)."""
    if isinstance(value, Mapping):
        return sorted((repr(k), _plain(v)) for k, v in value.items())
    return repr(value)


def table_digest() -> str:
    """sha256 of every table's keys and rows (every field of every row): what the verdicts are read from."""
    return hashlib.sha256(repr([(name, _plain(t)) for name, t in TABLES.items()]).encode()).hexdigest()


# The digest as built. Nothing but the package's own code runs in the run's process (kernels run in workers), so
# the tables cannot change during a run; a run compares the digest again before it reports (gates.tables_changed)
# all the same, a second line behind the process boundary.
DIGEST = table_digest()
