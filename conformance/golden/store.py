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

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import signal
import struct
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from k3ref.safetensors_io import NUMPY_DTYPES, FormatError, is_int, loads_strict, parse_bytes, read_json

SCHEMA_VERSION = "1"
GROUPS = ("inputs", "weights", "inter", "outputs")
MANIFEST = "MANIFEST.json"
SUFFIX = ".safetensors"
REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED_ROOT = REPO_ROOT / "golden"
# Regeneration keeps a golden whose outputs moved by no more than this (relative RMS): float64 BLAS
# kernels differ at the last bit between CPUs; a real change of the math moves results far more.
ROUNDING_DRIFT = 1e-12

# numpy dtype <-> safetensors dtype tag (little-endian on disk): the dtypes numpy has natively (no BF16 in goldens)
_NP_OF = dict(NUMPY_DTYPES)
_DTYPES = {dt.name: tag for tag, dt in _NP_OF.items()}
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


def _file_mode() -> int:
    """0o666 less the process umask: what open() would give a new file (mkstemp's files are 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


TMP_SUFFIX = ".tmp"


_TEMP_NAME = re.compile(r"\.(.+\.safetensors|MANIFEST\.json)\.[^.]+" + re.escape(TMP_SUFFIX))


def _is_temp(path: Path) -> bool:
    """A temporary file of a golden or manifest write: '.<name>.safetensors.<random>.tmp', '.MANIFEST.json.<random>.tmp'."""
    return _TEMP_NAME.fullmatch(path.name) is not None


def leftover_temps(root: Path) -> list[Path]:
    """Temporary files an interrupted writer left under `root` (a killed process cannot remove its own)."""
    root = Path(root)
    return sorted(p for p in root.rglob("." + "*" + TMP_SUFFIX) if p.is_file() and _is_temp(p)) if root.is_dir() else []


class Staged:
    """A file written and fsynced but not yet in place; `commit()` renames it over `path`.

    On Linux the data lives in an unnamed O_TMPFILE inode until the commit, so a process killed before
    then leaves nothing behind; elsewhere a '.<name>.<random>.tmp' file next to `path`, removed on any
    exception (a SIGKILL leaves it; the next regen removes it, `regen --check` lists it).
    """

    def __init__(self, path: Path, blob: bytes):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd, self.tmp = self._open()
        try:
            os.fchmod(self.fd, _file_mode())
            view = memoryview(blob)
            while view:
                view = view[os.write(self.fd, view):]
            os.fsync(self.fd)
        except BaseException:
            self.discard()
            raise

    def _open(self) -> tuple[int, Path | None]:
        flag = getattr(os, "O_TMPFILE", 0)
        if flag and sys.platform == "linux" and Path("/proc/self/fd").is_dir():
            try:
                return os.open(self.path.parent, flag | os.O_WRONLY, 0o600), None
            except OSError:
                pass   # a file system without O_TMPFILE: a named temporary file instead
        fd, tmp = tempfile.mkstemp(prefix="." + self.path.name + ".", suffix=TMP_SUFFIX, dir=self.path.parent)
        return fd, Path(tmp)

    def commit(self) -> None:
        while self.tmp is None:   # give the unnamed inode a name, then move it over the target in one rename
            tmp = self.path.with_name(f".{self.path.name}.{os.urandom(6).hex()}{TMP_SUFFIX}")
            try:
                _link_follow(f"/proc/self/fd/{self.fd}", tmp)
            except FileExistsError:
                continue
            self.tmp = tmp
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        finally:
            self.tmp = None
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)


_AT_FDCWD, _AT_SYMLINK_FOLLOW = -100, 0x400


def _link_follow(src: str, dst: Path) -> None:
    """linkat(src, dst, AT_SYMLINK_FOLLOW): os.link calls link(2), which would link the /proc symlink itself
    instead of the O_TMPFILE inode it points at (open(2) documents this linkat call for O_TMPFILE)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(str(dst)), _AT_SYMLINK_FOLLOW) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(dst))


