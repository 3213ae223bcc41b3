"""The run's view of a backend whose kernels run in a worker: what the worker said of it, checked as data
(Description), and a BackendBase whose cores send each call there (RemoteBackend; RemoteWholeModel for a backend
that runs whole traces by its own wiring).

    backend = pool.backend("./k3_backend.py:make")   # conformance.isolation.client.WorkerPool
    backend.name, backend.precision, backend.kernel_cores()   # from the worker's description
    y = backend.cores().rmsnorm(x, w, 1e-5)           # runs in the worker; y checked here before it is used

The run never imports the backend's module: everything here is built from the worker's answers, each field
checked for its type, its values and its length, and every text cut to a bound. A core's arguments cross as
arrays and numbers; only what the kernel returns comes back, and it must be arrays (a tuple of them for a core
with several outputs). Cores the backend does not supply itself stay k3ref's, called here: the worker would run
the very same reference code. A backend whose AttnRes hub is its own gets a RemoteHub (the hub lives in the worker,
its state and its mixes there).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from conformance.backends.protocol import TENSOR_KINDS, BackendBase, BackendError, WholeModelBackend
from conformance.cases.protocol import Evaluation, RunInfo
from conformance.isolation import wire
from conformance.isolation.errors import ReplyError
from conformance.isolation.trace_view import TraceRefused, TraceServer
from k3cuda.forcing import forced_entries
from k3ref.cores import CORE_NAMES, Cores, UnsupportedShape, reference_cores


class WorkerPool(Protocol):
    """What a RemoteBackend needs of the pool of workers (conformance.isolation.client.WorkerPool)."""

    case: str

    def request(self, spec: str, header: dict, arrays: dict | None = None, serve=None,
                limit: float | None = None) -> tuple[dict, dict]: ...

PRECISIONS = ("fp64", "fp32", "bf16")
MAX_NAME = 100      # a backend's name, a device string
MAX_TEXT = 2000     # a reason, a note
MAX_NOTES = 200     # notes per evaluation
# a backend's name heads a report column and a terminal table: letters, digits and a few marks, no markup
_NAME = re.compile(r"[A-Za-z0-9_.:+@=-]{1,100}")


def bounded(text: object, limit: int = MAX_TEXT) -> str:
    """`text` as a str of at most `limit` characters (the cut is said)."""
    s = str(text)
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s) - limit} more characters)"


@dataclasses.dataclass(frozen=True)
class Description:
    """What a worker said of the backend it loaded (conformance.isolation.worker.describe), checked."""

    spec: str                     # the name the run loaded it by (file.py:ATTR, a registry name)
    name: str
    precision: str
    device: str
    deterministic: bool
    available: bool
    reason: str
    kernel_cores: frozenset[str]
    whole_model: bool
    own_hub: bool
    cores_error: str              # why the backend has no cores (a whole model's UnsupportedShape), else ''
    timed: frozenset[str]
    speed_targets: Mapping[str, float | None]


def _field(doc: dict, key: str, kind: type | tuple, spec: str, expected: str):
    value = doc.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BackendError(f"backend {spec}: its worker described {key} as {type(value).__name__} "
                           f"{bounded(repr(value), 200)}; expected {expected}")
    return value


def read_description(doc: object, spec: str) -> Description:
    """The worker's description `doc`, checked field by field; BackendError naming the field, what was expected
    and what was found."""
    if not isinstance(doc, dict):
        raise BackendError(f"backend {spec}: its worker sent no description (found {type(doc).__name__})")
    name = _field(doc, "name", str, spec, "a name of 1 to 100 letters, digits and _ . : + @ = -")
    if not _NAME.fullmatch(name):
        raise BackendError(f"backend {spec}: name {bounded(repr(name), 200)}: expected 1 to 100 letters, digits and "
                           "_ . : + @ = - (no spaces, no markup)")
    precision = _field(doc, "precision", str, spec, f"one of {PRECISIONS}")
    available = _field(doc, "available", bool, spec, "True or False")
    if available and precision not in PRECISIONS:   # one that cannot run may not know it (a broken entry point)
        raise BackendError(f"backend {spec}: precision expected one of {PRECISIONS}, found {bounded(precision, 100)!r}")
    tensors = _field(doc, "tensors", str, spec, f"one of {TENSOR_KINDS}")
    if tensors not in TENSOR_KINDS:
        raise BackendError(f"backend {spec}: tensors expected one of {TENSOR_KINDS}, found {bounded(tensors, 100)!r}")
    cores = _field(doc, "kernel_cores", list, spec, "a list of core names")
    timed = _field(doc, "timed", list, spec, "a list of core names")
    odd = [c for c in cores + timed if not isinstance(c, str) or c not in CORE_NAMES]
    if odd or not set(timed) <= set(cores):
        raise BackendError(f"backend {spec}: kernel_cores() names {bounded(repr(odd or timed), 300)}; expected core "
                           f"names from {sorted(CORE_NAMES)}")
    targets = _field(doc, "speed_targets", dict, spec, "a dict of block -> ratio or None")
    for block, target in targets.items():
        ok = target is None or (isinstance(target, int | float) and not isinstance(target, bool)
                                and math.isfinite(target) and target > 0)
        if not ok or len(block) > MAX_NAME:
            raise BackendError(f"backend {spec}: speed_target({bounded(block, 100)!r}) is {bounded(repr(target), 100)};"
                               " expected None or a positive finite ratio")
    return Description(
        spec=spec, name=name, precision=precision, device=bounded(_field(doc, "device", str, spec, "a str"), MAX_NAME),
        deterministic=_field(doc, "deterministic", bool, spec, "True or False"),
        available=available,
        reason=bounded(_field(doc, "reason", str, spec, "a str")),
        kernel_cores=frozenset(cores), whole_model=_field(doc, "whole_model", bool, spec, "True or False"),
        own_hub=_field(doc, "own_hub", bool, spec, "True or False"),
        cores_error=bounded(_field(doc, "cores_error", str, spec, "a str")), timed=frozenset(timed),
        speed_targets={str(b): (None if t is None else float(t)) for b, t in targets.items()})


def _arrays_only(value: Any, what: str) -> Any:
    """`value` (an unpacked core result) when it is an array or a tuple / list of arrays; ValueError otherwise."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, tuple | list) and value and all(isinstance(v, np.ndarray) for v in value):
        return tuple(value) if isinstance(value, tuple) else list(value)
    raise ValueError(f"{what} returned {bounded(type(value).__name__, 60)}, expected an array or a tuple of arrays")


