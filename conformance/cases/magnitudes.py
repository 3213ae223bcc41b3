"""The magnitudes of K3's kernel inputs, as a real layer produces them, and the draws of the k3 shape sets.

A kernel tested on toy magnitudes can pass every test and still break on a real layer (a KDA port that pinned the
gate to [-0.05, -0.001] broke 68 of 69 layers: K3's gate spans (-5, 0)). The numbers below were measured on the
`small` model's trace (`python -m conformance.cases.magnitudes_measure` reruns the measurement and prints them): the
host graph in float64 on the synthetic `small` weights (conformance.cases.traces.WEIGHT_SEED), the trace prompt
prefilled and decoded, each core's inputs recorded. `scale` is the median over calls of the RMS of the input,
`outlier` the largest |x| / RMS of a row over all calls (heavy tails: a kernel that accumulates in too narrow a
type or clips sees them), `spread` the log10 ratio of the largest to the smallest row RMS.

The k3 draws use these: activations are Gaussian at the measured scale with per-row scales spanning the measured
spread and a few entries at the measured outlier ratio; the KDA gate pre-activation is drawn so that the gate
g = lower_bound * sigmoid(...) covers (lower_bound, 0) (most of it, both ends) with long runs of steps at the
lower bound; the router's logits and bias are drawn at the measured scale with K3's top-16 of 896 and a
margin between the 16th and 17th score kept above bf16 rounding (conformance.cases.routes).
"""
from __future__ import annotations

import decimal

import numpy as np

from k3ref.kda import kda_gate

# measured on the `small` trace (see the module docstring; `python -m conformance.cases.magnitudes_measure`)
MEASURED: dict[str, dict[str, float]] = {
    "attnres.sources": {"scale": 1.86, "outlier": 4.63, "spread": 1.37},
    "kda.q": {"scale": 0.608, "outlier": 9.47, "spread": 0.703},
    "kda.v": {"scale": 0.600, "outlier": 9.34, "spread": 0.683},
    "mla.q_abs": {"scale": 0.775, "outlier": 5.29, "spread": 0.109},
    "mla.kv": {"scale": 1.01, "outlier": 4.11, "spread": 0.0302},
    "mxfp4_gemv.x": {"scale": 0.990, "outlier": 9.76, "spread": 0.377},
    "rmsnorm.x": {"scale": 0.874, "outlier": 9.34, "spread": 3.05},
    "router.logits": {"scale": 0.998, "outlier": 3.46, "spread": 0.169},
    "router.bias": {"scale": 0.0499, "outlier": 3.07, "spread": 0.0},
    "situ_glu.gate": {"scale": 0.990, "outlier": 4.74, "spread": 0.113},
    "situ_glu.up": {"scale": 0.986, "outlier": 4.31, "spread": 0.182},
}
# also measured there: the KDA gate covers all of (-5, 0) with 27% of the values at the bound; the router's
# 8th-minus-9th score margin has median 9.4e-3 and 10th percentile 1.3e-3 (selection-score units)
MEASURED_ON = "small trace, prompt 7 + 5 decode steps, float64 host graph"

# The KDA gate at K3's magnitudes (docs/spec.md section 3): g in (lower_bound, 0) per step and channel.
GATE_COVER = 0.8          # the drawn gates cover at least this fraction of (lower_bound, 0)
GATE_RUN = 256            # steps of the long runs at the lower bound (one per run, several channels)
GATE_AT_BOUND = 0.99      # "at the lower bound": g <= GATE_AT_BOUND * lower_bound


def ten_to(u: np.ndarray) -> np.ndarray:
    """10^u elementwise, the same bits on every machine: what the goldens' inputs are drawn with. NumPy's
    `10.0 ** u` is not: on an AVX-512 CPU it runs its own SIMD pow, which differs from other CPUs' in the last
    bit for some u (measured: one committed golden's inputs, moe_experts/T2-E4-k4-Dl64-I32, changed by 1 ulp).
    Decimal arithmetic is software, here in a context of its own (28 digits, whatever the caller's), and the
    conversion to float rounds to nearest."""
    u = np.asarray(u, np.float64)
    with decimal.localcontext(decimal.Context(prec=28, rounding=decimal.ROUND_HALF_EVEN)):
        powers = [float(decimal.Decimal(10) ** decimal.Decimal(v)) for v in u.ravel().tolist()]
    return np.array(powers, np.float64).reshape(u.shape)