def _fsync_dir(path: Path) -> None:
    """Make renames in `path` durable (a power cut after the rename keeps the new name)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, blob: bytes) -> None:
    """Write blob to a temporary file next to `path`, fsync it, then rename it into place.

    The file gets the usual permissions (0o644 under umask 022), not mkstemp's owner-only 0o600: goldens
    and their manifest are shared data that other users and CI jobs must be able to read.
    """
    staged = Staged(Path(path), blob)
    try:
        staged.commit()
    finally:
        staged.discard()
    _fsync_dir(Path(path).parent)


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


def metadata(case, kwargs: Mapping) -> dict[str, str]:
    """The golden's metadata strings for `case`: schema version, block, case, config, seed, generator, kwargs."""
    from conformance.cases.core import GENERATOR_VERSION

    return {
        "schema_version": SCHEMA_VERSION,
        "block": case.block,
        "case": case.name,
        "config": case.config,
        "seed": str(case.seed),
        "generator_version": GENERATOR_VERSION,
        "kwargs": json.dumps(dict(kwargs), sort_keys=True, separators=(",", ":")),
    }


def golden_problems(case, golden: Golden) -> list[str]:
    """How a readable golden differs in kind from what the generator makes for `case` (empty: it does not).

    Compared: the metadata (seed, generator version, kwargs), the tensor names, each tensor's dtype and
    shape, and where it holds NaN/Inf. Values are not compared (that is `k3conf regen --check`): this
    separates "the golden is wrong" from "the backend is wrong" when a case crashes or fails.
    """
    from conformance.cases.core import kind_of

    content = kind_of(case).generate(case)
    out = []
    want_meta = metadata(case, content.kwargs)
    for key in ("seed", "generator_version"):
        if golden.meta.get(key) != want_meta[key]:
            out.append(f"metadata {key} is {golden.meta.get(key)!r:.60}, the generator writes {want_meta[key]!r}")
    if golden.kwargs != json.loads(want_meta["kwargs"]):
        out.append(f"kwargs are {golden.meta.get('kwargs')!r:.120}, the generator writes {want_meta['kwargs']}")
    have, want = golden.tensors, content.tensors
    for name in sorted(set(want) - set(have)):
        out.append(f"tensor {name} missing")
    for name in sorted(set(have) - set(want)):
        out.append(f"tensor {name} is not one the generator writes")
    for name in sorted(set(have) & set(want)):
        a, b = have[name], np.asarray(want[name])
        if a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"tensor {name} is {a.dtype}{list(a.shape)}, the generator writes {b.dtype}{list(b.shape)}")
        elif a.dtype.kind == "f":
            bad = ~np.isfinite(a) & np.isfinite(b)
            if bad.any():
                i = tuple(int(j) for j in np.argwhere(bad)[0])
                out.append(f"tensor {name} holds {int(bad.sum())} non-finite value(s) where the generator's are "
                           f"finite (first at {i}: {a[i]})")
    return out


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
    """What regeneration did (or, with check, found) for one case, or for one file no case owns.

    case: the case name, or for the file-level statuses the path relative to the golden root."""

    case: str
    path: Path
    # new | unchanged | rounding | changed | accepted | drift | missing (a case);
    # stale | pruned (a manifest entry no case owns); leftover | removed (a temporary file of a killed regen)
    status: str
    drift: list[TensorDrift] = dataclasses.field(default_factory=list)
    note: str = ""

    @property
    def failed(self) -> bool:
        """True for the outcomes that make `k3conf regen` exit 1."""
        return self.status in ("changed", "drift", "missing", "stale", "leftover")


def build_blob(case) -> bytes:
    """The golden bytes of `case`, computed from scratch by its kind (float64 k3ref)."""
    from conformance.cases.core import kind_of

    content = kind_of(case).generate(case)
    return encode(content.tensors, metadata(case, content.kwargs))


