"""The checks `Dump.open` makes, each raising its named DumpError: the top manifest, the rank manifests and
files (size, sha256, safetensors header), and every step's tensors (names, required ones, dtypes, shapes)."""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from k3ref.config import K3Config
from k3ref.safetensors_io import Entry, FormatError, Header, read_header, read_json

from .errors import DumpDtypeError, DumpFileError, DumpManifestError, DumpMissingError, DumpShapeError
from .names import (
    DTYPE_TAGS,
    FLOAT_TAGS,
    FORMAT,
    GLOBAL_KEYS,
    INT_KEYS,
    INT_TAGS,
    LAYER_KEYS,
    MANIFEST,
    VERSION,
    Split,
    expected_shapes,
    merged_shape,
    parse_splits,
    required_keys,
    split_name,
    step_file,
    step_of_file,
)

_HASH_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class DumpStep:
    """One forward call of the engine: the prefill (index 0, start 0) or one decode step."""

    index: int
    kind: str
    start: int
    tokens: np.ndarray


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The checked top manifest."""

    engine: str
    dtype: str
    raw_config: dict[str, Any]
    config: K3Config
    tp_size: int
    splits: dict[str, Split]
    layers: tuple[int, ...]
    steps: list[DumpStep]
    chosen: list[int] | None
    fp32: frozenset[str]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_manifest(path: Path) -> Manifest:
    file = path / MANIFEST
    if not path.is_dir():
        raise DumpFileError(f"{path}: expected a dump directory, found {'a file' if path.exists() else 'nothing'}")
    if not file.exists():
        raise DumpFileError(f"{file}: missing (an unfinished dump, or not a dump: rank 0 writes it last)")
    try:
        m = read_json(file, "dump manifest")
    except FormatError as e:
        raise DumpManifestError(str(e)) from None
    if not isinstance(m, dict):
        raise DumpManifestError(f"{file}: expected a JSON object, found {type(m).__name__}")
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise DumpManifestError(f"{file}: expected format {FORMAT!r} version {VERSION}, found format "
                                f"{m.get('format')!r} version {m.get('version')!r}")
    missing = [k for k in ("engine", "dtype", "config", "tp", "layers", "steps") if k not in m]
    if missing:
        raise DumpManifestError(f"{file}: expected the fields engine, dtype, config, tp, layers, steps; "
                                f"missing {', '.join(missing)}")
    if not isinstance(m["dtype"], str) or m["dtype"] not in DTYPE_TAGS:
        raise DumpManifestError(f"{file}: dtype: expected one of {', '.join(DTYPE_TAGS)}, found {m['dtype']!r}")
    if not isinstance(m["config"], dict):
        raise DumpManifestError(f"{file}: config: expected the checkpoint's config.json object, found "
                                f"{type(m['config']).__name__}")
    try:
        cfg = K3Config.from_json(m["config"])
    except (ValueError, TypeError) as e:
        raise DumpManifestError(f"{file}: config: {e}") from None
    tp = m["tp"]
    if not (isinstance(tp, dict) and _is_int(tp.get("size")) and tp["size"] >= 1):
        raise DumpManifestError(f"{file}: tp: expected {{\"size\": int >= 1, \"splits\": {{...}}}}, found {tp!r:.80}")
    fp32 = m.get("fp32", [])
    if not (isinstance(fp32, list) and all(isinstance(k, str) and (k in LAYER_KEYS or k in GLOBAL_KEYS)
                                           for k in fp32)):
        raise DumpManifestError(f"{file}: fp32: expected a list of tensor keys ({', '.join(LAYER_KEYS + GLOBAL_KEYS)})"
                                f", found {fp32!r:.120}")
    steps = _read_steps(file, m["steps"], cfg)
    return Manifest(str(m["engine"]), m["dtype"], m["config"], cfg, tp["size"],
                    parse_splits(tp.get("splits"), tp["size"]), _read_layers(file, m["layers"], cfg), steps,
                    _read_chosen(file, m.get("chosen"), len(steps), cfg), frozenset(fp32))


def _read_layers(file: Path, layers: Any, cfg: K3Config) -> tuple[int, ...]:
    L = cfg.num_hidden_layers
    if not (isinstance(layers, list) and layers and all(_is_int(x) and 0 <= x < L for x in layers)
            and layers == sorted(set(layers))):
        raise DumpManifestError(f"{file}: layers: expected a non-empty increasing list of layers in [0, {L}) for "
                                f"this config, found {layers!r:.120}")
    return tuple(layers)


def _read_tokens(file: Path, i: int, tokens: Any, cfg: K3Config) -> np.ndarray:
    V = cfg.vocab_size
    if not (isinstance(tokens, list) and tokens and all(_is_int(t) and 0 <= t < V for t in tokens)):
        raise DumpManifestError(f"{file}: steps[{i}].tokens: expected a non-empty list of ids in [0, {V}), found "
                                f"{tokens!r:.80}")
    return np.asarray(tokens, np.int64)


def _read_steps(file: Path, raw: Any, cfg: K3Config) -> list[DumpStep]:
    if not (isinstance(raw, list) and raw):
        raise DumpManifestError(f"{file}: steps: expected a non-empty list (prefill first), found {raw!r:.80}")
    steps: list[DumpStep] = []
    at = 0
    for i, s in enumerate(raw):
        if not (isinstance(s, dict) and {"index", "kind", "start", "tokens"} <= set(s)):
            raise DumpManifestError(f"{file}: steps[{i}]: expected {{index, kind, start, tokens}}, found {s!r:.80}")
        want = "prefill" if i == 0 else "decode"
        tokens = _read_tokens(file, i, s["tokens"], cfg)
        if not _is_int(s["index"]) or s["index"] != i:
            if _is_int(s["index"]) and s["index"] > i:
                raise DumpMissingError(f"{file}: step {i} is missing: steps[{i}] is step {s['index']} (the steps "
                                       "must be 0, 1, 2, ... with none left out)")
            raise DumpManifestError(f"{file}: steps[{i}].index: expected {i}, found {s['index']!r}")
        if s["kind"] != want:
            raise DumpManifestError(f"{file}: step {i}: expected kind {want!r}, found {s['kind']!r}")
        if not _is_int(s["start"]) or s["start"] != at:
            if _is_int(s["start"]) and s["start"] > at:
                raise DumpMissingError(f"{file}: step {i} starts at position {s['start']}, expected {at}: the steps "
                                       f"holding positions {at}..{s['start'] - 1} are missing")
            raise DumpManifestError(f"{file}: step {i}: expected start {at}, found {s['start']!r}")
        if want == "decode" and len(tokens) != 1:
            raise DumpManifestError(f"{file}: step {i}: a decode step takes one token, found {len(tokens)}")
        steps.append(DumpStep(i, want, at, tokens))
        at += len(tokens)
    return steps


def _read_chosen(file: Path, chosen: Any, n: int, cfg: K3Config) -> list[int] | None:
    if chosen is None:
        return None
    V = cfg.vocab_size
    if not (isinstance(chosen, list) and len(chosen) == n and all(_is_int(c) and 0 <= c < V for c in chosen)):
        raise DumpManifestError(f"{file}: chosen: expected one id in [0, {V}) per step ({n}), found {chosen!r:.80}")
    return list(chosen)


# ----- rank manifests and files -----

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_rank(path: Path, rank: int, steps: int, verify: bool) -> dict[int, tuple[Path, Header]]:
    """Rank `rank`'s manifest and step files -> {step: (file, header)}."""
    rdir = path / f"rank{rank}"
    file = rdir / MANIFEST
    if not file.exists():
        raise DumpFileError(f"{file}: missing: the manifest says tp size > {rank}, so rank {rank} must be dumped")
    try:
        m = read_json(file, "rank manifest")
    except FormatError as e:
        raise DumpManifestError(str(e)) from None
    if not (isinstance(m, dict) and m.get("rank") == rank and isinstance(m.get("files"), dict)):
        raise DumpManifestError(f"{file}: expected {{\"rank\": {rank}, \"files\": {{...}}}}, found {str(m)[:120]}")
    files: dict[str, Any] = m["files"]
    for name in sorted(set(files) | {p.name for p in rdir.iterdir()}):
        s = step_of_file(name)
        if s is not None and s >= steps:
            held = "names" if name in files else "does not name, but the directory holds"
            raise DumpManifestError(f"{file}: {held} {name}, but the top manifest lists {steps} steps (0..{steps - 1})")
        if name in files and s is None:
            raise DumpManifestError(f"{file}: names {name!r}: expected only step files step<NNNN>.safetensors")
    out = {}
    for s in range(steps):
        name = step_file(s)
        if name not in files and (rdir / name).exists():
            raise DumpManifestError(f"{file}: does not name, but the directory holds {name} (step {s}): the "
                                    "manifest disagrees with the files")
        if name not in files:
            raise DumpMissingError(f"{file}: step {s} is missing: the manifest names no {name}")
        header = _check_file(rdir / name, files[name], verify)
        said = header.metadata.get("step")
        if said is not None and said != str(s):
            raise DumpFileError(f"{rdir / name}: its metadata says step {said}, expected step {s} (a renamed file?)")
        out[s] = (rdir / name, header)
    return out