class RemoteCore:
    """One core of a RemoteBackend: calling it sends the call to the worker."""

    def __init__(self, backend: RemoteBackend, core: str):
        self.backend, self.core = backend, core
        self.__name__ = self.__qualname__ = core

    def __call__(self, *args, **kwargs):
        return self.backend.call(self.core, args, kwargs)


class RemoteHub:
    """The backend's own AttnRes hub (k3ref.attnres.AttnResHub's interface), living in its worker; its mixes call
    the backend's own attnres_mix there."""

    def __init__(self, backend: RemoteBackend, block_size: int, eps: float = 1e-5):
        self.backend, self.block_size, self.eps = backend, int(block_size), float(eps)
        reply, _ = backend.request({"op": "hub", "what": "new", **_packed([block_size], {"eps": eps})[0]})
        self.id = reply.get("id")

    def _call(self, what: str, name: str, *args, **kwargs):
        kwargs.pop("cores", None)   # the hub's mixes run the backend's own core, in the worker
        header, arrays = _packed(list(args), kwargs)
        reply, got = self.backend.request({"op": "hub", "what": what, "id": self.id, "name": name, **header}, arrays)
        return _unpacked(reply, got, f"attnres_hub.{name}")

    def start(self, embedding) -> None:
        self._call("call", "start", embedding)

    def mixer_input(self, layer, proj_w, norm_w, mix=1.0, cores=None):
        return self._call("call", "mixer_input", layer, proj_w, norm_w, mix)

    def add_mixer(self, a) -> None:
        self._call("call", "add_mixer", a)

    def mlp_input(self, proj_w, norm_w, mix=1.0, cores=None):
        return self._call("call", "mlp_input", proj_w, norm_w, mix)

    def add_mlp(self, f) -> None:
        self._call("call", "add_mlp", f)

    def final_input(self, proj_w, norm_w, mix=1.0, cores=None):
        return self._call("call", "final_input", proj_w, norm_w, mix)

    @property
    def blocks(self) -> list:
        return list(self._call("get", "blocks") or [])

    @blocks.setter
    def blocks(self, value) -> None:
        self._call("set", "blocks", list(value))

    @property
    def prefix(self):
        return self._call("get", "prefix")

    @prefix.setter
    def prefix(self, value) -> None:
        self._call("set", "prefix", value)


def _packed(args: list, kwargs: dict) -> tuple[dict, dict]:
    arrays: dict[str, np.ndarray] = {}
    header = {"args": wire.pack(list(args), arrays), "kwargs": wire.pack(dict(kwargs), arrays)}
    return header, arrays


def _unpacked(reply: dict, arrays: dict, what: str):
    try:
        return wire.unpack(reply.get("out"), arrays)
    except wire.Unpackable as e:
        raise ValueError(f"{what}: the worker's answer is not data ({e})") from None


