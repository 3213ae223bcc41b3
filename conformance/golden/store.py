"""Golden files: one safetensors file per case and a MANIFEST.json with a sha256 per file; reading,
verifying and writing them. Storage only: it never computes a golden (`conformance.golden.regen` does).

File layout (docs/spec.md section 4.1): `<root>/<block>/<case>.safetensors` holding tensors named `inputs.*`,
`weights.*`, `inter.*`, `outputs.*` and string metadata `schema_version`, `block`, `case`, `config`,
`seed`, `generator_version`, `kwargs` (a JSON object of the scalar keyword arguments, e.g. scale, eps).
`<root>/MANIFEST.json` lists every file with its sha256, size, config, seed and generator version.

The writer emits the safetensors format itself (8-byte little-endian header length, a JSON header with
sorted keys and no whitespace, padded with spaces to 8 bytes, then the tensor bytes in name order) so a
rerun is byte-identical; `safetensors.numpy.load_file` reads the files as usual. Writes go through
`conformance.golden.durable` (staged, then renamed into place), so a crash never leaves half a golden.

Every problem a reader can hit (truncated file, bad header, sha256 mismatch, missing tensor, unknown
schema version) raises `GoldenError` naming the file and the command that regenerates it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from conformance.golden.durable import atomic_write, temporaries
from conformance.golden.errors import GoldenError
from k3ref.safetensors_io import NUMPY_DTYPES, FormatError, is_int, loads_strict, parse_bytes, read_json

SCHEMA_VERSION = "1"
GROUPS = ("inputs", "weights", "inter", "outputs")
MANIFEST = "MANIFEST.json"
SUFFIX = ".safetensors"
# the data package an installed wheel holds the committed goldens in (pyproject.toml, [tool.setuptools])
INSTALLED_GOLDEN_PACKAGE = "k3conf_golden"


def committed_root(parent: Path) -> Path:
    """The committed goldens of the code whose top-level packages sit in `parent`: golden/ in a checkout (it has
    pyproject.toml; an editable install runs from it), the data package k3conf_golden next to conformance/ in an
    installed wheel (site-packages)."""
    return parent / "golden" if (parent / "pyproject.toml").is_file() else parent / INSTALLED_GOLDEN_PACKAGE


REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED_ROOT = committed_root(REPO_ROOT)
# the files a regeneration writes under a golden root (their interrupted temporaries are `leftover_temps`)
_WRITTEN = re.compile(".+" + re.escape(SUFFIX) + "|" + re.escape(MANIFEST))

# numpy dtype <-> safetensors dtype tag (little-endian on disk): the dtypes numpy has natively (no BF16 in goldens)
_NP_OF = dict(NUMPY_DTYPES)
_DTYPES = {dt.name: tag for tag, dt in _NP_OF.items()}
_ITEMSIZE = {tag: dt.itemsize for tag, dt in _NP_OF.items()}


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
    for name, entry in header.entries.items():
        dtype = _NP_OF[entry.dtype].newbyteorder("<")
        raw = np.frombuffer(data[entry.begin:entry.end], dtype=dtype)
        tensors[name] = raw.reshape(entry.shape).astype(dtype.newbyteorder("="))
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

    def watch(self, record: Mapping[str, object]) -> None:
        """Nothing: a whole model run beside its golden (a test) is given every layer input at once. In a worker
        the model holds a conformance.isolation.trace_view.TraceView instead, which serves each layer's input
        after the outputs recorded in `record` before it."""

    def require(self, names: Iterable[str]) -> None:
        """Raise GoldenError unless every full tensor name in `names` is present."""
        missing = sorted(set(names) - set(self.tensors))
        if missing:
            raise GoldenError(
                f"{self.path}: missing tensor(s) {missing}; found {sorted(self.tensors)}. "
                f"Regenerate it with: {regen_command(self.case, self.meta.get('config', 'tiny'))}")


def load_manifest(root: Path) -> dict:
    """MANIFEST.json as a dict ({'schema_version', 'files': {relpath: entry}}); empty if absent.

    The document must be strict JSON holding a 'files' object; each entry is checked when it is used
    (`entry_problem`), so one bad entry spoils one case, not the run.
    """
    path = Path(root) / MANIFEST
    if not path.exists():
        return {"schema_version": SCHEMA_VERSION, "files": {}}
    try:
        m = read_json(path, "manifest")
        if not isinstance(m, dict) or not isinstance(m.get("files"), dict):
            raise FormatError(path, "manifest: expected an object with a 'files' object {path: entry}")
    except FormatError as e:
        # `k3conf regen` reads the manifest too: removing it lets regen list the files on disk again
        raise GoldenError(f"unreadable manifest: {e}. Delete it, then rebuild it with: k3conf regen "
                          f"(with the same --config / --out)") from None
    return m


_HEX64 = re.compile(r"[0-9a-f]{64}")


def entry_problem(entry) -> str | None:
    """What is wrong with one MANIFEST.json entry (None when it is well formed): an object with a 64-hex
    sha256, an int bytes >= 0, config and generator_version strings and an int seed."""
    if not isinstance(entry, dict):
        return f"entry is {type(entry).__name__} {entry!r:.60}, expected an object"
    sha = entry.get("sha256")
    if not (isinstance(sha, str) and _HEX64.fullmatch(sha)):
        return f"sha256 is {sha!r:.80}, expected 64 lowercase hex digits"
    for key, ok in (("bytes", lambda v: is_int(v) and v >= 0), ("seed", is_int),
                    ("config", lambda v: isinstance(v, str)), ("generator_version", lambda v: isinstance(v, str))):
        if not ok(entry.get(key)):
            return f"{key} is {entry.get(key)!r:.60}"
    return None


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


def leftover_temps(root: Path) -> list[Path]:
    """Temporary files of golden or manifest writes an interrupted regeneration left under `root`:
    '.<name>.safetensors.<random>.tmp', '.MANIFEST.json.<random>.tmp'."""
    return temporaries(root, _WRITTEN)


def read_golden(root: Path, case: str, manifest: dict | None = None, config: str = "tiny") -> Golden:
    """Read and verify one golden: in the manifest (a well-formed entry), sha256 matches, parses by the
    safetensors rules, known schema, metadata for this case and config, tensors named '<group>.<name>',
    kwargs a JSON object.

    manifest: a loaded MANIFEST.json (read from root when None).
    """
    root = Path(root)
    path = golden_path(root, case)
    fix = regen_command(case, config)

    def bad(what: str) -> GoldenError:
        return GoldenError(f"{path}: {what}. Regenerate it with: {fix}")

    manifest = load_manifest(root) if manifest is None else manifest
    blob = _listed_bytes(root, path, manifest, bad, fix)
    meta, tensors = decode(blob, str(path), fix)
    _check_contents(case, config, path, meta, tensors, bad)
    return Golden(case, path, meta, tensors)


def golden_of_bytes(blob: bytes, case: str, config: str, path: Path) -> Golden:
    """A golden made in memory (a fresh draw): the bytes `k3conf regen` would write, read by the same rules as a file
    (safetensors, schema, metadata, names), never written where another process could read it. `path` names it in
    messages."""
    fix = regen_command(case, config)

    def bad(what: str) -> GoldenError:
        return GoldenError(f"{path}: {what}. Regenerate it with: {fix}")

    meta, tensors = decode(blob, str(path), fix)
    _check_contents(case, config, path, meta, tensors, bad)
    return Golden(case, path, meta, tensors)


def _listed_bytes(root: Path, path: Path, manifest: dict, bad, fix: str) -> bytes:
    """The golden's bytes, once the file exists, has a well-formed manifest entry and matches its sha256."""
    rel = path.relative_to(root).as_posix()
    entry = manifest["files"].get(rel)
    try:
        present = path.is_file()
    except OSError as e:   # a name too long, a path through a file
        raise bad(f"cannot read: {e.strerror}") from None
    if not present:
        raise GoldenError(f"{path}: no such golden file. Generate it with: {fix}")
    if rel not in manifest["files"]:
        raise bad(f"not listed in {root / MANIFEST}")
    problem = entry_problem(entry)
    if problem:
        raise bad(f"its entry in {root / MANIFEST} is malformed: {problem}")
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise bad(f"cannot read: {e}") from None
    sha = hashlib.sha256(blob).hexdigest()
    if sha != entry["sha256"]:
        raise bad(f"sha256 mismatch: manifest says {entry['sha256']}, file has {sha} ({len(blob)} bytes, "
                  f"manifest {entry['bytes']})")
    return blob


