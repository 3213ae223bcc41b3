"""Merge the ranks of a tensor-parallel dump into a TP-1 dump holding the merged view."""
from __future__ import annotations

import os
from pathlib import Path

from .format import Dump
from .writer import DumpWriter


def merge_ranks(path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the merged view of the dump at `path` (any TP size) to `out` as a TP-1 dump; returns `out`.

    Every replicated tensor is checked to be identical on all ranks (DumpRankError otherwise). The engine,
    dtype, config, steps, chosen tokens and fp32 list are kept."""
    dump = Dump.open(path)
    w = DumpWriter(out, engine=dump.engine, dtype=dump.dtype, config=dump.raw_config, fp32=sorted(dump.fp32),
                   overwrite=overwrite)
    for s in dump.steps:
        w.begin_step(s.kind, s.tokens, s.start)
        for name in dump.names(s.index):
            w.put(name, dump.raw(s.index, name))
        w.end_step(None if dump.chosen is None else dump.chosen[s.index])
    return w.close()
