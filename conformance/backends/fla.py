"""flash-linear-attention (fla-core) KDA kernels as the `kda_prefill` and `kda_decode` cores.

K3's KDA core (docs/interfaces.md) and fla's kernels share the layout (q, k [B, T, H, K], v [B, T, H, V],
state [B, H, K, V] in fp32) and, with these options, the math:

| K3 core step                                            | fla argument                                      |
|---------------------------------------------------------|---------------------------------------------------|
| q^ = L2(q) * scale, k^ = L2(k), eps 1e-6 inside the sqrt | use_qk_l2norm_in_kernel=True (fla's eps is 1e-6)  |
| g = lb * sigma(exp(A_log) * (g_raw + dt_bias)), lb = -5  | use_gate_in_kernel=True, A_log, dt_bias [H*K],    |
|                                                         | lower_bound=lb (chunk_kda: with safe_gate=True)   |
| lower_bound=None: g = -exp(A_log) * softplus(g_raw + dt) | use_gate_in_kernel=True, lower_bound=None         |
| beta = sigma(beta_raw)                                  | use_beta_sigmoid_in_kernel=True                   |
| S: [B, H, K, V] fp32, new state returned                | initial_state (fp32), output_final_state=True     |

`kda_prefill` calls `chunk_kda`, `kda_decode` calls `fused_recurrent_kda` on a T=1 axis. dt_bias is [H*K] for both:
fused_recurrent_kda's docstring says [HV], but its kernel reads dt_bias[i_hv * K + k] (fla-core 0.6.0).
chunk_kda gets the state V-first ([B, H, V, K], state_v_first=True) under torch.inference_mode: the call shape
with which fla's dispatcher hands chunk_kda to Moonshot's FlashKDA when that package is installed (fla's
FlashKDABackend verifier: no grad, bf16, K = V = 128, H = HV, the three in-kernel flags, safe_gate,
state_v_first); FLA_FLASH_KDA=0 keeps fla's Triton kernels.
fla's safe gate accepts -5 <= lower_bound < 0 only: another bound is an UnsupportedShape (a skipped case).
The cores take and return numpy arrays (the runner's interface), so their host time includes the copies.

Where it runs (`available()` says which):
- a CUDA GPU: fla's Triton kernels compiled for it ("Triton (GPU)"), or FlashKDA for the chunk_kda calls it takes;
- no GPU: the same Triton kernels under Triton's interpreter ("Triton under the interpreter (CPU)"), with the
  five bridges of conformance.backends.triton_interpreter, for the fla-core and triton versions measured there.
  TRITON_INTERPRET=1 is set in the process that builds the cores, before fla is imported: fla's kernels are
  decorated (compiled or interpreted) when fla imports. The backend's device is then "cpu", so its worker is
  forked from the run; the run's process never imports fla itself (kernel_cores() is known without building
  the cores), so the worker imports fla fresh, under the interpreter.
Each evaluation's notes name the implementation that ran each core (run_notes), and, under the interpreter,
what such a verdict does not cover (triton_interpreter.INTERPRETER_LIMITS).

EXPECTED_FINDINGS lists the cases fla is known to fail (and 'fuzz/<core>' where the run's fuzz draws of a core
fail), each with its reason. `python -m conformance.backends.fla
REPORT.json` (check_findings; CI runs it after `k3conf run --backend fla`) passes only when the failed cases are
exactly those: a new failure fails CI, and a listed case that passes asks to be struck from the list.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from conformance.backends import triton_interpreter
from conformance.backends.external import Backend
from k3ref.cores import Cores, require_supported

NAME = "fla"
SAFE_GATE_RANGE = (-5.0, 0.0)    # chunk_kda(safe_gate=True) rejects lower bounds outside [-5, 0)
KERNEL_CORES = frozenset({"kda_prefill", "kda_decode"})
TRITON_GPU = "Triton (GPU)"
FLASH_KDA = "FlashKDA"
TRITON_INTERPRETED = "Triton under the interpreter (CPU)"

# case glob -> why the bf16 `fla` backend fails it, as measured (docs/measurements.md, "fla under the Triton
# interpreter"). The gate still fails the case; this list only lets CI tell a known finding from a new one.
EXPECTED_FINDINGS: dict[str, str] = {
    # the run's fuzz draws of a core: 'fuzz/<core>' fails when a draw of it did (fuzz_cells)
    "fuzz/kda_prefill": (
        "chunk_kda without a gate lower bound (Kimi Linear's form, lower_bound None): its bf16 per-chunk state "
        "snapshots put one element of the final state just past the per-element rule, 3.1x torch-bf16's worst "
        "element against 3x (FLA_FRESH_SEED's draws: B=1 T=8 H=1 K=8 and B=1 T=3 H=72 K=8, both lower_bound None; "
        "the per-block cases, all with the K3 bound -5, pass at 1.0-2.0x torch-bf16's error)"),
}


def _cuda() -> bool:
    import torch  # noqa: PLC0415 -- optional: this module imports without torch (it reports torch missing)

    return bool(torch.cuda.is_available())


def _fla_version() -> str:
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def flash_kda_installed() -> bool:
    """Whether fla's dispatcher may hand chunk_kda to FlashKDA: the `flash_kda` package importable and neither
    FLA_FLASH_KDA=0 nor FLA_DISABLE_BACKEND_DISPATCH=1 (fla's BaseBackend.is_enabled / fla.backends)."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False
    enabled = os.environ.get("FLA_FLASH_KDA", "1") != "0"
    return enabled and importlib.util.find_spec("flash_kda") is not None


def available() -> tuple[bool, str]:
    """(True, which implementation runs: fla's Triton kernels on the GPU (FlashKDA for the chunk_kda calls it
    takes) or under Triton's interpreter on the CPU) or (False, why not). fla itself is not imported here: its
    kernels are decorated compiled or interpreted when it imports, which the worker decides."""
    if importlib.util.find_spec("torch") is None:
        return False, "PyTorch is not installed (fla's kernels are torch + Triton): pip install torch"
    if importlib.util.find_spec("fla") is None:
        return False, "flash-linear-attention is not installed: pip install --no-deps -r requirements-fla.txt"
    version = _fla_version()
    if _cuda():
        import torch  # noqa: PLC0415 -- optional, see _cuda

        impl = f"{TRITON_GPU}; chunk_kda on {FLASH_KDA} where it takes the call" if flash_kda_installed() \
            else TRITON_GPU
        return True, f"fla {version}: {impl}, on {torch.cuda.get_device_name()}"
    why = triton_interpreter.refusal()
    if why:
        return False, f"no CUDA GPU, and fla under Triton's interpreter cannot run: {why}"
    triton = importlib.metadata.version("triton")
    return True, f"fla {version}, triton {triton}: {TRITON_INTERPRETED}; {triton_interpreter.INTERPRETER_LIMITS}"


def fla_arguments(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None,
                  dtype=None, device="cpu") -> dict:
    """K3's core arguments (q, k, g_raw [B, T, H, K], v [B, T, H, V], beta_raw [B, T, H], A_log [H],
    dt_bias [H*K], state [B, H, K, V]) as the keyword arguments of fla's `fused_recurrent_kda`: torch
    tensors on `device`, activations in `dtype` (default: the dtype of q), A_log, dt_bias and the state fp32.
    `chunk_kda` takes the same plus `safe_gate` (see chunk_arguments)."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    B, T, H, K = np.shape(q)
    V = np.shape(v)[-1]
    expect = {"k": (B, T, H, K), "v": (B, T, H, V), "g_raw": (B, T, H, K), "beta_raw": (B, T, H),
              "A_log": (H,), "dt_bias": (H * K,), "state": (B, H, K, V)}
    for arg, a in zip(expect, (k, v, g_raw, beta_raw, A_log, dt_bias, state), strict=True):
        if np.shape(a) != expect[arg]:
            raise ValueError(f"{arg}: expected shape {list(expect[arg])}, found {list(np.shape(a))}")

    def tensor(a, dt):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dt)

    act = dtype or torch.from_numpy(np.asarray(q)).dtype
    f32 = torch.float32
    return dict(q=tensor(q, act), k=tensor(k, act), v=tensor(v, act), g=tensor(g_raw, act),
                beta=tensor(beta_raw, act), A_log=tensor(A_log, f32), dt_bias=tensor(dt_bias, f32), scale=scale,
                initial_state=tensor(state, f32), output_final_state=True, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)


def chunk_arguments(*args, **kwargs) -> dict:
    """fla_arguments plus `safe_gate` (chunk_kda applies the lower-bound gate with safe_gate=True), with the state
    V-first ([B, H, V, K], state_v_first=True): the layout FlashKDA takes, so fla may dispatch to it."""
    out = fla_arguments(*args, **kwargs)
    lb = out["lower_bound"]
    if lb is not None:
        require_supported(SAFE_GATE_RANGE[0] <= lb < SAFE_GATE_RANGE[1],
                          f"fla's bounded gate needs {SAFE_GATE_RANGE[0]} <= lower_bound < 0, found {lb}")
    v_first = out["initial_state"].transpose(-1, -2).contiguous()
    return {**out, "initial_state": v_first, "state_v_first": True, "safe_gate": lb is not None}


def _host(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


Record = Callable[[str, dict], None]     # (core, the keyword arguments of fla's call) -> None, before the call


def fla_cores(base: Cores, chunk_kda, fused_recurrent_kda, *, dtype=None, device="cuda",
              record: Record | None = None) -> Cores:
    """`base` with kda_prefill calling `chunk_kda` and kda_decode calling `fused_recurrent_kda` (fla's, or
    stand-ins with their keyword arguments: the CPU test of this mapping passes fla's naive recurrence).
    Both run under torch.inference_mode (FlashKDA takes no call that tracks gradients); `record` is told each
    call's core and arguments first."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    def call(core: str, fn, kw: dict):
        with torch.inference_mode():
            if record is not None:
                record(core, kw)
            return fn(**kw)

    def kda_prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
        kw = chunk_arguments(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, lower_bound=lower_bound,
                             scale=scale, dtype=dtype, device=device)
        o, S = call("kda_prefill", chunk_kda, kw)
        return _host(o), _host(S.transpose(-1, -2))      # V-first back to K3's [B, H, K, V]

    def kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
        step = [np.asarray(a)[:, None] for a in (q, k, v, g_raw, beta_raw)]     # a T=1 axis
        kw = fla_arguments(*step, A_log, dt_bias, state, lower_bound=lower_bound, scale=scale, dtype=dtype,
                           device=device)
        o, S = call("kda_decode", fused_recurrent_kda, kw)
        return _host(o)[:, 0], _host(S)

    return base.replace(kda_prefill=kda_prefill, kda_decode=kda_decode)


def chunk_kda_implementation(kw: dict) -> str:
    """Which implementation fla's dispatcher picks for chunk_kda(**kw) on a GPU, decided as fla-core 0.6.0
    decides it (fla.backends.BackendRegistry.dispatch): FlashKDA when it is installed and enabled and its
    verifier takes the call, else fla's Triton kernels (with FlashKDA's reason for declining)."""
    if not flash_kda_installed():
        return TRITON_GPU
    from fla.ops.kda.backends.flash_kda import FlashKDABackend  # noqa: PLC0415 -- optional: fla is optional

    accepted, why = FlashKDABackend().verify("chunk_kda", **kw)
    return FLASH_KDA if accepted else f"{TRITON_GPU} (FlashKDA declined: {why})"


@dataclasses.dataclass(eq=False)
class FlaBackend(Backend):
    """The fla backend: the external Backend with its kernel cores known without importing fla (the run's process
    must not import it: see the module docstring) and a note per evaluation naming what ran."""

    interpreted: bool = False
    _ran: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)

    def kernel_cores(self) -> frozenset[str]:
        return KERNEL_CORES

    def record(self, core: str, kw: dict) -> None:
        """Note the implementation that runs this call of `core` (fla's function and where it runs)."""
        function = "chunk_kda" if core == "kda_prefill" else "fused_recurrent_kda"
        if self.interpreted:
            impl = TRITON_INTERPRETED
        else:
            impl = chunk_kda_implementation(kw) if core == "kda_prefill" else TRITON_GPU
        self._ran[core] = f"fla {_fla_version()} {function}: {impl}"

    def run_notes(self) -> list[str]:
        """The lines for the report since the last call: each core's implementation, and under the interpreter
        the limits of its verdict."""
        notes = [f"{core} ran {what}" for core, what in sorted(self._ran.items())]
        if notes and self.interpreted:
            notes.append(f"verdict reached under {triton_interpreter.INTERPRETER_LIMITS}")
        self._ran.clear()
        return notes


def make_cores(base: Cores, backend: FlaBackend, dtype_name: str) -> Cores:
    """`base` with fla's kernels as kda_prefill and kda_decode: compiled for the GPU, or without one under Triton's
    interpreter with the bridges applied (FlashKDA kept off there: it is a GPU kernel)."""
    import torch  # noqa: PLC0415 -- optional: this module imports without torch

    if _cuda():
        fla_kda = importlib.import_module("fla.ops.kda")
        device = "cuda"
    else:
        os.environ["FLA_FLASH_KDA"] = "0"
        fla_kda = triton_interpreter.fla_kda_under_interpreter()
        backend.interpreted, device = True, "cpu"
    return fla_cores(base, fla_kda.chunk_kda, fla_kda.fused_recurrent_kda, dtype=getattr(torch, dtype_name),
                     device=device, record=backend.record)


def make_backend(precision: str = "bf16") -> FlaBackend:
    """The `fla` backend: bf16 activations (how fla's kernels run in a model) with the fp32 state, judged by
    the bf16 gates; `make_backend("fp32")` gives fp32 activations (on a GPU Triton may use TF32 in its dots)."""
    dtype_name = {"bf16": "bfloat16", "fp32": "float32"}.get(precision)
    if dtype_name is None:
        raise ValueError(f"fla backend precision: expected 'bf16' or 'fp32', found {precision!r}")
    name = NAME if precision == "bf16" else f"{NAME}-{precision}"
    device = "cuda" if importlib.util.find_spec("torch") is not None and _cuda() else "cpu"
    backend = FlaBackend(name, precision, lambda base: make_cores(base, backend, dtype_name),
                         is_available=available, device=device)
    return backend


def expected_finding(case: str, backend: str = NAME) -> str | None:
    """The reason fla is known to fail `case`, or None (EXPECTED_FINDINGS lists the bf16 backend's only)."""
    if backend != NAME:
        return None
    return next((why for pattern, why in EXPECTED_FINDINGS.items() if fnmatch.fnmatchcase(case, pattern)), None)


def fuzz_cells(fuzz: dict | None, backend: str = NAME) -> list[dict]:
    """A report's fuzz draws as one result per core, 'fuzz/<core>': fail when a draw of that core failed on
    `backend` (a shrunk finding), else pass when one passed, so check_findings judges them as it judges cases."""
    if not fuzz:
        return []
    cores = sorted({r["block"] for r in fuzz.get("results", []) if r.get("backend") == backend})
    failed = {line.split(": ", 2)[1] for line in fuzz.get("findings", []) if line.startswith(f"{backend}: ")}
    passed = {r["block"] for r in fuzz.get("results", []) if r.get("backend") == backend and r["status"] == "pass"}
    return [{"case": f"fuzz/{core}", "backend": backend, "error": "a fuzz draw failed",
             "status": "fail" if core in failed else "pass" if core in passed else "skip"} for core in cores]


def check_findings(results: list[dict], backend: str = NAME) -> list[str]:
    """report.json results of `backend` -> the problems that fail CI: a failed or errored case that is not an
    expected finding, an expected finding that now passes (strike it from EXPECTED_FINDINGS), and a run in which
    no case of the backend passed or failed at all. Empty: the verdict is as documented."""
    mine = [r for r in results if r.get("backend") == backend]
    problems = [f"{r['case']}: {r['status']} and not an expected finding ({r.get('error') or 'a gate failed'})"
                for r in mine if r["status"] in ("fail", "error") and expected_finding(r["case"], backend) is None]
    problems += [f"{r['case']}: passes now, but is listed in EXPECTED_FINDINGS ({expected_finding(r['case'])}); "
                 "strike it from the list" for r in mine
                 if r["status"] == "pass" and expected_finding(r["case"], backend) is not None]
    if not any(r["status"] in ("pass", "fail", "error") for r in mine):
        problems.append(f"no case was judged on {backend}: found {sorted({r['status'] for r in mine}) or 'none'}")
    return problems


# fla's kernel behind each core the report judges, and what its error against the bf16 baseline says about it
KERNEL_OF = {"kda_decode": "fused_recurrent_kda", "kda_prefill": "chunk_kda"}


def baseline_multiples(results: list[dict], backend: str = NAME) -> list[str]:
    """One line per core of `backend`'s per-block cases: the range of its error over torch-bf16's on the same
    tensors (the bf16 baseline keeps the KDA state in fp32; a kernel that keeps it, or its snapshots, in bf16
    errs a multiple of it)."""
    lines = []
    for block, kernel in KERNEL_OF.items():
        ratios: dict[str, list[float]] = {t["tensor"]: [] for r in results
                                           if r.get("backend") == backend and r.get("block") == block
                                           for t in r.get("tensors", [])}
        for r in results:
            if r.get("backend") == backend and r.get("block") == block:
                for t in r.get("tensors", []):
                    if isinstance(t.get("baseline_multiple"), int | float):
                        ratios[t["tensor"]].append(float(t["baseline_multiple"]))
        parts = [f"{tensor} {min(v):.2f}-{max(v):.2f}x" for tensor, v in sorted(ratios.items()) if v]
        if parts:
            lines.append(f"{block} ({kernel}): error over torch-bf16's (fp32 state) on the same tensors: "
                         + ", ".join(parts))
    return lines


def main(argv: list[str]) -> int:
    """python -m conformance.backends.fla REPORT.json: 0 when fla's failures in that run are exactly the expected
    findings (each printed with its reason), 1 otherwise (each problem printed), 2 on bad usage."""
    if len(argv) != 1:
        print(f"usage: python -m conformance.backends.fla REPORT.json (found {argv})", file=sys.stderr)
        return 2
    try:
        report = json.loads(Path(argv[0]).read_text())
        results = report["results"] + fuzz_cells(report.get("fuzz"))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        print(f"{argv[0]}: expected a k3conf run report.json with 'results', found {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    for r in results:
        why = expected_finding(r["case"]) if r.get("backend") == NAME and r["status"] == "fail" else None
        if why:
            print(f"expected finding: {r['case']} fails on {NAME}: {why}")
    for line in baseline_multiples(results):
        print(f"fla finding: {line}")
    problems = check_findings(results)
    for p in problems:
        print(f"fla verdict: {p}", file=sys.stderr)
    counts = {s: sum(r["status"] == s for r in results if r.get("backend") == NAME)
              for s in ("pass", "fail", "error", "n/a", "skip")}
    print(f"fla verdict: {'as documented' if not problems else 'NOT as documented'} ("
          + ", ".join(f"{n} {s}" for s, n in counts.items()) + ")")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
