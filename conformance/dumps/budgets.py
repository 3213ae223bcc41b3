"""How much divergence a correct engine adds per sublayer, by the dump's geometry and the engine's dtype.

Each row is a budget for one measure: the ADDED divergence of one sublayer (engine output vs the float64
recompute from the engine's own input) as a relative RMS (row "<sublayer>"), its gain |g - 1| (row
"<sublayer>.gain", divergence.py), the routed experts' pooled gain score inside the mlp row (row
"experts.gain", experts.py), the choice-score gap at which a clean engine's route flipped (row "route_tie")
and how far a clean engine moves the gap between two logits of the reference (row "token_tie", the near-tie
allowance of a greedy token).

The rows are data, measured: `budget_table.py` is written by `python -m conformance.dumps.measure --write`
(clean dumps of the correct PyTorch model over many prompts, prefill lengths and decode steps per shipped
config and dtype; calibrate.py turns each dump into its worst value per row, and a row's limit is MARGIN x the
largest of those over every dump, rounded up to 2 digits). `k3conf calibrate DUMPS... --out FILE` derives the
same table from a deployment's own clean dumps; `k3conf compare --budgets FILE` judges by it. A budget is
never raised to let a dump pass: a correct engine over it is a finding about the budget, to be re-measured.

Rows are keyed (geometry, dtype, row). The geometry is the shipped preset whose config the dump's is
(`geometry_of`); a dump of another geometry is judged by the largest row of that dtype over every measured
geometry (geometry "any"), and the report says so.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from k3ref.config import K3Config

from .budget_table import TABLE

SUBLAYER_ROWS = ("attnres_mixer", "mixer", "attnres_mlp", "mlp", "layer")
EXPERTS_GAIN = "experts.gain"   # the routed experts' pooled gain score (experts.py), inside the mlp row


def gain_key(sublayer: str) -> str:
    """The row of a sublayer's gain budget: |g - 1|, g = <e, r> / <r, r> (divergence.py)."""
    return f"{sublayer}.gain"


GAIN_ROWS = (*(gain_key(s) for s in SUBLAYER_ROWS), EXPERTS_GAIN)
ROUTE_TIE = "route_tie"     # router choices within this choice-score gap of a tie follow the engine
TOKEN_TIE = "token_tie"     # a token choice differing from the reference within this logit gap is a near tie
ROWS = (*SUBLAYER_ROWS, *GAIN_ROWS, ROUTE_TIE, TOKEN_TIE)
CONTROL_RATIO = "control_ratio"   # candidate added / control added, per sublayer, past which a row is over (control.py)
ANY = "any"                 # the geometry of a row that holds for a dump of any geometry
# limit = MARGIN x the largest per-dump worst value of the clean dumps (rounded up). 1.5: over 150 dumps per config
# and dtype the bf16 clean tail is short (tiny bf16 mixer: p99 2.2e-2, max 2.3e-2), and 2.0 let a KDA gate-bound bug
# that adds 4.3e-2 pass. float32 rows take FLOAT32_MARGIN: their tail is longer (tiny float32 mixer max 1.7 x its
# p99; a fresh k3geom prompt reached 1.57 x the 150-prompt max) and a layer bug adds 1e3 x more than float32
# rounding, so a wide margin costs no bug. Both false-source rates are measured on fresh prompts
# (docs/dumps_compare.md).
MARGIN = 1.5
FLOAT32_MARGIN = 3.0
Budgets = Callable[[str, str], float]     # (engine dtype, row) -> limit, for one geometry


@dataclasses.dataclass(frozen=True)
class Budget:
    geometry: str
    dtype: str
    sublayer: str
    limit: float                  # relative RMS (sublayers); |g - 1| (gain rows); choice-score gap; logit gap
    reason: str
    measured: dict[str, float]    # the distribution it was set from: max, p50, p90, p99 of per-dump worsts, n


def round_up(x: float, digits: int = 2) -> float:
    """x rounded up to `digits` significant digits (0 stays 0)."""
    if x <= 0 or not math.isfinite(x):
        return x
    e = math.floor(math.log10(x)) - (digits - 1)
    return float(f"{math.ceil(round(x / 10 ** e, 9)) * 10 ** e:.{digits}g}")


