"""`k3conf admit DIR [--config NAME|PATH] [--layers 0,3]`: check a checkpoint's tensors against the K3 inventory.

Reads only the safetensors headers. Exit 0: admitted; 1: any missing / unexpected / misshaped / mistyped
tensor or index problem (all listed); 2: unreadable input (no such folder, corrupt shard, bad config).

A checkpoint of another config altogether (tiny's 430 tensors admitted as k3) is refused first, in a few lines
(exit 1): most of the tensors the config expects of the layers the checkpoint holds are absent or of another
shape. The refusal names the preset (or the checkpoint's own config.json) its tensors fit, instead of listing
the hundreds of thousands of problems that follow from the wrong config.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from conformance.cli.usage import UsageError
from k3ref.config import PRESETS, K3Config
from k3ref.weights import (
    LM_HEAD,
    TEXT_PREFIX,
    CheckpointError,
    admit_checkpoint,
    check_layers,
    checkpoint_layers,
    dense_inventory,
    is_routed_expert,
    read_header,
)

# Below this share of matching tensors (name and shape, routed experts aside) a checkpoint is another config's:
# a checkpoint of the right config with a few defects matches almost all, one of another preset almost none
# (every width differs; the layer kinds fall elsewhere).
SAME_CONFIG_SHARE = 0.5
# the share a candidate config must reach for the refusal to say the checkpoint looks like it
LOOKS_LIKE_SHARE = 0.9
EMBEDDING = TEXT_PREFIX + "embed_tokens.weight"
_LAYER_OF = re.compile(re.escape(TEXT_PREFIX) + r"layers\.(\d+)\.")


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
    layers = parse_layers(args.layers, cfg)
    try:
        shapes = _text_shapes(args.dir)
        refusal = _other_config(args, cfg, layers, shapes) if shapes else None
        if refusal is not None:
            print(refusal)
            return 1
        verdict = admit_checkpoint(args.dir, cfg, layers=layers)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    print(verdict.summary(limit=args.limit))
    return 0 if verdict.ok else 1


def _text_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of the checkpoint's text tensors outside the routed experts, from the shard headers (the
    first shard's where two hold a name: admit_checkpoint reports that). Empty when DIR holds no shard:
    admit_checkpoint says what is wrong with the folder."""
    try:
        shards = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    except (OSError, ValueError):   # a name too long, a NUL byte: admit_checkpoint names the problem
        return {}
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in shards:
        for name, entry in read_header(shard).items():
            if name.startswith("language_model.") and not is_routed_expert(name):
                shapes.setdefault(name, entry.shape)
    return shapes


class _Fit:
    """How the checkpoint's tensors (routed experts aside) fit one config: of the tensors the config expects of the
    globals and of the layers the checkpoint holds (with --layers: those of them asked for), the ones present with
    the expected shape, against the union of those expected and those held (a layer the config does not have
    counts against it)."""

    def __init__(self, cfg: K3Config, layers: tuple[int, ...] | None, shapes: Mapping[str, tuple[int, ...]]):
        held = set(checkpoint_layers(shapes))
        if layers is not None:
            held &= set(layers)

        def in_scope(name: str) -> bool:
            m = _LAYER_OF.match(name)
            return m is None or int(m.group(1)) in held

        expected = {s.name: s.shape for s in dense_inventory(cfg) if in_scope(s.name)}
        self.matched = sum(1 for n, shape in expected.items() if shapes.get(n) == shape)
        self.union = len({n for n in shapes if layers is None or in_scope(n)} | set(expected))

    @property
    def share(self) -> float:
        return self.matched / self.union if self.union else 1.0

    def evidence(self) -> str:
        return f"{self.matched:,} of {self.union:,} tensors match by name and shape"


class _Candidate(NamedTuple):
    """A config a checkpoint may be of instead of the one asked for."""

    label: str      # how the refusal names it: "preset 'tiny'", "its own DIR/config.json"
    option: str     # what `k3conf admit DIR` needs to take it: " --config tiny", or "" for DIR/config.json
    cfg: K3Config


def _candidates(directory: Path, cfg: K3Config) -> list[_Candidate]:
    """The presets and DIR/config.json, except `cfg` itself. DIR/config.json is named as such when it is a
    preset (then `k3conf admit DIR` alone takes it), and left out when it does not load (the refusal is about
    the tensors; `k3conf admit DIR` says what is wrong with it)."""
    out = [_Candidate(f"preset {name!r}", f" --config {name}", K3Config.preset(name)) for name in PRESETS]
    own = directory / "config.json"
    try:
        mine = K3Config.from_json(own) if own.is_file() else None
    except (OSError, ValueError):
        mine = None
    if mine is not None:
        same = next((i for i, c in enumerate(out) if c.cfg == mine), None)
        if same is not None:
            out[same] = _Candidate(f"{out[same].label} (its own config.json)", "", mine)
        else:
            out.append(_Candidate(f"its own {own}", "", mine))
    return [c for c in out if c.cfg != cfg]


def _other_config(args, cfg: K3Config, layers, shapes: Mapping[str, tuple[int, ...]]) -> str | None:
    """None when the checkpoint's tensors could be `cfg`'s (admit_checkpoint then lists every problem), else the
    refusal: the evidence, and the config the tensors do fit, if one does."""
    fit = _Fit(cfg, layers, shapes)
    if fit.share >= SAME_CONFIG_SHARE:
        return None
    name = args.config if args.config is not None else str(args.dir / "config.json")
    lines = [f"REJECTED  {args.dir}: not a checkpoint of config {name}: {fit.evidence()} ({fit.share:.0%}; the "
             f"globals and the layers it holds{' of those asked for' if layers else ''}, routed experts aside)",
             f"  evidence: {_evidence(cfg, shapes)}"]
    fits = [(f, c) for c in _candidates(args.dir, cfg) if (f := _Fit(c.cfg, None, shapes)).share >= LOOKS_LIKE_SHARE]
    if fits:
        best, like = max(fits, key=lambda t: t[0].share)
        rerun = f"k3conf admit {args.dir}{like.option}" + (f" --layers {args.layers}" if args.layers else "")
        lines += [f"  it looks like {like.label}: {best.evidence()}", f"  admit it as that: {rerun}"]
    else:
        lines.append(f"  it fits none of the presets ({', '.join(sorted(PRESETS))}) either; give its config.json "
                     "with --config")
    return "\n".join(lines)


def _evidence(cfg: K3Config, shapes: Mapping[str, tuple[int, ...]]) -> str:
    """One line a reader can check: the embedding's (or lm_head's) shape against the config's, else a tensor the
    config expects that is absent; and the layers held against the config's layer count."""
    layers = f"layers held {_span(checkpoint_layers(shapes))}, the config has {cfg.num_hidden_layers}"
    want = (cfg.vocab_size, cfg.hidden_size)
    for name in (EMBEDDING, LM_HEAD):
        if name in shapes and shapes[name] != want:
            return f"{name} is {list(shapes[name])} (vocab, hidden), the config has {list(want)}; {layers}"
    absent = next((s for s in dense_inventory(cfg) if s.name not in shapes), None)
    return f"{absent.name} {list(absent.shape)} is absent; {layers}" if absent else layers


def _span(layers: tuple[int, ...]) -> str:
    if not layers:
        return "none"
    return f"{layers[0]}..{layers[-1]}" if len(layers) == layers[-1] - layers[0] + 1 else ",".join(map(str, layers))
