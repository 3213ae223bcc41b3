"""`k3conf synth DIR --config k3 --layers 1,3`: write a real-geometry checkpoint of some layers, in minutes.

The checkpoint holds the asked layers plus the global tensors (embedding, final norms, lm_head) in the
inventory's names, so `k3conf admit DIR --layers ...` and `k3conf decode --checkpoint DIR --layers ...` take it.
Dense tensors are the synthetic weights' values; routed experts are random MXFP4 bytes with valid scales
(k3ref.weights.synth_checkpoint: no quantisation pass). Refuses a DIR that exists and is not empty, and a disk
without room. Exit 0: written (the last line names the folder, its size and the time taken); 2: refused.
"""
from __future__ import annotations

import time
from pathlib import Path

from conformance.cli.admit import load_config, parse_layers
from conformance.cli.usage import UsageError
from k3ref.weights import inventory, synth_checkpoint


def register(sub) -> None:
    p = sub.add_parser("synth", help="write a real-geometry checkpoint of some layers (random MXFP4 experts)")
    p.add_argument("dir", type=Path, help="the folder to create (must not exist, or be empty)")
    p.add_argument("--config", default="k3", help="preset name (k3, small, tiny, k3geom) or config.json path")
    p.add_argument("--layers", required=True,
                   help="0-indexed layers to write, e.g. 1 (K3: KDA + LatentMoE) or 3 (MLA + LatentMoE), 1,3, 0-2")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic values")
    p.add_argument("--shard-gib", type=float, default=1.0, help="shard size in GiB (a larger tensor gets its own)")
    p.set_defaults(func=run)


def run(args) -> int:
    cfg = load_config(args.config)
    layers = parse_layers(args.layers, cfg)
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed: expected an int in [0, 2^63), found {args.seed}")
    if not args.shard_gib > 0:
        raise UsageError(f"--shard-gib: expected a size > 0, found {args.shard_gib}")
    nbytes = sum(s.nbytes for s in inventory(cfg, layers))
    start = time.perf_counter()
    try:
        out = synth_checkpoint(cfg, args.dir, layers=layers, seed=args.seed,
                               shard_bytes=max(1, int(args.shard_gib * 2**30)))
    except ValueError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {out}: layers {','.join(map(str, layers or ()))} of config {args.config} plus the globals, "
          f"{nbytes / 2**30:,.2f} GiB in {time.perf_counter() - start:,.1f} s")
    return 0
