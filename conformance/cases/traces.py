"""The `trace` kind: the whole host graph of a preset model with one backend's cores swapped in.

A trace prefills a 7-token prompt and then decodes 5 tokens greedily (6 steps) on a model config (the
case's `model` parameter: `tiny`, or any K3Config preset; add a config with `trace_cases`). Two modes:

- `layerwise`: every layer of every step is fed its *golden* input (the AttnRes state: completed blocks +
  prefix, and that layer's cache before the step), so an error cannot leak from one layer into the next;
  every tensor is gated and the first failing one names the step, the layer and the block.
- `free`: the backend runs freely (fed the golden tokens), so the per-layer errors show how error
  accumulates through depth and across steps. Only the logits and the greedy tokens are gated; the
  intermediate tensors are reported (the layerwise trace gates them).

Per layer and step the outputs are, in the order they are computed (conformance.cases.trace_names: the slot
number keeps name order = compute order, which is how the runner picks the first failure): 1_h (AttnRes mix
for the mixer), 2_x_mixer (input norm), 3_a (KDA / MLA output), 4_m (AttnRes mix for the MLP), 5_x_mlp (post
norm), 6_f (dense SiTU MLP or LatentMoE), 7_cache (the layer's cache after the step: KDA recurrent state or the
MLA rows appended). Per step: `logits` and `token` (the greedy token id, int64, compared exactly).

Discrete choices. The golden stores, per step, the argmax margin (top logit minus the runner-up) and, per MoE
layer and step, the router's choice and margin (the k-th minus the (k+1)-th selection score). The generator
refuses a golden whose margin is below TIE_MARGIN (a tie would make the golden's choice arbitrary). Where a
margin is below the precision's budget (gate_table.MARGIN_BUDGETS; zero at fp64/fp32) the backend is given the
golden's choice, a teacher-forced step that the report counts; elsewhere a flipped token fails and is named
(step, expected id, found id, the reference's margin), and a flipped route shows in its layer's MoE output.

The notes of a result list every core that ran k3ref's reference instead of the backend's own, and why:
not a kernel core of that backend, or an UnsupportedShape fallback (a kernel built for K3's head_dim 128
inside a toy model). A trace where no kernel of the backend ran at all is n/a.

The same two traces run on `k3geom` (K3's per-head geometry at toy counts, `trace/k3geom/*`), where every
CUDA kernel is inside its shape limits, so the kernels run inside a real layer instead of falling back. Its
KDA states (128 x 128 per head) dominate the golden size, so it prefills 3 tokens and decodes 1: the case
params `prompt` and `decode` (the lengths, default 7 and 5) say so and are stored in the golden's kwargs.
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from conformance.backends.protocol import WholeModelBackend
from conformance.backends.torch_model import verify_trace_golden
from conformance.cases.engine_routes import HOST_CORES, TRACE_CORES, route_notes, through_engine
from conformance.cases.inputs import cast_weights
from conformance.cases.protocol import Case, Content, Evaluation, KindBase, RunInfo, Timed, Timer
from conformance.cases.trace_names import TraceName
from conformance.cases.trace_run import (
    DECODE_STEPS,
    PROMPT,
    GoldenFeed,
    RouterTap,
    Stepper,
    argmax_margin,
    check_forced,
    compute_dtype,
    forcing_budgets,
    guard_kernels,
)
from conformance.golden.errors import GoldenError
from conformance.judge import gates
from k3ref.config import K3Config
from k3ref.cores import CORE_NAMES, reference_cores
from k3ref.cpu_forward import K3CpuModel
from k3ref.greedy import greedy_decode
from k3ref.weights import synthetic_weights

WEIGHT_SEED = 7
TIMED_TRACES = 3   # timed runs of a whole model's free trace (after an untimed warm-up run), each run's outputs checked
# A golden whose router or argmax margin is below these sits on a tie: its choice would be arbitrary and a
# float32 backend could flip it. Router margins are in selection-score units (sigmoid + bias, ~0.1 apart),
# argmax margins in logits; float32 moves either by ~1e-6 on these traces, so 1e-4 leaves 100x.
TIE_MARGIN = {"router": 1e-4, "argmax": 1e-4}
# The slot of a per-layer tensor -> the block it belongs to (3: the mixer, 6: the MLP, decided per layer)
_SLOT_BLOCKS = {1: "attnres_mix", 4: "attnres_mix", 2: "rmsnorm", 5: "rmsnorm"}


def model_name(case: Case) -> str:
    """The preset a trace case runs: its `model` param, else its case set's config."""
    return case.params.get("model", case.config)