def geometry_of(config: K3Config | Mapping[str, Any]) -> str:
    """The shipped preset whose config this is ("tiny", "k3geom", "small", "k3"), else "other"."""
    mine = config.to_json() if isinstance(config, K3Config) else K3Config.from_json(config).to_json()
    for name in ("tiny", "k3geom", "small", "k3"):
        if K3Config.preset(name).to_json() == mine:
            return name
    return "other"


_F64 = "float64 engine: only summation order can differ from the recompute (k3ref's own dump measures 0)"
FLOAT64 = tuple(Budget(ANY, "float64", r, 1.0e-10 if r in SUBLAYER_ROWS + GAIN_ROWS else 1.0e-9, _F64, {})
                for r in ROWS)


class BudgetTable:
    """Every budget row, keyed (geometry, dtype, row); `source` names the measurement that made it."""

    def __init__(self, rows: list[Budget], source: str):
        self.rows = {(b.geometry, b.dtype, b.sublayer): b for b in rows}
        self.source = source

    @property
    def dtypes(self) -> list[str]:
        return sorted({d for _, d, _ in self.rows})

    def row(self, geometry: str, dtype: str, key: str) -> Budget:
        """The row for the geometry, else the largest of that dtype over every geometry (geometry "any"); a
        control_ratio row, measured at one dtype, holds for any."""
        exact = self.rows.get((geometry, dtype, key)) or self.rows.get((ANY, dtype, key))
        if exact is not None:
            return exact
        same = [b for (_, d, k), b in self.rows.items() if (d == dtype or key == CONTROL_RATIO) and k == key]
        if not same:
            raise ValueError(f"budget: expected an engine dtype in {self.dtypes} and a row in {list(ROWS)}, "
                             f"found ({dtype!r}, {key!r}) ({self.source})")
        top = max(same, key=lambda b: b.limit)
        return dataclasses.replace(top, geometry=ANY, reason=f"no rows measured for geometry {geometry!r}: the "
                                   f"largest over {sorted(b.geometry for b in same)} ({top.reason})")

    def bound(self, geometry: str) -> Budgets:
        """(dtype, row) -> limit for dumps of this geometry."""
        return lambda dtype, key: self.row(geometry, dtype, key).limit

    def for_report(self, geometry: str, dtype: str) -> list[Budget]:
        out = []
        for key in ROWS:
            try:
                out.append(self.row(geometry, dtype, key))
            except ValueError:
                continue
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any], source: str = "") -> BudgetTable:
        """A table written by calibrate.table_json (plus the float64 rows, which are not measured)."""
        if d.get("format") != "k3conf-budgets" or d.get("version") != 1:
            raise ValueError(f"budget table {source}: expected format 'k3conf-budgets' version 1, found "
                             f"{d.get('format')!r} version {d.get('version')!r} (write one with `k3conf calibrate`)")
        rows = [Budget(r["geometry"], r["dtype"], r["row"], float(r["limit"]), _reason(d, r),
                       {k: float(v) for k, v in r["measured"].items()}) for r in d["rows"]]
        have = {(b.geometry, b.dtype, b.sublayer) for b in rows}
        return cls(rows + [b for b in FLOAT64 if (b.geometry, b.dtype, b.sublayer) not in have],
                   source or str(d.get("command", "")))


def _reason(d: Mapping[str, Any], r: Mapping[str, Any]) -> str:
    m = r["measured"]
    return (f"{r.get('margin', d['margin']):g} x the largest of {int(m['n'])} clean dumps' worst (max {m['max']:.3g}, "
            f"p99 {m['p99']:.3g}, p50 {m['p50']:.3g}); {d['engine']}; `{d['command']}`")


def _default() -> BudgetTable:
    return BudgetTable.from_json(TABLE, "conformance/dumps/budget_table.py")


_DEFAULT: list[BudgetTable] = []


def default_table() -> BudgetTable:
    """The committed table (budget_table.py), loaded once."""
    if not _DEFAULT:
        _DEFAULT.append(_default())
    return _DEFAULT[0]


def budget_row(dtype: str, sublayer: str, geometry: str = ANY) -> Budget:
    """The committed row for (engine dtype, row) at `geometry` ("any": the largest over geometries)."""
    return default_table().row(geometry, dtype, sublayer)


def budget_for(dtype: str, sublayer: str, geometry: str = ANY) -> float:
    return budget_row(dtype, sublayer, geometry).limit
