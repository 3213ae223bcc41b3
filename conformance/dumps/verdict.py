"""One report from the per-layer results: the source of a divergence, its carriers, tokens, exit code.

SOURCE: a sublayer that ADDS. The first layer (lowest index) with a sublayer row over budget (or a non-finite
engine value), and in it the first sublayer in compute order (attnres_mixer, mixer, attnres_mlp, mlp), at the
first step where that sublayer is over. The whole-layer row (the layer recomputed from its input alone) is
never the source: when it is over while every sublayer of the layer is within its own budget, the sublayers'
rounding was amplified through the layer (each sublayer judged on the engine's own input is correct), and the
report lists it under `amplification` with its numbers. CARRIERS: the later layers whose own added divergence
is within budget but whose input (from the free run) is further from the reference than the source layer's
input was: they pass on an error they did not make. (A fixed carried budget cannot tell this: the carried
divergence of a correct bf16 engine grows with depth, past what a small bug adds a few layers on.)
Exit code: 0 no source, every layer judged and the tokens agree (a disagreement where the reference's gap to
the engine's token is within what a correct engine of that dtype moves a logit gap, the measured token_tie,
is noted as a near tie, not failed); 1 otherwise; 2 is a bad dump (a DumpError, raised before any report
exists; `k3conf compare` maps it).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from pathlib import Path

from k3ref.config import K3Config

from .budgets import ROWS, TOKEN_TIE, Budgets, BudgetTable, default_table, geometry_of
from .divergence import Divergence
from .errors import DumpShapeError
from .format import Dump
from .free_run import FreeRun, checkpoint_misses_layers, free_run
from .precision import StateFingerprint, kda_state
from .recompute import LAYER_ROW, SUBLAYERS, LayerResult, Row, recompute_layer

ORDER = (*SUBLAYERS, LAYER_ROW)
SOURCES = SUBLAYERS       # the rows that can name a source: the whole-layer row only amplifies
RunLayer = Callable[[Dump | str | Path, str | Path, int], LayerResult]
MapLayers = Callable[[RunLayer, Path, Path, list[int]], list[LayerResult]]


@dataclasses.dataclass(frozen=True)
class LayerSummary:
    """One layer: the worst added row per sublayer (over steps), the worst carried divergence, the verdict
    ("source" | "over" | "carrier" | "ok")."""

    layer: int
    mixer: str
    mlp: str
    worst: dict[str, Row]
    carried: Divergence | None
    carried_budget: float | None          # what a carrier's carried rel_rms exceeds: the source's input's
    verdict: str
    per_step: dict[str, list[float]] = dataclasses.field(default_factory=dict)   # added rel RMS by step index

    def to_json(self) -> dict:
        return {"layer": self.layer, "mixer": self.mixer, "mlp": self.mlp,
                "worst": {k: r.to_json() for k, r in self.worst.items()},
                "carried": None if self.carried is None else self.carried.to_json(),
                "carried_budget": self.carried_budget, "verdict": self.verdict, "per_step": self.per_step}

    @classmethod
    def from_json(cls, d: dict) -> LayerSummary:
        return cls(int(d["layer"]), d["mixer"], d["mlp"], {k: Row.from_json(r) for k, r in d["worst"].items()},
                   None if d["carried"] is None else Divergence.from_json(d["carried"]),
                   None if d["carried_budget"] is None else float(d["carried_budget"]), d["verdict"],
                   {k: [float(x) for x in v] for k, v in d.get("per_step", {}).items()})


@dataclasses.dataclass(frozen=True)
class DumpReport:
    engine: str
    dtype: str
    tp_size: int
    layers: list[LayerSummary]
    source: tuple[int, str, int] | None        # (layer, sublayer, step)
    carriers: list[int]
    findings: list[str]                        # non-finite engine values: the engine's findings
    missing: list[int]                         # layers asked for that have no result
    free: FreeRun | None
    notes: list[str]
    token_tie: float                           # a differing token within this reference logit gap is a near tie
    amplification: list[str] = dataclasses.field(default_factory=list)   # whole-layer rows over, sublayers within
    budgets: dict[str, float] = dataclasses.field(default_factory=dict)  # the limit of every row it was judged by
    budget_source: str = ""                    # which table, which geometry
    kda_state: StateFingerprint | None = None  # the KDA state's inferred precision and drift (precision.py)

    @property
    def token_failures(self) -> list[int]:
        """Steps whose chosen token differs from the reference's by more than a near tie."""
        return [t.step for t in (self.free.tokens if self.free else [])
                if not t.agree and not (t.gap or 0.0) <= self.token_tie]

    @property
    def exit_code(self) -> int:
        return 1 if self.source is not None or self.missing or self.token_failures else 0

    def to_json(self) -> dict:
        return {"engine": self.engine, "dtype": self.dtype, "tp_size": self.tp_size,
                "layers": [s.to_json() for s in self.layers],
                "source": None if self.source is None else list(self.source), "carriers": self.carriers,
                "findings": self.findings, "missing": self.missing,
                "free": None if self.free is None else self.free.to_json(), "notes": self.notes,
                "token_tie": self.token_tie, "amplification": self.amplification, "budgets": self.budgets,
                "budget_source": self.budget_source,
                "kda_state": None if self.kda_state is None else self.kda_state.to_json(),
                "token_failures": self.token_failures,
                "exit_code": self.exit_code}

    @classmethod
    def from_json(cls, d: dict) -> DumpReport:
        src = d["source"]
        return cls(d["engine"], d["dtype"], int(d["tp_size"]), [LayerSummary.from_json(s) for s in d["layers"]],
                   None if src is None else (int(src[0]), str(src[1]), int(src[2])), [int(i) for i in d["carriers"]],
                   list(d["findings"]), [int(i) for i in d["missing"]],
                   None if d["free"] is None else FreeRun.from_json(d["free"]), list(d["notes"]), float(d["token_tie"]),
                   list(d.get("amplification", [])), {k: float(v) for k, v in d.get("budgets", {}).items()},
                   str(d.get("budget_source", "")),
                   None if d.get("kda_state") is None else StateFingerprint.from_json(d["kda_state"]))

    def dumps(self) -> str:
        """Strict JSON (non-finite floats are written as strings by Divergence.to_json)."""
        return json.dumps(self.to_json(), indent=1, allow_nan=False)