def trace_cases(model: str, case_set: str = "tiny", prompt: int = len(PROMPT),
                decode: int = DECODE_STEPS) -> list[tuple[str, dict]]:
    """The layerwise and free trace cases of model config `model` (a K3Config preset) in `case_set`, prefilling
    the first `prompt` tokens of PROMPT and decoding `decode` more: `trace/[<model>/]<mode>-P<prompt>-D<decode>`."""
    if not 1 <= prompt <= len(PROMPT) or decode < 0:
        raise ValueError(f"trace_cases: expected 1 <= prompt <= {len(PROMPT)} and decode >= 0, "
                         f"found prompt={prompt}, decode={decode}")
    tag = "" if model == case_set else f"{model}/"
    lengths = {} if (prompt, decode) == (len(PROMPT), DECODE_STEPS) else {"prompt": prompt, "decode": decode}
    return [(f"trace/{tag}{mode}-P{prompt}-D{decode}", {"mode": mode, "model": model, **lengths})
            for mode in ("layerwise", "free")]


def _stored(w) -> np.ndarray:
    """Weights as the golden stores them: float32 (exact: synthetic weights are bf16/F32 values), U8 as is."""
    w = np.asarray(w)
    if w.dtype.kind == "f":
        w32 = w.astype(np.float32)
        assert np.array_equal(w32, w), "synthetic weights must be exact in float32"
        return w32
    return w


