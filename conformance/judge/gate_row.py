"""One row of the gate table, the rule that turns a baseline's measured error into its own absolute row, how a
row is found for a tensor of a shape set, and the read-only mapping every built table is held in.

Kept apart from the table (conformance.judge.gate_table) and from the verdicts (conformance.judge.gates), which
both build on it.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import types
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

PRECISIONS = ("fp64", "fp32", "bf16")
BASELINE = {"fp32": "numpy32", "bf16": "torch-bf16"}
BASELINE_FACTOR = 3.0   # a baseline's cap over its measured worst: room for another CPU's summation order


@dataclasses.dataclass(frozen=True)
class Gate:
    """One row. fp64: `cap` is the bound. fp32/bf16: bound = min(cap, k * baseline_err + floor), and the
    per-element rule: worst element error <= elem_k * the baseline's worst element error + elem_floor. A row with an
    abs_floor adds abs_floor / RMS(ref) to both floors (gates.judge)."""

    cap: float            # absolute bound on relative RMS error
    k: float | None       # multiple of the baseline's error (None at fp64)
    floor: float          # added to k * baseline_err, so an exact baseline does not demand exactness
    atol: float           # per-element rule for "N of M passed"
    rtol: float
    reason: str
    elem_k: float | None = None     # multiple of the baseline's worst element error (None: no per-element rule)
    elem_floor: float = 0.0         # added to it, so an exact baseline does not demand an exact element
    elem_why: str = ""              # the measurement behind elem_k and elem_floor
    abs_floor: float = 0.0          # an absolute error (the tensor's own units) allowed in both rules, over RMS(ref):
                                    # a sum that cancels keeps the rounding of its terms, not of its small value
    out_round: float = 0.0          # the unit roundoff of an output the baseline returns unrounded and a kernel may
                                    # store rounded: u added to the relative RMS floor, u x |ref| of the worst
                                    # element (over RMS(ref)) to the per-element floor


def baseline_row(precision: str, measured: float, where: str, shape_set: str) -> Gate:
    """The absolute row that gates the baseline backend of `precision` itself: cap = BASELINE_FACTOR x
    `measured`, its worst relative RMS error on the cases of `shape_set` (on `where`, the case that set it)."""
    if precision not in BASELINE:
        raise ValueError(f"precision: expected one of {sorted(BASELINE)}, found {precision!r}")
    if not measured > 0:
        raise ValueError(f"measured: expected the baseline's positive worst error, found {measured!r}")
    if not shape_set or ":" in shape_set:
        raise ValueError(f"shape_set: expected the name of the shape set measured on (tiny, small, ...), "
                         f"found {shape_set!r}")
    reason = (f"{BASELINE[precision]} measured {measured:.3g} worst on {shape_set} ({where}); "
              f"cap {BASELINE_FACTOR:g}x that")
    return Gate(BASELINE_FACTOR * measured, None, 0.0, 0.0, 0.0, reason)


def qualified(shape_set: str, tensor: str) -> str:
    """The tensor name (or pattern) of a row measured on `shape_set`: '<set>:<tensor>'. A case of that set looks its
    rows up by this name first, so it finds its own set's measured rows and never another set's."""
    return f"{shape_set}:{tensor}"


def _literal_start(pattern: str) -> int:
    """How many characters of `pattern` come before its first wildcard."""
    return min((i for i, ch in enumerate(pattern) if ch in "*?["), default=len(pattern))


def lookup(table: Mapping, block: str, tensor: str, precision: str,
           shape_set: str | None = None) -> tuple[tuple[str, str, str] | None, Gate | None]:
    """The row of `table` that applies to (block, tensor, precision) on `shape_set`, and its key; (None, None)
    when none does.

    The names tried: '<set>:<tensor>' (the rows measured on that set) and the bare tensor (rows for every set);
    shape_set None: the bare tensor only. First an exact key, then tensor patterns matching either name (e.g. the
    traces' '<set>:<model>/<mode>/step*'), most specific first: the longest literal start (a set's own rows, then
    a model's own, before shared ones), then the longest pattern; then (block, "*"), then the set's default
    ("*", "<set>:*"), then ("*", "*")."""
    names = [tensor] if shape_set is None else [qualified(shape_set, tensor), tensor]
    for name in names:
        if (block, name, precision) in table:
            return (block, name, precision), table[(block, name, precision)]
    patterns = sorted((k for k in table if k[0] == block and k[2] == precision and k[1] != "*"
                       and any(ch in k[1] for ch in "*?[") and any(fnmatch.fnmatchcase(n, k[1]) for n in names)),
                      key=lambda k: (-_literal_start(k[1]), -len(k[1])))
    if patterns:
        return patterns[0], table[patterns[0]]
    fallbacks = [(block, "*", precision), ("*", "*", precision)]
    if shape_set is not None:   # a set's own default row, below the block's row for every set
        fallbacks.insert(1, ("*", qualified(shape_set, "*"), precision))
    for key in fallbacks:
        if key in table:
            return key, table[key]
    return None, None


class ReadOnlyTable(Mapping):
    """A gate table after it is built: it reads like a dict, and any write raises TypeError naming the table."""

    def __init__(self, name: str, rows: Mapping):
        self._name, self._rows = name, types.MappingProxyType(dict(rows))

    def __getitem__(self, key: Any) -> Any:
        return self._rows[key]

    def __iter__(self) -> Iterator:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"ReadOnlyTable({self._name}, {len(self._rows)} rows)"

    def __setitem__(self, key: Any, value: Any) -> NoReturn:
        raise self._refused(f"set {key!r}")

    def __delitem__(self, key: Any) -> NoReturn:
        raise self._refused(f"delete {key!r}")

    def _refused(self, what: str) -> TypeError:
        return TypeError(f"the gate table {self._name} is read-only once built: cannot {what}; its rows are data "
                         "in conformance/judge/ (a backend is never judged by rows it wrote)")
