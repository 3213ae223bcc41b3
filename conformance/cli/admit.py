"""`k3conf admit DIR [--config NAME|PATH] [--layers 0,3]`: check a checkpoint's tensors against the K3 inventory.

Reads only the safetensors headers. Exit 0: admitted; 1: any missing / unexpected / misshaped / mistyped
tensor or index problem (all listed); 2: unreadable input (no such folder, corrupt shard, bad config).
"""
from __future__ import annotations

from pathlib import Path

from conformance.cli.usage import UsageError
from k3ref.config import PRESETS, K3Config
from k3ref.weights import CheckpointError, admit_checkpoint, check_layers


def load_config(spec: str | None, directory: Path | None = None):
    """A K3Config from a preset name, a config.json path, or (spec None) DIR/config.json."""
    try:
        if spec is None:
            if directory is None or not (directory / "config.json").is_file():
                raise UsageError(f"no config.json in {str(directory)[:300]}; pass --config with a preset "
                                 f"({', '.join(sorted(PRESETS))}) or a path")
            spec = str(directory / "config.json")
        if spec not in PRESETS and not Path(spec).exists():
            raise UsageError(f"--config {spec[:300]}: neither a preset ({', '.join(sorted(PRESETS))}) nor an "
                             "existing config.json path")
    except (OSError, ValueError) as e:   # a name too long, a NUL byte: not a usable path
        if isinstance(e, UsageError):
            raise
        raise UsageError(f"--config / checkpoint path {str(spec or directory)[:300]}: not usable ({e})") from None
    try:
        return K3Config.preset(spec) if spec in PRESETS else K3Config.from_json(spec)
    except ValueError as e:
        raise UsageError(f"--config {spec}: {e}") from None


def parse_layers(text: str | None, cfg) -> tuple[int, ...] | None:
    """`--layers 0,3` or `--layers 1-3,7` -> (0, 3) / (1, 2, 3, 7), checked against cfg; None for None."""
    if text is None:
        return None
    out: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi) + 1) if hi else [int(lo)]
        return check_layers(cfg, out)
    except ValueError as e:
        raise UsageError(f"--layers {text[:200]}: {e}" if "layers:" in str(e) else
                         f"--layers {text[:200]}: expected comma-separated layer numbers or ranges (0,3 or 1-3), "
                         f"0-indexed, 0..{cfg.num_hidden_layers - 1}") from None


def register(sub) -> None:
    p = sub.add_parser("admit", help="check a checkpoint folder's tensors against the K3 inventory")
    p.add_argument("dir", type=Path, help="checkpoint folder (*.safetensors, model.safetensors.index.json)")
    p.add_argument("--config", default=None,
                   help="preset name (k3, small, tiny, k3geom) or config.json path; default: DIR/config.json")
    p.add_argument("--layers", default=None, metavar="LIST",
                   help="only these layers (0,3 or 1-3) and the globals are expected: a checkpoint written with "
                        "`k3conf synth --layers` (tensors of other layers are counted and ignored)")
    p.add_argument("--limit", type=int, default=20, help="problems listed per kind (all are counted)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.limit < 0:
        raise UsageError(f"--limit: expected an int >= 0, found {args.limit}")
    cfg = load_config(args.config, args.dir)
    try:
        verdict = admit_checkpoint(args.dir, cfg, layers=parse_layers(args.layers, cfg))
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    print(verdict.summary(limit=args.limit))
    return 0 if verdict.ok else 1
