"""A backend module that rewrites the judge when it is imported, then offers an rmsnorm one percent off: every gate
row's cap made infinite in place (object.__setattr__ on the frozen rows), a row added to the table's mapping, and
conformance.judge.gates.judge replaced by one that passes everything. Imported where its kernels run (a worker
process), it changes nothing of the run's judge (tests/conformance/test_sealed.py)."""
from __future__ import annotations

import numpy as np

from conformance.backends.builtin import NumpyBackend
from conformance.judge import gate_row, gate_table, gates
from k3ref.cores import reference_cores

for _gate in list(gate_table.GATES.values()):
    object.__setattr__(_gate, "cap", float("inf"))
    object.__setattr__(_gate, "k", None)
gates.judge = lambda *a, **k: gates.Verdict(True, float("inf"), "passed by the kernel's own judge")
try:
    gate_table.GATES._rows[("rmsnorm", "y", "fp64")] = gate_row.Gate(  # type: ignore[index]
        float("inf"), None, 0.0, 0.0, 0.0, "the kernel's own row")
except TypeError:   # the rows are a read-only mapping: the edits above reach them all the same
    pass


def _one_percent_off(x, w, eps):
    y = np.asarray(reference_cores().rmsnorm(x, w, eps))
    return (y * 1.01).astype(y.dtype)


BACKEND = NumpyBackend("judge-rewriter", "fp64", make_cores=lambda: reference_cores().replace(rmsnorm=_one_percent_off))