def _check_file(f: Path, want: Any, verify: bool) -> Header:
    if not (isinstance(want, dict) and _is_int(want.get("bytes")) and isinstance(want.get("sha256"), str)):
        raise DumpManifestError(f"{f.parent / MANIFEST}: {f.name}: expected {{\"bytes\": int, \"sha256\": hex}}, "
                                f"found {want!r:.80}")
    if not f.is_file():
        raise DumpFileError(f"{f}: missing: the rank manifest names it ({want['bytes']} bytes)")
    size = os.path.getsize(f)
    if size != want["bytes"]:
        what = "truncated" if size < want["bytes"] else "size mismatch"
        raise DumpFileError(f"{f}: {what}: the rank manifest says {want['bytes']} bytes, found {size}")
    if verify:
        digest = sha256_file(f)
        if digest != want["sha256"].lower():
            raise DumpFileError(f"{f}: sha256 mismatch: the rank manifest says {want['sha256']}, found {digest}")
    try:
        return read_header(f)
    except FormatError as e:
        raise DumpFileError(f"unreadable safetensors header: {e}") from None


# ----- the tensors of one step -----

def check_step(man: Manifest, step: DumpStep, ranks: list[tuple[Path, Header]]) -> dict[str, tuple[int, ...]]:
    """Names, dtypes and merged shapes of one step over all ranks -> {name: merged shape}."""
    names = set(ranks[0][1].entries)
    for f, h in ranks[1:]:
        if set(h.entries) != names:
            odd = sorted(names ^ set(h.entries))[:4]
            raise DumpMissingError(f"{f}: step {step.index}: expected the tensors of rank 0 ({ranks[0][0]}); the "
                                   f"ranks differ in {odd}")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in sorted(names):
        entries = [h.entries[name] for _, h in ranks]
        layer, key = _name(ranks[0][0], name, man)
        for (f, _), e in zip(ranks, entries, strict=True):
            _check_dtype(f, step, name, key, e, man)
        shapes[name] = _check_shape(ranks[0][0], step, name, layer, key, entries, man)
    for layer in man.layers:
        need = required_keys(man.config, layer)
        for key in need:
            if f"layers.{layer}.{key}" not in names:
                raise DumpMissingError(f"{ranks[0][0]}: step {step.index} layer {layer}: required tensor "
                                       f"layers.{layer}.{key} is missing (every layer needs {', '.join(need)})")
    return shapes


