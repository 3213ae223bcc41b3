"""Planted bugs against the serving engines' own K3 test gates and this tool's gates, measured on the same inputs.

The engines test their K3 kernels with gates of their own (docs/why.md, the facts in their test files):

| gate           | engine test                                | rule, as read here                                  |
|----------------|--------------------------------------------|-----------------------------------------------------|
| vllm-attnres   | vLLM tests/models/kimi_k3/test_attn_res.py | allclose to a bf16 reference: |out - ref| <= 8e-2 + |
|                |                                            | 3e-2 |ref| at every element                         |
| trtllm-attnres | TensorRT-LLM test_attn_res_op.py           | cosine(out, ref) > 0.999 and rel L2 < 3e-2, ref the |
|                |                                            | float reference                                     |
| vllm-kda       | vLLM tests/models/kimi_k3/test_kda.py      | RMS(out - ref) / RMS(ref) < 0.005 against an fp32   |
|                |                                            | naive recurrence                                    |

Each planted bug is a bf16 core built on the torch-bf16 baseline with one fault (PLANTED). For each (bug, case) this
script reads the case's float64 golden, casts its inputs to bf16 as the judge does, runs the torch-bf16 core (the
"bf16 reference" vLLM's AttnRes test compares with) and the planted core, and prints the engine gate's metric and
verdict; then it runs `K3CONF_FRESH_SEED=20261204 k3conf run --backend tools/engine_gates.py:<bug> --config SET
--cases CASE` and prints this tool's verdict from its report (the failing tensor and the rule it broke). A k3 case's
golden is generated when missing (`k3conf regen --shapes k3 --cases CASE`).

    python tools/engine_gates.py [--bugs NAME ...] [--report DIR]

Takes about 2 minutes (each k3conf run loads the planted core in a worker and checks it at start-up).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from conformance import Backend
from conformance.cases.inputs import cast
from conformance.golden.store import default_root, golden_path, read_golden
from k3ref.cores import Cores

REPO = Path(__file__).resolve().parents[1]
FRESH_SEED = "20261204"     # the judge's fresh inputs: one fixed draw, as `make engines` uses, so the verdicts repeat
KEEP_FP32 = ("A_log", "dt_bias", "state")      # the KDA inputs K3 keeps in fp32 (conformance.cases.inputs)


def bf16(a) -> np.ndarray:
    """Values rounded to bf16, held as float32."""
    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _torch_bf16() -> Cores:
    import torch  # noqa: PLC0415 -- optional: the tool needs torch, the module imports without it

    from conformance.backends.pytorch import torch_cores  # noqa: PLC0415 -- needs torch, as above

    return torch_cores(torch.bfloat16)


# ---------------------------------------------------------------------------------------------- the planted bugs


def plant_attnres_scale_2pct(base: Cores) -> Cores:
    """The AttnRes mix 2% too large (a scale folded in twice, a wrong normaliser): out * 1.02."""
    def attnres_mix(sources, proj_w, norm_w, mix=1.0, eps=1e-5):
        return bf16(np.asarray(base.attnres_mix(sources, proj_w, norm_w, mix=mix, eps=eps)) * 1.02)
    return base.replace(attnres_mix=attnres_mix)


def plant_attnres_bf16_scores(base: Cores) -> Cores:
    """The AttnRes scores rounded to bf16 before the softmax (keys normalised and cast to bf16, projected onto the
    bf16 query, the score itself stored in bf16), the rest in fp32: what an eager bf16 layer stack computes."""
    def attnres_mix(sources, proj_w, norm_w, mix=1.0, eps=1e-5):
        if mix != 1.0:      # the ablation blend is not what this bug is about: torch-bf16's answer
            return base.attnres_mix(sources, proj_w, norm_w, mix=mix, eps=eps)
        V = np.asarray(sources, dtype=np.float64)
        query = bf16(np.asarray(norm_w, np.float64) * np.asarray(proj_w, np.float64).reshape(-1))
        keys = bf16(V / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + eps))
        scores = bf16(keys.astype(np.float64) @ query.astype(np.float64))
        alpha = np.exp(scores - scores.max(axis=0))
        alpha /= alpha.sum(axis=0)
        return bf16(np.sum(alpha[..., None] * V, axis=0))
    return base.replace(attnres_mix=attnres_mix)


def plant_kda_bf16_state(base: Cores) -> Cores:
    """KDA prefill with the recurrent state stored in bf16 between tokens (an fp32 state pool held in bf16): each
    token is torch-bf16's decode step on the state rounded to bf16."""
    def kda_prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
        S, outs = bf16(state), []
        for t in range(np.shape(q)[1]):
            o, S = base.kda_decode(q[:, t], k[:, t], v[:, t], g_raw[:, t], beta_raw[:, t], A_log, dt_bias, S,
                                   lower_bound=lower_bound, scale=scale)
            S = bf16(S)
            outs.append(np.asarray(o))
        return np.stack(outs, axis=1), S
    return base.replace(kda_prefill=kda_prefill)