def _worst(rows: Iterable[Row]) -> dict[str, Row]:
    worst: dict[str, Row] = {}
    for r in rows:
        w = worst.get(r.sublayer)
        if w is None or (r.over, r.added.rel_rms) > (w.over, w.added.rel_rms):     # an over row first
            worst[r.sublayer] = r
    return {k: worst[k] for k in ORDER if k in worst}


def _first_over(result: LayerResult) -> tuple[str, int] | None:
    for sub in SOURCES:
        over = sorted(r.step for r in result.rows if r.sublayer == sub and r.over)
        if over:
            return sub, over[0]
    return None


def _worst_carried(free: FreeRun | None, layer: int) -> Divergence | None:
    found = [d for (_, la), d in free.carried.items() if la == layer] if free else []
    return max(found, key=lambda d: (d.nonfinite, d.rel_rms)) if found else None


def _amplified(res: LayerResult) -> str | None:
    """The whole-layer row over while every sublayer row of the layer is within budget, in words."""
    whole = [r for r in res.rows if r.sublayer == LAYER_ROW and r.over]
    if not whole or any(r.over for r in res.rows if r.sublayer in SOURCES):
        return None
    w = max(whole, key=lambda r: r.added.rel_rms)
    subs = ", ".join(f"{s} {max(r.added.rel_rms for r in res.rows if r.sublayer == s):.2e}"
                     for s in SOURCES if any(r.sublayer == s for r in res.rows))
    return (f"layer {res.layer}: whole layer {'; '.join(w.over_by)} at step {w.step}, while every sublayer is "
            f"within its budget (worst added rel RMS {subs}): the sublayers' rounding amplified through the layer, "
            f"not a source")


def table_budgets(table: BudgetTable | None, dump: Dump) -> tuple[Budgets, str]:
    """(dtype, row) -> limit for this dump's geometry from `table` (None: the committed one), and its name."""
    table = table or default_table()
    geometry = geometry_of(dump.config)
    return table.bound(geometry), f"{table.source} (geometry {geometry})"


