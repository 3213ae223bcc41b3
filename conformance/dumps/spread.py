"""One compare with its layers spread: in this process, over `--workers N` processes, or over torchrun ranks.

    report, run = compare_spread(dump_dir, checkpoint_dir, workers=2)

The steps are those of verdict.compare_dump (open and check the dump, check the checkpoint's config, recompute
each layer, free-run, assemble), with two differences that the spread needs: the float64 free run runs in this
process while the workers recompute the layers (it holds one layer's weights at a time too), and a worker that
died is named in the report's notes with the layers it held (verdict.assemble reports a layer without a result
as missing). `run` says how the work was spread (workers, ranks, seconds); it is kept out of the report so
that the report of one worker and of N are the same.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from .budgets import BudgetTable
from .distributed import run_ranks
from .format import Dump
from .free_run import FreeRun, checkpoint_misses_layers, free_run
from .recompute import LayerResult, recompute_layer
from .report_text import ranges
from .verdict import DumpReport, assemble, check_checkpoint, table_budgets
from .workers import LayerRuns, RunLayer, run_layers


def pick_layers(dump: Dump, layers: Iterable[int] | None) -> list[int]:
    """The layers to judge: `layers` (each must be dumped) or every dumped layer; ValueError names the strays."""
    wanted = sorted(set(dump.layers if layers is None else (int(x) for x in layers)))
    stray = [x for x in wanted if x not in dump.layers]
    if stray:
        raise ValueError(f"--layers: expected some of the dumped layers {list(dump.layers)}, found {stray}")
    if not wanted:
        raise ValueError("--layers: expected at least one layer, found none")
    return wanted


def compare_spread(path: str | Path, checkpoint: str | Path, *, layers: Iterable[int] | None = None,
                   workers: int = 1, free: bool = True, distributed: bool = False,
                   run_layer: RunLayer = recompute_layer,
                   table: BudgetTable | None = None) -> tuple[DumpReport, dict] | None:
    """(report, how it ran) of the dump at `path` against `checkpoint`; None on a torchrun rank other than 0.
    Raises DumpError for a bad dump, ValueError for layers the dump does not hold."""
    t0 = time.perf_counter()
    path, checkpoint = Path(path), Path(checkpoint)
    dump = Dump.open(path)
    check_checkpoint(dump, checkpoint)
    wanted = pick_layers(dump, layers)
    notes: list[str] = []
    meanwhile = None
    if free:
        gone = checkpoint_misses_layers(checkpoint, dump.config)
        if gone:
            notes.append(f"no free run (no carried divergence, no token check): the checkpoint lacks layers "
                         f"{ranges(gone)}")
        else:
            def meanwhile() -> FreeRun:
                return free_run(dump, checkpoint, wanted)
    run: dict = {"workers": workers, "distributed": distributed, "layers": wanted}
    if distributed:
        spread = run_ranks(dump, checkpoint, wanted, run_layer=run_layer, meanwhile=meanwhile)
        if spread is None:
            return None
        runs, ref, run["ranks"] = spread
    else:
        runs, ref = run_layers(dump, checkpoint, wanted, workers=workers, run_layer=run_layer, meanwhile=meanwhile)
    budgets, source = table_budgets(table, dump)
    report = assemble(dump, results_of(runs), ref, budgets, wanted=wanted, notes=notes + run_notes(runs),
                      budget_source=source)
    run["failures"] = runs.failures
    run["seconds"] = round(time.perf_counter() - t0, 3)
    return report, run


def results_of(runs: LayerRuns) -> list[LayerResult]:
    return [LayerResult.from_json(runs.results[layer]) for layer in sorted(runs.results)]


def run_notes(runs: LayerRuns) -> list[str]:
    """The workers that died and why each missing layer has no result, for the report's notes."""
    return [*runs.failures, *(f"layer {layer}: no result: {why}" for layer, why in sorted(runs.missing.items()))]