class RemoteBackend(BackendBase):
    """A backend as its worker described it (see the module docstring)."""

    tensors = "numpy"   # what its cores take and return here, whatever they take in the worker

    def __init__(self, pool: WorkerPool, description: Description):
        self.pool, self.description = pool, description
        self.spec = description.spec
        self.name, self.precision = description.name, description.precision
        self.deterministic = description.deterministic
        self.check_writes = True   # False during the start-up check: a write is left to the cells, which name the case
        self._cores: Cores | None = None

    def __repr__(self) -> str:
        return f"RemoteBackend({self.spec!r}, name={self.name!r})"

    @property
    def device(self) -> str:
        return self.description.device

    def available(self) -> tuple[bool, str]:
        return self.description.available, self.description.reason

    def kernel_cores(self) -> frozenset[str]:
        return self.description.kernel_cores

    def timed_cores(self) -> frozenset[str]:
        return self.description.timed

    def speed_target(self, block: str) -> float | None:
        return self.description.speed_targets.get(block)

    def request(self, header: dict, arrays: dict | None = None, serve=None) -> tuple[dict, dict]:
        """One request to the backend's worker (its errors name the backend and the pool's case)."""
        return self.pool.request(self.spec, header, arrays, serve)

    def refused(self, what: str) -> ReplyError:
        return ReplyError(f"backend {self.name} on case {self.pool.case}: {what}")

    def cores(self) -> Cores:
        if self.description.cores_error:
            raise UnsupportedShape(self.description.cores_error)
        if self._cores is None:
            own = self.description.kernel_cores
            swaps: dict[str, Any] = {c: RemoteCore(self, c) for c in CORE_NAMES if c in own and c != "attnres_hub"}
            if self.description.own_hub:
                swaps["attnres_hub"] = lambda block_size, eps=1e-5: RemoteHub(self, block_size, eps)
            self._cores = reference_cores().replace(**swaps)
        return self._cores

    def call(self, core: str, args: tuple, kwargs: dict):
        """One call of the backend's `core` in its worker; its outputs, checked to be arrays."""
        header, arrays = _packed(list(args), kwargs)
        forced = dict(forced_entries())
        reply, got = self.request({"op": "call", "core": core, "forced": forced, "check_writes": self.check_writes,
                                   **header}, arrays)
        try:
            return _arrays_only(_unpacked(reply, got, f"core {core}"), f"core {core}")
        except ValueError as e:
            raise self.refused(str(e)) from None

    def run_notes(self) -> list[str]:
        reply, _ = self.request({"op": "notes"})
        notes = reply.get("notes")
        if not isinstance(notes, list):
            raise self.refused(f"run_notes() came back as {type(notes).__name__}, expected a list")
        return [bounded(n) for n in notes[:MAX_NOTES]] + (
            [f"... and {len(notes) - MAX_NOTES} more notes"] if len(notes) > MAX_NOTES else [])

    def copy_bandwidth(self) -> float | None:
        value = self.request({"op": "copy_bandwidth"})[0].get("value")
        if value is None:
            return None
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise self.refused(f"copy_bandwidth() came back as {bounded(repr(value), 80)}, expected a positive "
                               "number of bytes/s or None")
        return float(value)

    def scrub(self) -> None:
        """Poison the worker's freed memory (conformance.isolation.worker.scrub) before a repeated call."""
        self.request({"op": "scrub"})

    def timed_calls(self, core: str, sets: list[tuple[list, dict]], repeats: int) -> tuple[list[float], list]:
        """The judge's timing of `core` in the worker (conformance.isolation.timing): seconds and outputs of each
        of `repeats` calls, on the input sets in turn."""
        header, arrays = _packed([[list(a), dict(k)] for a, k in sets], {})
        reply, got = self.request({"op": "time", "core": core, "repeats": repeats,
                                   "forced": dict(forced_entries()), **header}, arrays)
        try:
            return _timed(reply, _unpacked(reply, got, f"core {core} (timed)"), repeats,
                          lambda out: _arrays_only(out, f"a timed call of core {core}"))
        except ValueError as e:
            raise self.refused(str(e)) from None

    def time_core(self, core: str, inputs: dict) -> float | None:
        """None: the judge times an isolated backend itself (timed_calls), never by the backend's own clock."""
        return None


def _timed(reply: dict, outs: Any, repeats: int, check) -> tuple[list[float], list]:
    """(seconds, outputs) of a timing reply, checked; ValueError naming what is wrong."""
    seconds = reply.get("seconds")
    if not (isinstance(seconds, list) and isinstance(outs, list) and len(seconds) == len(outs) == repeats):
        raise ValueError(f"a timing came back with {bounded(repr(seconds), 80)} seconds and {type(outs).__name__} "
                         f"outputs; expected {repeats} of each")
    if not all(isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s) and s >= 0
               for s in seconds):
        raise ValueError(f"a timing came back with times {bounded(repr(seconds), 200)}; expected seconds >= 0")
    return [float(s) for s in seconds], [check(o) for o in outs]


