"""A deliberately wrong AttnRes hub, for the mutant that proves the traces catch a block-boundary slip.

A module of its own that imports no backend code, so the backends' table of mutants can use it while the trace
kind imports the backends.
"""
from __future__ import annotations

from k3ref.attnres import AttnResHub


class BoundaryOffByOneHub(AttnResHub):
    """AttnRes blocks close one layer late: at layer 0, then where l % block_size == 1."""

    def mixer_input(self, layer, proj_w, norm_w, mix=1.0, cores=None):
        return super().mixer_input(layer - 1 if layer else layer + self.block_size, proj_w, norm_w, mix, cores)
