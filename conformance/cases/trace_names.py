"""The names of a model trace's tensors: one type writes them and reads them back.

Per step s and layer l a trace records `step<s>.layer<ll>.<slot>_<what>` (e.g. `step1.layer02.3_a`): the slot
numbers the tensors of a layer in the order they are computed, so name order is compute order (the runner
picks the first failure by it). Per step it records `step<s>.logits` and `step<s>.token`. The golden's
intermediates reuse the prefixes: `step<s>.layer<ll>` (a layer's input state, a router's choice at that layer)
and `step<s>.final` (the state the LM head reads).
"""
from __future__ import annotations

import dataclasses
import re

# the outputs of one layer, in compute order: slot i + 1 holds RECORD[i]; slot 7 is the layer's cache after the step
RECORD = ("h", "x_mixer", "a", "m", "x_mlp", "f")
CACHE_SLOT, CACHE_WHAT = 7, "cache"
STEP_OUTPUTS = ("logits", "token")

_LAYER_NAME = re.compile(r"step(\d+)\.layer(\d+)\.(\d)_(\w+)")
_STEP_NAME = re.compile(r"step(\d+)\.(\w+)")


@dataclasses.dataclass(frozen=True)
class TraceName:
    """One trace tensor: its step, and for a per-layer tensor its layer, slot (compute order) and what it holds;
    a per-step tensor (logits, token) has layer and slot None."""

    step: int
    what: str
    layer: int | None = None
    slot: int | None = None

    @classmethod
    def of_layer(cls, step: int, layer: int, slot: int, what: str) -> TraceName:
        return cls(step, what, layer, slot)

    @classmethod
    def parse(cls, name: str) -> TraceName | None:
        """The name read back, or None when `name` is not a trace tensor's name."""
        m = _LAYER_NAME.fullmatch(name)
        if m:
            return cls(int(m.group(1)), m.group(4), int(m.group(2)), int(m.group(3)))
        m = _STEP_NAME.fullmatch(name)
        if m and m.group(2) in STEP_OUTPUTS:
            return cls(int(m.group(1)), m.group(2))
        return None

    def __str__(self) -> str:
        if self.layer is None:
            return f"step{self.step}.{self.what}"
        return f"{layer_key(self.step, self.layer)}.{self.slot}_{self.what}"


def layer_key(step: int, layer: int) -> str:
    """`step<s>.layer<ll>`: the prefix of a layer's tensors and of the golden's state and router entries there."""
    return f"step{step}.layer{layer:02d}"


def final_key(step: int) -> str:
    """`step<s>.final`: the golden's state that the LM head reads at step s."""
    return f"step{step}.final"


def layer_of(name: str) -> int | None:
    """The layer of a per-layer trace tensor, else None (a per-step tensor or not a trace tensor)."""
    parsed = TraceName.parse(name)
    return None if parsed is None else parsed.layer
