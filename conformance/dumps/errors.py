"""The errors of a bad dump: one base class, one subclass per kind of problem.

Every message names where the problem is (the file, step, layer or tensor), what was expected and what was
found, so that an engine author can fix the dump (or the engine) without reading this package.
"""
from __future__ import annotations


class DumpError(ValueError):
    """A dump this package cannot judge; `k3conf compare` exits 2 on it."""


class DumpManifestError(DumpError):
    """The top manifest or a rank manifest is not what the format says (format, version, fields, config)."""


class DumpFileError(DumpError):
    """A file of the dump is missing, truncated, unreadable, or disagrees with its rank manifest (size, sha256)."""


class DumpMissingError(DumpError, KeyError):
    """A step, a layer or a required tensor is absent (also what `Dump.get` raises for an absent tensor)."""

    def __str__(self) -> str:   # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""


class DumpShapeError(DumpError):
    """A tensor whose shape disagrees with the config and the step's length (or with the other ranks)."""


class DumpDtypeError(DumpError):
    """A tensor of a dtype the manifest does not allow (mixed dtypes, or a float where ids belong)."""


class DumpRankError(DumpError):
    """The ranks of a tensor-parallel dump disagree: a replicated tensor that is not identical on every rank."""
