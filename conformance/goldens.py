"""Golden files: one safetensors file per case, a MANIFEST.json with a sha256 per file, and regeneration.

File layout (DESIGN.md section 4): `<root>/<block>/<case>.safetensors` holding tensors named `inputs.*`,
`weights.*`, `inter.*`, `outputs.*` and string metadata `schema_version`, `block`, `case`, `config`,
`seed`, `generator_version`, `kwargs` (a JSON object of the scalar keyword arguments, e.g. scale, eps).
`<root>/MANIFEST.json` lists every file with its sha256, size, config, seed and generator version.

The writer emits the safetensors format itself (8-byte little-endian header length, a JSON header with
sorted keys and no whitespace, padded with spaces to 8 bytes, then the tensor bytes in name order) so a
rerun is byte-identical; `safetensors.numpy.load_file` reads the files as usual. Writes go to a
temporary file in the same directory and are renamed into place, so a crash never leaves half a golden.

Every problem a reader can hit (truncated file, bad header, sha256 mismatch, missing tensor, unknown
schema version) raises `GoldenError` naming the file and the command that regenerates it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from k3ref.safetensors_io import FormatError, parse_bytes

SCHEMA_VERSION = "1"
GROUPS = ("inputs", "weights", "inter", "outputs")
MANIFEST = "MANIFEST.json"
SUFFIX = ".safetensors"
REPO_ROOT = Path(__file__).resolve().parent.parent
COMMITTED_ROOT = REPO_ROOT / "golden"
# Regeneration keeps a golden whose outputs moved by no more than this (relative RMS): float64 BLAS
# kernels differ at the last bit between CPUs; a real change of the math moves results far more.
ROUNDING_DRIFT = 1e-12

# numpy dtype <-> safetensors dtype tag (little-endian on disk)
_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
}
_NP_OF = {tag: np.dtype(name) for name, tag in _DTYPES.items()}
_ITEMSIZE = {tag: dt.itemsize for tag, dt in _NP_OF.items()}


class GoldenError(Exception):
    """A golden file that cannot be used; the message names the file and how to regenerate it."""


def regen_command(case: str, config: str = "tiny") -> str:
    """The command that regenerates one case's golden."""
    extra = "" if config == "tiny" else f" --config {config}"
    return f"k3conf regen --cases '{case}'{extra}"


def default_root(config: str) -> Path:
    """Where the goldens of `config` live: committed golden/ for tiny, a cache dir for anything larger.

    The cache is $K3CONF_CACHE/golden/<config> if set, else ~/.cache/k3conf/golden/<config>.
    """
    if config == "tiny":
        return COMMITTED_ROOT
    base = os.environ.get("K3CONF_CACHE")
    cache = Path(base) if base else Path.home() / ".cache" / "k3conf"
    return cache / "golden" / config


def golden_path(root: Path, case: str) -> Path:
    """<root>/<block>/<case-id>.safetensors for a case named '<block>/<case-id>'."""
    return Path(root) / (case + SUFFIX)


# --------------------------------------------------------------------------------------------------
# encoding


def encode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """Serialise tensors + string metadata to safetensors bytes, deterministically.

    tensors: name -> array (names must start with one of GROUPS + '.'); metadata: str -> str.
    """
    header: dict[str, object] = {"__metadata__": {str(k): str(v) for k, v in sorted(metadata.items())}}
    chunks, offset = [], 0
    for name in sorted(tensors):
        if name.split(".", 1)[0] not in GROUPS or "." not in name:
            raise ValueError(f"tensor name {name!r}: expected a '<group>.<name>' with group in {GROUPS}")
        arr = np.ascontiguousarray(tensors[name])
        tag = _DTYPES.get(arr.dtype.name)
        if tag is None:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors tag ({sorted(_DTYPES)})")
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(chunks)


def decode(blob: bytes, where: str, fix: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Parse safetensors bytes -> (metadata, tensors); any defect raises GoldenError('<where>: ...; fix').

    The header goes through k3ref's strict safetensors parser (the format's rules, the tensor named), and
    only the dtypes a golden may hold are accepted.
    """
    try:
        header = parse_bytes(blob, where, _ITEMSIZE)
    except FormatError as e:
        raise GoldenError(f"{e}. Regenerate it with: {fix}") from None
    data = memoryview(blob)[header.data_start:]
    tensors = {}
    for name, e in header.entries.items():
        dtype = _NP_OF[e.dtype].newbyteorder("<")
        tensors[name] = np.frombuffer(data[e.begin:e.end], dtype=dtype).reshape(e.shape).astype(dtype.newbyteorder("="))
    return header.metadata, tensors


# --------------------------------------------------------------------------------------------------
# golden objects and the manifest


@dataclasses.dataclass
class Golden:
    """One case's golden: metadata strings and tensors by full name ('outputs.o')."""

    case: str
    path: Path
    meta: dict[str, str]
    tensors: dict[str, np.ndarray]

    @property
    def block(self) -> str:
        return self.meta["block"]

    @property
    def kwargs(self) -> dict:
        """The scalar keyword arguments (JSON object in the metadata)."""
        return json.loads(self.meta.get("kwargs", "{}"))

    def group(self, group: str) -> dict[str, np.ndarray]:
        """Tensors of one group with the group prefix stripped: group('inputs') -> {'q': ...}."""
        p = group + "."
        return {k[len(p):]: v for k, v in self.tensors.items() if k.startswith(p)}

    def require(self, names: Iterable[str]) -> None:
        """Raise GoldenError unless every full tensor name in `names` is present."""
        missing = sorted(set(names) - set(self.tensors))
        if missing:
            raise GoldenError(
                f"{self.path}: missing tensor(s) {missing}; found {sorted(self.tensors)}. "
                f"Regenerate it with: {regen_command(self.case, self.meta.get('config', 'tiny'))}")