def assemble(dump: Dump, layer_results: list[LayerResult], free: FreeRun | None,
             budgets: Budgets | None = None, *, wanted: Iterable[int] | None = None,
             notes: Iterable[str] = (), budget_source: str = "") -> DumpReport:
    """The report of `dump` from its layers' results (any order) and the free run (None: no carried); every
    row is judged against `budgets(dump.dtype, key)` for its sublayer, its gain (budgets.gain_key) and its
    routed experts (budgets.EXPERTS_GAIN), so a result can be re-judged without recomputing (default: the
    committed table at the dump's geometry)."""
    if budgets is None:
        budgets, budget_source = table_budgets(None, dump)
    results = [dataclasses.replace(r, rows=[w.judged(budgets, dump.dtype) for w in r.rows])
               for r in sorted(layer_results, key=lambda r: r.layer)]
    wanted = sorted(dump.layers if wanted is None else wanted)
    missing = [la for la in wanted if la not in {r.layer for r in results}]
    source: tuple[int, str, int] | None = None
    cb: float | None = None
    findings = list(dump.nonfinite())
    summaries: list[LayerSummary] = []
    for res in results:
        first = _first_over(res)
        carried = _worst_carried(free, res.layer)
        findings += [f"step {r.step} layer {res.layer} {r.sublayer}: {r.added.nonfinite} non-finite engine values"
                     for r in res.rows if r.added.nonfinite]
        if first is not None:
            verdict = "over"
            if source is None:
                source, verdict = (res.layer, first[0], first[1]), "source"
                cb = None if carried is None else carried.rel_rms
        elif cb is not None and carried is not None and not carried.rel_rms <= cb:
            verdict = "carrier"
        else:
            verdict = "ok"
        per_step = {sub: [r.added.rel_rms for r in sorted(res.rows, key=lambda r: r.step) if r.sublayer == sub]
                    for sub in ORDER}
        summaries.append(LayerSummary(res.layer, res.mixer, res.mlp, _worst(res.rows), carried, cb, verdict,
                                      {k: v for k, v in per_step.items() if v}))
    carriers = [s.layer for s in summaries if s.verdict == "carrier"]
    amplification = [a for a in map(_amplified, results) if a is not None]
    limits = {}
    for key in ROWS:
        try:
            limits[key] = budgets(dump.dtype, key)
        except ValueError:
            continue
    return DumpReport(dump.engine, dump.dtype, dump.tp_size, summaries, source, carriers, findings, missing, free,
                      list(notes), budgets(dump.dtype, TOKEN_TIE), amplification, limits, budget_source,
                      kda_state(results))


def check_checkpoint(dump: Dump, checkpoint: Path) -> None:
    """The dump's config must be the checkpoint's (else every shape and weight would be judged wrongly)."""
    mine, theirs = dump.config.to_json(), K3Config.from_json(checkpoint / "config.json").to_json()
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if differ:
        shown = ", ".join(f"{k}: dump {mine.get(k)!r} vs checkpoint {theirs.get(k)!r}" for k in differ[:6])
        raise DumpShapeError(f"dump {dump.path}: expected the checkpoint's config ({checkpoint}/config.json), "
                             f"found {len(differ)} differing fields: {shown}")


def _sequential(run_layer: RunLayer, path: Path, checkpoint: Path, layers: list[int]) -> list[LayerResult]:
    return [run_layer(path, checkpoint, la) for la in layers]


def compare_dump(path: str | Path, checkpoint: str | Path, *, layers: Iterable[int] | None = None,
                 free: bool = True, run_layer: RunLayer = recompute_layer,
                 map_layers: MapLayers | None = None, table: BudgetTable | None = None) -> DumpReport:
    """Open and check the dump, recompute its layers (`map_layers`: how to spread `run_layer` over them;
    default one after another here; a layer missing from its answer is reported missing), free-run it, and
    assemble the report. Raises DumpError for a bad dump."""
    path, checkpoint = Path(path), Path(checkpoint)
    dump = Dump.open(path)
    check_checkpoint(dump, checkpoint)
    wanted = sorted(dump.layers if layers is None else layers)
    bad = [la for la in wanted if la not in dump.layers]
    if bad:
        raise ValueError(f"layers: expected some of the dumped layers {list(dump.layers)}, found {bad}")
    results = (map_layers or _sequential)(run_layer, path, checkpoint, wanted)
    notes, ref = [], None
    if not free:
        notes.append("free run off: no carried divergence, no carriers, no token check")
    else:
        gone = checkpoint_misses_layers(checkpoint, dump.config)
        if gone:
            notes.append(f"no free run (no carried divergence, no token check): the checkpoint lacks layers {gone}")
        else:
            ref = free_run(dump, checkpoint, wanted)
    budgets, source = table_budgets(table, dump)
    return assemble(dump, results, ref, budgets, wanted=wanted, notes=notes, budget_source=source)
