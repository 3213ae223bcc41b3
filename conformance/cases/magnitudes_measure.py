"""Measuring the magnitudes of conformance.cases.magnitudes: each core's inputs recorded over a model's trace.

`python -m conformance.cases.magnitudes_measure` runs the `small` model (synthetic weights of the trace cases,
conformance.cases.traces.WEIGHT_SEED) in float64 over the trace prompt and 5 decode steps and prints, per core
input, the median RMS (`scale`), the largest |x| / row RMS (`outlier`) and the log10 ratio of the largest to the
smallest row RMS (`spread`); for the KDA gate how much of (lower_bound, 0) it covers; for the router the k-th
minus (k+1)-th selection score. The numbers in magnitudes.MEASURED were copied from its output.
"""
from __future__ import annotations

import numpy as np

from conformance.cases.magnitudes import gate_coverage
from conformance.cases.trace_run import PROMPT
from conformance.cases.traces import WEIGHT_SEED
from k3ref.config import K3Config
from k3ref.cores import reference_cores
from k3ref.cpu_forward import K3CpuModel
from k3ref.greedy import greedy_decode
from k3ref.kda import kda_gate
from k3ref.weights import synthetic_weights


def _stats(x: np.ndarray) -> dict[str, float]:
    """scale, outlier and spread of the rows (last axis) of x; rows of NaN or zeros (unused cache slots, the
    pool's empty pages) are no activations and are left out."""
    x = np.asarray(x, np.float64)
    x = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    x = x[np.all(np.isfinite(x), axis=-1) & np.any(x != 0, axis=-1)]
    if not x.size:
        return {"scale": 0.0, "outlier": 0.0, "spread": 0.0}
    rms = np.sqrt(np.mean(x * x, axis=-1))
    return {"scale": float(np.sqrt(np.mean(x * x))), "outlier": float(np.max(np.abs(x) / rms[:, None])),
            "spread": float(np.log10(rms.max() / rms.min()))}


def measure(config: str = "small", prompt_len: int = 7, decode: int = 5) -> dict[str, dict[str, float]]:
    """Each core's input statistics over the `config` model's trace (see the module docstring)."""
    seen: dict[str, list[dict[str, float]]] = {}
    gates: list[np.ndarray] = []
    margins: list[np.ndarray] = []

    def note(key, x):
        seen.setdefault(key, []).append(_stats(x))

    ref = reference_cores()

    def rec(core, keys):
        fn = getattr(ref, core)

        def call(*args, **kwargs):
            for i, key in keys.items():
                val = kwargs[i] if isinstance(i, str) else args[i] if i < len(args) else None
                if val is not None:
                    note(key, val)
            if core in ("kda_decode", "kda_prefill"):
                g = kda_gate(kwargs.get("g_raw", args[3] if len(args) > 3 else None),
                             kwargs.get("A_log", args[5] if len(args) > 5 else None),
                             kwargs.get("dt_bias", args[6] if len(args) > 6 else None),
                             kwargs.get("lower_bound", -5.0))
                gates.append(np.asarray(g).reshape(-1))
            out = fn(*args, **kwargs)
            if core == "moe_route":
                logits = np.asarray(args[0] if args else kwargs["logits"], np.float64)
                bias = np.asarray(args[1] if len(args) > 1 else kwargs["bias"], np.float64)
                top_k = kwargs.get("top_k", args[2] if len(args) > 2 else None)
                s = np.sort(1.0 / (1.0 + np.exp(-logits)) + bias, axis=-1)[:, ::-1]
                margins.append(s[:, top_k - 1] - s[:, top_k])
            return out
        return call

    cores = ref.replace(
        rmsnorm=rec("rmsnorm", {0: "rmsnorm.x"}),
        situ_glu=rec("situ_glu", {0: "situ_glu.gate", 1: "situ_glu.up"}),
        kda_decode=rec("kda_decode", {0: "kda.q", 2: "kda.v"}),
        kda_prefill=rec("kda_prefill", {0: "kda.q", 2: "kda.v"}),
        mla_decode=rec("mla_decode", {0: "mla.q_abs", 1: "mla.kv"}),
        mxfp4_gemv=rec("mxfp4_gemv", {2: "mxfp4_gemv.x"}),
        moe_route=rec("moe_route", {0: "router.logits", 1: "router.bias"}),
        attnres_mix=rec("attnres_mix", {0: "attnres.sources"}),
    )
    cfg = K3Config.preset(config)
    model = K3CpuModel(cfg, synthetic_weights(cfg, WEIGHT_SEED), np.float64)
    greedy_decode(model, list(PROMPT[:prompt_len]), decode, cores=cores)
    out = {k: {"scale": float(np.median([s["scale"] for s in v])), "outlier": max(s["outlier"] for s in v),
               "spread": max(s["spread"] for s in v)} for k, v in sorted(seen.items())}
    if gates:
        lb = cfg.gate_lower_bound if cfg.gate_lower_bound is not None else float(np.concatenate(gates).min())
        out["kda.gate"] = {**gate_coverage(np.concatenate(gates), lb), "min": float(np.concatenate(gates).min())}
    if margins:
        m = np.concatenate(margins)
        out["router.margin"] = {"median": float(np.median(m)), "p10": float(np.quantile(m, 0.1))}
    return out


if __name__ == "__main__":
    for key, stats in measure().items():
        print(f"{key:18s} " + "  ".join(f"{k}={v:.3g}" for k, v in stats.items()))