def load_manifest(root: Path) -> dict:
    """MANIFEST.json as a dict ({'schema_version', 'files': {relpath: entry}}); empty if absent."""
    path = Path(root) / MANIFEST
    if not path.exists():
        return {"schema_version": SCHEMA_VERSION, "files": {}}
    try:
        m = json.loads(path.read_text())
        if not isinstance(m.get("files"), dict):
            raise ValueError("no 'files' object")
    except (ValueError, AttributeError) as e:
        # `k3conf regen` reads the manifest too: removing it lets regen list the files on disk again
        raise GoldenError(f"{path}: unreadable manifest ({e}). Delete it, then rebuild it with: k3conf regen "
                          f"(with the same --config / --out)") from None
    return m


def save_manifest(root: Path, manifest: dict) -> None:
    """Write MANIFEST.json (sorted keys, stable layout) atomically."""
    text = json.dumps(manifest, sort_keys=True, indent=1) + "\n"
    atomic_write(Path(root) / MANIFEST, text.encode())


def manifest_entry(blob: bytes, meta: Mapping[str, str]) -> dict:
    """The manifest row of one golden file."""
    return {
        "sha256": hashlib.sha256(blob).hexdigest(),
        "bytes": len(blob),
        "config": meta["config"],
        "seed": int(meta["seed"]),
        "generator_version": meta["generator_version"],
    }


def _file_mode() -> int:
    """0o666 less the process umask: what open() would give a new file (mkstemp's files are 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: Path, blob: bytes) -> None:
    """Write blob to a temporary file next to `path`, fsync it, then rename it into place.

    The file gets the usual permissions (0o644 under umask 022), not mkstemp's owner-only 0o600: goldens
    and their manifest are shared data that other users and CI jobs must be able to read.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_golden(root: Path, case: str, manifest: dict | None = None, config: str = "tiny") -> Golden:
    """Read and verify one golden: in the manifest, sha256 matches, parses, known schema.

    manifest: a loaded MANIFEST.json (read from root when None).
    """
    root = Path(root)
    path = golden_path(root, case)
    fix = regen_command(case, config)
    manifest = load_manifest(root) if manifest is None else manifest
    rel = path.relative_to(root).as_posix()
    entry = manifest["files"].get(rel)
    if not path.exists():
        raise GoldenError(f"{path}: no such golden file. Generate it with: {fix}")
    if entry is None:
        raise GoldenError(f"{path}: not listed in {root / MANIFEST}. Regenerate it with: {fix}")
    blob = path.read_bytes()
    sha = hashlib.sha256(blob).hexdigest()
    if sha != entry.get("sha256"):
        raise GoldenError(
            f"{path}: sha256 mismatch: manifest says {entry.get('sha256')}, file has {sha} "
            f"({len(blob)} bytes, manifest {entry.get('bytes')}). Regenerate it with: {fix}")
    meta, tensors = decode(blob, str(path), fix)
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise GoldenError(
            f"{path}: unknown schema_version {version!r}, this reader knows {SCHEMA_VERSION!r}. Regenerate it with: {fix}")
    for key in ("block", "case", "config", "seed", "generator_version"):
        if key not in meta:
            raise GoldenError(f"{path}: metadata key {key!r} missing (found {sorted(meta)}). Regenerate it with: {fix}")
    if meta["case"] != case:
        raise GoldenError(f"{path}: holds case {meta['case']!r}, expected {case!r}. Regenerate it with: {fix}")
    if not any(k.startswith("outputs.") for k in tensors):
        raise GoldenError(f"{path}: no outputs.* tensor (found {sorted(tensors)}). Regenerate it with: {fix}")
    return Golden(case, path, meta, tensors)


# --------------------------------------------------------------------------------------------------
# diffs between two versions of a golden


@dataclasses.dataclass(frozen=True)
class TensorDrift:
    """How one tensor changed between the stored golden and a recomputation."""

    name: str
    status: str              # "same" | "changed" | "added" | "removed" | "reshaped"
    max_abs: float = 0.0
    rel_rms: float = 0.0
    detail: str = ""

    def line(self) -> str:
        if self.status in ("changed", "same") and not self.detail:   # a tensor: its numbers
            return f"{self.name}: {self.status}, max abs {self.max_abs:.3g}, rel RMS {self.rel_rms:.3g}"
        return f"{self.name}: {self.status} {self.detail}".rstrip()    # metadata, manifest, shape: the detail