class RemoteWholeModel(RemoteBackend, WholeModelBackend):
    """A whole-model backend in its worker: a trace runs there on a TraceView, its questions answered here by a
    TraceServer from the golden (conformance.isolation.trace_view)."""

    def __init__(self, pool: WorkerPool, description: Description):
        super().__init__(pool, description)
        self.routes: dict[str, dict] = {}   # case -> the near-tie route answers its judged trace was given

    def _trace_request(self, op: str, case, golden, config_json: Mapping, prompt_len: int, router_budget: float,
                       extra: dict) -> tuple[dict, dict, dict]:
        arrays = {f"w.{k}": v for k, v in golden.group("weights").items()}
        arrays["tokens"] = golden.group("inputs")["tokens"]
        doc = {"name": case.name, "kind": case.kind, "config": case.config, "seed": case.seed,
               "params": dict(case.params)}
        header = {"op": op, "case": wire.pack(doc, {}), "config_json": dict(config_json), "prompt_len": prompt_len,
                  "router_budget": router_budget, "golden_kwargs": dict(golden.kwargs), **extra}
        return header, arrays, doc

    def evaluate_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int,
                       router_budget: float = 0.0) -> Evaluation:
        server = TraceServer(golden, router_budget)
        header, arrays, _ = self._trace_request("trace", case, golden, config_json, prompt_len, router_budget, {})
        reply, got = self.request(header, arrays, serve=server.answer)
        try:
            outputs = self._outputs(_unpacked(reply, got, "evaluate_trace"), golden)
            server.check_final(outputs)
            own_argmax(outputs)
        except (ValueError, TraceRefused) as e:
            raise self.refused(str(e)) from None
        self.routes[case.name] = server.routes
        return Evaluation(outputs, info=RunInfo(teacher_forced={"router": server.forced}))

    def timed_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int, router_budget: float,
                    repeats: int) -> tuple[list[float], list[dict[str, np.ndarray]]]:
        """Seconds and outputs of `repeats` runs of the trace in the worker, given the route answers of the judged
        run (evaluate_trace first) so that nothing is asked while the clock runs."""
        routes = self.routes.get(case.name, {})
        packed_routes: dict[str, np.ndarray] = {}
        tree = wire.pack({k: {"margin": v["margin"], "choice": v["choice"]} for k, v in routes.items()}, packed_routes)
        header, arrays, _ = self._trace_request("time_trace", case, golden, config_json, prompt_len, router_budget,
                                                {"routes": tree, "repeats": repeats})
        reply, got = self.request(header, {**arrays, **packed_routes})   # routes' arrays are p0, p1, ...
        try:
            return _timed(reply, _unpacked(reply, got, "a timed trace"), repeats,
                          lambda out: self._outputs(out, golden))
        except ValueError as e:
            raise self.refused(str(e)) from None

    def _outputs(self, value: Any, golden) -> dict[str, np.ndarray]:
        """A trace's outputs: a dict of arrays named by the golden's outputs (no other name is accepted)."""
        known = set(golden.group("outputs"))
        if not (isinstance(value, dict) and all(isinstance(v, np.ndarray) for v in value.values())):
            raise ValueError(f"a trace came back as {type(value).__name__}, expected a dict of arrays by tensor name")
        odd = sorted(k for k in value if k not in known)
        if odd:
            raise ValueError(f"a trace came back with {len(odd)} tensor(s) no trace of this case holds: "
                             f"{bounded(', '.join(odd[:5]), 300)}")
        return dict(value)

    def time_trace(self, case: Any, golden: Any, config_json: Mapping, prompt_len: int) -> tuple[float, int] | None:
        return None   # timed by the judge: timed_trace


def own_argmax(outputs: Mapping[str, np.ndarray]) -> None:
    """ValueError when a step's greedy token is not the argmax of the same step's logits: a whole model is given
    the golden's tokens (teacher forcing), and a token copied from them instead of read off its own logits would
    pass the token check on logits that choose another."""
    for name, token in outputs.items():
        logits = outputs.get(name.removesuffix(".token") + ".logits") if name.endswith(".token") else None
        if logits is None or np.size(token) != 1 or np.size(logits) == 0:
            continue
        found = int(np.argmax(np.asarray(logits, np.float64).ravel()))
        if int(np.asarray(token).ravel()[0]) != found:
            raise ValueError(f"its {name} is {int(np.asarray(token).ravel()[0])}, not the argmax of its own logits "
                             f"({found})")


def remote_backend(pool: WorkerPool, description: Description) -> RemoteBackend:
    """The run's backend for `description`: a RemoteWholeModel for a whole model, else a RemoteBackend."""
    return (RemoteWholeModel if description.whole_model else RemoteBackend)(pool, description)