def plant_kda_last_head_gate(base: Cores) -> Cores:
    """KDA prefill whose last head takes head 0's A_log (an indexing slip that touches one head of H): its decay
    rate is another head's."""
    def kda_prefill(q, k, v, g_raw, beta_raw, A_log, dt_bias, state, *, lower_bound=-5.0, scale=None):
        wrong = np.array(A_log, copy=True)
        wrong[-1] = wrong[0]
        return base.kda_prefill(q, k, v, g_raw, beta_raw, wrong, dt_bias, state, lower_bound=lower_bound,
                                scale=scale)
    return base.replace(kda_prefill=kda_prefill)


@dataclasses.dataclass(frozen=True)
class Planted:
    make: Callable[[Cores], Cores]     # torch-bf16's cores -> the same with the fault
    core: str                          # the core it changes
    gates: tuple[str, ...]             # the engine gates it is measured against
    cases: tuple[tuple[str, str], ...]  # (config, case)


ATTNRES_CASES = (("tiny", "attnres_mix/S3-T5-D113"), ("k3", "attnres_mix/S2-T64-D7168"),
                 ("k3", "attnres_mix/S9-T16-D7168"))
KDA_CASES = (("tiny", "kda_prefill/B2-T63-H2-K16"), ("k3", "kda_prefill/B2-T64-H96-K128"))
PLANTED: dict[str, Planted] = {
    "attnres-scale-2pct": Planted(plant_attnres_scale_2pct, "attnres_mix", ("vllm-attnres", "trtllm-attnres"),
                                  ATTNRES_CASES),
    "attnres-bf16-scores": Planted(plant_attnres_bf16_scores, "attnres_mix", ("vllm-attnres", "trtllm-attnres"),
                                   ATTNRES_CASES),
    "kda-bf16-state": Planted(plant_kda_bf16_state, "kda_prefill", ("vllm-kda",), KDA_CASES),
    "kda-last-head-gate": Planted(plant_kda_last_head_gate, "kda_prefill", ("vllm-kda",), KDA_CASES),
}


def backend(name: str) -> Backend:
    """The planted bug `name` as a bf16 backend (for `k3conf run --backend tools/engine_gates.py:<factory>`)."""
    planted = PLANTED[name]

    def make_cores(base: Cores) -> Cores:
        return base.replace(**{planted.core: getattr(planted.make(_torch_bf16()), planted.core)})
    return Backend.from_cores(f"planted-{name}", "bf16", make_cores)


def _factory(name: str) -> Callable[[], Backend]:
    return lambda: backend(name)


# `--backend tools/engine_gates.py:attnres_scale_2pct` and so on: one module attribute per bug
for _name in PLANTED:
    globals()[_name.replace("-", "_")] = _factory(_name)


# ---------------------------------------------------------------------------------------------- the engine gates