def _name(f: Path, name: str, man: Manifest) -> tuple[int | None, str]:
    try:
        layer, key = split_name(name)
    except ValueError as e:
        raise DumpFileError(f"{f}: {e}") from None
    if layer is not None and layer not in man.layers:
        raise DumpManifestError(f"{f}: holds {name}, but layer {layer} is not in the manifest's layers "
                                f"{list(man.layers)[:12]}")
    return layer, key


def _check_dtype(f: Path, step: DumpStep, name: str, key: str, e: Entry, man: Manifest) -> None:
    if key in INT_KEYS:
        if e.dtype not in INT_TAGS:
            raise DumpDtypeError(f"{f}: step {step.index} {name}: expected I32 or I64 expert ids, found {e.dtype}")
        return
    want = {DTYPE_TAGS[man.dtype]} | ({"F32"} if key in man.fp32 else set())
    if e.dtype not in want:
        kind = "mixed dtypes: " if e.dtype in FLOAT_TAGS else ""
        hint = "" if key in man.fp32 else f" (or F32 with {key!r} listed in the manifest's fp32)"
        raise DumpDtypeError(f"{f}: step {step.index} {name}: {kind}expected {' or '.join(sorted(want))} for a "
                             f"{man.dtype} dump{hint}, found {e.dtype}")


def _check_shape(f: Path, step: DumpStep, name: str, layer: int | None, key: str, entries: list[Entry],
                 man: Manifest) -> tuple[int, ...]:
    where = f"{f}: step {step.index} {name}"
    try:
        shape = merged_shape([e.shape for e in entries], man.splits.get(key, Split("replicated")), where)
    except ValueError as e:
        raise DumpShapeError(str(e)) from None
    allowed = expected_shapes(man.config, layer, key, len(step.tokens))
    if shape not in allowed:
        want = " or ".join(str(list(s)) for s in allowed) if allowed else "no such tensor in this layer"
        raise DumpShapeError(f"{where}: expected shape {want} (config and a step of {len(step.tokens)} tokens), "
                             f"found {list(shape)}")
    return shape
