"""Engine per-layer dumps (docs/dumps.md): the format's reader and writer, rank merging, and the recorders
that write a dump from the PyTorch K3 model (forward hooks) and from k3ref's CPU host graph."""
from .errors import (
    DumpDtypeError,
    DumpError,
    DumpFileError,
    DumpManifestError,
    DumpMissingError,
    DumpRankError,
    DumpShapeError,
)
from .format import Dump, DumpStep
from .merge import merge_ranks
from .recorder import TorchDumpHooks, record_torch
from .recorder_ref import record_ref, record_ref_tp
from .writer import DumpWriter

__all__ = ["Dump", "DumpDtypeError", "DumpError", "DumpFileError", "DumpManifestError", "DumpMissingError",
           "DumpRankError", "DumpShapeError", "DumpStep", "DumpWriter", "TorchDumpHooks", "merge_ranks",
           "record_ref", "record_ref_tp", "record_torch"]