class TraceKind(KindBase):
    """`trace/*`: a model config through every layer with the backend's cores (see the module docstring)."""

    name = "trace"
    # case set -> [(case name, params)]; K3's per-head geometry: its 128 x 128 KDA states dominate the golden
    # size, hence the short k3geom trace
    TABLE: dict[str, list[tuple[str, dict]]] = {
        "tiny": trace_cases("tiny") + trace_cases("k3geom", prompt=3, decode=1),
    }

    def cases(self, config: str) -> list[Case]:
        return [Case(n, self.name, config, WEIGHT_SEED, p) for n, p in self.TABLE.get(config, [])]

    def generate(self, case: Case) -> Content:
        cfg = K3Config.preset(model_name(case))
        prompt = list(PROMPT[:case.params.get("prompt", len(PROMPT))])
        decode = case.params.get("decode", DECODE_STEPS)
        weights = synthetic_weights(cfg, case.seed)
        model = K3CpuModel(cfg, weights, np.float64)
        new = greedy_decode(model, prompt, decode).tokens
        tokens = np.array(prompt + new, dtype=np.int64)
        snapshot: dict[str, np.ndarray] = {}
        tap = RouterTap(reference_cores().moe_route)
        outputs = Stepper(model, reference_cores(), tap=tap, prompt_len=len(prompt)).run(tokens, snapshot)
        margins = {f"argmax.step{s}.margin": np.array([argmax_margin(outputs[str(TraceName(s, "logits"))])])
                   for s in range(decode + 1)}
        tensors = {"inputs.tokens": tokens, **{f"weights.{k}": _stored(v) for k, v in weights.items()},
                   **{f"outputs.{k}": v for k, v in outputs.items()},
                   **{f"inter.{k}": v for k, v in {**tap.record, **margins}.items()}}
        if case.params["mode"] == "layerwise":
            tensors.update(snapshot)
        # the wiring first: a disagreement explains a near-tie too (a wrong reading moves the margins)
        verify_trace_golden(case.name, cfg.to_json(), weights, tokens, len(prompt), outputs)
        _refuse_ties(case, tap.record, margins)
        lengths = {k: case.params[k] for k in ("prompt", "decode") if k in case.params}
        return Content(tensors, {"mode": case.params["mode"], "config": model_name(case), **lengths})

    def evaluate(self, case: Case, golden, backend) -> Evaluation:
        golden.require(["inputs.tokens"])
        cfg = K3Config.preset(golden.kwargs.get("config", model_name(case)))
        prompt_len = golden.kwargs.get("prompt", len(PROMPT))
        budgets = forcing_budgets(backend.precision, golden.kwargs["mode"])
        if isinstance(backend, WholeModelBackend):   # it runs the trace by its own wiring
            # it routes its near-ties itself (given the budget) and counts them in its RunInfo
            run = backend.evaluate_trace(case, golden, cfg.to_json(), prompt_len,
                                         router_budget=budgets.get("router", 0.0))
            info = RunInfo(teacher_forced={"router": run.info.teacher_forced.get("router", 0), "argmax": 0})
            outputs = dict(run.outputs)
            judge_tokens(golden, outputs, budgets.get("argmax", 0.0), info)
            evaluation = Evaluation(outputs, forced_notes(backend.precision, info.teacher_forced), info)
        else:
            evaluation = self._evaluate_cores(golden, backend, cfg, prompt_len, budgets)
        check_forced(backend.precision, evaluation.info.teacher_forced)
        return evaluation

    @staticmethod
    def _evaluate_cores(golden, backend, cfg: K3Config, prompt_len: int, budgets: dict[str, float]) -> Evaluation:
        """The trace on the host graph with the backend's cores, each kernel core guarded (fallbacks counted)."""
        p = backend.precision
        model = K3CpuModel(cfg, cast_weights(golden.group("weights"), p), compute_dtype(p))
        inter = golden.group("inter")
        feed = GoldenFeed(inter, p) if golden.kwargs["mode"] == "layerwise" else None
        cores, own, routed = through_engine(backend.cores(), backend.kernel_cores())
        cores, calls, fallbacks = guard_kernels(cores, own)
        tap = RouterTap(cores.moe_route, inter, budgets.get("router", 0.0))
        outputs = Stepper(model, cores, feed, tap, prompt_len).run(golden.group("inputs")["tokens"])
        info = RunInfo(teacher_forced={"router": tap.forced, "argmax": 0})
        judge_tokens(golden, outputs, budgets.get("argmax", 0.0), info)
        notes = [f"{core}: k3ref's reference core ran (not a kernel core of {backend.name})"
                 for core in CORE_NAMES if core in HOST_CORES and core not in own and core not in routed]
        notes += route_notes(routed, backend.name)
        for core, (n, why) in sorted(fallbacks.items()):
            notes.append(f"{core}: k3ref's reference core ran instead on {n} of {calls[core]} call(s) "
                         f"(UnsupportedShape: {why})")
        notes += forced_notes(p, info.teacher_forced)
        notes += backend.run_notes()
        info.kernels_ran = sorted(c for c, n in calls.items() if n > fallbacks.get(c, [0])[0])
        return Evaluation(outputs, notes, info)

    def cores_of(self, case: Case) -> frozenset[str]:
        return TRACE_CORES

    def block_of(self, case: Case, tensor: str) -> str:
        name = TraceName.parse(tensor)
        if name is None or name.layer is None or name.slot is None:
            return "lm_head" if tensor.endswith("logits") else "greedy"
        if name.slot in _SLOT_BLOCKS:
            return _SLOT_BLOCKS[name.slot]
        cfg = K3Config.preset(model_name(case))
        if name.slot == 6:
            return "situ_glu" if cfg.mlp_is_dense(name.layer) else "latent_moe"
        mixer = "mla" if cfg.is_mla(name.layer) else "kda"
        return f"{mixer}_prefill" if name.step == 0 else f"{mixer}_decode"

    def gate_tensor(self, case: Case, tensor: str) -> str:
        """'<model>/<mode>/<tensor>': each cap gates the trace mode it was measured on, and gate rows
        '<model>/<mode>/step*' (one model config's measurements) win over the shared '*/<mode>/step*' rows
        (measured.TRACES, keyed by shape set; the runner qualifies the name as
        '<set>:<model>/<mode>/<tensor>')."""
        return f"{model_name(case)}/{case.params['mode']}/{tensor}"

    def is_gated(self, case: Case, tensor: str) -> bool:
        """The free run gates logits and tokens only; its intermediates are reported."""
        return case.params["mode"] == "layerwise" or tensor.endswith((".logits", ".token"))

    def pooled_baseline(self, case: Case, errs: dict) -> dict:
        """In a free run a per-step tensor's (the logits') baseline error is the worst the baseline made on it over
        the run's steps: the error of one step is one draw of compounded rounding noise. numpy32's logits on
        trace/free-P7-D5 erred 1.2e-6 to 1.0e-5 across its 6 steps (BLAS's sums) and 1.7e-6 to 4.6e-6 (the compiled
        GEMV's), and a bound k x one step's draw failed torch's 9.1e-6 at the step where numpy32 happened to err
        2.0e-6, 4.7x, two steps before it erred 4.6e-6 itself. A layerwise run feeds every layer the golden's
        inputs, so nothing compounds there: its errors stay per tensor.

        Either way without row leans, so the bias rule (gates.BIAS_RULES) never judges a trace: inside a layer a
        tensor's inputs are the backend's own earlier outputs, not the baseline's, and two correct bf16 recipes
        leaned 0.26-0.72 units from torch-bf16 with |t| > 8 on 7-row tensors of 3 of 128 models layer by layer
        (tools/trace_spread.py --seeds 60:200 --trace trace/layerwise-P7-D5). Truncating kernels fail their
        per-block cases and fuzz draws by that rule, and the traces by size."""
        errs = {t: dataclasses.replace(e, row_leans=None) for t, e in errs.items()}
        if case.params["mode"] != "free" or not errs:
            return errs
        per_step = {tensor: name.what for tensor, name in ((t, TraceName.parse(t)) for t in errs)
                    if name is not None and name.layer is None}          # tensor -> what it holds ('logits')
        worst: dict[str, gates.BaselineError] = {}
        for tensor, what in per_step.items():
            err, seen = errs[tensor], worst.get(what)
            worst[what] = err if seen is None else gates.BaselineError(
                max(seen.rel_rms, err.rel_rms),
                None if seen.worst_err is None or err.worst_err is None else max(seen.worst_err, err.worst_err))
        return {**errs, **{tensor: worst[what] for tensor, what in per_step.items()}}

    def timing(self, case: Case, goldens: list, backend, timer: Timer) -> Timed | None:
        """A whole model's free-running trace, timed whole (the cores of a core backend are timed in their own
        cases); the near-tie tokens of each timed run forced as in the judged one. None elsewhere."""
        if not isinstance(backend, WholeModelBackend) or case.params["mode"] != "free":
            return None
        golden = goldens[0]
        cfg = K3Config.preset(golden.kwargs.get("config", model_name(case)))
        budgets = forcing_budgets(backend.precision, golden.kwargs["mode"])
        timed = backend.timed_trace(case, golden, cfg.to_json(), golden.kwargs.get("prompt", len(PROMPT)),
                                    budgets.get("router", 0.0), TIMED_TRACES)
        if timed is None:
            return None
        seconds, runs = timed
        for outputs in runs:
            judge_tokens(golden, outputs, budgets.get("argmax", 0.0), RunInfo(teacher_forced={"argmax": 0}))
        return Timed(statistics.median(seconds), 0, [(0, outputs) for outputs in runs])


