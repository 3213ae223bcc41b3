"""The error rates of `k3conf compare`'s verdict, measured: how often a correct engine is blamed, and how often a
planted single-layer bug is named at its layer and sublayer.

    python tools/compare_rates.py clean --config tiny --dtype bfloat16 --prompts 100 --out rates/clean-tiny-bf16.json
    python tools/compare_rates.py bugs --config tiny --dtype bfloat16 --prompts 10 --out rates/bugs-tiny-bf16.json

clean: the correct PyTorch model (k3torch, synthetic checkpoint seed 7) over `--prompts` prompts whose rng seeds
start at FRESH_SEED (the budgets were measured from seeds 100000 on: conformance/dumps/measure.py), prefill
lengths and decode steps in turn as there. Counted: dumps with a source named (false sources), dumps with a token
failure, greedy flips judged near ties, and layers whose whole-layer row was amplification only.
bugs: every kind of conformance.dumps.planted planted in each of up to LAYERS_PER_BUG layers of its kind, each
(kind, layer) over `--prompts` prompts; every third run writes a TP-2 dump (head- and vocab-split ranks).
Counted per (kind, layer): named right (the source is that layer and the expected sublayer), named at a correct
layer instead (the worst outcome: listed with its numbers), named at the right layer but another sublayer, and
missed (no source). Each result is printed as a Markdown table and written (JSON, atomically) to --out. Needs
torch; one process, one thread.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from conformance.dumps.calibrate import write_json
from conformance.dumps.format import Dump
from conformance.dumps.measure import checkpoint_for, prompt_plan
from conformance.dumps.planted import EXPECTED_SUBLAYER, LAYER_KIND, plant
from conformance.dumps.verdict import DumpReport, compare_dump
from k3ref.config import K3Config

FRESH_SEED = 1            # never a calibration seed (those start at measure.CALIBRATION_SEED)
LAYERS_PER_BUG = 3


def layers_of_kind(cfg: K3Config, kind: str) -> list[int]:
    """Layers a bug of `kind` can be planted in; the AttnRes bugs skip layer 0 (its mixer AttnRes has one
    source, so a query error changes nothing there)."""
    ok = {"kda": lambda i: not cfg.is_mla(i), "mla": cfg.is_mla, "moe": lambda i: not cfg.mlp_is_dense(i),
          "dense": cfg.mlp_is_dense, "any": lambda i: i > 0}[kind]
    return [i for i in range(cfg.num_hidden_layers) if ok(i)]


def spread(xs: list[int], n: int) -> list[int]:
    """Up to n of xs, first, last and evenly between."""
    if len(xs) <= n:
        return xs
    return sorted({xs[round(i * (len(xs) - 1) / (n - 1))] for i in range(n)})


def corpus(config: str) -> list[tuple[str, int]]:
    cfg = K3Config.preset(config)
    return [(bug, layer) for bug in EXPECTED_SUBLAYER for layer in spread(layers_of_kind(cfg, LAYER_KIND[bug]),
                                                                          LAYERS_PER_BUG)]


def _model(ckpt: Path, dtype: str):
    import torch  # noqa: PLC0415 -- optional dependency: the engines measured are torch models

    from k3torch.modeling_k3 import K3ForCausalLM  # noqa: PLC0415 -- needs torch

    return K3ForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype))


def _record(model, cfg: K3Config, seed: int, length: int, new: int, out: Path, tp_size: int = 1) -> Path:
    from conformance.dumps.recorder import record_torch  # noqa: PLC0415 -- needs torch

    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, length)
    return record_torch(model, prompt, new, out, overwrite=True, tp_size=tp_size)


def _numbers(report: DumpReport) -> str:
    if report.source is None:
        return "no source"
    layer, sub, step = report.source
    row = next(s for s in report.layers if s.layer == layer).worst.get(sub)
    return f"layer {layer} {sub} step {step}: " + ("; ".join(row.over_by) if row is not None else "")


def clean(config: str, dtype: str, n: int, root: Path, seed0: int = FRESH_SEED) -> dict:
    ckpt, cfg = checkpoint_for(config, root), K3Config.preset(config)
    model = _model(ckpt, dtype)
    false, tokens, ties, amplified, flips = [], [], 0, 0, 0
    t0 = time.perf_counter()
    for seed, length, new in prompt_plan(n, seed0):
        report = compare_dump(_record(model, cfg, seed, length, new, root / "dump"), ckpt)
        if report.source is not None:
            false.append({"seed": seed, "prefill": length, "decode": new, "source": _numbers(report)})
        if report.token_failures:
            tokens.append({"seed": seed, "prefill": length, "decode": new, "steps": report.token_failures})
        assert report.free is not None
        differ = [t for t in report.free.tokens if not t.agree]
        flips += len(differ)
        ties += len(differ) - len(report.token_failures)
        amplified += len(report.amplification)
    return {"config": config, "dtype": dtype, "prompts": n, "seeds": f"{seed0}..{seed0 + n - 1}",
            "false_sources": len(false), "token_failures": len(tokens), "greedy_flips": flips, "near_ties": ties,
            "amplified_layers": amplified, "false_source_cases": false, "token_failure_cases": tokens,
            "seconds": round(time.perf_counter() - t0, 1)}


def _busiest_expert(dump: Path, layer: int) -> int:
    d = Dump.open(dump)
    return int(np.argmax(np.bincount(np.concatenate([d.get(s.index, f"layers.{layer}.router.ids").ravel()
                                                     for s in d.steps]))))


def _inactive(clean: Path, buggy: Path, layer: int) -> bool:
    """The planted layer computed exactly what the correct model did on this prompt (a bug that the prompt does
    not reach: a prefill-only MLA scale error with one prefill token, a router bias that changes no choice):
    nothing to find, so the run is left out of the rate and counted apart."""
    a, b = Dump.open(clean), Dump.open(buggy)
    names = [f"layers.{layer}.{k}" for k in ("h", "a", "m", "f")]
    return all(np.array_equal(a.get(s.index, k), b.get(s.index, k)) for s in a.steps for k in names
               if a.has(s.index, k))


def bugs(config: str, dtype: str, n: int, root: Path, only: list[str] | None = None) -> dict:
    ckpt, cfg = checkpoint_for(config, root), K3Config.preset(config)
    rows: list[dict[str, Any]] = []
    exceptions: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    runs = 0
    clean_model = _model(ckpt, dtype)
    plan = prompt_plan(n, FRESH_SEED)
    correct = {seed: _record(clean_model, cfg, seed, length, new, root / f"clean-{seed}") for seed, length, new in plan}
    for bug, layer in corpus(config):
        if only and bug not in only:
            continue
        counts = {"right": 0, "correct_layer_blamed": 0, "other_sublayer": 0, "later_layer": 0, "missed": 0,
                  "inactive": 0}
        for seed, length, new in plan:
            kwargs = {}
            if bug == "expert_scale":
                kwargs["expert"] = _busiest_expert(correct[seed], layer)
            model = _model(ckpt, dtype)
            plant(model, bug, layer, **kwargs)
            tp = 2 if runs % 3 == 2 else 1
            runs += 1
            dump = _record(model, cfg, seed, length, new, root / f"dump-tp{tp}", tp)
            if _inactive(correct[seed], dump, layer):
                counts["inactive"] += 1
                continue
            report = compare_dump(dump, ckpt)
            src = report.source
            if src is not None and src[:2] == (layer, EXPECTED_SUBLAYER[bug]):
                counts["right"] += 1
                continue
            kind = ("missed" if src is None else "correct_layer_blamed" if src[0] < layer
                    else "other_sublayer" if src[0] == layer else "later_layer")
            counts[kind] += 1
            exceptions.append({"bug": bug, "layer": layer, "seed": seed, "prefill": length, "decode": new, "tp": tp,
                               "outcome": kind, "report": _numbers(report)})
        rows.append({"bug": bug, "layer": layer, "sublayer": EXPECTED_SUBLAYER[bug], "runs": n - counts["inactive"],
                     **counts})
    total = sum(r["runs"] for r in rows)
    right = sum(r["right"] for r in rows)
    return {"config": config, "dtype": dtype, "prompts_per_bug": n, "seeds": f"{FRESH_SEED}..{FRESH_SEED + n - 1}",
            "runs": total, "named_right": right, "rate": right / total if total else None,
            "correct_layer_blamed": sum(r["correct_layer_blamed"] for r in rows),
            "inactive": sum(r["inactive"] for r in rows), "rows": rows,
            "exceptions": exceptions, "seconds": round(time.perf_counter() - t0, 1)}


def markdown(result: dict) -> str:
    if "rows" not in result:
        r = result
        return (f"| {r['config']} | {r['dtype']} | {r['prompts']} | {r['false_sources']} | {r['token_failures']} | "
                f"{r['greedy_flips']} ({r['near_ties']} near ties) | {r['amplified_layers']} |")
    lines = [f"{result['config']} {result['dtype']}: {result['named_right']} of {result['runs']} named right "
             f"({100 * (result['rate'] or 0):.1f}%), a correct layer blamed {result['correct_layer_blamed']} times; "
             f"{result['inactive']} runs left out (the bug did not change its layer on that prompt)",
             "", "| bug | layer | sublayer | runs | right | correct layer blamed | other sublayer | later layer "
             "| missed | inactive |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['bug']} | {r['layer']} | {r['sublayer']} | {r['runs']} | {r['right']} | "
              f"{r['correct_layer_blamed']} | {r['other_sublayer']} | {r['later_layer']} | {r['missed']} | "
              f"{r['inactive']} |"
              for r in result["rows"]]
    lines += [f"- {e['bug']} layer {e['layer']} seed {e['seed']} (prefill {e['prefill']}, decode {e['decode']}, "
              f"TP {e['tp']}): {e['outcome']}: {e['report']}" for e in result["exceptions"]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import torch  # noqa: PLC0415 -- optional dependency

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["clean", "bugs"])
    p.add_argument("--config", default="tiny", choices=["tiny", "k3geom"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--seed0", type=int, default=FRESH_SEED, help="clean: the first prompt's rng seed")
    p.add_argument("--bugs", nargs="*", default=None, help="only these planted kinds")
    p.add_argument("--work", type=Path, default=None, help="keep checkpoints and scratch dumps here")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = a.work or Path(tmp)
        result = (clean(a.config, a.dtype, a.prompts, root, a.seed0) if a.what == "clean"
                  else bugs(a.config, a.dtype, a.prompts, root, a.bugs))
    result["command"] = "python tools/compare_rates.py " + " ".join(argv)
    print(markdown(result))
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