def rel_l2(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def engine_gate(gate: str, out, bf16_ref, ref) -> tuple[bool, str]:
    """(passes, its metric) of one engine gate; bf16_ref the torch-bf16 output, ref the float64 golden."""
    out, bf16_ref, ref = (np.asarray(a, np.float64) for a in (out, bf16_ref, ref))
    if gate == "vllm-attnres":
        excess = np.max(np.abs(out - bf16_ref) - (8e-2 + 3e-2 * np.abs(bf16_ref)))
        return bool(excess <= 0), f"max(|out - ref_bf16| - (8e-2 + 3e-2 |ref_bf16|)) = {excess:.3g}"
    if gate == "trtllm-attnres":
        cosine = float(out.ravel() @ ref.ravel() / np.linalg.norm(out) / np.linalg.norm(ref))
        rel = rel_l2(out, ref)
        return cosine > 0.999 and rel < 3e-2, f"cosine {cosine:.6f}, rel L2 {rel:.3g}"
    if gate == "vllm-kda":
        ratio = rel_l2(out, ref)
        return ratio < 5e-3, f"RMS ratio {ratio:.3g}"
    raise ValueError(f"gate: expected one of vllm-attnres, trtllm-attnres, vllm-kda, found {gate!r}")


def golden_io(config: str, case: str):
    """(bf16 inputs as the judge casts them, kwargs, the float64 golden's first output), regenerating the golden
    of a non-tiny case when it is missing."""
    root = default_root(config)
    if not golden_path(root, case).exists():
        subprocess.run([sys.executable, "-m", "conformance", "regen", "--config", config, "--cases", case],
                       check=True, cwd=REPO)
    golden = read_golden(root, case, config=config)
    inputs = {k: cast(v, "fp32" if k in KEEP_FP32 else "bf16") for k, v in golden.group("inputs").items()}
    outputs = golden.group("outputs")
    first = "out" if "out" in outputs else "o"
    return inputs, golden.kwargs, outputs[first]


def first_output(result):
    return np.asarray(result[0] if isinstance(result, tuple) else result)


def judge_verdict(name: str, config: str, case: str, report: Path) -> str:
    """This tool's verdict: `k3conf run` on the planted backend, its cell and first failing tensor's numbers."""
    out_dir = report / name / case.replace("/", "_")
    subprocess.run([sys.executable, "-m", "conformance", "run", "--backend",
                    f"tools/engine_gates.py:{name.replace('-', '_')}", "--config", config, "--cases", case,
                    "--no-timing", "--report", str(out_dir)], cwd=REPO, capture_output=True, text=True,
                   env={**os.environ, "K3CONF_FRESH_SEED": FRESH_SEED})
    results = json.loads((out_dir / "report.json").read_text())["results"]
    mine = [r for r in results if r["backend"] == f"planted-{name}"]
    if not mine:
        return "no verdict (the planted core was refused at start-up: see the report)"
    r = mine[0]
    tensors = r.get("tensors", [])
    failed = [t for t in tensors if t.get("passed") is False]
    shown = failed[0] if failed else max(tensors, key=lambda t: t.get("baseline_multiple") or 0, default=None)
    if shown is None:
        return r["status"].upper()
    detail = (f"{shown['tensor']}: rel RMS {shown['comparison']['rel_rms']:.3g} = "
              f"{shown.get('baseline_multiple') or 0:.2f} x torch-bf16")
    if failed:
        detail += f"; failed: {(shown.get('rule') or 'its gate').split(' (')[0]}"
    return f"{r['status'].upper()} ({detail})"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bugs", nargs="+", default=list(PLANTED), choices=list(PLANTED))
    parser.add_argument("--report", default="reports/engine_gates", help="where the k3conf run reports go")
    args = parser.parse_args(argv)
    base = _torch_bf16()
    for name in args.bugs:
        planted = PLANTED[name]
        cores = planted.make(base)
        for config, case in planted.cases:
            inputs, kwargs, ref = golden_io(config, case)
            out = first_output(getattr(cores, planted.core)(**inputs, **kwargs))
            bf16_ref = first_output(getattr(base, planted.core)(**inputs, **kwargs))
            gates = [engine_gate(g, out, bf16_ref, ref) for g in planted.gates]
            shown = "; ".join(f"{g}: {'pass' if ok else 'FAIL'} ({m})" for g, (ok, m) in zip(planted.gates, gates,
                                                                                               strict=True))
            print(f"{name} on {case} ({config}): {shown}; torch-bf16 rel RMS {rel_l2(bf16_ref, ref):.3g}, planted "
                  f"{rel_l2(out, ref):.3g}")
            print(f"    this tool: {judge_verdict(name, config, case, Path(args.report))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