def _check_contents(case: str, config: str, path: Path, meta: dict, tensors: dict, bad) -> None:
    """Schema, metadata for this case and config, '<group>.<name>' tensors with float64 results, JSON kwargs."""
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise bad(f"unknown schema_version {version!r}, this reader knows {SCHEMA_VERSION!r}")
    for key in ("block", "case", "config", "seed", "generator_version"):
        if key not in meta:
            raise bad(f"metadata key {key!r} missing (found {sorted(meta)})")
    want = {"case": case, "block": case.split("/")[0], "config": config}
    for key, value in want.items():
        if meta[key] != value:
            raise bad(f"metadata {key} is {meta[key]!r:.80}, expected {value!r}")
    misnamed = sorted(k for k in tensors if k.split(".", 1)[0] not in GROUPS or "." not in k)
    if misnamed:
        raise bad(f"tensor name(s) {misnamed[:5]} are not '<group>.<name>' with group in {GROUPS}")
    if not any(k.startswith("outputs.") for k in tensors):
        raise bad(f"no outputs.* tensor (found {sorted(tensors)})")
    narrow = sorted(k for k, v in tensors.items() if k.split(".")[0] in ("inter", "outputs")
                    and v.dtype.kind == "f" and v.dtype != np.float64)
    if narrow:   # computed tensors are float64 k3ref results; a narrower one is not a reference
        raise bad(f"computed tensor(s) {narrow[:5]} are {tensors[narrow[0]].dtype}, goldens hold float64 results")
    try:
        kwargs = loads_strict(meta.get("kwargs", "{}"), path, "metadata kwargs")
    except FormatError as e:
        raise bad(e.what) from None
    if not isinstance(kwargs, dict):
        raise bad(f"metadata kwargs is {meta['kwargs']!r:.80}, expected a JSON object of the scalar arguments")
