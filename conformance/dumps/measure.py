"""Measure what a correct engine adds over many prompts: the committed budget table (budget_table.py).

    python -m conformance.dumps.measure --write                      # the committed table (minutes)
    python -m conformance.dumps.measure --configs tiny --dtypes bfloat16 --prompts 20 --out /tmp/t.json

records clean dumps from the correct PyTorch model (k3torch K3ForCausalLM, bf16 weights and stores with
fp32 accumulation, or float32) on the synthetic checkpoint of each config (seed 7), over `--prompts` prompts
per config and dtype: prompt i has rng seed CALIBRATION_SEED + i, a prefill length from PREFILLS (across
the 64-token KDA chunk and MLA page) and a number of greedy decode steps from DECODES, both in turn. Each dump
becomes its worst value per row (calibrate.dump_stats), and each row's limit MARGIN x the largest of them.
`--write` writes conformance/dumps/budget_table.py; `--out FILE` the same table as JSON (what `k3conf
calibrate` writes for a deployment). The prompts of tools/compare_rates.py start at other seeds: the rates it
publishes are measured on prompts the budgets never saw. Needs torch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from k3ref.config import K3Config
from k3ref.cpu_forward import K3CpuModel
from k3ref.tp_weights import synthetic_rank_shard
from k3ref.weights import synthetic_checkpoint

from .budgets import CONTROL_RATIO, FLOAT32_MARGIN, MARGIN, round_up
from .calibrate import DumpStats, dump_stats, table_json, write_json
from .control import judge_against
from .recorder import record_torch
from .recorder_ref import record_ref, record_ref_tp
from .verdict import compare_dump

CALIBRATION_SEED = 100_000
PREFILLS = (8, 1, 13, 63, 64, 65, 5, 31, 100, 129)   # tokens; 63 | 64 | 65 and 128 | 129 sit at chunk/page edges
DECODES = (3, 6, 1, 9)                                # greedy decode steps after the prefill
CHECKPOINT_SEED = 7
TABLE_MODULE = Path(__file__).with_name("budget_table.py")


def prompt_plan(n: int, seed0: int = CALIBRATION_SEED) -> list[tuple[int, int, int]]:
    """(rng seed, prefill length, decode steps) of prompts 0..n-1."""
    return [(seed0 + i, PREFILLS[i % len(PREFILLS)], DECODES[(i // len(PREFILLS)) % len(DECODES)])
            for i in range(n)]


def checkpoint_for(name: str, root: Path) -> Path:
    ckpt = root / f"{name}-ckpt"
    if not (ckpt / "config.json").exists():
        synthetic_checkpoint(K3Config.preset(name), CHECKPOINT_SEED, ckpt)
    return ckpt


def measure(configs: list[str], dtypes: list[str], n: int, root: Path, *, log=print) -> list[DumpStats]:
    """Per-dump worsts of `n` clean prompts per config and dtype."""
    import torch  # noqa: PLC0415 -- optional dependency, only the measurement records from torch

    from k3torch.modeling_k3 import K3ForCausalLM  # noqa: PLC0415 -- needs torch

    out = []
    for name in configs:
        ckpt, cfg = checkpoint_for(name, root), K3Config.preset(name)
        for dt in dtypes:
            model = K3ForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dt))
            t0 = time.perf_counter()
            for seed, length, new in prompt_plan(n):
                prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, length)
                dump = record_torch(model, prompt, new, root / "dump", overwrite=True)
                out.append(dump_stats(dump, ckpt))
            log(f"{name} {dt}: {n} dumps in {time.perf_counter() - t0:.0f} s")
    return out


def control_pairs(configs: list[str], n: int, root: Path, *, log=print) -> list[DumpStats]:
    """The worst ratio (either way) of two correct float32 engines' added divergence per layer and sublayer on
    the same prompt: k3torch against k3ref, and k3ref at TP 1 against TP 2; one DumpStats per pair."""
    import torch  # noqa: PLC0415 -- optional dependency, only the measurement records from torch

    from k3torch.modeling_k3 import K3ForCausalLM  # noqa: PLC0415 -- needs torch


    out = []
    for name in configs:
        ckpt, cfg = checkpoint_for(name, root), K3Config.preset(name)
        torch_model = K3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        ref_model = K3CpuModel.from_checkpoint(ckpt, dtype=np.float32)
        t0 = time.perf_counter()
        for seed, length, new in prompt_plan(n):
            prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, length)
            a = record_torch(torch_model, prompt, new, root / "a", overwrite=True)
            b = record_ref(ref_model, prompt, new, root / "b", overwrite=True)
            c = record_ref_tp(cfg.to_json(), lambda plan, r: synthetic_rank_shard(plan, r, CHECKPOINT_SEED)[0], 2,
                              prompt, new, root / "c", dtype=np.float32, overwrite=True)
            ra, rb, rc = (compare_dump(x, ckpt, free=False) for x in (a, b, c))
            worst = max(max(r.ratio for r in judge_against(x, y, 1.0).ratios)
                        for x, y in ((ra, rb), (rb, ra), (rb, rc), (rc, rb)))
            out.append(DumpStats(f"{a} {b} {c}", name, "float32", {"control_ratio": worst}))
        log(f"{name} control pairs: {n} prompts in {time.perf_counter() - t0:.0f} s")
    return out


def _literal(table: dict) -> str:
    """TABLE = {...} with one budget row per line (the module stays a readable table, not one value per line)."""
    head = {k: v for k, v in table.items() if k != "rows"}
    lines = ["TABLE = {"] + [f"    {k!r}: {v!r}," for k, v in head.items()] + ["    'rows': ["]
    lines += [f"        {r!r}," for r in table["rows"]]
    return "\n".join(lines + ["    ],", "}", ""])


def write_module(table: dict, path: Path = TABLE_MODULE) -> None:
    """The table as a Python module (TABLE = {...}), written atomically."""
    # ruff: the generated module's lines are as long as the measuring command and the table's reasons
    text = ("# ruff: noqa: E501\n"
            '"""The committed budget table, measured; generated, do not edit: re-measure with\n'
            f"`{table['command']}` (conformance/dumps/measure.py).\"\"\"\n\n"
            + _literal(table))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str]) -> None:
    import torch  # noqa: PLC0415 -- optional dependency

    p = argparse.ArgumentParser(prog="python -m conformance.dumps.measure", description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=["tiny", "k3geom"])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--prompts", type=int, default=120, help="clean prompts per config and dtype")
    p.add_argument("--margin", type=float, default=MARGIN, help=f"limit = margin x the largest (default {MARGIN})")
    p.add_argument("--float32-margin", type=float, default=FLOAT32_MARGIN,
                   help=f"the float32 rows' margin (default {FLOAT32_MARGIN})")
    p.add_argument("--control-pairs", type=int, default=30, help="prompts per config for the control_ratio row")
    p.add_argument("--write", action="store_true", help="write conformance/dumps/budget_table.py")
    p.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    p.add_argument("--work", type=Path, default=None, help="keep checkpoints and the scratch dump here")
    p.add_argument("--merge", type=Path, default=None, metavar="FILE",
                   help="a table (--out of an earlier run) whose rows this run did not measure are kept, its "
                        "command and prompts noted: one table from runs made one after the other")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m conformance.dumps.measure " + " ".join(argv)
    with tempfile.TemporaryDirectory() as tmp:
        log = lambda s: print(s, flush=True)  # noqa: E731
        stats = measure(a.configs, a.dtypes, a.prompts, a.work or Path(tmp), log=log)
        stats += control_pairs(a.configs, a.control_pairs, a.work or Path(tmp), log=log) if a.control_pairs else []
    plan = (f"{a.prompts} prompts per config and dtype: rng seeds {CALIBRATION_SEED}.., prefill lengths "
            f"{list(PREFILLS)} and decode steps {list(DECODES)} in turn; synthetic checkpoints (seed "
            f"{CHECKPOINT_SEED}) of {a.configs}; control_ratio: {a.control_pairs} prompts per config, the worst "
            "ratio of two correct float32 engines (k3torch vs k3ref, k3ref TP 1 vs TP 2) either way")
    table = table_json(stats, command=command, engine="correct k3torch model (bf16: bf16 weights and stores, fp32 "
                       "accumulation and state; float32)", prompts=plan, margin=a.margin,
                       dtype_margins={"float32": a.float32_margin})
    if a.merge:
        earlier = json.loads(a.merge.read_text())
        mine = {(r["geometry"], r["dtype"], r["row"]) for r in table["rows"]}
        def margin_of(r: dict) -> float:
            return a.float32_margin if r["dtype"] == "float32" and r["row"] != CONTROL_RATIO else a.margin
        kept = [dict(r, limit=round_up(margin_of(r) * r["measured"]["max"]), margin=margin_of(r))
                for r in earlier["rows"] if (r["geometry"], r["dtype"], r["row"]) not in mine]   # at this run's margins
        table["rows"] = sorted([*table["rows"], *kept], key=lambda r: (r["geometry"], r["dtype"], r["row"]))
        table["command"] = f"{earlier['command']} && {command}"
        table["prompts"] = f"{earlier['prompts']}; {plan}"
        table["carried_max"] = {**earlier["carried_max"], **table["carried_max"]}
    if a.write:
        write_module(table)
    if a.out:
        write_json(a.out, table)
    for r in table["rows"]:
        m = r["measured"]
        print(f"{r['geometry']:<7} {r['dtype']:<9} {r['row']:<20} limit {r['limit']:.3g}  max {m['max']:.3g}  "
              f"p99 {m['p99']:.3g}  p50 {m['p50']:.3g}  n {int(m['n'])}")


if __name__ == "__main__":
    main(sys.argv[1:])
