"""Budgets from clean dumps: each dump's worst value per budget row, and the table those make.

    stats = [dump_stats(path, checkpoint) for path in clean_dumps]
    table = table_json(stats, command="k3conf calibrate ...", engine="my engine, fp8 KV")
    write_table(Path("budgets.json"), table)          # k3conf compare --budgets budgets.json

A dump's worst value of a row is the largest over its layers and steps of: the added relative RMS of a
sublayer, its |gain|, the routed experts' pooled gain score, the choice-score gap of a route the engine chose
differently from the recompute (every differing route is followed, so a flip adds nothing to the other rows),
and the token shift (free_run.StepTokens.shift). Its row's limit is MARGIN x the largest of those worsts over
the dumps, rounded up to 2 digits; the table keeps the distribution (max, p50, p90, p99, n) beside it, so a
reader sees how far the margin stands above the tail. The unit is the dump because the verdict is per dump: a
correct dump is blamed when its own worst value of any row is over.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .budgets import (
    CONTROL_RATIO,
    EXPERTS_GAIN,
    MARGIN,
    ROUTE_TIE,
    TOKEN_TIE,
    BudgetTable,
    gain_key,
    geometry_of,
    round_up,
)
from .format import Dump
from .free_run import checkpoint_misses_layers, free_run
from .recompute import recompute_layer

CARRIED = "carried"    # measured and reported, never a budget (a correct engine's grows with depth)


@dataclasses.dataclass(frozen=True)
class DumpStats:
    """One clean dump's worst value per row (budgets.ROWS plus "carried")."""

    path: str
    geometry: str
    dtype: str
    worst: dict[str, float]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def dump_stats(path: str | Path, checkpoint: str | Path) -> DumpStats:
    """The worst value per row of the clean dump at `path` (recomputed here, every layer, one at a time)."""
    dump = Dump.open(path)
    worst: dict[str, float] = {}

    def put(key: str, x: float) -> None:
        if math.isfinite(x):
            worst[key] = max(worst.get(key, 0.0), x)
    for layer in dump.layers:
        for r in recompute_layer(dump, checkpoint, layer, route_tie=math.inf).rows:
            put(r.sublayer, r.added.rel_rms)
            put(gain_key(r.sublayer), abs(r.added.gain))
            put(ROUTE_TIE, r.forced_gap)
            if r.experts is not None and r.experts.worst is not None:
                put(EXPERTS_GAIN, r.experts.worst.score)
    if not checkpoint_misses_layers(checkpoint, dump.config):
        ref = free_run(dump, checkpoint, route_tie=math.inf)
        for t in ref.tokens:
            put(TOKEN_TIE, t.shift or 0.0)
        for d in ref.carried.values():
            put(CARRIED, d.rel_rms)
    return DumpStats(str(path), geometry_of(dump.config), dump.dtype, worst)


def table_json(stats: Iterable[DumpStats], *, command: str, engine: str, prompts: str = "",
               margin: float = MARGIN, dtype_margins: dict[str, float] | None = None) -> dict:
    """The budget table (budgets.BudgetTable.from_json reads it) of these clean dumps: one row per geometry,
    dtype and measured row; a dtype in `dtype_margins` takes its own margin (not the control_ratio row, which
    holds for every dtype)."""
    groups: dict[tuple[str, str, str], list[float]] = {}
    for s in stats:
        for key, x in s.worst.items():
            groups.setdefault((s.geometry, s.dtype, key), []).append(x)
    rows = []
    for (geometry, dtype, key), xs in sorted(groups.items()):
        a = np.asarray(xs, np.float64)
        measured = {"n": len(xs), "max": float(a.max()), **{f"p{q}": float(np.quantile(a, q / 100))
                                                             for q in (50, 90, 99)}}
        if key == CARRIED:
            continue
        m = margin if key == CONTROL_RATIO else (dtype_margins or {}).get(dtype, margin)
        rows.append({"geometry": geometry, "dtype": dtype, "row": key, "limit": round_up(m * measured["max"]),
                     "margin": m, "measured": measured})
    carried = {f"{g} {d}": max(xs) for (g, d, k), xs in sorted(groups.items()) if k == CARRIED}
    return {"format": "k3conf-budgets", "version": 1, "command": command, "engine": engine, "prompts": prompts,
            "margin": margin, "carried_max": carried, "rows": rows}


def write_json(path: Path, table: dict) -> None:
    """The table as JSON, written atomically (a temporary file in the same directory, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_table(path: Path) -> BudgetTable:
    """A BudgetTable from a JSON file written by write_json."""
    return BudgetTable.from_json(json.loads(path.read_text()), str(path))
