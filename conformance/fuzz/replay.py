"""A shrunk fuzz finding as files: a replay file (JSON: the draw, the backend, the failure) and the draw's golden in
the cache (the float64 reference of its inputs, with its seed), so that the smallest failing draw runs again, by
itself, on the same backend or on the next version of the kernel.

    path = write(finding, spec, out_dir)          # out_dir/<block>/<draw id>.json + the golden in the cache
    draw, spec, said = read(path)                 # `k3conf fuzz --replay PATH` judges `draw` again
"""
from __future__ import annotations

import json
from pathlib import Path

from conformance.fuzz.draws import Draw, Finding
from conformance.golden.durable import atomic_write
from conformance.golden.regen import build_blob
from conformance.golden.store import default_root, golden_path

FORMAT = "k3conf-fuzz-replay/1"


class ReplayError(ValueError):
    """A replay file that is not one `write` made; the message names the file, what was expected and found."""


def cache_root() -> Path:
    """Where a finding's golden goes: the cache's `fuzz` folder beside its shape sets' goldens."""
    return default_root("fuzz")


def write(finding: Finding, spec: str, out_dir: Path) -> Path:
    """The replay file of `finding` (its smallest draw) under `out_dir`, and the draw's golden in the cache; the
    replay file's path. Both are written to a temporary file and renamed into place."""
    case = finding.smallest.case
    golden = golden_path(cache_root(), case.name)
    golden.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(golden, build_blob(case))
    doc = {"format": FORMAT, "backend": spec, "draw": finding.smallest.to_json(), "first": finding.first.to_json(),
           "failure": finding.line(), "golden": str(golden)}
    path = Path(out_dir) / (case.name + ".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(doc, indent=1) + "\n").encode())
    return path


def read(path: Path) -> tuple[Draw, str, str]:
    """(the draw, the backend it failed on, the failure line) of a replay file; ReplayError when it is none."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise ReplayError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise ReplayError(f"{path}: not JSON ({str(e)[:200]}); expected a replay file `k3conf fuzz` wrote") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ReplayError(f"{path}: format {str(found)[:80]!r}, expected {FORMAT!r} (a replay file `k3conf fuzz` "
                          "wrote)")
    try:
        draw = Draw.from_json(doc["draw"])
    except (KeyError, TypeError, ValueError) as e:
        raise ReplayError(f"{path}: its draw is not one `k3conf fuzz` wrote ({type(e).__name__}: {e})") from None
    return draw, str(doc.get("backend", "")), str(doc.get("failure", ""))