def judge_tokens(golden, outputs: dict, budget: float, info: RunInfo) -> None:
    """Greedy tokens: a near-tie step (golden margin < budget) gets the golden's token (teacher-forced);
    any other difference is a flip, recorded with the step, both ids and the reference's margin."""
    inter, ref = golden.group("inter"), golden.group("outputs")
    for name in sorted(k for k in outputs if k.endswith(".token")):
        step = _step_of(name)
        expected, found = int(ref[name][0]), int(outputs[name][0])
        margin = float(np.asarray(inter.get(f"argmax.step{step}.margin", [np.inf]))[0])
        if margin < budget:
            info.teacher_forced["argmax"] += 1
            outputs[name] = np.array([expected], dtype=np.int64)
            if found != expected:
                info.tensor_notes[name] = (f"near-tie at step {step} (margin {margin:.3g} < budget {budget:.3g}):"
                                           f" {found} instead of {expected}, teacher-forced")
        elif found != expected:
            info.flips.append({"step": step, "expected": expected, "found": found, "margin": margin})
            info.tensor_notes[name] = (f"greedy token flip at step {step}: expected {expected}, found {found} "
                                       f"(reference logit margin {margin:.3g})")


def _step_of(name: str) -> int:
    parsed = TraceName.parse(name)
    if parsed is None:
        raise ValueError(f"trace tensor: expected a name like 'step3.token', found {name!r}")
    return parsed.step


def forced_notes(precision: str, forced: dict) -> list[str]:
    """The note counting a result's teacher-forced near-ties (none when nothing was forced)."""
    if not (forced["router"] or forced["argmax"]):
        return []
    return [f"teacher-forced near-ties (margin below the {precision} budget, the golden's choice given): "
            f"{forced['router']} router choice(s), {forced['argmax']} greedy token(s)"]


def _refuse_ties(case: Case, route: dict, argmax: dict) -> None:
    """Raise when a golden choice sits within TIE_MARGIN of another (pick another PROMPT / WEIGHT_SEED)."""
    bad = [f"{k} = {float(np.min(v)):.3g} (router, < {TIE_MARGIN['router']:g})"
           for k, v in route.items() if k.endswith(".margin") and np.min(v) < TIE_MARGIN["router"]]
    bad += [f"{k} = {float(v[0]):.3g} (argmax, < {TIE_MARGIN['argmax']:g})"
            for k, v in argmax.items() if v[0] < TIE_MARGIN["argmax"]]
    if bad:
        raise GoldenError(f"{case.name}: the golden would sit on a near-tie, where its choice is arbitrary: "
                         f"{'; '.join(bad)}. Choose another prompt or weight seed (conformance/cases/traces.py).")

