"""What a dump of format version 1 may hold: tensor names, the shapes the config implies, dtypes, TP splits.

Shared by the writer (which refuses to write what the reader would refuse) and the reader's checks.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from k3ref.config import K3Config

from .errors import DumpManifestError

FORMAT = "k3-dump"
VERSION = 1
MANIFEST = "manifest.json"

# The engine's activation dtype (manifest "dtype") -> its safetensors tag.
DTYPE_TAGS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}
FLOAT_TAGS = frozenset({"BF16", "F16", "F32", "F64"})
INT_TAGS = frozenset({"I32", "I64"})

# Per-layer keys in compute order; the names are those of the layer records in k3ref and k3torch.
LAYER_KEYS = ("blocks", "prefix", "h", "x_mixer", "a", "m", "x_mlp", "f", "router.ids", "router.weights",
              "experts.in", "experts.out", "kda.core_out", "mla.attn_out")
GLOBAL_KEYS = ("embed", "final.hidden", "logits")
# Every dumped layer and step must hold these (plus `blocks` when the layer has completed blocks before it).
REQUIRED_KEYS = ("prefix", "a", "f")
INT_KEYS = frozenset({"router.ids"})
ROUTER_KEYS = frozenset({"router.ids", "router.weights"})
EXPERT_KEYS = frozenset({"experts.in", "experts.out"})

SPLIT_KINDS = ("replicated", "concat", "sum")


class Split(NamedTuple):
    """How one tensor key is spread over TP ranks: replicated, concatenated along `axis`, or partial sums."""

    how: str
    axis: int = 0


# Keys not listed are replicated. Heads are split by the TP plan, so are the vocab rows of lm_head.
DEFAULT_SPLITS = {"kda.core_out": Split("concat", 1), "mla.attn_out": Split("concat", 1),
                  "logits": Split("concat", -1)}

_LAYER_NAME = re.compile(r"layers\.(0|[1-9][0-9]*)\.(.+)")
_STEP_FILE = re.compile(r"step([0-9]{4,})\.safetensors")


def step_file(step: int) -> str:
    return f"step{step:04d}.safetensors"


def step_of_file(name: str) -> int | None:
    """The step index of a step file name, or None for any other name."""
    m = _STEP_FILE.fullmatch(name)
    return int(m.group(1)) if m else None


def layer_name(layer: int, key: str) -> str:
    return f"layers.{layer}.{key}"


def split_name(name: str) -> tuple[int | None, str]:
    """'layers.3.a' -> (3, 'a'); 'logits' -> (None, 'logits'); ValueError naming the known names otherwise."""
    m = _LAYER_NAME.fullmatch(name)
    if m and m.group(2) in LAYER_KEYS:
        return int(m.group(1)), m.group(2)
    if name in GLOBAL_KEYS:
        return None, name
    raise ValueError(f"tensor name {name!r}: expected layers.<l>.<key> with key one of {', '.join(LAYER_KEYS)}, "
                     f"or one of {', '.join(GLOBAL_KEYS)}")


def key_of(name: str) -> str:
    """The tensor key of a name (the name without its `layers.<l>.` prefix)."""
    return split_name(name)[1]


def num_blocks(cfg: K3Config, layer: int) -> int:
    """Completed AttnRes blocks before layer `layer`: one per block start (0, B, 2B, ...) below it."""
    return -(-layer // cfg.attn_res_block_size)


def expected_shapes(cfg: K3Config, layer: int | None, key: str, tokens: int) -> list[tuple[int, ...]]:
    """The merged shapes a tensor may have in a step of `tokens` tokens ([] when the key does not apply to
    that layer: a router on a dense layer, a KDA tensor on an MLA layer, blocks before layer 0)."""
    D, T = cfg.hidden_size, tokens
    if key == "logits":
        return [(T, cfg.vocab_size), (1, cfg.vocab_size)] if T > 1 else [(1, cfg.vocab_size)]
    if layer is None or key in ("prefix", "h", "x_mixer", "a", "m", "x_mlp", "f"):
        return [(T, D)]
    if key == "blocks":
        n = num_blocks(cfg, layer)
        return [(n, T, D)] if n else []
    if key in ROUTER_KEYS:
        return [] if cfg.mlp_is_dense(layer) else [(T, cfg.num_experts_per_tok)]
    if key in EXPERT_KEYS:           # the routed experts' latent input [T, Dl] and per-slot outputs [T, k, Dl]
        if cfg.mlp_is_dense(layer):
            return []
        Dl = cfg.routed_expert_hidden_size
        return [(T, Dl)] if key == "experts.in" else [(T, cfg.num_experts_per_tok, Dl)]
    if key == "kda.core_out":
        return [] if cfg.is_mla(layer) else [(T, cfg.kda_num_heads, cfg.kda_head_dim)]
    if key == "mla.attn_out":
        return [(T, cfg.num_attention_heads, cfg.v_head_dim)] if cfg.is_mla(layer) else []
    raise ValueError(f"unknown tensor key {key!r}")


def required_keys(cfg: K3Config, layer: int) -> tuple[str, ...]:
    return (("blocks",) if num_blocks(cfg, layer) else ()) + REQUIRED_KEYS


def parse_splits(raw: object, tp_size: int) -> dict[str, Split]:
    """The manifest's tp.splits merged over DEFAULT_SPLITS; DumpManifestError on a malformed entry."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise DumpManifestError(f"manifest tp.splits: expected an object {{key: {{how, axis}}}}, found {raw!r:.80}")
    out = dict(DEFAULT_SPLITS)
    for key, spec in raw.items():
        if key not in LAYER_KEYS and key not in GLOBAL_KEYS:
            raise DumpManifestError(f"manifest tp.splits: unknown tensor key {key!r}; expected one of "
                                    f"{', '.join(LAYER_KEYS + GLOBAL_KEYS)}")
        how = spec.get("how") if isinstance(spec, dict) else None
        axis = spec.get("axis", 0) if isinstance(spec, dict) else None
        if how not in SPLIT_KINDS or not isinstance(axis, int) or isinstance(axis, bool):
            raise DumpManifestError(f"manifest tp.splits[{key!r}]: expected {{\"how\": one of {list(SPLIT_KINDS)}, "
                                    f"\"axis\": int}}, found {spec!r:.80}")
        if key in INT_KEYS and how == "sum":
            raise DumpManifestError(f"manifest tp.splits[{key!r}]: expert ids cannot be partial sums")
        out[key] = Split(how, axis)
    return out


