"""Every torch core by name: the host-graph cores (k3torch.cores) and the engine-shaped ones (k3torch.engine_kda,
engine_mla, engine_moe), which build on k3torch.cores and so are gathered here rather than there."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from k3torch import cores, engine_kda, engine_mla, engine_moe
from k3torch.cores import TorchCore, precision

_ALL: dict[str, tuple[Callable[..., dict], Callable[..., Any]]] = {
    **cores.CORES, **engine_kda.CORES, **engine_mla.CORES, **engine_moe.CORES}
TIMEABLE = tuple(_ALL)     # every core here is math: each can be timed on device-resident inputs


def torch_core(name: str, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu",
               **knobs: Any) -> TorchCore:
    """One core by name; `knobs` are the private keyword arguments of its compute function (mutants)."""
    if name not in _ALL:
        raise ValueError(f"core: expected one of {sorted(_ALL)}, found {name!r}")
    prep, compute = _ALL[name]
    return TorchCore(name, prep, compute, precision(dtype, device), **knobs)


def all_cores(dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu") -> dict[str, TorchCore]:
    """Every core by its docs/interfaces.md name, at one precision on one device."""
    p = precision(dtype, device)
    return {name: TorchCore(name, prep, compute, p) for name, (prep, compute) in _ALL.items()}


__all__ = ["TIMEABLE", "all_cores", "torch_core"]
