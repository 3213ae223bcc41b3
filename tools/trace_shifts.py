"""How far correct implementations move a trace's discrete choices: router and greedy-token margin shifts, and the
logits errors once every choice is aligned, over many synthetic models.

    python tools/trace_shifts.py --backends torch-bf16 recipe:bf16-f32-math recipe:bf16-wide --seeds 0:60 \
        [--trace trace/free-P7-D5]

At bf16 a trace gives a backend the golden's choice where the golden's margin is below the precision's budget
(teacher forcing, gate_table.MARGIN_BUDGETS); past it a flipped choice is the backend's. A budget is only honest if
no correct implementation moves a margin by more: this measures, per (weight seed, backend), the largest shift of
a router margin (the golden's k-th minus (k+1)-th selection score, against the same difference of the backend's
scores over the golden's chosen set) and of a greedy-token margin (the golden token's logit minus the next), with
every router choice given the golden's so the run stays on the golden's path. It also prints each backend's
logits error over the baseline's (pooled over the steps), the multiple a trace's k must exceed.

The trace is built again with other weight seeds (other synthetic models, in memory; a seed whose golden sits on a
near-tie is skipped, as regen refuses it). Free traces compound every step's rounding through the KDA states and
the MLA caches; layerwise ones feed each layer the golden's state.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

from conformance.backends.registry import get_backend
from conformance.cases.catalog import all_cases
from conformance.cases.engine_routes import through_engine
from conformance.cases.inputs import cast_weights
from conformance.cases.trace_names import TraceName
from conformance.cases.trace_run import GoldenFeed, Stepper, compute_dtype, guard_kernels
from conformance.cases.traces import PROMPT, model_name
from conformance.fuzz.draws import FuzzRunner
from conformance.golden.errors import GoldenError
from conformance.golden.store import COMMITTED_ROOT
from conformance.judge import gates
from conformance.runner import Runner
from k3ref.config import K3Config
from k3ref.cores import reference_cores
from k3ref.cpu_forward import K3CpuModel
from k3ref.latent_moe import route_weights
from k3ref.ops import sigmoid

sys.path.insert(0, str(Path(__file__).parent))
from fresh_margins import _seeds  # noqa: E402 - a sibling script: one reading of FIRST:END for every tool


class ScoreTap:
    """moe_route wrapped: records each call's selection scores (sigmoid(logits) + bias, float64) under the Stepper's
    `where`; given a golden, answers with the golden's choice everywhere (weights from the backend's own logits)."""

    def __init__(self, route, inter: dict | None = None):
        self.route, self.inter = route, inter
        self.where = ""
        self.scores: dict[str, np.ndarray] = {}

    def __call__(self, logits, bias, top_k, n_group=1, topk_group=1, renormalize=True, scaling=1.0):
        if n_group != 1:
            raise ValueError(f"router with n_group={n_group}: the shift is measured for n_group 1 only")
        w, idx = self.route(logits, bias, top_k, n_group=n_group, topk_group=topk_group, renormalize=renormalize,
                            scaling=scaling)
        self.scores[self.where] = sigmoid(np.asarray(logits, np.float64)) + np.asarray(bias, np.float64)
        if self.inter is None:
            return w, idx
        gold = np.asarray(self.inter[f"route.{self.where}.choice"]).astype(np.int64)
        gw = route_weights(sigmoid(np.asarray(logits)), gold, renormalize, scaling).astype(np.asarray(w).dtype)
        return gw, gold


def _set_margin(scores: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Per token, the smallest score of the chosen set minus the largest outside it: [T, E], [T, k] -> [T]."""
    mask = np.zeros(scores.shape, bool)
    np.put_along_axis(mask, chosen, True, axis=-1)
    return np.where(mask, scores, np.inf).min(-1) - np.where(mask, -np.inf, scores).max(-1)


def _token_margin(logits: np.ndarray, token: int) -> float:
    others = np.delete(np.asarray(logits, np.float64), token)
    return float(logits[token] - others.max())


def measure(golden, backend, mode: str, prompt_len: int, cfg: K3Config, ref: dict) -> dict:
    """One backend on one golden: its largest router and token margin shifts and its logits errors per step."""
    p = backend.precision
    inter = golden.group("inter")
    model = K3CpuModel(cfg, cast_weights(golden.group("weights"), p), compute_dtype(p))
    cores, own, _ = through_engine(backend.cores(), backend.kernel_cores())
    cores, _, _ = guard_kernels(cores, own)   # a kernel refusing a shape falls back to the reference, as in a run
    tap = ScoreTap(cores.moe_route, inter)
    feed = GoldenFeed(inter, p) if mode == "layerwise" else None
    outs = Stepper(model, cores, feed, tap, prompt_len).run(golden.group("inputs")["tokens"])
    router = 0.0
    for where, s in tap.scores.items():
        chosen = np.asarray(inter[f"route.{where}.choice"]).astype(np.int64)
        router = max(router, float(np.max(_set_margin(ref["scores"][where], chosen) - _set_margin(s, chosen))))
    token, logits = 0.0, {}
    gold = golden.group("outputs")
    for name, want in gold.items():
        parsed = TraceName.parse(name)
        if parsed is None or parsed.layer is not None or parsed.what != "logits":
            continue
        t = int(np.argmax(want))
        token = max(token, _token_margin(want, t) - _token_margin(outs[name], t))
        logits[name] = float(np.linalg.norm(outs[name] - want) / np.linalg.norm(want))
    return {"router": router, "token": token, "logits": logits}


