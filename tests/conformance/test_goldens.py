"""Golden files: format round trip, determinism, --check drift, refusal to overwrite, broken-file errors."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from conformance.cases.catalog import all_cases, select
from conformance.cli import main
from conformance.golden import store as goldens
from conformance.golden.drift import ROUNDING_DRIFT, diff_tensors, is_rounding_only
from conformance.golden.regen import regenerate
from conformance.golden.store import COMMITTED_ROOT, GoldenError, decode, encode, read_golden

CASE = "rmsnorm/T1-D113"
FIX = f"k3conf regen --cases '{CASE}'"
SUBSET = ["rmsnorm/*", "moe_route/T1-E8-k2", "mxfp4_gemv/N1-K32"]
# committed goldens stay under 22 MB so that a clone stays light. Measured: 21.8 MB, of which the two k3geom
# traces are 12.5 MB (K3's per-head sizes: a 2 x 128 x 128 float64 KDA state per KDA layer and step, kept as
# input and output; 2 x 256 x 512 MLA kv_b weights per MLA layer), the engine-shaped cores' 2.2 MB (one case per
# core at K3's per-head geometry: a 128 x 128 state per pool slot, kept as input and output) and tiny's 4.4 MB.
MAX_COMMITTED_BYTES = 22_000_000


def _subset():
    return select(all_cases("tiny"), SUBSET)


@pytest.fixture
def root(tmp_path) -> Path:
    """A fresh golden dir holding the SUBSET cases."""
    out = regenerate(_subset(), tmp_path)
    assert {o.status for o in out} == {"new"}
    return tmp_path


def _resign(root: Path, case: str, blob: bytes) -> None:
    """Write `blob` as the golden of `case` and list its sha256 in the manifest (a consistent but bad file)."""
    path = goldens.golden_path(root, case)
    path.write_bytes(blob)
    m = json.loads((root / "MANIFEST.json").read_text())
    m["files"][path.relative_to(root).as_posix()]["sha256"] = hashlib.sha256(blob).hexdigest()
    (root / "MANIFEST.json").write_text(json.dumps(m))


def _with_tensor(blob: bytes, name: str, fn) -> bytes:
    meta, tensors = decode(blob, "x", "y")
    tensors[name] = fn(tensors[name])
    return encode(tensors, meta)


def test_round_trip_and_safetensors_interop(rng):
    tensors = {
        "inputs.x": rng.standard_normal((3, 5)),
        "inputs.table": np.arange(6, dtype=np.int32).reshape(2, 3),
        "weights.packed": rng.integers(0, 256, (4, 2), dtype=np.uint8),
        "outputs.idx": np.array([[3, 1]], dtype=np.int64),
        "outputs.y32": rng.standard_normal(7).astype(np.float32),
    }
    meta = {"schema_version": "1", "case": "a/b", "kwargs": json.dumps({"eps": 1e-5})}
    blob = encode(tensors, meta)
    got_meta, got = decode(blob, "mem", "fix")
    assert got_meta == meta
    assert sorted(got) == sorted(tensors)
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and np.array_equal(got[k], v), k
    lib = safetensors.numpy.load(blob)     # the reference reader agrees with ours
    for k, v in tensors.items():
        assert np.array_equal(lib[k], v), k


def test_encode_rejects_unknown_group():
    with pytest.raises(ValueError, match="group"):
        encode({"x": np.zeros(2)}, {})


def test_regen_is_byte_identical(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    regenerate(_subset(), a)
    regenerate(_subset(), b)
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files_a == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert len(files_a) == len(_subset()) + 1      # + MANIFEST.json
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    # a rerun into the same dir changes nothing and leaves no temporary file behind
    out = regenerate(_subset(), a)
    assert {o.status for o in out} == {"unchanged"}
    assert not list(a.rglob("*.tmp"))


def test_goldens_are_readable_by_others(tmp_path):
    """Written with the umask's permissions (0o644 under umask 022), not mkstemp's owner-only 0o600."""
    regenerate(select(all_cases("tiny"), [CASE]), tmp_path)
    mask = os.umask(0)
    os.umask(mask)
    for path in (goldens.golden_path(tmp_path, CASE), tmp_path / "MANIFEST.json"):
        assert path.stat().st_mode & 0o777 == 0o666 & ~mask, path


def test_committed_goldens_are_current_and_small():
    manifest = goldens.load_manifest(COMMITTED_ROOT)
    total = 0
    for rel, entry in manifest["files"].items():
        blob = (COMMITTED_ROOT / rel).read_bytes()
        assert hashlib.sha256(blob).hexdigest() == entry["sha256"], rel
        total += len(blob)
    assert total < MAX_COMMITTED_BYTES, f"committed goldens are {total} bytes"
    out = regenerate(all_cases("tiny"), COMMITTED_ROOT, check=True)
    stale = [(o.case, o.status, [d.line() for d in o.drift]) for o in out if o.failed]
    assert not stale, f"committed goldens differ from a fresh regeneration: {stale}; run `k3conf regen`"


def test_metadata_and_groups(root):
    g = read_golden(root, CASE)
    for key in ("schema_version", "block", "case", "config", "seed", "generator_version", "kwargs"):
        assert key in g.meta
    assert g.block == "rmsnorm" and g.kwargs == {"eps": 1e-5}
    assert set(g.group("inputs")) == {"x", "w"} and set(g.group("outputs")) == {"y"}
    assert all(v.dtype == np.float64 for v in g.tensors.values())


def test_check_reports_drift_per_tensor(root, capsys):
    blob = goldens.golden_path(root, CASE).read_bytes()
    _resign(root, CASE, _with_tensor(blob, "outputs.y", lambda y: y * (1 + 1e-3)))
    rc = main(["regen", "--check", "--out", str(root), "--cases", *SUBSET])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"{CASE}: DRIFT" in out and "outputs.y: changed" in out and "rel RMS 0.000999" in out
    assert "moe_route/T1-E8-k2: DRIFT" not in out


def test_check_passes_on_fresh_goldens(root, capsys):
    assert main(["regen", "--check", "--out", str(root), "--cases", *SUBSET]) == 0


def test_regen_refuses_to_overwrite_without_accept(root, capsys):
    path = goldens.golden_path(root, CASE)
    fresh = path.read_bytes()
    tampered = _with_tensor(fresh, "inputs.w", lambda w: w + 1.0)
    _resign(root, CASE, tampered)
    assert main(["regen", "--out", str(root), "--cases", CASE]) == 1
    out = capsys.readouterr().out
    assert "CHANGED, not overwritten" in out and "inputs.w: changed" in out
    assert path.read_bytes() == tampered
    assert main(["regen", "--accept", "--out", str(root), "--cases", CASE]) == 0
    out = capsys.readouterr().out
    assert "changed, overwritten" in out and "inputs.w: changed, max abs 1" in out
    assert path.read_bytes() == fresh
    assert read_golden(root, CASE).tensors   # manifest re-signed


def _truncate(root, blob):
    _resign(root, CASE, blob[: len(blob) // 2])


def _bad_header(root, blob):
    _resign(root, CASE, blob[:8] + b"{not json" + blob[17:])


def _sha_mismatch(root, blob):
    goldens.golden_path(root, CASE).write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))


def _unknown_schema(root, blob):
    meta, tensors = decode(blob, "x", "y")
    _resign(root, CASE, encode(tensors, {**meta, "schema_version": "99"}))


def _no_outputs(root, blob):
    meta, tensors = decode(blob, "x", "y")
    _resign(root, CASE, encode({k: v for k, v in tensors.items() if not k.startswith("outputs.")}, meta))


def _unlisted(root, blob):
    m = json.loads((root / "MANIFEST.json").read_text())
    del m["files"][CASE + ".safetensors"]
    (root / "MANIFEST.json").write_text(json.dumps(m))


def _deleted(root, blob):
    goldens.golden_path(root, CASE).unlink()


@pytest.mark.parametrize("damage, message", [
    pytest.param(_truncate, "truncated", id="truncated"),
    pytest.param(_bad_header, "bad header", id="bad-header"),
    pytest.param(_sha_mismatch, "sha256 mismatch", id="sha-mismatch"),
    pytest.param(_unknown_schema, "unknown schema_version '99'", id="unknown-schema"),
    pytest.param(_no_outputs, "no outputs", id="no-outputs"),
    pytest.param(_unlisted, "not listed in", id="not-in-manifest"),
    pytest.param(_deleted, "no such golden file", id="missing-file"),
])
def test_broken_golden_names_file_and_fix(root, damage, message):
    damage(root, goldens.golden_path(root, CASE).read_bytes())
    with pytest.raises(GoldenError) as e:
        read_golden(root, CASE)
    text = str(e.value)
    assert message in text and str(goldens.golden_path(root, CASE)) in text and FIX in text


def test_missing_tensor_names_file_and_fix(root):
    g = read_golden(root, CASE)
    with pytest.raises(GoldenError, match=r"missing tensor\(s\) \['outputs.nope'\]") as e:
        g.require(["outputs.y", "outputs.nope"])
    assert FIX in str(e.value)


def test_small_config_goes_to_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("K3CONF_CACHE", str(tmp_path))
    assert goldens.default_root("small") == tmp_path / "golden" / "small"
    assert goldens.default_root("tiny") == COMMITTED_ROOT
    assert goldens.regen_command("a/b", "small") == "k3conf regen --cases 'a/b' --config small"


def test_metadata_drift_shows_the_values(root, capsys):
    blob = goldens.golden_path(root, CASE).read_bytes()
    meta, tensors = decode(blob, "x", "y")
    _resign(root, CASE, encode(tensors, {**meta, "seed": "99"}))
    assert main(["regen", "--check", "--out", str(root), "--cases", CASE]) == 1
    assert "metadata.seed: changed '99' -> " in capsys.readouterr().out


def test_check_flags_a_kept_file_the_manifest_does_not_list(root):
    """Rounding-level drift keeps the file, but `run` would reject a file whose sha256 is not in the manifest."""
    path = goldens.golden_path(root, CASE)
    path.write_bytes(_with_tensor(path.read_bytes(), "outputs.y", lambda y: y * (1 + 4e-16)))   # not re-signed
    (o,) = regenerate(select(all_cases("tiny"), [CASE]), root, check=True)
    assert o.failed and o.status == "drift" and any(d.name == "MANIFEST.json" for d in o.drift)
    (o,) = regenerate(select(all_cases("tiny"), [CASE]), root)                 # the regen the error names
    assert o.status == "rounding" and read_golden(root, CASE).tensors       # re-listed, readable


def test_rounding_level_drift_keeps_the_file_unless_accepted(root):
    path = goldens.golden_path(root, CASE)
    fresh = path.read_bytes()
    nudged = _with_tensor(fresh, "outputs.y", lambda y: y * (1 + 4e-16))   # another CPU's BLAS, say
    assert nudged != fresh
    _resign(root, CASE, nudged)
    (o,) = regenerate(select(all_cases("tiny"), [CASE]), root, check=True)
    assert o.status == "rounding" and not o.failed
    (o,) = regenerate(select(all_cases("tiny"), [CASE]), root)
    assert o.status == "rounding" and path.read_bytes() == nudged
    (o,) = regenerate(select(all_cases("tiny"), [CASE]), root, accept=True)
    assert o.status == "accepted" and path.read_bytes() == fresh


def _margin_drift(old: dict, name: str, moved: float):
    new = {**old, name: old[name] + moved}
    (d,) = diff_tensors(old, new)
    return d, is_rounding_only([d], {}, {})


@pytest.mark.parametrize("name", ["inter.argmax.step1.margin", "inter.route.step1.layer04.margin"])
def test_a_margin_is_judged_at_the_scale_of_its_scores(rng, name):
    """A margin is the difference of two nearly equal scores: a last-bits change of the scores is a large
    fraction of a small margin, yet rounding. A real change still is drift."""
    logits = rng.standard_normal(97)   # scores of order 1 (the argmax margin's are the golden's step logits)
    old = {"outputs.step1.logits": logits, name: np.array([1.2e-3])}
    d, rounding = _margin_drift(old, name, 1e-14)
    assert d.rel_rms > ROUNDING_DRIFT and rounding, d.line()      # relative to itself it would be drift
    assert "at the scale of its scores" in d.line()
    d, rounding = _margin_drift(old, name, 1e-6)
    assert d.rounding_rms > ROUNDING_DRIFT and not rounding, d.line()


def test_only_margins_are_judged_at_the_scale_of_scores(rng):
    """The same change on a small tensor that is not a margin, or on a margin whose scores the golden does
    not hold, is judged relative to itself: drift."""
    old = {"outputs.step1.logits": rng.standard_normal(97), "outputs.small": np.array([1.2e-3]),
           "inter.argmax.step2.margin": np.array([1.2e-3])}
    for name in ("outputs.small", "inter.argmax.step2.margin"):
        d, rounding = _margin_drift(old, name, 1e-14)
        assert d.score_scale is None and not rounding, d.line()
