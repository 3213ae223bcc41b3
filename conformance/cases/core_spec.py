"""How to build and read one core's cases (shared by the host-graph cores and the engine-shaped cores)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class CoreSpec:
    """How to build and read one core's cases.

    make(rng, **params) -> (inputs: name -> float64/int array, kwargs: name -> scalar); the core is called
    as core(**inputs, **kwargs). outputs: the names of the core's return values, in order.
    canonical(outputs) -> outputs: an order-free normal form (router: each row sorted by expert index).
    fp32_inputs: inputs that K3 keeps in fp32 (F32 checkpoint tensors, the fp32 KDA state, the fp32 router
    logits); a bf16 backend receives them in fp32, not rounded to bf16.
    unjudged(inputs, outputs) -> outputs: the outputs with the parts the core's contract leaves unspecified (a
    padded batch row's) set to zero, on the reference's outputs and the backend's alike.
    """

    core: str
    outputs: tuple[str, ...]
    make: Callable[..., tuple[dict, dict]]
    canonical: Callable[[dict], dict] | None = None
    fp32_inputs: tuple[str, ...] = ()
    unjudged: Callable[[dict, dict], dict] | None = None

    def normal_form(self, inputs: dict, outputs: dict) -> dict:
        """`outputs` (name -> array) with what the contract leaves open set to zero (`unjudged(inputs, outputs)`:
        a padded batch row's output) and then in the canonical order."""
        out = self.unjudged(inputs, outputs) if self.unjudged else outputs
        return self.canonical(out) if self.canonical else out


__all__ = ["CoreSpec"]
