"""How much divergence a correct engine adds per sublayer, by the engine's activation dtype.

Each row is a budget for the ADDED divergence of one sublayer (engine output vs the float64 recompute from the
engine's own input), with the reason and the numbers it was set from: its relative RMS (row "<sublayer>"), its
gain |g - 1| (row "<sublayer>.gain", divergence.py), and the routed experts' pooled gain score inside the mlp
row (row "experts.gain", experts.py). A row is over when any of its measures is over. The bf16 rows come
from the correct bf16 PyTorch model (k3torch, bf16 weights and stores, fp32 accumulation) recorded on the
`tiny` and `k3geom` synthetic checkpoints: the largest added divergence over every layer and step of the clean
dumps, times MARGIN. A budget is never raised to let a dump pass: a correct engine over it is a finding
about the budget, to be re-measured and the row's numbers updated.

Re-measure: `python -m conformance.dumps.measure` (records clean dumps from k3torch and prints the worst
added divergence and gain per dtype and sublayer, the experts' score, the carried divergence, route and token
near-tie gaps, and what a planted 1% error in one expert's w2 scales scores).
"""
from __future__ import annotations

import dataclasses

SUBLAYER_ROWS = ("attnres_mixer", "mixer", "attnres_mlp", "mlp", "layer")
EXPERTS_GAIN = "experts.gain"   # the routed experts' pooled gain score (experts.py), inside the mlp row


def gain_key(sublayer: str) -> str:
    """The row of a sublayer's gain budget: |g - 1|, g = <e, r> / <r, r> (divergence.py)."""
    return f"{sublayer}.gain"


GAIN_ROWS = (*(gain_key(s) for s in SUBLAYER_ROWS), EXPERTS_GAIN)
ROUTE_TIE = "route_tie"     # router choices within this choice-score gap of a tie follow the engine
TOKEN_TIE = "token_tie"     # a token choice differing from the reference within this logit gap is a near tie


@dataclasses.dataclass(frozen=True)
class Budget:
    dtype: str
    sublayer: str
    limit: float                  # relative RMS (sublayers); choice-score gap (route_tie); logit gap (token_tie)
    reason: str
    measured: dict[str, float]    # the worst clean added divergence per config it was set from


MARGIN = 2.0    # budget = MARGIN x the worst clean measurement over both configs, rounded up to 2 digits

# Measured 2026-12-04 with `python -m conformance.dumps.measure` (3 prompts of 5..13 tokens + 3 greedy decode
# steps each, every layer and step): the worst clean value per config. The carried divergence has no budget
# (it grows with depth in a correct engine: worst clean bf16 1.3e-1 on tiny, 1.9e-2 on k3geom; float32
# 4.3e-6, 9.3e-7); carriers are judged against the source's own input instead (see verdict.py).
_BF16 = "correct bf16 k3torch model (bf16 weights and stores, fp32 accumulation): 2 x worst clean added"
_F32 = "correct float32 k3torch model: 2 x worst clean added (float32 rounding vs float64)"
_F64 = "float64 engine: only summation order can differ from the recompute (k3ref's own dump measures 0)"
_BF16_GAIN = ("correct bf16 k3torch model: 2 x worst clean |g - 1|, g = <e, r> / <r, r> (unbiased rounding barely "
              "moves it; a scale error on the sublayer's output moves it by the error)")
_BF16_EXPERTS = ("correct bf16 k3torch model (experts.in in bf16, as its matmuls take it): 2 x the worst clean "
                 "pooled expert gain score |g - 1| sqrt(n_eff); one expert's w2 scales 1% off (layer 1, its most "
                 "routed expert) score 1.69e-2 .. 2.57e-2, 3.0x the budget or more")
_F32_GAIN = "correct float32 k3torch model: 2 x worst clean |g - 1| (float32 rounding vs float64)"
_F32_EXPERTS = ("correct float32 k3torch model: 2 x the worst clean pooled expert gain score; one expert's w2 "
                "scales 1% off score 1.81e-2 .. 2.66e-2")
_ROUTE = ("near-tie routing: 2 x the largest choice-score gap a clean engine's flipped route showed; a dropped "
          "router bias (std 0.05 in the synthetic checkpoints) moves choices far more")
_TOKEN = "near-tie token: 2 x the largest |engine - reference| logit at a clean step's last position"

