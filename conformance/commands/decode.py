"""`k3conf decode`: greedy decode on the CPU reference (synthetic weights or a checkpoint)."""
from __future__ import annotations

import sys
from pathlib import Path

from ..cli import UsageError
from .admit import load_config


def register(sub) -> None:
    p = sub.add_parser("decode", help="greedy decode with the NumPy reference model")
    p.add_argument("--config", default=None,
                   help="preset name (tiny, small, k3) or a config.json path; default: the checkpoint's "
                        "config.json with --checkpoint, else tiny")
    p.add_argument("--checkpoint", help="checkpoint directory (default: synthetic weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--prompt", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new", type=int, default=8, help="tokens to generate")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    from .run import add_tp_options

    add_tp_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import numpy as np
    from rich.console import Console
    from rich.progress import Progress

    from k3ref.cpu_forward import K3CpuModel
    from k3ref.greedy import greedy_decode

    try:
        prompt = [int(t) for t in args.prompt.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt: expected comma-separated integers, found {args.prompt!r}") from None
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    cfg = load_config(args.config if args.config or checkpoint else "tiny", checkpoint)
    if cfg.num_parameters() > 2e9 and not args.checkpoint:
        raise UsageError(f"--config {args.config}: {cfg.num_parameters() / 1e9:.0f}B parameters is too large to "
                         "synthesise on the CPU; use tiny or small, or give --checkpoint")
    if args.tp != 1:
        from ..dist.cli import decode_tp_command

        return decode_tp_command(args, cfg, prompt)
    dtype = np.dtype(args.dtype)
    try:
        model = (K3CpuModel.from_checkpoint(args.checkpoint, cfg, dtype) if args.checkpoint
                 else K3CpuModel.synthetic(cfg, args.seed, dtype))
        with Progress(console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as bar:
            task = bar.add_task("decoding", total=args.max_new)
            result = greedy_decode(model, prompt, args.max_new, on_token=lambda _t: bar.advance(task))
    except ValueError as e:
        raise UsageError(str(e)) from None
    except KeyError as e:  # a tensor the config needs is not in the checkpoint (k3conf admit lists them all)
        raise UsageError(f"{e.args[0]}; run `k3conf admit {args.checkpoint}`") from None
    print(",".join(map(str, result.tokens)))
    return 0