class RegenBusy(GoldenError):
    """Another regeneration holds the golden directory's lock."""


@contextlib.contextmanager
def regen_lock(root: Path, wait: bool = True, shared: bool = False):
    """Hold an exclusive flock on the golden directory itself while regenerating into it.

    Two regenerations into one directory would each write the manifest from what they read, and the
    later one would drop the other's entries. The second waits (wait=True, saying so on stderr) or
    raises RegenBusy. The lock is on the directory's own descriptor: no lock file to leave behind, and
    the kernel drops it when the holder dies, even by SIGKILL. shared: a reader's lock (`--check`), which
    only waits for a writer to finish its renames.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise RegenBusy(f"{root}: another `k3conf regen` is writing this golden directory; wait for it to "
                                "finish, then rerun") from None
            print(f"k3conf regen: waiting for another regeneration writing {root} to finish", file=sys.stderr)
            fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _signals_deferred():
    """Hold back Ctrl-C / SIGTERM / SIGHUP while the files and the manifest are renamed into place (a few
    milliseconds), so that an interrupt lands before the commit or after it, never inside it.

    The Python handlers are swapped for ones that only record the signal, then the first recorded one is
    re-sent once the commit is done. (Masking the signals would not do: the kernel hands a process signal
    to any thread not masking it, BLAS worker threads included.)"""
    import threading

    if threading.current_thread() is not threading.main_thread():   # handlers can only be set from there
        yield
        return
    got: list[int] = []
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            os.kill(os.getpid(), got[0])


def _compare(case, path: Path, blob: bytes, old: bytes | None, check: bool, accept: bool):
    """(status, drift) of a fresh blob against the file on disk (see regenerate)."""
    if old is None:
        return ("missing" if check else "new"), []
    if old == blob:
        return "unchanged", []
    new_meta, new_t = decode(blob, str(path), regen_command(case.name, case.config))
    try:
        old_meta, old_t = decode(old, str(path), "")
        drift = diff_tensors(old_t, new_t)
        meta_changes = {k for k in set(old_meta) | set(new_meta) if old_meta.get(k) != new_meta.get(k)}
        drift += [TensorDrift(f"metadata.{k}", "changed", detail=f"{old_meta.get(k)!r:.80} -> {new_meta.get(k)!r:.80}")
                  for k in sorted(meta_changes)]
        rounding = is_rounding_only(drift, old_meta, new_meta)
    except GoldenError as e:
        drift, rounding = [TensorDrift("file", "unreadable", detail=str(e).split(". Regenerate")[0])], False
    if accept and not check:
        return "accepted", drift
    if rounding:
        return "rounding", drift
    return ("drift" if check else "changed"), drift


def regenerate(cases, root: Path, *, check: bool = False, accept: bool = False,
               known: Iterable[str] | None = None) -> list[RegenOutcome]:
    """Recompute every case's golden under `root`.

    Without check: write new files; leave identical ones (and rounding-only drift, <= ROUNDING_DRIFT) alone;
    refuse to overwrite a changed golden (status 'changed', with the per-tensor drift). With accept: overwrite
    every golden whose bytes differ (status 'accepted', drift shown).
    With check: write nothing; 'drift' for a changed golden (or one the manifest does not list as it is),
    'missing' for an absent one, 'leftover' for a temporary file a killed regeneration left.
    known: every case name of the config; manifest entries of no known case are 'stale' under check and
    'pruned' (entry dropped, file left alone) otherwise.

    Writing is all or nothing, under the directory lock (regen_lock): every new file is first written and
    fsynced as an unnamed temporary, then all are renamed into place and MANIFEST.json is replaced last,
    with Ctrl-C held back for those renames. A process killed before the renames changes nothing (on
    Linux it leaves no file either); one killed by SIGKILL inside them leaves files the manifest does not
    list as they are, which `--check` names ('drift', MANIFEST.json) and a plain regen re-lists.
    Leftover temporary files are removed first.
    """
    root = Path(root)
    if check and not root.is_dir():   # nothing to read, and --check creates nothing
        return _regenerate(cases, root, check, accept, known)
    with regen_lock(root, shared=check):
        return _regenerate(cases, root, check, accept, known)


def _regenerate(cases, root: Path, check: bool, accept: bool, known) -> list[RegenOutcome]:
    outcomes = _leftovers(root, check)
    manifest = load_manifest(root)
    files = manifest["files"]
    staged: list[tuple[Staged, str, dict]] = []
    relist: dict[str, dict | None] = {}   # manifest rows to rewrite (None: drop the row)
    try:
        for case in cases:
            outcomes.append(_regenerate_case(case, root, files, check, accept, staged, relist))
        if known is not None:
            outcomes += _stale_entries(root, files, known, check, relist)
        if check:
            return outcomes
        with _signals_deferred():
            _commit(root, manifest, staged, relist)
    finally:
        for st, _, _ in staged:
            st.discard()
    return outcomes


def _leftovers(root: Path, check: bool) -> list[RegenOutcome]:
    """Temporary files an interrupted write left behind: reported under --check, removed otherwise."""
    outcomes = []
    for tmp in leftover_temps(root):
        rel = tmp.relative_to(root).as_posix()
        if check:
            outcomes.append(RegenOutcome(rel, tmp, "leftover", note="k3conf regen removes it"))
        else:
            tmp.unlink(missing_ok=True)
            outcomes.append(RegenOutcome(rel, tmp, "removed"))
    return outcomes


def _regenerate_case(case, root: Path, files: dict, check: bool, accept: bool,
                     staged: list, relist: dict) -> RegenOutcome:
    """Rebuild one golden and compare it with the file; a write is staged (not committed) in `staged`, a file
    that stays is listed as it is on disk in `relist`."""
    path = golden_path(root, case.name)
    rel = path.relative_to(root).as_posix()
    blob = build_blob(case)
    old = path.read_bytes() if path.is_file() else None
    status, drift = _compare(case, path, blob, old, check, accept)
    entry = files.get(rel)
    listed = entry["sha256"] if entry_problem(entry) is None else None
    if check and status in ("unchanged", "rounding") and listed != hashlib.sha256(old).hexdigest():
        # the file would be kept, but `run` reads it against the manifest and would reject it
        status = "drift"
        why = "malformed" if entry is not None and listed is None else "not listed"
        drift = drift + [TensorDrift("MANIFEST.json", "changed", detail=f"sha256 of {rel} {why}")]
    meta = decode(blob, str(path), "")[0]
    if not check and status in ("new", "accepted"):
        staged.append((Staged(path, blob), rel, manifest_entry(blob, meta)))
    elif not check and status in ("unchanged", "rounding"):
        relist[rel] = manifest_entry(old, meta)   # the file stays: list what is on disk
    return RegenOutcome(case.name, path, status, drift)


def _stale_entries(root: Path, files: dict, known, check: bool, relist: dict) -> list[RegenOutcome]:
    """Manifest rows that no case of this config owns: reported under --check, dropped otherwise."""
    outcomes = []
    owned = {golden_path(root, name).relative_to(root).as_posix() for name in known}
    for rel in sorted(set(files) - owned):
        outcomes.append(RegenOutcome(rel, root / rel, "stale" if check else "pruned",
                                     note="a manifest entry no case of this config owns"))
        if not check:
            relist[rel] = None
    return outcomes


def _commit(root: Path, manifest: dict, staged: list, relist: dict) -> None:
    """Rename every staged golden into place, then write the manifest that lists them."""
    files = manifest["files"]
    for st, rel, entry in staged:
        st.commit()
        files[rel] = entry
    for rel, entry in relist.items():
        if entry is None:
            files.pop(rel, None)
        else:
            files[rel] = entry
    manifest["schema_version"] = SCHEMA_VERSION
    save_manifest(root, manifest)