BUDGETS: tuple[Budget, ...] = (
    Budget("bfloat16", "attnres_mixer", 4.5e-3, _BF16, {"tiny": 2.237e-3, "k3geom": 1.977e-3}),
    Budget("bfloat16", "mixer", 2.7e-2, _BF16, {"tiny": 1.347e-2, "k3geom": 6.612e-3}),
    Budget("bfloat16", "attnres_mlp", 5.0e-3, _BF16, {"tiny": 2.120e-3, "k3geom": 2.487e-3}),
    Budget("bfloat16", "mlp", 1.2e-2, _BF16, {"tiny": 5.921e-3, "k3geom": 5.300e-3}),
    Budget("bfloat16", "layer", 2.8e-2, _BF16, {"tiny": 1.379e-2, "k3geom": 9.272e-3}),
    Budget("bfloat16", gain_key("attnres_mixer"), 2.7e-3, _BF16_GAIN, {"tiny": 1.276e-3, "k3geom": 1.318e-3}),
    Budget("bfloat16", gain_key("mixer"), 8.4e-3, _BF16_GAIN, {"tiny": 4.195e-3, "k3geom": 2.921e-3}),
    Budget("bfloat16", gain_key("attnres_mlp"), 3.5e-3, _BF16_GAIN, {"tiny": 1.137e-3, "k3geom": 1.729e-3}),
    Budget("bfloat16", gain_key("mlp"), 4.7e-3, _BF16_GAIN, {"tiny": 2.311e-3, "k3geom": 1.603e-3}),
    Budget("bfloat16", gain_key("layer"), 7.7e-3, _BF16_GAIN, {"tiny": 3.810e-3, "k3geom": 2.619e-3}),
    Budget("bfloat16", EXPERTS_GAIN, 5.7e-3, _BF16_EXPERTS, {"tiny": 2.807e-3, "k3geom": 2.307e-3}),
    Budget("bfloat16", ROUTE_TIE, 1.6e-2, _ROUTE, {"tiny": 7.636e-3, "k3geom": 8.274e-4}),
    Budget("bfloat16", TOKEN_TIE, 0.44, _TOKEN, {"tiny": 0.2192, "k3geom": 0.06856}),
    Budget("float32", "attnres_mixer", 3.7e-7, _F32, {"tiny": 1.839e-7, "k3geom": 1.491e-7}),
    Budget("float32", "mixer", 1.5e-6, _F32, {"tiny": 6.154e-7, "k3geom": 7.048e-7}),
    Budget("float32", "attnres_mlp", 3.4e-7, _F32, {"tiny": 1.529e-7, "k3geom": 1.656e-7}),
    Budget("float32", "mlp", 8.2e-7, _F32, {"tiny": 4.081e-7, "k3geom": 3.168e-7}),
    Budget("float32", "layer", 1.6e-6, _F32, {"tiny": 7.976e-7, "k3geom": 5.690e-7}),
    Budget("float32", gain_key("attnres_mixer"), 2.2e-7, _F32_GAIN, {"tiny": 1.058e-7, "k3geom": 1.099e-7}),
    Budget("float32", gain_key("mixer"), 6.1e-7, _F32_GAIN, {"tiny": 1.768e-7, "k3geom": 3.032e-7}),
    Budget("float32", gain_key("attnres_mlp"), 2.7e-7, _F32_GAIN, {"tiny": 1.317e-7, "k3geom": 1.194e-7}),
    Budget("float32", gain_key("mlp"), 2.7e-7, _F32_GAIN, {"tiny": 1.152e-7, "k3geom": 1.349e-7}),
    Budget("float32", gain_key("layer"), 5.3e-7, _F32_GAIN, {"tiny": 2.614e-7, "k3geom": 2.067e-7}),
    Budget("float32", EXPERTS_GAIN, 4.6e-7, _F32_EXPERTS, {"tiny": 2.257e-7, "k3geom": 1.653e-7}),
    Budget("float32", ROUTE_TIE, 1.0e-4, "no clean float32 route flipped; 20x the worst carried error (4.3e-6)",
           {"tiny": 0.0, "k3geom": 0.0}),
    Budget("float32", TOKEN_TIE, 3.7e-5, _TOKEN, {"tiny": 1.830e-5, "k3geom": 5.429e-6}),
    *(Budget("float64", s, 1.0e-10, _F64, {}) for s in SUBLAYER_ROWS + GAIN_ROWS),
    Budget("float64", ROUTE_TIE, 1.0e-9, _F64, {}),
    Budget("float64", TOKEN_TIE, 1.0e-9, _F64, {}),
)
# No float16 rows: no float16 engine has been measured (k3torch has no float16 model); a float16 dump is refused
# by name rather than judged by borrowed numbers.
_TABLE = {(b.dtype, b.sublayer): b for b in BUDGETS}


def budget_row(dtype: str, sublayer: str) -> Budget:
    """The row for (engine dtype, sublayer or "carried"); a ValueError names the rows there are."""
    row = _TABLE.get((dtype, sublayer))
    if row is None:
        have = sorted({b.dtype for b in BUDGETS})
        raise ValueError(f"budget: expected an engine dtype in {have} and a sublayer in "
                         f"{[*SUBLAYER_ROWS, *GAIN_ROWS, TOKEN_TIE, ROUTE_TIE]}, found ({dtype!r}, {sublayer!r})")
    return row


def budget_for(dtype: str, sublayer: str) -> float:
    return budget_row(dtype, sublayer).limit