def diff_tensors(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> list[TensorDrift]:
    """Per-tensor drift from `old` to `new` (only tensors that differ at all are listed)."""
    out = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            out.append(TensorDrift(name, "removed", detail=f"(was {old[name].dtype}{list(old[name].shape)})"))
        elif name not in old:
            out.append(TensorDrift(name, "added", detail=f"({new[name].dtype}{list(new[name].shape)})"))
        elif old[name].shape != new[name].shape or old[name].dtype != new[name].dtype:
            out.append(TensorDrift(name, "reshaped", detail=(
                f"{old[name].dtype}{list(old[name].shape)} -> {new[name].dtype}{list(new[name].shape)}")))
        elif old[name].tobytes() != new[name].tobytes():
            a = old[name].astype(np.float64)
            b = new[name].astype(np.float64)
            den = max(float(np.linalg.norm(a)), np.finfo(np.float64).tiny)
            out.append(TensorDrift(name, "changed", float(np.max(np.abs(b - a))), float(np.linalg.norm(b - a) / den)))
    return out


def is_rounding_only(drift: list[TensorDrift], meta_old: Mapping, meta_new: Mapping) -> bool:
    """True when only computed tensors moved, each by <= ROUNDING_DRIFT relative RMS."""
    if dict(meta_old) != dict(meta_new):
        return False
    return all(d.status == "changed" and d.name.split(".")[0] in ("inter", "outputs") and d.rel_rms <= ROUNDING_DRIFT
               for d in drift)


# --------------------------------------------------------------------------------------------------
# regeneration


@dataclasses.dataclass
class RegenOutcome:
    """What regeneration did (or, with check, found) for one case."""

    case: str
    path: Path
    status: str    # new | unchanged | rounding | changed | accepted | drift | missing
    drift: list[TensorDrift] = dataclasses.field(default_factory=list)
    note: str = ""

    @property
    def failed(self) -> bool:
        """True for the outcomes that make `k3conf regen` exit 1."""
        return self.status in ("changed", "drift", "missing")


def build_blob(case) -> bytes:
    """The golden bytes of `case`, computed from scratch by its kind (float64 k3ref)."""
    from .cases import kind_of, metadata

    content = kind_of(case).generate(case)
    return encode(content.tensors, metadata(case, content.kwargs))


def regenerate(cases, root: Path, *, check: bool = False, accept: bool = False) -> list[RegenOutcome]:
    """Recompute every case's golden under `root`.

    Without check: write new files; leave identical ones (and rounding-only drift, <= ROUNDING_DRIFT) alone;
    refuse to overwrite a changed golden (status 'changed', with the per-tensor drift). With accept: overwrite
    every golden whose bytes differ (status 'accepted', drift shown).
    With check: write nothing; 'drift' for a changed golden, 'missing' for an absent one.
    MANIFEST.json is updated for every file written.
    """
    root = Path(root)
    manifest = load_manifest(root)
    outcomes = []
    for case in cases:
        path = golden_path(root, case.name)
        rel = path.relative_to(root).as_posix()
        blob = build_blob(case)
        new_meta, new_t = decode(blob, str(path), regen_command(case.name, case.config))
        old = path.read_bytes() if path.exists() else None
        listed = manifest["files"].get(rel, {}).get("sha256")
        if old is None:
            status, drift = ("missing" if check else "new"), []
        elif old == blob:
            status, drift = "unchanged", []
        else:
            try:
                old_meta, old_t = decode(old, str(path), "")
                drift = diff_tensors(old_t, new_t)
                meta_changes = {k for k in set(old_meta) | set(new_meta) if old_meta.get(k) != new_meta.get(k)}
                drift += [TensorDrift(f"metadata.{k}", "changed", detail=f"{old_meta.get(k)!r} -> {new_meta.get(k)!r}")
                          for k in sorted(meta_changes)]
                rounding = is_rounding_only(drift, old_meta, new_meta)
            except GoldenError as e:
                drift, rounding = [TensorDrift("file", "unreadable", detail=str(e).split(". Regenerate")[0])], False
            if accept and not check:
                status = "accepted"
            elif rounding:
                status = "rounding"
            elif check:
                status = "drift"
            else:
                status = "changed"
        if check and status in ("unchanged", "rounding") and listed != hashlib.sha256(old).hexdigest():
            # the file would be kept, but `run` reads it against the manifest and would reject it
            status = "drift"
            drift = drift + [TensorDrift("MANIFEST.json", "changed", detail=f"sha256 of {rel} not listed")]
        if not check and status in ("new", "accepted"):
            atomic_write(path, blob)
            manifest["files"][rel] = manifest_entry(blob, new_meta)
        elif not check and status in ("unchanged", "rounding"):
            manifest["files"][rel] = manifest_entry(old, new_meta)   # the file stays: list what is on disk
        outcomes.append(RegenOutcome(case.name, path, status, drift))
    if not check:
        manifest["schema_version"] = SCHEMA_VERSION
        save_manifest(root, manifest)
    return outcomes
