"""Fresh goldens: a per-block case drawn again with another seed, so that a kernel is judged on inputs it could
not have seen (a kernel that returns stored outputs, zeros, or its first answer passes no fresh golden).

The fresh golden is made the way a committed one is: the kind's own generator computes the float64 reference
on the fly, the golden store encodes it into the bytes of a golden file, and they are read back with every check
a committed golden gets. It stays in the run's memory: a file, even in a private temporary folder, could be read
by a kernel's process (the same user), and the fresh draw is what a memoriser of answers must not see. Given a
work directory (tools, tests), the file is also written there with its manifest. Only the seed differs, recorded in
the golden's metadata for replay (`dataclasses.replace(case, seed=...)` regenerates the very same bytes).

Per-block kinds only: a trace's data is a model preset and a prompt, not a seeded draw of a block's inputs.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import secrets
from pathlib import Path

from conformance.cases.protocol import Case
from conformance.golden.durable import atomic_write, regen_lock
from conformance.golden.regen import build_blob
from conformance.golden.store import (
    Golden,
    decode,
    golden_of_bytes,
    golden_path,
    load_manifest,
    manifest_entry,
    read_golden,
    regen_command,
    save_manifest,
)

# the kinds whose cases are one block on seeded arrays (conformance.cases.catalog.KINDS)
PER_BLOCK_KINDS = frozenset({"core", "latent_moe"})
# the range of the committed cases' seeds (conformance.cases.protocol.case_seed)
SEED_RANGE = 2 ** 31 - 1


def draw_seed() -> int:
    """A seed from the operating system's randomness: no kernel can know it before the run prints it."""
    return secrets.randbelow(SEED_RANGE)


def env_seed(name: str, printed_by: str, error: type[Exception]) -> int:
    """The seed in environment variable `name` when set (a replay of one `printed_by` printed), else `draw_seed()`;
    a value that is not a non-negative integer raises `error` (the caller's kind of error) naming it."""
    text = os.environ.get(name, "").strip()
    if not text:
        return draw_seed()
    if not text.isdigit():
        raise error(f"{name}: expected a non-negative integer (a seed {printed_by} printed), found {text[:60]!r}")
    return int(text)


def fresh_case(case: Case, seed: int) -> Case | None:
    """`case` with `seed` instead of its own; None for a kind whose data is not a seeded draw (the traces)."""
    if case.kind not in PER_BLOCK_KINDS:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"{case.name}: seed expected a non-negative integer, found {seed!r}")
    return dataclasses.replace(case, seed=int(seed))


def fresh_golden(case: Case, seed: int, workdir: Path | None = None) -> Golden | None:
    """The golden of `case` drawn with `seed`, read by the store's rules from its bytes in memory; None for the
    trace cases (see fresh_case). With `workdir` it is written there too (file + MANIFEST.json, as `k3conf regen`
    writes them) and read back by `read_golden`: an earlier fresh golden of the same case in `workdir` is replaced;
    the manifest keeps the other cases' rows."""
    fresh = fresh_case(case, seed)
    if fresh is None:
        return None
    blob = build_blob(fresh)
    if workdir is None:
        return golden_of_bytes(blob, case.name, case.config, Path(f"(fresh draw, seed {seed}, in memory)") / case.name)
    root = Path(workdir)
    path = golden_path(root, case.name)
    meta, _ = decode(blob, str(path), regen_command(case.name, case.config))
    with regen_lock(root):   # one manifest per work directory: concurrent writers must not drop each other's rows
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, blob)
        manifest = load_manifest(root)
        manifest["files"][path.relative_to(root).as_posix()] = manifest_entry(blob, meta)
        save_manifest(root, manifest)
    return read_golden(root, case.name, manifest, config=case.config)
