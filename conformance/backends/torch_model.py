"""The PyTorch K3 model (k3torch) on the judge's side: the `torch-model` backends and the trace-golden check.

- `TorchModelBackend` ("torch-model" fp32, "torch-model-bf16"): a backend that runs whole traces
  (`evaluate_trace`) through k3torch.trace.run_trace; it has no cores, so the per-block cases do not apply.
  At bf16 the golden's near-tie router choices are given to the model by the judge's one rule for them
  (conformance.judge.gates.near_tie_route), as the trace kind does for the core backends, and counted.
- `verify_trace_golden`: run by the trace generator before a golden is written; float64 k3ref and the
  float64 torch model must agree on every tensor within AGREEMENT_RTOL, else TraceDisagreement names the
  first tensor (step, layer, slot) where they do not.

Importing this module does not need torch: k3torch is imported where a model is built.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from conformance.backends.protocol import WholeModelBackend
from conformance.cases.inputs import cast, fp32_kept
from conformance.cases.protocol import Evaluation, RunInfo
from conformance.cases.trace_names import TraceName
from conformance.golden.store import GoldenError
from conformance.judge.gates import near_tie_route
from k3ref.cores import Cores, UnsupportedShape

if TYPE_CHECKING:
    import torch

    from k3torch.modeling_k3 import K3ForCausalLM
    from k3torch.trace import RouteForcing

# Two float64 implementations of one model, through <= 7 layers x 6 steps with different summation orders
# (chunked vs recurrent KDA, absorbed vs expanded MLA, expert sums in another order): measured 3.1e-14
# relative RMS at worst over every trace tensor of `tiny` (step1.layer04.3_a); 1e-10 leaves three orders for
# deeper configs and longer traces. Each wiring mutant of tests/k3torch/test_torch_model.py moves a tensor by > 1e-7.
AGREEMENT_RTOL = 1e-10
INSTALL_HINT = "pip install 'k3-conformance[torch]'"


class TraceDisagreement(GoldenError, ValueError):
    """k3ref and the torch model disagree on a trace tensor (the message names step, layer and tensor); a
    GoldenError, so `k3conf regen` reports it as the reason it wrote nothing."""


# ---------------------------------------------------------------------------------------------------
# comparing two traces
# ---------------------------------------------------------------------------------------------------


def compute_order(name: str) -> tuple[int, int, int, str]:
    """Sort key: the order in which a trace computes its tensors (step, layer, slot; logits before token);
    names that are not trace tensors go last."""
    parsed = TraceName.parse(name)
    if parsed is None:
        return (1 << 30, 0, 0, name)
    if parsed.layer is not None and parsed.slot is not None:
        return (parsed.step, parsed.layer, parsed.slot, name)
    return (parsed.step, 1 << 20, 0 if parsed.what == "logits" else 1, name)


def describe(name: str, config_json: Mapping) -> str:
    """'step1.layer02.3_a' -> 'step 1, layer 2 (MLA layer), tensor 3_a'."""
    parsed = TraceName.parse(name)
    if parsed is None or parsed.layer is None:
        return f"tensor {name}"
    layer = parsed.layer
    lac = config_json.get("linear_attn_config", {})
    full = lac.get("full_attn_layers", config_json.get("full_attn_layers", ()))
    kind = "MLA" if layer + 1 in full else "KDA"
    return f"step {parsed.step}, layer {layer} ({kind} layer), tensor {name.rsplit('.', 1)[1]}"


def first_disagreement(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray],
                       rtol: float = AGREEMENT_RTOL) -> tuple[str, float] | None:
    """(name, relative RMS error) of the first tensor (compute order) where `candidate` is off by > rtol;
    a tensor missing from `candidate` or of another shape is off by inf."""
    for name in sorted(reference, key=compute_order):
        ref = np.asarray(reference[name], dtype=np.float64)
        got = candidate.get(name)
        if got is None or np.shape(got) != ref.shape:
            return name, float("inf")
        den = max(float(np.linalg.norm(ref)), np.finfo(np.float64).tiny)
        err = float(np.linalg.norm(np.asarray(got, dtype=np.float64) - ref) / den)
        if not err <= rtol:
            return name, err
    return None


def verify_trace_golden(label: str, config_json: Mapping, weights: Mapping, tokens, prompt_len: int,
                        outputs: Mapping[str, np.ndarray]) -> None:
    """Raise TraceDisagreement unless the float64 torch model reproduces `outputs` (k3ref's) on `tokens`."""
    try:
        from k3torch.trace import build_model, cpu_threads, run_trace  # noqa: PLC0415 -- optional: k3torch needs torch
        model = build_model(config_json, weights, "fp64")
    except ImportError as e:
        raise TraceDisagreement(f"{label}: cannot check the golden against the torch model ({e}); a trace "
                                "golden is written only when the independent PyTorch model agrees with it: "
                                f"{INSTALL_HINT}") from e
    with cpu_threads(model.device):
        found = first_disagreement(outputs, run_trace(model, tokens, prompt_len))
    if found:
        name, err = found
        raise TraceDisagreement(
            f"{label}: refusing to write: the PyTorch model (k3torch) disagrees with k3ref at "
            f"{describe(name, config_json)}: relative RMS error {err:.3g} > {AGREEMENT_RTOL:g}. One of the two "
            f"reads the wiring differently there; see docs/torch_model.md")


def golden_route_forcing(inter: Mapping[str, np.ndarray], budget: float) -> RouteForcing:
    """A RouteForcing that gives each MoE layer the golden's experts where the golden's router margin is below
    `budget` (gates.near_tie_route: the same rule as for the core backends)."""
    from k3torch.trace import RouteForcing  # noqa: PLC0415 -- optional: k3torch needs torch

    return RouteForcing(lambda key: near_tie_route(inter, key, budget))


# ---------------------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------------------


class TorchModelBackend(WholeModelBackend):
    """The torch model as a backend: whole traces only (`evaluate_trace`); no cores, no per-block cases.

    name: "torch-model" (float32) or "torch-model-bf16"; `torch_device` is CUDA when torch sees a GPU, else
    the CPU (override with K3CONF_TORCH_DEVICE); `device` stays BackendBase's "cpu" (its worker is forked)."""

    PRECISIONS = {"torch-model": "fp32", "torch-model-bf16": "bf16"}

    def __init__(self, name: str):
        if name not in self.PRECISIONS:
            raise ValueError(f"backend name: expected one of {sorted(self.PRECISIONS)}, found {name!r}")
        self.name, self.precision = name, self.PRECISIONS[name]

    @property
    def torch_device(self) -> torch.device:
        """CUDA when torch sees a GPU, else the CPU; K3CONF_TORCH_DEVICE overrides."""
        import torch  # noqa: PLC0415 -- optional: this module imports without torch

        return torch.device(os.environ.get("K3CONF_TORCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))

    def available(self) -> tuple[bool, str]:
        try:
            import torch  # noqa: PLC0415 -- optional: this module imports without torch
        except ImportError as e:
            return False, f"PyTorch is not installed ({e}); {INSTALL_HINT}"
        return True, (f"k3torch.K3ForCausalLM, torch {torch.__version__} {_DTYPE_WORDS[self.precision]} on "
                      f"{self.torch_device}; model traces only")

    def timed_cores(self) -> frozenset[str]:
        return frozenset()   # no cores: its whole traces are timed (WholeModelBackend.timed_trace)

    def cores(self) -> Cores:
        raise UnsupportedShape(f"{self.name} runs whole model traces only (an eager PyTorch model, no "
                               "swappable cores): n/a for the per-block cases")

    def _model(self, config_json: Mapping, golden) -> K3ForCausalLM:
        from k3torch.trace import build_model  # noqa: PLC0415 -- optional: k3torch needs torch

        return build_model(config_json, golden.group("weights"), self.precision, device=self.torch_device)

    def time_trace(self, case, golden, config_json: Mapping, prompt_len: int, repeats: int = 3) -> tuple[float, int]:
        """(median seconds of one whole trace after a warm-up run, 0): the model is built once, untimed.
        Bytes are not counted (a whole model: no copy-bandwidth ratio), so the report shows the time alone."""
        from k3torch.trace import cpu_threads, run_trace  # noqa: PLC0415 -- optional: k3torch needs torch

        model = self._model(config_json, golden)
        tokens = golden.group("inputs")["tokens"]
        times = []
        with cpu_threads(self.torch_device):
            run_trace(model, tokens, prompt_len)
            for _ in range(repeats):
                t0 = time.perf_counter()
                run_trace(model, tokens, prompt_len)
                times.append(time.perf_counter() - t0)
        return statistics.median(times), 0

    def evaluate_trace(self, case, golden, config_json: Mapping, prompt_len: int,
                       router_budget: float = 0.0) -> Evaluation:
        """The trace tensors of `golden` (a trace case of the config `config_json`, whose first `prompt_len`
        tokens are the prompt) computed by the torch model at this precision. Where the golden's router margin
        is below `router_budget` the token is given the golden's experts; the count of such tokens is
        `info.teacher_forced["router"]`."""
        from k3torch.trace import GoldenFeed, cpu_threads, run_trace  # noqa: PLC0415 -- optional: k3torch needs torch

        golden.require(["inputs.tokens"])
        model = self._model(config_json, golden)
        feed = None
        if golden.kwargs.get("mode") == "layerwise":
            feed = GoldenFeed(RecordedInputs(golden.group("inter"), self.precision), model)
        routes = golden_route_forcing(golden.group("inter"), router_budget)
        out: dict[str, np.ndarray] = {}
        golden.watch(out)   # each layer's golden input is served after the outputs recorded before it
        with cpu_threads(self.torch_device):
            run_trace(model, golden.group("inputs")["tokens"], prompt_len, feed, routes, record=out)
        return Evaluation(out, info=RunInfo(teacher_forced={"router": routes.forced}))


class RecordedInputs(Mapping):
    """The golden's layer inputs (read one key at a time) as a run at `precision` holds them: bf16 rounded, the
    KDA recurrent state kept fp32."""

    def __init__(self, inter: Mapping[str, np.ndarray], precision: str):
        self.inter, self.precision = inter, precision

    def __getitem__(self, key: str) -> np.ndarray:
        value = self.inter[key]
        if self.precision != "bf16":
            return value
        return cast(value, fp32_kept(self.precision) if key.endswith(".kda.recurrent") else self.precision)

    def __iter__(self):
        return iter(self.inter)

    def __len__(self) -> int:
        return len(self.inter)


_DTYPE_WORDS = {"fp32": "float32", "bf16": "bfloat16"}

__all__ = ["AGREEMENT_RTOL", "TraceDisagreement", "compute_order", "describe", "first_disagreement",
           "verify_trace_golden", "golden_route_forcing", "TorchModelBackend"]