def splits_json(splits: dict[str, Split]) -> dict[str, dict[str, object]]:
    return {k: {"how": s.how, "axis": s.axis} for k, s in sorted(splits.items())}


def merged_shape(shapes: list[tuple[int, ...]], split: Split, where: str) -> tuple[int, ...]:
    """The shape of the merged tensor from the rank shapes (in rank order); ValueError when they cannot merge."""
    first = shapes[0]
    if len(shapes) == 1:
        return first
    if split.how != "concat":
        if any(s != first for s in shapes):
            raise ValueError(f"{where}: {split.how} over ranks needs one shape on every rank, found "
                             f"{[list(s) for s in shapes]}")
        return first
    if not -len(first) <= split.axis < len(first):
        raise ValueError(f"{where}: concat axis {split.axis} is outside a tensor of shape {list(first)}")
    ax = split.axis % len(first)
    rest = [s[:ax] + s[ax + 1:] for s in shapes]
    if any(len(s) != len(first) or r != rest[0] for s, r in zip(shapes, rest, strict=True)):
        raise ValueError(f"{where}: concat along axis {split.axis} needs the other dims equal on every rank, found "
                         f"{[list(s) for s in shapes]}")
    return first[:ax] + (sum(s[ax] for s in shapes),) + first[ax + 1:]