def reference_scores(golden, prompt_len: int, cfg: K3Config) -> dict:
    """The float64 reference's selection scores at every router call of the golden's run."""
    model = K3CpuModel(cfg, golden.group("weights"), np.float64)
    tap = ScoreTap(reference_cores().moe_route)
    Stepper(model, reference_cores(), None, tap, prompt_len).run(golden.group("inputs")["tokens"])
    return {"scores": tap.scores}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", required=True,
                    help="the backends (one precision; its baseline is measured too, first)")
    ap.add_argument("--trace", default="trace/free-P7-D5", help="the trace case (default trace/free-P7-D5)")
    ap.add_argument("--config", default="tiny", help="the shape set it belongs to (default tiny)")
    ap.add_argument("--seeds", type=_seeds, default=range(0, 10), help="weight seeds FIRST:END (default 0:10)")
    args = ap.parse_args()

    (case,) = [c for c in all_cases(args.config) if c.name == args.trace]
    parent = Runner(COMMITTED_ROOT, args.config, False, seed=None, in_process=frozenset({"numpy64"}))
    runner = FuzzRunner(parent)
    backends = [get_backend(b) for b in args.backends]
    baseline = gates.BASELINE[backends[0].precision]
    judged = [get_backend(name) for name in dict.fromkeys([baseline, *args.backends])]   # the baseline first, once
    rows: list[tuple[int, str, dict]] = []
    margins: list[float] = []
    t0 = time.perf_counter()
    try:
        for seed in args.seeds:
            drawn = dataclasses.replace(case, name=f"{case.name}-w{seed}", seed=seed)
            golden = runner.golden(drawn)
            if isinstance(golden, GoldenError):
                continue
            cfg = K3Config.preset(golden.kwargs.get("config", model_name(case)))
            prompt_len = golden.kwargs.get("prompt", len(PROMPT))
            ref = reference_scores(golden, prompt_len, cfg)
            margins += [float(m) for k, v in golden.group("inter").items() if k.endswith(".margin")
                        and k.startswith("route.") for m in np.ravel(v)]
            for b in judged:
                rows.append((seed, b.name, measure(golden, b, case.params["mode"], prompt_len, cfg, ref)))
    finally:
        parent.close()
    seeds = sorted({s for s, _, _ in rows})
    print(f"{case.name} ({case.params['mode']}) on {len(seeds)} weight seeds of {len(args.seeds)} "
          f"({time.perf_counter() - t0:.0f} s); budgets now "
          f"{gates.margin_budgets(backends[0].precision, case.params['mode'])}")
    for name in dict.fromkeys(n for _, n, _ in rows):
        mine = [(s, r) for s, n, r in rows if n == name]
        for what in ("router", "token"):
            vals = np.array([r[what] for _, r in mine])
            worst = max(mine, key=lambda sr, w=what: sr[1][w])[0]
            print(f"  {name:24} {what:6} shift: max {vals.max():.3g} p99 {np.quantile(vals, 0.99):.3g} "
                  f"p90 {np.quantile(vals, 0.9):.3g} median {np.median(vals):.3g} (seed {worst})")
    base = {s: r for s, n, r in rows if n == baseline}
    for name in dict.fromkeys(n for _, n, _ in rows if n != baseline):
        ratios = []
        for s, n, r in rows:
            if n != name or s not in base:
                continue
            pooled = max(base[s]["logits"].values()) if case.params["mode"] == "free" else None
            ratios += [(err / (pooled or base[s]["logits"][t]), s) for t, err in r["logits"].items()]
        a = np.array([v for v, _ in ratios])
        print(f"  {name:24} logits / {baseline}'s{' (pooled over steps)' if case.params['mode'] == 'free' else ''}: "
              f"max {a.max():.3g} p99 {np.quantile(a, 0.99):.3g} median {np.median(a):.3g} (seed {max(ratios)[1]})")
    m = np.array(margins)
    for budget in (1.5e-2, 3e-2, 5e-2, 1e-1):
        print(f"  router margins of the goldens below {budget:g}: {np.mean(m < budget):.1%} of {m.size}")


if __name__ == "__main__":
    main()