def activations(rng: np.random.Generator, shape: tuple, key: str) -> np.ndarray:
    """Gaussian activations at MEASURED[key]: RMS `scale`, rows (last axis) scaled over a range of 10^spread, one
    entry per row at the outlier ratio times the row's RMS (sign random)."""
    m = MEASURED[key]
    shape = tuple(shape)
    rows = shape[:-1] + (1,)
    x = rng.standard_normal(shape) * ten_to(rng.uniform(-m["spread"] / 2, m["spread"] / 2, rows))
    x *= m["scale"] / np.sqrt(np.mean(x * x))     # the tensor's RMS is the measured scale, its rows spread around it
    if shape[-1] > 1:
        flat = x.reshape(-1, shape[-1])
        n, D = flat.shape
        col = rng.integers(0, D, n)
        ratio = min(m["outlier"], 0.9 * np.sqrt(D))           # |x| / RMS of a row is at most sqrt(D)
        rest = np.sum(flat * flat, axis=-1) - flat[np.arange(n), col] ** 2
        # the entry a with a / RMS(row with a) = ratio: a^2 = ratio^2 (rest + a^2) / D
        flat[np.arange(n), col] = rng.choice((-1.0, 1.0), n) * ratio * np.sqrt(rest / (D - ratio ** 2))
    return x


def gate_raw(rng: np.random.Generator, lead: tuple, H: int, K: int, A_log: np.ndarray,
             dt_bias: np.ndarray, run: int = GATE_RUN) -> np.ndarray:
    """g_raw [lead..., H, K] so that g = kda_gate(g_raw, A_log, dt_bias, lb) spans (lb, 0): the sigmoid's argument
    exp(A_log) * (g_raw + dt_bias) is drawn uniform in (-8, 8) (g from 3e-4 lb to 0.9997 lb); on the time axis
    (lead[-1], when there is one) a run of `run` steps holds a quarter of every head's channels at the bound."""
    a = np.exp(A_log)[:, None]                                    # [H, 1]
    target = rng.uniform(-8.0, 8.0, tuple(lead) + (H, K))
    g_raw = target / a - dt_bias.reshape(H, K)
    if len(lead) >= 2 and lead[-1] > 1:                           # [..., T, H, K]: runs along T
        T = lead[-1]
        n = min(run, T)
        start = int(rng.integers(0, T - n + 1))
        channels = rng.permutation(K)[: K // 4]
        sl = (Ellipsis, slice(start, start + n), slice(None), channels)
        g_raw[sl] = (12.0 / a - dt_bias.reshape(H, K)[:, channels])[None]
    return g_raw


def gate_coverage(g: np.ndarray, lower_bound: float) -> dict[str, float]:
    """How much of (lower_bound, 0) the gates g cover: `cover` the fraction of 20 equal bins holding a value,
    `at_bound` the fraction of values at the bound (<= GATE_AT_BOUND * lower_bound), `longest_run` the longest
    run of consecutive steps (axis -3 of [.., T, H, K]) a channel stays at the bound."""
    g = np.asarray(g, np.float64)
    bins = np.histogram(g, bins=20, range=(lower_bound, 0.0))[0]
    at = g <= GATE_AT_BOUND * lower_bound
    longest = 0
    if g.ndim >= 3:
        runs = np.zeros(g.shape[:-3] + g.shape[-2:], np.int64)
        for t in range(g.shape[-3]):
            runs = np.where(at[..., t, :, :], runs + 1, 0)
            longest = max(longest, int(runs.max()))
    return {"cover": float(np.mean(bins > 0)), "at_bound": float(np.mean(at)), "longest_run": float(longest)}


def gate_of(inputs: dict, lower_bound: float) -> np.ndarray:
    """The gates g a KDA case's inputs produce (k3ref.kda.kda_gate)."""
    return kda_gate(inputs["g_raw"], inputs["A_log"], inputs["dt_bias"], lower_bound)
