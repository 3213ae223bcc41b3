"""SGLang's Block AttnRes kernels and eager reference, as shipped in its wheel, as the `attnres_mix` core.

SGLang (PyPI `sglang`, MEASURED_SGLANG) serves K3's AttnRes through `sglang/srt/layers/attn_residual.py`: a bank
of frozen block snapshots [T, NB, H] plus the running prefix [T, H], scored against one query vector
cw = score_norm.weight * score_proj.weight (fp32), softmaxed and mixed. Three of its paths run without a GPU:

| backend      | engine code judged                                            | runs here as                        |
|--------------|---------------------------------------------------------------|-------------------------------------|
| `sglang`     | `_mix_fused`: the two Triton kernels `_score_kernel` (one     | Triton under the interpreter (CPU), |
|              | score per row and token) and `_combine_kernel` (softmax + mix | compiled on a GPU; H a multiple of  |
|              | per 1024-wide H chunk), its fallback on every GPU without the | 1024 only (SGLang sends other       |
|              | TMA kernel; and its vendored fla's `chunk_kda` as             | widths to its eager path)           |
|              | `kda_prefill_varlen` (conformance.backends.sglang_kda)        |                                     |
| `sglang-hip` | `attn_res_hip` (sglang/kernels/ops/attention/attn_res_hip.py):| the same; nvb >= 1 and the register |
|              | one Triton kernel per token, ROCm's path, output norm off     | tile within its budget              |
| `sglang-ref` | `aggregate_stream_torch`: SGLang's eager reference, through   | torch on the CPU, any H             |
|              | its RMSNorm and ReplicatedLinear (stubbed: engine_modules)    |                                     |

The product's core and SGLang's call, for sources [S, ..., D] (S - 1 completed blocks, then the prefix):

| attnres_mix argument      | SGLang                                                                           |
|---------------------------|----------------------------------------------------------------------------------|
| sources[:-1]              | bank [T, NB = S - 1, H], T the flattened lead axes; nvb = S - 1                  |
| sources[-1]               | prefix_sum [T, H]                                                                |
| proj_w [D] / [1, D]       | score_proj.weight [1, H], bf16 as the checkpoint holds it                        |
| norm_w [D]                | score_norm.weight [H] (its variance_epsilon = eps)                               |
| mix                       | none: SGLang always mixes fully; mix != 1 is an UnsupportedShape                 |

Activations are bf16 (how SGLang runs K3), cw fp32 (get_cw), so the backends are judged by the bf16 gates. The
output RMSNorm that SGLang's fast paths fuse into the mix is outside the product's `attnres_mix` core: the
single-kernel path's fused norm is checked against the reference by tests/conformance/test_engines_sglang.py.

EXPECTED_FINDINGS holds, per backend, the cases it is known to fail and why; `python -m conformance.backends.engines
REPORT.json` (what `make engines` runs) passes only when each engine backend's failed cases are exactly those.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from conformance.backends import engine_modules, sglang_kda, triton_engine_bridges, triton_interpreter
from conformance.backends.engine_modules import EngineModule, StubReplicatedLinear, StubRMSNorm
from conformance.backends.external import Backend
from k3ref.cores import Cores, require_supported

DIST = "sglang"
MEASURED_SGLANG = ("0.5.23",)
BLOCK_H = 1024          # the H chunk of _score_kernel / _combine_kernel (attn_residual._BLOCK_H)
KERNEL_CORES = frozenset({"attnres_mix"})
TRITON_INTERPRETED = "Triton under the interpreter (CPU)"


def attn_residual_module(platform: str) -> EngineModule:
    """sglang/srt/layers/attn_residual.py with its three sglang imports stood in (engine_modules' table)."""
    return EngineModule(DIST, "sglang/srt/layers/attn_residual.py", {
        "sglang.srt.layers.layernorm": {"RMSNorm": StubRMSNorm},
        "sglang.srt.layers.linear": {"ReplicatedLinear": StubReplicatedLinear},
        "sglang.srt.utils": engine_modules.platform_predicates(platform),
    })


ATTN_RES_HIP = EngineModule(DIST, "sglang/kernels/ops/attention/attn_res_hip.py")   # torch and triton only


# backend -> case glob -> why it fails, as measured (docs/engines.md). The gate still fails the case; this table
# only lets `make engines` tell a known finding from a new one.
EXPECTED_FINDINGS: dict[str, dict[str, str]] = {
    "sglang": {
        "kda_prefill_varlen/N1-T17-S2-H2-K16-vk-nolb": (
            "chunk_kda with Kimi Linear's unbounded gate (lower_bound None; K3 bounds it at -5): head 0 decays by up "
            "to 167 per token, 2838 over the 17 tokens, and without the safe gate the chunked form factors "
            "exp(g_i - g_j) through exp(g_i) and exp(-g_j), which fp32 cannot hold; head 0's o errs 1.8 (rel RMS, "
            "459 x torch-bf16) and the state 26 x. K3's bounded gate takes the safe path and passes"),
        "kda_prefill_varlen/N6-T9-S7-H2-K16-kv": (
            "chunk_kda with empty sequences in the batch (cu_seqlens 0 0 5 5 6 9 9: three sequences of no token): "
            "o errs 13.8 and 257 (rel RMS, per head) and the state holds NaN; the same tokens with the empty "
            "sequences left out (cu_seqlens 0 5 6 9) err 3.2e-3 and 4.0e-3, as torch-bf16 does. Seen under "
            "Triton's interpreter; whether compiled kernels do the same needs a GPU"),
    },
    "sglang-hip": {},
    "sglang-ref": {
        "attnres_mix/S2-T64-D7168": (
            "aggregate_stream_torch rounds every score to bf16 (the RMS-normed rows are cast to bf16 and projected "
            "by a bf16 linear): at K3's magnitudes the scores are ~40 (RMS), so they err 0.15 RMS and 0.45 at worst "
            "on a draw of this case's shape and magnitudes, and the mix errs 9.9e-3 = 3.7 x torch-bf16's 2.7e-3 "
            "(> 2.5 x); SGLang's Triton paths keep the scores in fp32 and pass"),
    },
}


def _cuda() -> bool:
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    return bool(torch.cuda.is_available())


def refusal(triton: bool) -> str | None:
    """None when the installed sglang (and, for its Triton paths, triton) are versions measured here; else why not,
    with the command that installs measured ones."""
    fix = "pip install --no-deps -r requirements-engines.txt"
    if importlib_missing("torch"):
        return "PyTorch is not installed (SGLang's kernels are torch + Triton): pip install torch"
    version = engine_modules.installed_version(DIST)
    if version is None:
        return f"sglang is not installed: {fix}"
    if version not in MEASURED_SGLANG:
        return f"sglang {version} is not a version this adapter was measured on ({', '.join(MEASURED_SGLANG)}): {fix}"
    if triton:
        return triton_interpreter.triton_refusal()
    if importlib_missing("triton"):     # attn_residual.py imports it (and decorates its kernels) for the eager path too
        return ("triton is not installed (SGLang's attn_residual.py imports it): "
                "pip install --no-deps -r requirements-fla.txt")
    return None


# SGLang's vendored fla builds its KDA prefill on tl.make_block_ptr, which Triton 3.9's interpreter no longer runs
# ("Block pointers have been removed in favor of the tensor descriptor API"); 3.8.0 runs it (requirements-fla.txt)
KDA_TRITON_BELOW = (3, 9)


def kda_refusal() -> str | None:
    """None when SGLang's chunk_kda can run here: refusal(triton=True) and, without a GPU, a Triton below 3.9."""
    why = refusal(triton=True)
    if why or _cuda():
        return why
    version = engine_modules.installed_version("triton") or "?"
    if triton_interpreter.release(version)[:2] >= KDA_TRITON_BELOW:
        return (f"triton {version}: SGLang's chunk_kda uses tl.make_block_ptr, which Triton's interpreter runs only "
                "below 3.9: pip install --no-deps -r requirements-fla.txt (triton 3.8.0)")
    return None


def importlib_missing(name: str) -> bool:
    """True when the top-level package `name` cannot be found (without importing it)."""
    return importlib.util.find_spec(name) is None


def available_for(triton: bool, kda: bool = False) -> Callable[[], tuple[bool, str]]:
    """The available() of a backend that runs SGLang's Triton kernels (triton=True; kda: its chunk_kda too) or only
    its torch code."""
    def available() -> tuple[bool, str]:
        why = kda_refusal() if kda else refusal(triton)
        if why:
            return False, why
        version = engine_modules.installed_version(DIST)
        if not triton:
            return True, f"sglang {version}: its eager torch reference on the CPU"
        if _cuda():
            return True, f"sglang {version}: Triton (GPU)"
        return True, f"sglang {version}: {TRITON_INTERPRETED}; {triton_interpreter.INTERPRETER_LIMITS}"
    return available


# ------------------------------------------------------------------------------------------------ the mapping


@dataclasses.dataclass(frozen=True)
class MixCall:
    """attnres_mix's arguments as SGLang takes them (torch tensors on one device)."""

    prefix_sum: Any         # [T, H] activations (a torch tensor)
    bank: Any               # [T, NB = nvb, H] activations
    nvb: int
    score_proj: StubReplicatedLinear   # weight [1, H]
    score_norm: StubRMSNorm            # weight [H], variance_epsilon = eps
    lead: tuple[int, ...]              # the lead axes T was flattened from


def mix_call(sources, proj_w, norm_w, mix: float, eps: float, *, dtype, device: str = "cpu") -> MixCall:
    """attnres_mix's arguments (sources [S, ..., D], proj_w [D] or [1, D], norm_w [D]) as SGLang's: the bank holds
    the S - 1 completed blocks token-major, the prefix is the last source. mix != 1 is an UnsupportedShape."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    require_supported(float(mix) == 1.0, f"the engines' AttnRes always mixes fully (no blend with the skip); mix={mix}")
    V = np.asarray(sources)
    if V.ndim < 2:
        raise ValueError(f"sources: expected shape [S, ..., D], found {list(V.shape)}")
    S, lead, D = V.shape[0], V.shape[1:-1], V.shape[-1]
    w = np.asarray(proj_w).reshape(-1)
    if w.shape != (D,) or np.shape(norm_w) != (D,):
        raise ValueError(f"proj_w, norm_w: expected [{D}] (or proj_w [1, {D}]), found {list(np.shape(proj_w))}, "
                         f"{list(np.shape(norm_w))}")
    rows = torch.from_numpy(np.ascontiguousarray(V.reshape(S, -1, D))).to(device=device, dtype=dtype)
    return MixCall(prefix_sum=rows[-1].contiguous(), bank=rows[:-1].transpose(0, 1).contiguous(), nvb=S - 1,
                   score_proj=StubReplicatedLinear(torch.from_numpy(w[None]).to(device=device, dtype=dtype)),
                   score_norm=StubRMSNorm(torch.from_numpy(np.asarray(norm_w)).to(device=device, dtype=dtype), eps),
                   lead=tuple(lead))


def _host(t, lead: tuple[int, ...]) -> np.ndarray:
    return t.detach().float().cpu().numpy().reshape(*lead, t.shape[-1])


MixFn = Callable[[MixCall], object]     # SGLang's call on a MixCall -> the mix [T, H]


def mix_core(run: MixFn, *, dtype, device: str = "cpu", accepts: Callable[[MixCall], None] | None = None):
    """The attnres_mix core calling `run` (one of SGLang's paths, or a stand-in with its contract) on SGLang's
    arguments; `accepts(call)` raises UnsupportedShape for a shape that path does not take."""
    def attnres_mix(sources, proj_w, norm_w, mix: float = 1.0, eps: float = 1e-5) -> np.ndarray:
        call = mix_call(sources, proj_w, norm_w, mix, eps, dtype=dtype, device=device)
        if accepts is not None:
            accepts(call)
        return _host(run(call), call.lead)
    return attnres_mix


def two_kernel_accepts(call: MixCall) -> None:
    """_mix_fused's shapes: H a multiple of its 1024-wide chunk (SGLang sends other widths to its eager path) and
    at least one banked block (its callers never mix a lone prefix)."""
    H = call.prefix_sum.shape[-1]
    require_supported(H % BLOCK_H == 0, f"SGLang's two-kernel AttnRes scans H in chunks of {BLOCK_H}; H={H} "
                      "(SGLang takes its eager path there: judged as sglang-ref)")
    require_supported(call.nvb >= 1, "SGLang's callers never mix a lone prefix (nvb = 0 returns it unchanged)")


def single_kernel_accepts(supports: Callable[[int, int], bool]) -> Callable[[MixCall], None]:
    """attn_res_hip's shapes: nvb >= 1 and its register tile within budget (`supports`: supports_attn_res_hip)."""
    def accepts(call: MixCall) -> None:
        H = call.prefix_sum.shape[-1]
        require_supported(call.nvb >= 1, "attn_res_hip needs nvb >= 1 (its callers handle a lone prefix)")
        require_supported(supports(H, call.nvb), f"attn_res_hip's register tile is over budget at H={H}, "
                          f"nvb={call.nvb}")
    return accepts


def two_kernel_run(attn_residual) -> MixFn:
    """SGLang's two-kernel pipeline (`_mix_fused`: _score_kernel then _combine_kernel): the pre-norm mixture."""
    def run(call: MixCall):
        return attn_residual._mix_fused(call.prefix_sum, call.bank, call.nvb, call.score_proj, call.score_norm)
    return run


def single_kernel_run(attn_residual, attn_res_hip, out_norm: StubRMSNorm | None = None) -> MixFn:
    """SGLang's single-kernel path (`attn_res_hip`, cw from attn_residual.get_cw): the pre-norm mixture, or with
    `out_norm` the mixture through the output RMSNorm the kernel fuses."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    def run(call: MixCall):
        out = torch.empty_like(call.prefix_sum)
        cw = attn_residual.get_cw(call.score_proj, call.score_norm)
        attn_res_hip.attn_res_hip(call.prefix_sum, call.bank, cw, None if out_norm is None else out_norm.weight,
                                  out, call.nvb, call.score_norm.variance_epsilon,
                                  0.0 if out_norm is None else out_norm.variance_epsilon)
        return out
    return run


def eager_run(attn_residual) -> MixFn:
    """SGLang's eager reference (`aggregate_stream_torch`)."""
    def run(call: MixCall):
        return attn_residual.aggregate_stream_torch(call.prefix_sum, call.bank, call.nvb, call.score_proj,
                                                    call.score_norm)
    return run


# ------------------------------------------------------------------------------------------------ the backends


def load_modules(triton: bool):
    """(attn_residual, attn_res_hip) from the installed wheel: under Triton's interpreter with its bridges when
    there is no GPU (TRITON_INTERPRET=1 set first: the kernels are decorated as the module executes)."""
    platform = "cpu"
    if triton and not _cuda():
        os.environ[triton_interpreter.ENV] = "1"
        for bridge in triton_interpreter.TRITON_BRIDGES:
            bridge()
    elif triton:
        platform = "cuda"
    attn_residual = engine_modules.load(attn_residual_module(platform))
    hip = engine_modules.load(ATTN_RES_HIP) if triton else None
    if triton and not _cuda() and not triton_interpreter.interpreted(attn_residual._score_kernel):
        raise RuntimeError("SGLang's AttnRes kernels were decorated compiled in this process before "
                           "TRITON_INTERPRET=1 was set; run the sglang backends in a fresh process")
    return attn_residual, hip


def make_cores(base: Cores, name: str) -> Cores:
    """`base` with attnres_mix on the SGLang path `name` names."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    triton = name != "sglang-ref"
    attn_residual, hip = load_modules(triton)
    device = "cuda" if triton and _cuda() else "cpu"
    if name == "sglang":
        core = mix_core(two_kernel_run(attn_residual), dtype=torch.bfloat16, device=device,
                        accepts=two_kernel_accepts)
        kda = sglang_kda.load_kda()
        if device == "cpu":
            fork = [m for n, m in list(sys.modules.items()) if n.startswith(sglang_kda.PACKAGE_NAME + ".")
                    and m is not None]
            triton_engine_bridges.engine_bridges(fork)
        varlen = sglang_kda.varlen_core(kda.chunk_kda, dtype=torch.bfloat16, device=device)
        return base.replace(attnres_mix=core, kda_prefill_varlen=varlen)
    elif name == "sglang-hip":
        core = mix_core(single_kernel_run(attn_residual, hip), dtype=torch.bfloat16, device=device,
                        accepts=single_kernel_accepts(hip.supports_attn_res_hip))
    else:
        core = mix_core(eager_run(attn_residual), dtype=torch.bfloat16)
    return base.replace(attnres_mix=core)


@dataclasses.dataclass(eq=False)
class EngineBackend(Backend):
    """An engine backend whose kernel cores are known without loading the engine's modules (the run's process
    never loads them: the worker does, under the interpreter when there is no GPU)."""

    known_cores: frozenset[str] = frozenset()
    ran: str = ""

    def kernel_cores(self) -> frozenset[str]:
        return self.known_cores

    def run_notes(self) -> list[str]:
        return [self.ran] if self.ran else []


NAMES = ("sglang", "sglang-hip", "sglang-ref")
KERNELS_OF = {"sglang": KERNEL_CORES | {"kda_prefill_varlen"}, "sglang-hip": KERNEL_CORES, "sglang-ref": KERNEL_CORES}
RAN = {"sglang": "attnres_mix ran sglang's _score_kernel + _combine_kernel (attn_residual._mix_fused), "
                 "kda_prefill_varlen sglang's chunk_kda (its vendored fla)",
       "sglang-hip": "attnres_mix ran sglang's attn_res_hip (one Triton kernel, output norm off)",
       "sglang-ref": "attnres_mix ran sglang's aggregate_stream_torch (eager torch, bf16)"}


def make_backend(name: str) -> EngineBackend:
    """One of NAMES, bf16."""
    if name not in NAMES:
        raise ValueError(f"sglang backend: expected one of {NAMES}, found {name!r}")
    triton = name != "sglang-ref"
    device = "cuda" if triton and not importlib_missing("torch") and _cuda() else "cpu"
    ran = RAN[name] + ("" if not triton or device == "cuda" else f", {TRITON_INTERPRETED}")
    return EngineBackend(name, "bf16", lambda base: make_cores(base, name),
                         is_available=available_for(triton, kda=name == "sglang"),
                         device=device, known_cores=KERNELS_OF[name], ran=ran)


def factory(name: str) -> Callable[[], EngineBackend]:
    """The registry's factory of the backend `name` (built on first use)."""
    return lambda: make_backend(name)
