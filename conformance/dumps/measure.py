"""Measure what a correct engine adds: the numbers behind the rows of `budgets.py`.

    python -m conformance.dumps.measure [OUT_DIR]

records clean dumps from the correct PyTorch model (k3torch K3ForCausalLM, synthetic checkpoints of `tiny`
and `k3geom`, seed 7) at bf16 and float32 for a few prompts, compares each against its float64 recompute,
and prints per engine dtype and config the worst added divergence per sublayer (over every layer and step),
the worst |gain| (g - 1) per sublayer, the worst routed-expert gain score, the worst carried divergence, the
largest choice-score gap at which a route followed the engine, and the largest |engine - reference| logit at a
step's last position. Then the planted 1% error in one expert's w2 scales (planted.expert_scale, layer 1, the
expert the clean run routes most slots of layer 1 to) per prompt: the mlp row's rel RMS, gain and expert score
it adds at layer 1, the numbers the experts' budget must separate. Needs torch.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from k3ref.config import K3Config
from k3ref.weights import synthetic_checkpoint

from . import routes
from .format import Dump
from .planted import plant
from .recompute import recompute_layer
from .recorder import record_torch
from .verdict import compare_dump

CONFIGS = ("tiny", "k3geom")
PROMPTS = ((0, 8), (1, 13), (2, 5))      # (rng seed, prompt length); 3 greedy decode steps after each
NEW_TOKENS = 3
SEED = 7


class _GapProbe:
    """Wraps routes.ForcedRoutes to remember the largest gap it forced (restored on exit)."""

    def __init__(self):
        self.largest = 0.0

    def __enter__(self):
        self.orig = orig = routes.ForcedRoutes.__call__

        def call(fr, *a, **k):
            out = orig(fr, *a, **k)
            self.largest = max(self.largest, fr.largest_forced_gap)
            return out
        routes.ForcedRoutes.__call__ = call
        return self

    def __exit__(self, *exc):
        routes.ForcedRoutes.__call__ = self.orig


def measure_one(name: str, dtype, root: Path) -> dict:
    """Worst clean numbers for one config and one torch dtype."""
    import torch  # noqa: PLC0415 -- optional dependency, only the measurement records from torch

    from k3torch.modeling_k3 import K3ForCausalLM  # noqa: PLC0415 -- needs torch

    cfg = K3Config.preset(name)
    ckpt = root / f"{name}-ckpt"
    if not (ckpt / "config.json").exists():
        synthetic_checkpoint(cfg, SEED, ckpt)
    model = K3ForCausalLM.from_pretrained(ckpt, dtype=dtype)
    worst: dict[str, float] = {}
    gain: dict[str, float] = {}
    expert_score = 0.0
    planted = []
    carried = logit_err = 0.0
    exits = []
    with _GapProbe() as probe:
        for seed, length in PROMPTS:
            prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, length)
            dump = record_torch(model, prompt, NEW_TOKENS, root / f"{name}-{dtype}-{seed}".replace("torch.", ""),
                                overwrite=True)
            report = compare_dump(dump, ckpt)
            exits.append(report.exit_code)
            for s in report.layers:
                for sub, row in s.worst.items():
                    worst[sub] = max(worst.get(sub, 0.0), row.added.rel_rms)
                carried = max(carried, s.carried.rel_rms if s.carried else 0.0)
            for la in Dump.open(dump).layers:           # the worst gain of every row, not of the worst rel RMS row
                for r in recompute_layer(dump, ckpt, la).rows:
                    gain[r.sublayer] = max(gain.get(r.sublayer, 0.0), abs(r.added.gain))
                    if r.experts is not None and r.experts.worst is not None:
                        expert_score = max(expert_score, r.experts.worst.score)
            planted.append(_planted(ckpt, dtype, dump, prompt, root / f"{name}-{dtype}-{seed}-planted".replace(
                "torch.", "")))
            assert report.free is not None
            logit_err = max([logit_err] + [t.logit_err or 0.0 for t in report.free.tokens])
    del torch
    return {"added": worst, "gain": gain, "expert_score": expert_score, "carried": carried,
            "forced_gap": probe.largest, "logit_err": logit_err, "exit_codes": exits, "planted_expert_scale": planted}


def _planted(ckpt: Path, dtype, clean: Path, prompt: np.ndarray, out: Path) -> dict:
    """Layer 1's mlp rows with one expert's w2 scales 1% off (the expert the clean dump routes most slots to)."""
    from k3torch.modeling_k3 import K3ForCausalLM  # noqa: PLC0415 -- needs torch

    d = Dump.open(clean)
    expert = int(np.argmax(np.bincount(np.concatenate([d.get(s.index, "layers.1.router.ids").ravel()
                                                       for s in d.steps]))))
    model = K3ForCausalLM.from_pretrained(ckpt, dtype=dtype)
    plant(model, "expert_scale", 1, expert=expert)
    rows = [r for r in recompute_layer(record_torch(model, prompt, NEW_TOKENS, out, overwrite=True), ckpt, 1).rows
            if r.sublayer == "mlp"]
    return {"expert": expert, "rel_rms": max(r.added.rel_rms for r in rows),
            "gain": max(abs(r.added.gain) for r in rows),
            "expert_score": max((r.experts.worst.score for r in rows if r.experts and r.experts.worst), default=0.0)}


def main(argv: list[str]) -> None:
    import torch  # noqa: PLC0415 -- optional dependency

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(argv[0]) if argv else Path(tmp)
        out = {f"{name} {dt}": measure_one(name, dt, root) for dt in (torch.bfloat16, torch.float32)
               for name in CONFIGS}
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
