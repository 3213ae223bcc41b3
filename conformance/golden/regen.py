"""Regeneration: a case's golden computed from scratch by its kind (float64 k3ref), compared with the stored
one, and written all or nothing. The storage it writes through (`store`, `durable`) knows nothing of cases.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from conformance.cases.catalog import kind_of
from conformance.cases.protocol import GENERATOR_VERSION, Case
from conformance.golden.drift import TensorDrift, diff_tensors, is_rounding_only
from conformance.golden.durable import Staged, regen_lock, signals_deferred
from conformance.golden.errors import GoldenError
from conformance.golden.store import (
    SCHEMA_VERSION,
    Golden,
    decode,
    encode,
    entry_problem,
    golden_path,
    leftover_temps,
    load_manifest,
    manifest_entry,
    regen_command,
    save_manifest,
)
from k3ref.threads import fixed_blas


def metadata(case: Case, kwargs: Mapping) -> dict[str, str]:
    """The golden's metadata strings for `case`: schema version, block, case, config, seed, generator, kwargs."""
    return {
        "schema_version": SCHEMA_VERSION,
        "block": case.block,
        "case": case.name,
        "config": case.config,
        "seed": str(case.seed),
        "generator_version": GENERATOR_VERSION,
        "kwargs": json.dumps(dict(kwargs), sort_keys=True, separators=(",", ":")),
    }


def golden_problems(case: Case, golden: Golden) -> list[str]:
    """How a readable golden differs in kind from what the generator makes for `case` (empty: it does not).

    Compared: the metadata (seed, generator version, kwargs), the tensor names, each tensor's dtype and
    shape, and where it holds NaN/Inf. Values are not compared (that is `k3conf regen --check`): this
    separates "the golden is wrong" from "the backend is wrong" when a case crashes or fails.
    """
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


def build_blob(case: Case) -> bytes:
    """The golden bytes of `case`, computed from scratch by its kind (float64 k3ref)."""
    content = kind_of(case).generate(case)
    return encode(content.tensors, metadata(case, content.kwargs))


def _compare(case: Case, path: Path, blob: bytes, old: bytes | None, check: bool,
             accept: bool) -> tuple[str, list[TensorDrift]]:
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


@fixed_blas
def regenerate(cases: Iterable[Case], root: Path, *, check: bool = False, accept: bool = False,
               known: Iterable[str] | None = None, config: str | None = None) -> list[RegenOutcome]:
    """Recompute every case's golden under `root`.

    Without check: write new files; leave identical ones (and rounding-only drift, <= ROUNDING_DRIFT) alone;
    refuse to overwrite a changed golden (status 'changed', with the per-tensor drift). With accept: overwrite
    every golden whose bytes differ (status 'accepted', drift shown).
    With check: write nothing; 'drift' for a changed golden (or one the manifest does not list as it is),
    'missing' for an absent one, 'leftover' for a temporary file a killed regeneration left.
    known, config: every case name of `config`; manifest entries of `config` that no known case owns are
    'stale' under check and 'pruned' (entry dropped, file left alone) otherwise. An entry that names another
    config is never stale here: one golden directory may hold several configs' goldens (`--out DIR`), and a
    regeneration of one config knows nothing of the others' cases. An entry whose config cannot be read
    (malformed) belongs to no config, so every regeneration may report and prune it.

    Writing is all or nothing, under the directory lock (regen_lock): every new file is first written and
    fsynced as an unnamed temporary, then all are renamed into place and MANIFEST.json is replaced last,
    with Ctrl-C held back for those renames. A process killed before the renames changes nothing (on
    Linux it leaves no file either); one killed by SIGKILL inside them leaves files the manifest does not
    list as they are, which `--check` names ('drift', MANIFEST.json) and a plain regen re-lists.
    Leftover temporary files are removed first.
    """
    root = Path(root)
    if known is not None and config is None:
        raise ValueError("regenerate: known case names need their config (which manifest entries they cover)")
    owned = None if known is None else (str(config), frozenset(known))
    if check and not root.is_dir():   # nothing to read, and --check creates nothing
        return _regenerate(cases, root, check, accept, owned)
    with regen_lock(root, shared=check):
        return _regenerate(cases, root, check, accept, owned)


def _regenerate(cases: Iterable[Case], root: Path, check: bool, accept: bool,
                owned: tuple[str, frozenset[str]] | None) -> list[RegenOutcome]:
    outcomes = _leftovers(root, check)
    manifest = load_manifest(root)
    files = manifest["files"]
    staged: list[tuple[Staged, str, dict]] = []
    relist: dict[str, dict | None] = {}   # manifest rows to rewrite (None: drop the row)
    try:
        for case in cases:
            outcomes.append(_regenerate_case(case, root, files, check, accept, staged, relist))
        if owned is not None:
            outcomes += _stale_entries(root, files, owned, check, relist)
        if check:
            return outcomes
        with signals_deferred():
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


def _regenerate_case(case: Case, root: Path, files: dict, check: bool, accept: bool,
                     staged: list, relist: dict) -> RegenOutcome:
    """Rebuild one golden and compare it with the file; a write is staged (not committed) in `staged`, a file
    that stays is listed as it is on disk in `relist`."""
    path = golden_path(root, case.name)
    rel = path.relative_to(root).as_posix()
    blob = build_blob(case)
    old = path.read_bytes() if path.is_file() else None
    status, drift = _compare(case, path, blob, old, check, accept)
    entry = files.get(rel)
    listed = entry["sha256"] if entry is not None and entry_problem(entry) is None else None
    kept = old if status in ("unchanged", "rounding") else None   # the file on disk, when it stays
    if check and kept is not None and listed != hashlib.sha256(kept).hexdigest():
        # the file would be kept, but `run` reads it against the manifest and would reject it
        status = "drift"
        why = "malformed" if entry is not None and listed is None else "not listed"
        drift = drift + [TensorDrift("MANIFEST.json", "changed", detail=f"sha256 of {rel} {why}")]
    meta = decode(blob, str(path), "")[0]
    if not check and status in ("new", "accepted"):
        staged.append((Staged(path, blob), rel, manifest_entry(blob, meta)))
    elif not check and kept is not None:
        relist[rel] = manifest_entry(kept, meta)   # the file stays: list what is on disk
    return RegenOutcome(case.name, path, status, drift)


def _stale_entries(root: Path, files: dict, owned: tuple[str, frozenset[str]], check: bool,
                   relist: dict) -> list[RegenOutcome]:
    """Manifest rows of this config that no case of it owns: reported under --check, dropped otherwise.
    Rows of another config are left alone (see regenerate)."""
    config, known = owned
    outcomes = []
    paths = {golden_path(root, name).relative_to(root).as_posix() for name in known}
    for rel in sorted(set(files) - paths):
        if _entry_config(files[rel]) not in (None, config):
            continue
        outcomes.append(RegenOutcome(rel, root / rel, "stale" if check else "pruned",
                                     note="a manifest entry no case of this config owns"))
        if not check:
            relist[rel] = None
    return outcomes


def _entry_config(entry) -> str | None:
    """The config a manifest row was written for; None when the row is malformed (it belongs to none)."""
    return entry["config"] if entry_problem(entry) is None else None


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
