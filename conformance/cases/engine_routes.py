"""Running the host graph (traces, the LatentMoE case) on a backend's engine-shaped cores.

The host graph calls the host cores (k3ref.cores: kda_decode, kda_prefill, rmsnorm, mxfp4_gemv per expert). A backend
that supplies an engine-shaped core instead (an engine's kernel in its own layout) is run through it: the host
core is expressed by the engine core (k3ref.engine's adapters: the states scattered into a shuffled pool with
padded rows, the batch packed along one time axis, the norm fed as a fused add of two halves), or, for the fused
experts and the prefill attention, the host graph calls the engine core in place of its own step. A backend that
supplies the host core as well is run on the host core (the direct one), so the baselines' traces stay as they
were measured; the engine core is judged by its own cases. The conv-state pool and the FP8 cache have no place in
the host graph (its conv is inline, its cache is bf16) and are judged by their own cases only.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

from k3ref.cores import CORE_NAMES, ENGINE_CORES, Cores, reference_cores
from k3ref.engine.kda import decode_through_pool, prefill_through_varlen
from k3ref.engine.norm import rmsnorm_through_add


@dataclasses.dataclass(frozen=True)
class Route:
    """How the host graph runs an engine core: `host` is the host core that takes precedence (a backend that
    supplies it runs on it), `adapter` expresses that host core through the engine core (None: the host graph calls
    the engine core itself in place of its own step), `step` names the host graph's step in the notes."""

    host: str
    adapter: Callable[[Callable], Callable] | None
    step: str


ROUTES: dict[str, Route] = {
    "kda_decode_pool": Route("kda_decode", decode_through_pool, "kda_decode"),
    "kda_prefill_varlen": Route("kda_prefill", prefill_through_varlen, "kda_prefill"),
    "add_rmsnorm": Route("rmsnorm", rmsnorm_through_add, "rmsnorm"),
    # k3ref.latent_moe.routed_experts calls a swapped-in moe_experts in place of one mxfp4_gemv per projection
    "moe_experts": Route("mxfp4_gemv", None, "routed experts"),
    # k3ref.mla.gated_mla_attend calls a swapped-in mla_prefill in place of its own attention; a backend with an
    # MLA decode kernel keeps the reference prefill, as torch-bf16 (the bf16 baseline of the traces) does
    "mla_prefill": Route("mla_decode", None, "MLA prefill attention"),
}
HOST_CORES = frozenset(CORE_NAMES) - frozenset(ENGINE_CORES)
# the cores a run of the host graph can exercise: a backend supplying none of these is n/a on traces
TRACE_CORES = HOST_CORES | frozenset(ROUTES)


def through_engine(cores: Cores, kernels: Collection[str]) -> tuple[Cores, frozenset[str], dict[str, str]]:
    """(cores for the host graph, the cores of `kernels` it runs, {host step: the engine core it runs through}).

    Engine cores the host graph does not run through are set back to k3ref's, so that the host graph takes its
    own path for them (k3ref calls `moe_experts` and `mla_prefill` only when they are not k3ref's)."""
    ref = reference_cores()
    swaps: dict[str, Callable] = {name: getattr(ref, name) for name in ENGINE_CORES}
    routed: dict[str, str] = {}
    run = set(kernels) & HOST_CORES
    for engine, route in ROUTES.items():
        if engine not in kernels or route.host in kernels:
            continue
        fn = swaps[engine] = getattr(cores, engine)
        routed[route.step] = engine
        if route.adapter is not None:
            swaps[route.host] = route.adapter(fn)
            run.add(route.host)
        else:
            run.add(engine)
    return cores.replace(**swaps), frozenset(run), routed


def route_notes(routed: dict[str, str], backend: str) -> list[str]:
    """One note per host core run through an engine core."""
    return [f"{host}: ran through {backend}'s engine-shaped core {engine}" for host, engine in sorted(routed.items())]


__all__ = ["HOST_CORES", "ROUTES", "TRACE_CORES", "Route", "route_notes", "through_engine"]
